"""`picker serve` starting on a pool of 256 endpoints (32 Pods x 8 target ports) through the real
API server: it reaches SERVING, and SERVING means it routes: the whole pool is known at that
moment, and requests land on the pool's endpoints. Start time is measured by `python -m picker_bench.startup`, not
asserted here: a time bound would be fragile on a shared machine."""

from __future__ import annotations

import random
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from picker_bench.kube_cluster import KubeCluster
from picker_bench.kube_resources import create_pod, put_pool, set_pod_ready
from picker_bench.process import ManagedProcess
from picker_bench.startup import MAX_TARGET_PORTS
from tests.e2e.kube_resources import create_namespace
from tests.e2e.kube_stack import shared_port
from tests.e2e.test_kube_routing import post
from tests.stack import start_backends, start_envoy, start_picker

PODS = 32
_METRICS_AGE = re.compile(r'^picker_metrics_age_seconds\{endpoint="([^"]+)"\}', re.MULTILINE)


def scraped_endpoints(metrics_port: int) -> set[str]:
    """The endpoints the picker's data layer follows, as its /metrics lists them."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
        return set(_METRICS_AGE.findall(response.read().decode()))


@pytest.fixture(scope="module")
def hosts() -> list[str]:
    """32 loopback addresses in a /24 the other e2e tests (127.0.0.x) do not use."""
    subnet = random.randrange(100, 200)
    return [f"127.0.{subnet}.{i + 2}" for i in range(PODS)]


@pytest.fixture(scope="module")
def endpoints(hosts: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """A backend at each of the 8 target ports of every host."""
    ports: set[int] = set()
    while len(ports) < MAX_TARGET_PORTS:
        ports.add(shared_port(hosts))
    addresses = [f"{host}:{port}" for host in hosts for port in sorted(ports)]
    process: ManagedProcess = start_backends(addresses, tmp_path_factory.mktemp("backends"))
    yield addresses
    process.stop()


def test_serving_on_a_pool_of_256_endpoints_means_routing(
    kube_cluster: KubeCluster, admin_api: client.ApiClient, hosts: list[str], endpoints: list[str], tmp_path: Path
) -> None:
    namespace, labels = create_namespace(admin_api, "startup"), {"app": "startup"}
    ports = sorted({int(address.rsplit(":", 1)[1]) for address in endpoints})
    put_pool(admin_api, namespace, "pool", labels, ports)
    for i, host in enumerate(hosts):
        create_pod(admin_api, namespace, f"startup-{i}", labels)
        set_pod_ready(admin_api, namespace, f"startup-{i}", host)
    args = ["--pool-name", "pool", "--pool-namespace", namespace, "--kubeconfig", str(kube_cluster.admin_kubeconfig)]
    picker = start_picker(tmp_path, *args, "--metrics-endpoint-auth=false", tls=False)  # returns once SERVING
    try:
        assert scraped_endpoints(picker.metrics_port) == set(endpoints)
        envoy = start_envoy("buffered", picker.grpc_port, tmp_path, tls=False)
        try:
            url = envoy.url + "/v1/completions"
            answers = [post(url) for _ in range(20)]
        finally:
            envoy.stop()
    finally:
        picker.stop()
    assert {status for status, _ in answers} == {200}
    assert {backend for _, backend in answers} <= set(endpoints)
