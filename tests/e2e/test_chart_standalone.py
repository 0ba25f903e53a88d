"""The standalone deployment (picker with an Envoy sidecar, for clusters without a Gateway) from
charts/picker: the reference standalone chart's own values.yaml (v1.5.0), as it is and switched
to selecting pods by label, and picker's own `sidecar.enabled` alone (the shipped Envoy config).

Each is linted, rendered, validated with `kubernetes-validate --strict` and installed with
`helm install` into the real API server, whose objects are checked; the reference standalone
chart rendered with the same values is the oracle for the sidecar, its files, the mode and the
Service. Then the pair runs as the pod would: `picker serve` with the installed Deployment's
arguments and the real Envoy with the installed ConfigMap's config (loopback ports in place of
the pod's), and a request sent to Envoy's client port reaches a Ready pod of the pool."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from picker_bench.envoy import EnvoyProcess, envoy_binary
from picker_bench.gobuild import GoModuleUnavailableError
from picker_bench.kube_resources import create_pod, put_pool, set_pod_ready
from picker_bench.process import wait_until
from tests.e2e.charts import (
    PICKER_CHART,
    by_kind,
    lint_validate_install,
    one,
    reference_chart,
    reference_values,
    render,
    values_file,
)
from tests.e2e.helm_cli import helm
from tests.e2e.kube_resources import create_namespace, service_account_kubeconfig
from tests.e2e.kube_stack import post, run_like_the_kubelet, shared_port
from tests.stack import start_backends

SHIPPED_ENVOY = PICKER_CHART / "envoy" / "gateway.yaml"
ROUTE_DEADLINE = 30.0

# name → values on top of the reference standalone values.yaml (None: without that file).
VALUE_SETS: dict[str, dict[str, Any] | None] = {
    "reference-alone": {},
    # The one value the reference chart requires (in pool mode) that its values.yaml leaves out.
    "reference-pool": {"inferencePool": {"modelServers": {"matchLabels": {"app": "vllm-qwen3-32b"}}}},
    "reference-selector": {
        "inferenceExtension": {
            "endpointsServer": {"createInferencePool": False, "endpointSelector": "app=vllm-qwen3-32b"}
        }
    },
    "shipped-envoy": None,
}
SHIPPED_ENVOY_VALUES = {"inferenceExtension": {"sidecar": {"enabled": True}}}


def value_files(value_set: str, directory: Path) -> list[Path]:
    extra = VALUE_SETS[value_set]
    if extra is None:
        return [values_file(directory, SHIPPED_ENVOY_VALUES, "shipped.yaml")]
    try:
        return [reference_values("standalone"), values_file(directory, extra, "extra.yaml")]
    except GoModuleUnavailableError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="module")
def reference(helm_binary: Path, helm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return reference_chart(helm_binary, helm_env, tmp_path_factory.mktemp("reference-standalone"), "standalone")
    except GoModuleUnavailableError as exc:
        pytest.fail(str(exc), pytrace=False)


def pod_spec(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = one(docs, "Deployment")["spec"]["template"]["spec"]
    return spec


def sidecar(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = [c for c in pod_spec(docs)["containers"] if c["name"] != "epp"]
    return container


def config_maps(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {c["metadata"]["name"]: c["data"] for c in by_kind(docs, "ConfigMap")}


@pytest.mark.parametrize("value_set", ["reference-pool", "reference-selector"])
def test_renders_what_the_reference_standalone_chart_renders(
    value_set, reference, helm_binary, helm_env, tmp_path
) -> None:
    values = value_files(value_set, tmp_path)
    ours, theirs = (render(helm_binary, helm_env, chart, values) for chart in (PICKER_CHART, reference))

    assert sidecar(ours) == sidecar(theirs)
    sidecar_volume = {v["name"] for v in pod_spec(theirs)["volumes"]} - {"plugins-config-volume"}
    assert [v for v in pod_spec(ours)["volumes"] if v["name"] in sidecar_volume] == [
        v for v in pod_spec(theirs)["volumes"] if v["name"] in sidecar_volume
    ]
    assert config_maps(ours)["envoy"] == config_maps(theirs)["envoy"]
    for kind in ("Deployment", "Service"):
        assert one(ours, kind)["metadata"]["name"] == one(theirs, kind)["metadata"]["name"]
    assert one(ours, "Deployment")["spec"]["selector"] == one(theirs, "Deployment")["spec"]["selector"]
    assert one(ours, "Service")["spec"]["selector"] == one(theirs, "Service")["spec"]["selector"]
    mode = "inference.networking.k8s.io/igw-mode"
    (our_labels, their_labels) = (
        one(d, "Deployment")["spec"]["template"]["metadata"]["labels"] for d in (ours, theirs)
    )
    assert our_labels[mode] == their_labels[mode]
    assert {(p["name"], p["port"]) for p in one(theirs, "Service")["spec"]["ports"]} <= {
        (p["name"], p["port"]) for p in one(ours, "Service")["spec"]["ports"]
    }

    # The pool (picker's chart also spells out the API's defaults: appProtocol, failureMode).
    def pools(docs: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
        specs = [p["spec"] for p in by_kind(docs, "InferencePool")]
        return [
            (s["selector"], s["targetPorts"], s["endpointPickerRef"]["name"], s["endpointPickerRef"]["port"])
            for s in specs
        ]

    assert pools(ours) == pools(theirs)

    # The mode's flags: the reference passes them as separate arguments, picker's chart as --name=value.
    (their_epp,) = [c for c in pod_spec(theirs)["containers"] if c["name"] == "epp"]
    (our_epp,) = [c for c in pod_spec(ours)["containers"] if c["name"] == "epp"]
    mode_flags = ("--endpoint-selector", "--endpoint-target-ports", "--pool-name", "--pool-namespace")
    their_args = their_epp["args"]
    expected = {f"{a}={their_args[i + 1]}" for i, a in enumerate(their_args) if a in mode_flags}
    assert expected and expected <= set(our_epp["args"])


@pytest.mark.parametrize("value_set", ["reference-alone", "reference-selector", "shipped-envoy"])
def test_installs_the_picker_with_its_envoy_sidecar(
    value_set, kube_cluster, admin_api, helm_binary, helm_env, third_party_crds, tmp_path
) -> None:
    values = value_files(value_set, tmp_path)
    namespace = lint_validate_install(helm_binary, helm_env, kube_cluster, admin_api, values, f"standalone-{value_set}")
    core, rbac = client.CoreV1Api(admin_api), client.RbacAuthorizationV1Api(admin_api)
    deployment = client.AppsV1Api(admin_api).read_namespaced_deployment("rel-epp", namespace)
    pod = deployment.spec.template.spec
    (epp, envoy) = pod.containers
    assert epp.name == "epp" and epp.args[0] == "serve"
    envoy_config_map = pod_config_map(pod, envoy)
    envoy_config = yaml.safe_load(core.read_namespaced_config_map(envoy_config_map, namespace).data["envoy.yaml"])
    if value_set == "shipped-envoy":
        assert envoy.name == "envoy" and envoy.image.startswith("docker.io/envoyproxy/envoy:")
        assert envoy_config == yaml.safe_load(SHIPPED_ENVOY.read_text())
    else:
        reference_sidecar = yaml.safe_load(reference_values("standalone").read_text())["inferenceExtension"]["sidecar"]
        assert (envoy.name, envoy.image) == (reference_sidecar["name"], reference_sidecar["image"])
        assert envoy_config == yaml.safe_load(reference_sidecar["configMap"]["data"]["envoy.yaml"])
    assert envoy.args[-2:] == ["-c", "/etc/envoy/envoy.yaml"]
    assert 8081 in {p.container_port for p in envoy.ports}

    service = core.read_namespaced_service("rel-epp", namespace)
    assert {p.port for p in service.spec.ports} >= {9002, 9090, 8081}
    assert service.spec.selector == deployment.spec.selector.match_labels
    assert "default-plugins.yaml" in core.read_namespaced_config_map("rel-epp", namespace).data

    standalone = value_set == "reference-selector"
    assert ("--endpoint-selector=app=vllm-qwen3-32b" in epp.args) == standalone
    assert ("--pool-name=rel" in epp.args) != standalone
    pools = client.CustomObjectsApi(admin_api).list_namespaced_custom_object(
        "inference.networking.k8s.io", "v1", namespace, "inferencepools"
    )["items"]
    assert [p["metadata"]["name"] for p in pools] == ([] if standalone else ["rel"])

    assert core.read_namespaced_service_account("rel-epp", namespace)
    role = rbac.read_namespaced_role("rel-epp", namespace)
    readable = {resource for rule in role.rules for resource in rule.resources}
    assert {"pods", "configmaps"} <= readable
    assert ({"inferencepools", "inferenceobjectives", "inferencemodelrewrites"} <= readable) != standalone
    binding = rbac.read_namespaced_role_binding("rel-epp", namespace)
    assert binding.role_ref.name == "rel-epp"
    assert [(s.kind, s.name) for s in binding.subjects] == [("ServiceAccount", "rel-epp")]


def pod_config_map(pod: client.V1PodSpec, container: client.V1Container) -> str:
    """The ConfigMap mounted at the container's /etc/envoy."""
    (mount,) = [m for m in container.volume_mounts if m.mount_path == "/etc/envoy"]
    (volume,) = [v for v in pod.volumes if v.name == mount.name]
    name: str = volume.config_map.name
    return name


