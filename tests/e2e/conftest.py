"""Fixtures for e2e tests against a real kube-apiserver + etcd, with the project's CRDs and the
picker chart installed by helm."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client, config

from picker_bench.kube_cluster import KubeCluster, MissingBinaryError, cached_binary
from picker_bench.kube_resources import apply_manifests, wait_crds_established
from tests.e2e.charts import install_third_party_crds
from tests.e2e.helm_cli import HELM_VERSION, helm
from tests.e2e.kube_resources import create_namespace, service_account_kubeconfig

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "picker"
CRDS = ROOT / "manifests" / "crds"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests on a real cluster are `slow` (in `make test`, not `make check`)."""
    for item in items:
        if "kube_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def helm_binary() -> Path:
    try:
        return cached_binary("helm", HELM_VERSION)
    except MissingBinaryError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def helm_env() -> Iterator[dict[str, str]]:
    with tempfile.TemporaryDirectory(prefix="picker-helm-") as home:
        env = dict(os.environ)
        env.update(HELM_CACHE_HOME=home, HELM_CONFIG_HOME=home, HELM_DATA_HOME=home)
        yield env


@pytest.fixture(scope="session")
def kube_cluster() -> Iterator[KubeCluster]:
    try:
        cluster = KubeCluster()
    except MissingBinaryError as exc:
        pytest.fail(str(exc), pytrace=False)
    cluster.start()
    try:
        api = config.new_client_from_config(config_file=str(cluster.admin_kubeconfig))
        with api:
            apply_manifests(api, sorted(CRDS.glob("*.yaml")))
            wait_crds_established(api, [p.stem for p in CRDS.glob("*.yaml")])
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def admin_api(kube_cluster: KubeCluster) -> Iterator[client.ApiClient]:
    api = config.new_client_from_config(config_file=str(kube_cluster.admin_kubeconfig))
    with api:
        yield api


@pytest.fixture(scope="session")
def third_party_crds(admin_api: client.ApiClient) -> None:
    """Stand-in CRDs for the other projects' kinds the charts' options render."""
    install_third_party_crds(admin_api)


@pytest.fixture(scope="module")
def picker_release(
    kube_cluster: KubeCluster,
    admin_api: client.ApiClient,
    helm_binary: Path,
    helm_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, str]:
    """The chart installed (default values, plaintext ext_proc) in a fresh namespace, and a
    kubeconfig with its ServiceAccount's credentials: what the picker runs with in a cluster."""
    namespace = create_namespace(admin_api, "picker-e2e")
    helm(
        helm_binary,
        helm_env,
        "install",
        "pool",
        str(CHART),
        "-n",
        namespace,
        "--wait=false",
        "--set",
        "inferenceExtension.secureServing=false",
        kube=kube_cluster,
    )
    path = service_account_kubeconfig(
        admin_api, kube_cluster, namespace, "pool-epp", tmp_path_factory.mktemp("sa") / "picker.kubeconfig"
    )
    return {"namespace": namespace, "pool": "pool", "config_map": "pool-epp", "kubeconfig": str(path)}
