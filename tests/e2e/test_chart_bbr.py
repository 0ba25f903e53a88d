"""charts/picker-bbr with the reference body-based-routing chart's own values.yaml (v1.5.0),
unchanged and with each provider (istio, gke) and multiNamespace: rendered beside the reference
chart (the oracle for every object but the router's image and its extra flags), linted,
validated strictly and installed into the real API server. Then the installed router runs as
its pod would (its args and env, its ServiceAccount's token, so its RBAC is what lets it read the
adapter ConfigMaps) behind Envoy, and a LoRA adapter's request reaches the model server with its
base model's header."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from picker.bbr.plugins import BASE_MODEL_HEADER, MODEL_HEADER
from picker_bench.bbr import bbr_envoy_config, start_envoy
from picker_bench.gobuild import GoModuleUnavailableError
from picker_bench.process import ManagedProcess, free_port, health_serving, wait_until
from tests.e2e.bbr_stack import ADAPTER, BASE_MODEL, post, put_adapter_config_map
from tests.e2e.charts import (
    PICKER_BBR_CHART,
    by_kind,
    lint_validate_install,
    one,
    reference_chart,
    reference_values,
    render,
    values_file,
)
from tests.e2e.kube_resources import service_account_kubeconfig
from tests.stack import loopback_addresses, start_backends

CHART = "body-based-routing"
# name → values over the reference values.yaml
VALUE_SETS: dict[str, dict[str, Any]] = {
    "reference": {},
    "istio": {"provider": {"name": "istio"}},
    "gke": {"provider": {"name": "gke"}},
    "multi-namespace": {"bbr": {"multiNamespace": True}},
}
# What picker's chart adds to the reference's arguments: the command, and the ports as flags
# (the reference's binary listens on its defaults whatever bbr.port says).
PICKER_ONLY_ARGS = ("bbr", "--grpc-port=9004", "--grpc-health-port=9005")


def value_files(value_set: str, directory: Path) -> list[Path]:
    try:
        return [reference_values(CHART), values_file(directory, VALUE_SETS[value_set], "extra.yaml")]
    except GoModuleUnavailableError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="module")
def reference(helm_binary: Path, helm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return reference_chart(helm_binary, helm_env, tmp_path_factory.mktemp("reference-bbr"), CHART)
    except GoModuleUnavailableError as exc:
        pytest.fail(str(exc), pytrace=False)


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (bbr,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return bbr


def without_container(deployment: dict[str, Any]) -> dict[str, Any]:
    spec = {**deployment["spec"]["template"]["spec"], "containers": None}
    return {**deployment, "spec": {**deployment["spec"], "template": {**deployment["spec"]["template"], "spec": spec}}}


@pytest.mark.parametrize("value_set", list(VALUE_SETS))
def test_renders_what_the_reference_chart_renders(value_set, reference, helm_binary, helm_env, tmp_path) -> None:
    values = value_files(value_set, tmp_path)
    ours, theirs = (render(helm_binary, helm_env, chart, values) for chart in (PICKER_BBR_CHART, reference))
    kinds = {doc["kind"] for doc in theirs}
    assert kinds == {doc["kind"] for doc in ours}
    for kind in kinds - {"Deployment"}:
        assert by_kind(ours, kind) == by_kind(theirs, kind), kind
    assert without_container(one(ours, "Deployment")) == without_container(one(theirs, "Deployment"))
    our_bbr, their_bbr = container(ours), container(theirs)
    assert [a for a in our_bbr["args"] if a not in PICKER_ONLY_ARGS] == their_bbr["args"]
    assert our_bbr["env"] == their_bbr.get("env", [])
    assert our_bbr["ports"] == their_bbr["ports"]
    assert our_bbr["image"].startswith("ghcr.io/picker-inference/picker:")  # the reference image cannot run picker bbr


@pytest.mark.parametrize("value_set", list(VALUE_SETS))
def test_installs_with_the_reference_values(
    value_set, kube_cluster, admin_api, helm_binary, helm_env, third_party_crds, tmp_path
) -> None:
    values = value_files(value_set, tmp_path)
    namespace = lint_validate_install(
        helm_binary, helm_env, kube_cluster, admin_api, values, f"bbr-{value_set}", chart=PICKER_BBR_CHART
    )
    deployment = client.AppsV1Api(admin_api).read_namespaced_deployment("body-based-router", namespace)
    assert deployment.spec.template.spec.service_account_name == "body-based-router-rel"
    assert (
        client.CoreV1Api(admin_api).read_namespaced_service("body-based-router", namespace).spec.ports[0].port == 9004
    )


@pytest.fixture
def installed(kube_cluster, admin_api, helm_binary, helm_env, third_party_crds, tmp_path) -> Iterator[tuple[str, Path]]:
    """The chart installed with the reference values; (namespace, its ServiceAccount's kubeconfig)."""
    namespace = lint_validate_install(
        helm_binary,
        helm_env,
        kube_cluster,
        admin_api,
        value_files("reference", tmp_path),
        "bbr-run",
        chart=PICKER_BBR_CHART,
    )
    kubeconfig = service_account_kubeconfig(
        admin_api, kube_cluster, namespace, "body-based-router-rel", tmp_path / "sa"
    )
    yield namespace, kubeconfig


def test_the_installed_router_maps_an_adapter_with_its_service_accounts_rights(installed, admin_api, tmp_path) -> None:
    namespace, kubeconfig = installed
    put_adapter_config_map(admin_api, namespace, "adapters", BASE_MODEL, [ADAPTER])
    pod = client.AppsV1Api(admin_api).read_namespaced_deployment("body-based-router", namespace).spec.template.spec
    (bbr,) = pod.containers
    ports = {9004: free_port(), 9005: free_port()}
    args = []
    for arg in bbr.args:
        name, _, value = arg.partition("=")
        args.append(f"{name}={ports[int(value)]}" if name in ("--grpc-port", "--grpc-health-port") else arg)
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    env.update({var.name: namespace for var in bbr.env if var.value_from.field_ref.field_path == "metadata.namespace"})
    router = ManagedProcess(
        "bbr-as-pod", [sys.executable, "-m", "picker.cli", *args, f"--metrics-port={free_port()}"], tmp_path, env=env
    )
    router.start()
    (backend,) = loopback_addresses(1)
    host, port = backend.rsplit(":", 1)
    backends = start_backends([backend], tmp_path)
    envoy = None
    try:
        router.wait_ready(lambda: health_serving("127.0.0.1", ports[9005]), timeout=60)
        config = bbr_envoy_config(
            "duplex",
            ("127.0.0.1", free_port()),
            ("127.0.0.1", ports[9004]),
            (host, int(port)),
            ("127.0.0.1", free_port()),
            tls=True,
        )
        envoy = start_envoy(config, tmp_path, "envoy-bbr-chart")
        url = envoy.url + "/v1/completions"
        body = f'{{"model": "{ADAPTER}", "prompt": "hi"}}'.encode()
        wait_until(
            lambda: post(url, body).upstream_header(BASE_MODEL_HEADER.lower()) == BASE_MODEL,
            30,
            "the adapter's base model",
            0.2,
        )
        assert post(url, body).upstream_header(MODEL_HEADER.lower()) == ADAPTER
    finally:
        if envoy is not None:
            envoy.stop()
        backends.stop()
        router.stop()