def local_envoy_config(config: dict[str, Any], local: Callable[[int], int]) -> dict[str, Any]:
    """The pod's Envoy config outside a pod: every socket on loopback, each port mapped by
    `local` (the same map the picker's ports went through, so ext_proc reaches it)."""

    def readdress(node: Any) -> None:
        if isinstance(node, dict):
            address = node.get("socket_address")
            if isinstance(address, dict):
                address["address"] = "127.0.0.1"
                address["port_value"] = local(int(address["port_value"]))
            for value in node.values():
                readdress(value)
        elif isinstance(node, list):
            for value in node:
                readdress(value)

    readdress(config)
    return config


@pytest.fixture
def pool_backends(tmp_path: Path) -> Iterator[tuple[list[str], int]]:
    """Two model-server stand-ins on 127.0.0.x sharing a port (one pool's pods), answering with
    an x-backend header naming themselves."""
    hosts = ["127.0.0.61", "127.0.0.62"]
    port = shared_port(hosts)
    process = start_backends([f"{h}:{port}" for h in hosts], tmp_path / "backends")
    yield hosts, port
    process.stop()


@pytest.mark.parametrize("value_set", ["reference-alone", "reference-selector", "shipped-envoy"])
def test_the_pair_routes_a_request_to_a_pod_of_the_pool(
    value_set, kube_cluster, admin_api, helm_binary, helm_env, third_party_crds, pool_backends, tmp_path
) -> None:
    hosts, port = pool_backends
    standalone = value_set == "reference-selector"
    # The pods' label and port: the pool's in pool mode (set below), the selector's in standalone mode.
    servers = {"endpointSelector": "app=vllm", "targetPorts": port}
    values = [
        *value_files(value_set, tmp_path),
        values_file(tmp_path, {"inferenceExtension": {"endpointsServer": servers}} if standalone else {}, "pods.yaml"),
    ]
    dash_f = [arg for path in values for arg in ("-f", str(path))]
    namespace = create_namespace(admin_api, f"pair-{value_set}")
    helm(helm_binary, helm_env, "install", "rel", str(PICKER_CHART), "-n", namespace, *dash_f, kube=kube_cluster)
    for i, host in enumerate(hosts):
        create_pod(admin_api, namespace, f"vllm-{i}", {"app": "vllm"})
        set_pod_ready(admin_api, namespace, f"vllm-{i}", host)
    if not standalone:
        put_pool(admin_api, namespace, "rel", {"app": "vllm"}, [port])

    deployment = client.AppsV1Api(admin_api).read_namespaced_deployment("rel-epp", namespace)
    pod = deployment.spec.template.spec
    kubeconfig = service_account_kubeconfig(
        admin_api, kube_cluster, namespace, pod.service_account_name, tmp_path / "sa"
    )
    picker, local = run_like_the_kubelet(deployment, namespace, kubeconfig, tmp_path)
    config_map = client.CoreV1Api(admin_api).read_namespaced_config_map(
        pod_config_map(pod, pod.containers[1]), namespace
    )
    config = local_envoy_config(yaml.safe_load(config_map.data["envoy.yaml"]), local)
    envoy = EnvoyProcess(f"envoy-{value_set}", config, tmp_path).start()
    try:
        envoy.wait_ready(envoy.ready, timeout=30)
        url = f"http://127.0.0.1:{local(8081)}/v1/completions"
        answers: list[tuple[int, str | None]] = []

        def routed() -> bool:
            answers.append(post(url))
            return answers[-1][0] == 200

        try:
            wait_until(routed, ROUTE_DEADLINE, "a request through Envoy answered 200", interval=0.2)
        except TimeoutError:
            pass  # the assertion below shows the answers and the logs
        assert answers and answers[-1][0] == 200, f"{answers[-3:]}\n{picker.log_tail()}\n{envoy.log_tail()}"
        assert answers[-1][1] in {f"{h}:{port}" for h in hosts}
    finally:
        envoy.stop()
        picker.stop()


def test_the_shipped_envoy_image_is_the_release_the_tests_run(helm_binary, helm_env, tmp_path) -> None:
    """The tests run the shipped config with the venv's Envoy: the chart's image is that release."""
    docs = render(helm_binary, helm_env, PICKER_CHART, value_files("shipped-envoy", tmp_path))
    version = subprocess.run([envoy_binary(), "--version"], capture_output=True, text=True, check=True, timeout=30)
    (release,) = re.findall(r"/(\d+\.\d+\.\d+)/", version.stdout)
    assert sidecar(docs)["image"] == f"docker.io/envoyproxy/envoy:distroless-v{release}"
