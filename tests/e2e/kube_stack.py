"""Real processes around a chart release on the e2e cluster: simulated vLLM pods as the release
pool's Ready pods, and `picker serve` for the release (its ServiceAccount's credentials, its
ConfigMap) behind Envoy; and `picker serve` run as the kubelet would run an installed
Deployment's container."""

from __future__ import annotations

import itertools
import json
import os
import random
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from kubernetes import client

from picker_bench.kube_resources import create_pod, put_pool, set_pod_ready
from picker_bench.process import ManagedProcess, free_port
from tests.sim_fixtures import start_sim, stop_process
from tests.stack import Picker, start_envoy, start_picker

_pod_names = itertools.count(1)


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


def run_like_the_kubelet(
    deployment: client.V1Deployment, namespace: str, kubeconfig: Path, log_dir: Path
) -> tuple[ManagedProcess, Callable[[int], int]]:
    """`picker serve` with the Deployment's args and env. Outside a pod it needs what the pod
    would give it: the API server (the ServiceAccount's token), loopback ports in place of the
    pod's own (the returned function maps a container port to the one used) and the downward
    API's values."""
    container = deployment.spec.template.spec.containers[0]
    assert container.args[0] == "serve"
    ports: dict[int, int] = {}

    def local(port: int) -> int:
        return ports.setdefault(port, free_port())

    args = []
    for arg in container.args:
        name, _, value = arg.partition("=")
        if name in ("--grpc-port", "--grpc-health-port", "--metrics-port"):
            arg = f"{name}={local(int(value))}"
        args.append(arg)
    downward = {"metadata.namespace": namespace, "metadata.name": f"{deployment.metadata.name}-{next(_pod_names)}"}
    env = dict(os.environ)
    for var in container.env:
        env[var.name] = downward[var.value_from.field_ref.field_path] if var.value_from else var.value
    argv = [sys.executable, "-m", "picker.cli", *args, "--bind-address=127.0.0.1", f"--kubeconfig={kubeconfig}"]
    return ManagedProcess(f"picker-{namespace}", argv, log_dir, env=env).start(), local


def post(url: str) -> tuple[int, str | None]:
    """(status, the backend that answered) for one completion request through Envoy."""
    body = json.dumps({"model": "m", "prompt": "hello"}).encode()
    request = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.headers.get("x-backend")
    except urllib.error.HTTPError as exc:
        return exc.code, None
