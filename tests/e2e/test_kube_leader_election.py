"""`--ha-enable-leader-election` on the real API server: two `picker serve` replicas (the chart
installed with `replicas: 2`, so its leader-election Role, and its ServiceAccount's token) behind
one Envoy ext_proc cluster, under load.

Envoy stands in for the Kubernetes Service in front of the replicas: it health-checks each with
the chart's readiness probe (gRPC health `readiness` on the health port) and sends ext_proc
streams only to a ready one (no panic routing), as a Service sends only to Ready pods. FailClose:
a request Envoy cannot hand to a picker fails with 500."""

from __future__ import annotations

import itertools
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from kubernetes import client

from picker.discovery.lease import LeaseTiming, lease_name
from picker_bench.envoy import EnvoyProcess, picker_config
from picker_bench.kube_cluster import KubeCluster
from picker_bench.kube_resources import create_pod, put_pool, set_pod_ready
from picker_bench.process import ManagedProcess, free_port, wait_until
from tests.e2e.conftest import CHART
from tests.e2e.helm_cli import helm
from tests.e2e.kube_resources import create_namespace, service_account_kubeconfig
from tests.e2e.kube_stack import shared_port
from tests.e2e.test_kube_routing import post
from tests.stack import health_status, loopback_addresses, start_backends

TIMING = LeaseTiming()  # the reference's (controller-runtime's defaults)
# A standby takes the Lease once its record has not changed for the lease duration since it
# last saw it change, i.e. at most a lease duration plus one (jittered) retry after the leader's
# last renewal; Envoy then needs one health check to send it traffic.
TAKEOVER_DEADLINE = TIMING.lease_duration + TIMING.retry_period * 1.2 + 1.0
HEALTH_CHECK_INTERVAL = 0.25
RELEASE = "ha"
_names = itertools.count(1)


@dataclass
class Replica:
    process: ManagedProcess
    grpc_port: int
    health_port: int

    def status(self, service: str) -> str:
        try:
            return health_pb2.HealthCheckResponse.ServingStatus.Name(health_status(self.health_port, service))
        except grpc.RpcError as exc:
            return f"unanswered ({exc.code().name})"

    def ready(self) -> bool:
        return self.status("readiness") == "SERVING"


@pytest.fixture(scope="module")
def ha_release(
    kube_cluster: KubeCluster,
    admin_api: client.ApiClient,
    helm_binary: Path,
    helm_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, str]:
    """The chart with two replicas (its leader-election Role) and a pool of two stand-in pods."""
    namespace = create_namespace(admin_api, "picker-ha")
    helm(
        helm_binary,
        helm_env,
        "install",
        RELEASE,
        str(CHART),
        "-n",
        namespace,
        "--set",
        "inferenceExtension.replicas=2",
        "--set",
        "inferenceExtension.secureServing=false",
        kube=kube_cluster,
    )
    directory = tmp_path_factory.mktemp("ha")
    kubeconfig = service_account_kubeconfig(admin_api, kube_cluster, namespace, f"{RELEASE}-epp", directory / "sa")
    return {"namespace": namespace, "kubeconfig": str(kubeconfig), "dir": str(directory)}


@pytest.fixture(scope="module")
def backends(admin_api: client.ApiClient, ha_release: dict[str, str]) -> Iterator[list[str]]:
    hosts = [address.rsplit(":", 1)[0] for address in loopback_addresses(2)]
    port = shared_port(hosts)  # pods of one pool share their target port
    addresses = [f"{host}:{port}" for host in hosts]
    process = start_backends(addresses, Path(ha_release["dir"]))
    ns, labels = ha_release["namespace"], {"app": "ha-model"}
    for i, address in enumerate(addresses):
        create_pod(admin_api, ns, f"model-{i}", labels)
        set_pod_ready(admin_api, ns, f"model-{i}", address.rsplit(":", 1)[0])
    put_pool(admin_api, ns, RELEASE, labels, [port])
    yield addresses
    process.stop()


def start_replica(release: dict[str, str]) -> Replica:
    """One replica as the chart runs it (leader election, the pool, its ConfigMap)."""
    grpc_port, health_port = free_port(), free_port()
    name = f"picker-ha-{next(_names)}"
    argv = [sys.executable, "-m", "picker.cli", "serve", "--bind-address", "127.0.0.1", "--secure-serving=false"]
    argv += ["--grpc-port", str(grpc_port), "--grpc-health-port", str(health_port), "--metrics-port", str(free_port())]
    argv += ["--pool-name", RELEASE, "--pool-namespace", release["namespace"], "--config-map", f"{RELEASE}-epp"]
    argv += ["--kubeconfig", release["kubeconfig"], "--ha-enable-leader-election", "--shutdown-delay=0s"]
    process = ManagedProcess(name, argv, Path(release["dir"])).start()
    replica = Replica(process, grpc_port, health_port)
    # Liveness answers on every replica, leader or not (the chart's liveness probe).
    process.wait_ready(lambda: replica.status("liveness") == "SERVING", timeout=30)
    return replica


