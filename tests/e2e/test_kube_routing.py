"""Routing through Envoy with `picker serve` discovering its pool from the real API server.

Model servers are the integration tests' stand-ins (tests/backends.py) on 127.0.0.x; Pod objects
carry those IPs and get Ready through the status subresource. The picker runs as a subprocess
with the chart's ServiceAccount token and plaintext ext_proc."""

from __future__ import annotations

import itertools
import json
import random
import time
import urllib.request
from collections.abc import Iterator

import pytest
from kubernetes import client

from picker_bench.kube_cluster import KubeCluster
from picker_bench.kube_resources import create_pod, put_pool, set_pod_ready
from picker_bench.process import ManagedProcess
from tests.e2e.kube_resources import delete_pod, patch_config_map
from tests.e2e.kube_stack import post, release_gateway, shared_port
from tests.stack import Picker, start_backends

CHANGE_DEADLINE = 1.0
_labels = itertools.count(1)


def routes_only_to(url: str, expected: set[str], deadline: float, what: str, probes: int = 6) -> float:
    """Poll until `probes` consecutive requests all land in `expected`; return the seconds taken."""
    start = time.monotonic()
    while True:
        backends = {post(url)[1] for _ in range(probes)}
        if backends <= expected and None not in backends:
            return time.monotonic() - start
        if time.monotonic() - start > deadline:
            raise AssertionError(f"not within {deadline} s: {what} (last answers came from {backends})")


@pytest.fixture(scope="module")
def hosts() -> list[str]:
    first = random.randrange(20, 200)
    return [f"127.0.0.{first + i}" for i in range(3)]


@pytest.fixture(scope="module")
def ports(hosts: list[str]) -> tuple[int, int]:
    return shared_port(hosts), shared_port(hosts)


@pytest.fixture(scope="module")
def backends(
    hosts: list[str], ports: tuple[int, int], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ManagedProcess]:
    process = start_backends([f"{h}:{p}" for h in hosts for p in ports], tmp_path_factory.mktemp("backends"))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def gateway(
    picker_release: dict[str, str], backends: ManagedProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Picker, str]]:
    """`picker serve` for the chart's pool, with the chart's credentials, behind Envoy."""
    with release_gateway(
        picker_release, tmp_path_factory.mktemp("gateway"), "kube", "--enable-debug-decisions"
    ) as gateway:
        yield gateway


@pytest.fixture
def labels(admin_api, picker_release) -> dict[str, str]:
    return {"app": f"route-{next(_labels)}"}


def test_routing_follows_pod_readiness_and_deletion(admin_api, picker_release, hosts, ports, labels, gateway) -> None:
    ns, (port, _) = picker_release["namespace"], ports
    _, url = gateway
    a, b = f"{labels['app']}-a", f"{labels['app']}-b"
    for name in (a, b):
        create_pod(admin_api, ns, name, labels)
    set_pod_ready(admin_api, ns, a, hosts[0])
    put_pool(admin_api, ns, "pool", labels, [port])
    routes_only_to(url, {f"{hosts[0]}:{port}"}, 5.0, "the pool's first pod")

    set_pod_ready(admin_api, ns, b, hosts[1])
    set_pod_ready(admin_api, ns, a, hosts[0], ready=False)
    routes_only_to(url, {f"{hosts[1]}:{port}"}, CHANGE_DEADLINE, "b Ready, a NotReady")

    set_pod_ready(admin_api, ns, a, hosts[0])
    delete_pod(admin_api, ns, b)
    routes_only_to(url, {f"{hosts[0]}:{port}"}, CHANGE_DEADLINE, "b deleted")

    delete_pod(admin_api, ns, a)
    start = time.monotonic()
    while post(url)[0] != 503:
        assert time.monotonic() - start < CHANGE_DEADLINE, "no 503 after the last pod was deleted"


def test_target_ports_are_separate_endpoints(admin_api, picker_release, hosts, ports, labels, gateway) -> None:
    ns = picker_release["namespace"]
    _, url = gateway
    pod = f"{labels['app']}-dp"
    create_pod(admin_api, ns, pod, labels, {"inference.networking.k8s.io/active-ports": str(ports[1])})
    set_pod_ready(admin_api, ns, pod, hosts[2])
    put_pool(admin_api, ns, "pool", labels, list(ports))
    routes_only_to(url, {f"{hosts[2]}:{ports[1]}"}, 5.0, "only the active rank")
    client.CoreV1Api(admin_api).patch_namespaced_pod(
        pod, ns, {"metadata": {"annotations": {"inference.networking.k8s.io/active-ports": str(ports[0])}}}
    )
    routes_only_to(url, {f"{hosts[2]}:{ports[0]}"}, CHANGE_DEADLINE, "the other rank")


