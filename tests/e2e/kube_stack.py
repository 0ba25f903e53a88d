"""Real processes around a chart release on the e2e cluster: simulated vLLM pods as the release
pool's Ready pods, and `picker serve` for the release (its ServiceAccount's credentials, its
ConfigMap) behind Envoy."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kubernetes import client

from picker_bench.kube_resources import create_pod, put_pool, set_pod_ready
from tests.sim_fixtures import start_sim, stop_process
from tests.stack import Picker, start_envoy, start_picker


def shared_port(hosts: list[str]) -> int:
    """A port free on every one of `hosts` (pods of one pool share their target ports)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port = probe.getsockname()[1]
        try:
            for host in hosts:
                with socket.socket() as s:
                    s.bind((host, port))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no port free on all of {hosts}")


def serve_args(release: dict[str, str], metrics_auth: bool = False) -> list[str]:
    """`picker serve` flags for the release's pool, credentials and ConfigMap; without metrics
    auth unless asked (test_kube_metrics_auth.py covers it), so tests read /metrics freely."""
    args = [
        "--pool-name",
        release["pool"],
        "--pool-namespace",
        release["namespace"],
        "--kubeconfig",
        release["kubeconfig"],
        "--config-map",
        release["config_map"],
    ]
    return args if metrics_auth else [*args, "--metrics-endpoint-auth=false"]


@contextmanager
def sim_pool(api: client.ApiClient, release: dict[str, str], app: str, *sim_flags: str) -> Iterator[list[str]]:
    """Two simulated vLLM pods (`picker sim` with `sim_flags`) on consecutive 127.0.0.x hosts, as
    Ready pods labelled `app` that the release's pool selects; yields their addresses."""
    first = random.randrange(20, 200)
    hosts = [f"127.0.0.{first}", f"127.0.0.{first + 1}"]
    port = shared_port(hosts)
    process, _ = start_sim(
        ["--pods", "2", "--host", hosts[0], "--distinct-hosts", "--base-port", str(port), *sim_flags]
    )
    try:
        ns, labels = release["namespace"], {"app": app}
        for i, host in enumerate(hosts):
            create_pod(api, ns, f"{app}-{i}", labels)
            set_pod_ready(api, ns, f"{app}-{i}", host)
        put_pool(api, ns, release["pool"], labels, [port])
        yield [f"{host}:{port}" for host in hosts]
    finally:
        stop_process(process)


@contextmanager
def release_gateway(release: dict[str, str], log_dir: Path, name: str, *flags: str) -> Iterator[tuple[Picker, str]]:
    """`picker serve` for the release (plaintext ext_proc, extra `flags`) behind Envoy; yields the
    picker and the completions URL."""
    picker = start_picker(log_dir, *serve_args(release), *flags, name=f"picker-{name}", tls=False)
    try:
        envoy = start_envoy("buffered", picker.grpc_port, log_dir, tls=False, name=f"envoy-{name}")
    except Exception:
        picker.stop()
        raise
    try:
        yield picker, envoy.url + "/v1/completions"
    finally:
        envoy.stop()
        picker.stop()