def start_gateway(replicas: list[Replica], log_dir: Path) -> EnvoyProcess:
    """Envoy with one ext_proc cluster over every replica, each health-checked as the chart's
    readiness probe checks it."""
    config = picker_config(
        "buffered", ("127.0.0.1", free_port()), ("127.0.0.1", 1), ("127.0.0.1", free_port()), tls=False
    )
    (cluster,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "ext_proc"]
    cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
        {
            "endpoint": {
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": r.grpc_port}},
                "health_check_config": {"port_value": r.health_port},
            }
        }
        for r in replicas
    ]
    cluster["health_checks"] = [
        {
            "timeout": "1s",
            "interval": f"{HEALTH_CHECK_INTERVAL}s",
            # Envoy checks at no_traffic_interval (60 s) until it counts traffic, which ext_proc's
            # gRPC streams do not make: check as often regardless, as the kubelet probes.
            "no_traffic_interval": f"{HEALTH_CHECK_INTERVAL}s",
            "no_traffic_healthy_interval": f"{HEALTH_CHECK_INTERVAL}s",
            "unhealthy_threshold": 1,
            "healthy_threshold": 1,
            "grpc_health_check": {"service_name": "readiness"},
        }
    ]
    cluster["common_lb_config"] = {"healthy_panic_threshold": {"value": 0}}  # only ready replicas
    envoy = EnvoyProcess(f"envoy-ha-{next(_names)}", config, log_dir).start()
    envoy.wait_ready(envoy.ready, timeout=30)
    return envoy


class Load:
    """Requests through Envoy one after another in a thread: (start, end, status) each."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.results: list[tuple[float, float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            status, _ = post(self.url)
            self.results.append((start, time.monotonic(), status))

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def between(self, start: float, end: float) -> list[int]:
        """Statuses of the requests sent and answered within [start, end]."""
        return [status for sent, done, status in self.results if sent >= start and done <= end]


def lease_holder(api: client.ApiClient, namespace: str) -> tuple[str, int]:
    lease = client.CoordinationV1Api(api).read_namespaced_lease(lease_name(namespace, RELEASE), namespace)
    return lease.spec.holder_identity or "", lease.spec.lease_transitions or 0


def test_standby_takes_over_after_the_leader_is_killed_and_requests_keep_routing(
    admin_api, ha_release, backends, tmp_path
) -> None:
    ns = ha_release["namespace"]
    replicas = [start_replica(ha_release), start_replica(ha_release)]
    envoy = None
    try:
        wait_until(lambda: sum(r.ready() for r in replicas) == 1, 30, "one replica to lead and be ready")
        (leader,) = [r for r in replicas if r.ready()]
        (standby,) = [r for r in replicas if r is not leader]
        assert standby.status("readiness") == "NOT_SERVING"
        assert standby.status("liveness") == "SERVING"  # a standby is not restarted for not leading
        holder, transitions = lease_holder(admin_api, ns)
        assert holder

        envoy = start_gateway(replicas, tmp_path)
        url = envoy.url + "/v1/completions"
        wait_until(lambda: post(url)[0] == 200, 10, "Envoy to route through the leader")
        with Load(url) as load:
            wait_until(lambda: len(load.results) >= 20, 30, "requests before the kill")
            killed_at = time.monotonic()
            os.kill(leader.process.pid, signal.SIGKILL)
            wait_until(standby.ready, TAKEOVER_DEADLINE, "the standby to become ready after the leader died")
            routed_again = time.monotonic() + 2 * HEALTH_CHECK_INTERVAL + 1.0  # Envoy's next health check
            wait_until(lambda: len(load.between(routed_again, time.monotonic())) >= 20, 30, "requests after")
            after_end = time.monotonic()

        before = load.between(0, killed_at)
        assert before and set(before) == {200}, f"before the kill: {sorted(set(before))}"
        after = load.between(routed_again, after_end)
        assert set(after) == {200}, f"after the takeover: {sorted(set(after))}"
        new_holder, new_transitions = lease_holder(admin_api, ns)
        assert new_holder != holder and new_transitions == transitions + 1
        # Only the gap without a ready replica failed, with FailClose's 500.
        gap = {status for sent, _, status in load.results if killed_at <= sent < routed_again}
        assert gap <= {200, 500}
    finally:
        if envoy is not None:
            envoy.stop()
        for replica in replicas:
            replica.process.stop()


def test_a_stopping_leader_releases_the_lease_so_the_standby_takes_over_at_once(admin_api, ha_release) -> None:
    """SIGTERM: the leader releases the Lease (the reference's ReleaseOnCancel), so the standby
    leads within a retry period instead of waiting for the lease to expire."""
    replicas = [start_replica(ha_release), start_replica(ha_release)]
    try:
        # A Lease left by an earlier test's killed leader expires first.
        wait_until(lambda: sum(r.ready() for r in replicas) == 1, TAKEOVER_DEADLINE + 10, "one leader")
        (leader,) = [r for r in replicas if r.ready()]
        (standby,) = [r for r in replicas if r is not leader]
        held_by, _ = lease_holder(admin_api, ha_release["namespace"])
        leader.process.stop()
        # Released on the way out (cleared, or already the standby's), not left to expire.
        assert lease_holder(admin_api, ha_release["namespace"])[0] != held_by
        # The deadline is well within TIMING.lease_duration: the standby did not wait for expiry.
        wait_until(standby.ready, TIMING.retry_period * 1.2 + 2.0, "the standby to lead after the release")
    finally:
        for replica in replicas:
            replica.process.stop()