def test_selector_change_retargets_routing(admin_api, picker_release, hosts, ports, labels, gateway) -> None:
    ns, (port, _) = picker_release["namespace"], ports
    _, url = gateway
    blue, green = {**labels, "track": "blue"}, {**labels, "track": "green"}
    create_pod(admin_api, ns, f"{labels['app']}-blue", blue)
    create_pod(admin_api, ns, f"{labels['app']}-green", green)
    set_pod_ready(admin_api, ns, f"{labels['app']}-blue", hosts[0])
    set_pod_ready(admin_api, ns, f"{labels['app']}-green", hosts[1])
    put_pool(admin_api, ns, "pool", blue, [port])
    routes_only_to(url, {f"{hosts[0]}:{port}"}, 5.0, "blue")
    put_pool(admin_api, ns, "pool", green, [port])
    routes_only_to(url, {f"{hosts[1]}:{port}"}, CHANGE_DEADLINE, "green after the selector change")


def test_api_server_restart_keeps_routing_and_the_watch_resumes(
    kube_cluster: KubeCluster, admin_api, picker_release, hosts, ports, labels, gateway
) -> None:
    ns, (port, _) = picker_release["namespace"], ports
    _, url = gateway
    a, b = f"{labels['app']}-a", f"{labels['app']}-b"
    create_pod(admin_api, ns, a, labels)
    set_pod_ready(admin_api, ns, a, hosts[0])
    put_pool(admin_api, ns, "pool", labels, [port])
    routes_only_to(url, {f"{hosts[0]}:{port}"}, 5.0, "a")

    kube_cluster.stop_apiserver()
    try:
        routes_only_to(url, {f"{hosts[0]}:{port}"}, CHANGE_DEADLINE, "routing with the API server down")
    finally:
        kube_cluster.start_apiserver()
    create_pod(admin_api, ns, b, labels)
    set_pod_ready(admin_api, ns, b, hosts[1])
    set_pod_ready(admin_api, ns, a, hosts[0], ready=False)
    routes_only_to(url, {f"{hosts[1]}:{port}"}, 5.0, "b after the restart (watch resumed)")


def test_config_map_weight_change_applies_without_restart(
    admin_api, picker_release, hosts, ports, labels, gateway
) -> None:
    """A weight edited in the ConfigMap is what the running picker (same PID) scores with within
    a second, as its decision log shows."""
    picker, url = gateway
    pid = picker.process.pid
    ns, name, (port, _) = picker_release["namespace"], picker_release["config_map"], ports
    pod = f"{labels['app']}-cfg"
    create_pod(admin_api, ns, pod, labels)
    set_pod_ready(admin_api, ns, pod, hosts[0])
    put_pool(admin_api, ns, "pool", labels, [port])
    routes_only_to(url, {f"{hosts[0]}:{port}"}, 5.0, "the pod")
    assert _prefix_weight(picker, url) == 3  # the chart's default-plugins.yaml

    current = client.CoreV1Api(admin_api).read_namespaced_config_map(name, ns).data["default-plugins.yaml"]
    try:
        patch_config_map(admin_api, ns, name, {"default-plugins.yaml": current.replace("weight: 3", "weight: 7")})
        start = time.monotonic()
        while _prefix_weight(picker, url) != 7:
            assert time.monotonic() - start < CHANGE_DEADLINE, "the new weight was not applied"
        assert picker.process.pid == pid and picker.process.alive()
    finally:
        patch_config_map(admin_api, ns, name, {"default-plugins.yaml": current})


def _prefix_weight(picker: Picker, url: str) -> float:
    """The prefix-cache-scorer weight the picker used for a request sent now."""
    assert post(url)[0] == 200
    with urllib.request.urlopen(f"http://127.0.0.1:{picker.metrics_port}/debug/decisions", timeout=2) as response:
        newest = json.loads(response.read())["decisions"][0]
    return newest["profiles"][newest["primary_profile"]]["weights"]["prefix-cache-scorer"]
