"""Start to SERVING with a large pool: `python -m picker_bench.startup [--endpoints 256] [--runs 5]
[--reference-epp PATH]`.

Starts a real control plane (etcd + kube-apiserver) with the project's CRDs, an InferencePool v1 of
8 target ports and endpoints/8 Pods Ready at distinct 127.0.x.y addresses, then starts each EPP
`--runs` times and reports the seconds from process start to its gRPC health service answering
SERVING (median, min, max) and the median CPU seconds it used until then (steadier than the wall
time on a shared machine): `picker serve` on the pool, `picker serve` on the same endpoints as
`--endpoints` (no Kubernetes), and the reference EPP on the pool with `--reference-epp`. Nothing
listens at the endpoints: start to SERVING does not wait for their metrics.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client
from kubernetes import config as kube_config

from picker_bench.kube_cluster import KubeCluster
from picker_bench.kube_resources import apply_manifests, create_pod, put_pool, set_pod_ready, wait_crds_established
from picker_bench.process import ManagedProcess, free_port, health_serving, port_open
from picker_bench.reference_epp import CRDS, MAX_TARGET_PORTS, NAMESPACE, POD_LABELS, POOL

FIRST_TARGET_PORT = 8000
_POLL_INTERVAL = 0.01


@dataclass(frozen=True)
class PoolLayout:
    """endpoints/8 Pods at distinct loopback addresses, each serving the pool's 8 target ports."""

    endpoints: int

    def __post_init__(self) -> None:
        if self.endpoints <= 0 or self.endpoints % MAX_TARGET_PORTS:
            raise ValueError(f"endpoints must be a positive multiple of {MAX_TARGET_PORTS}, not {self.endpoints}")

    @property
    def ports(self) -> list[int]:
        return [FIRST_TARGET_PORT + i for i in range(MAX_TARGET_PORTS)]

    @property
    def pod_ips(self) -> list[str]:
        # 127.0.x.y with y in 2..251: up to 250 pods per /24, so 1,024 endpoints fit in one.
        return [f"127.0.{i // 250}.{i % 250 + 2}" for i in range(self.endpoints // MAX_TARGET_PORTS)]

    @property
    def addresses(self) -> list[str]:
        return [f"{ip}:{port}" for ip in self.pod_ips for port in self.ports]


def create_pool(api: client.ApiClient, layout: PoolLayout) -> None:
    """The project's CRDs, the pool and its Pods, Ready, in the default namespace."""
    crds = sorted(CRDS.glob("*.yaml"))
    apply_manifests(api, crds)
    wait_crds_established(api, [crd.stem for crd in crds])
    put_pool(api, NAMESPACE, POOL, POD_LABELS, layout.ports)
    for i, ip in enumerate(layout.pod_ips):
        name = f"bench-backend-{i}"
        create_pod(api, NAMESPACE, name, POD_LABELS)
        set_pod_ready(api, NAMESPACE, name, ip)


@dataclass(frozen=True)
class Start:
    """One start: wall seconds from process start to SERVING, and the CPU seconds the process
    used meanwhile (less sensitive than the wall time to what else the machine runs)."""

    seconds: float
    cpu_seconds: float


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process `pid` has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def time_to_serving(name: str, argv: Sequence[str], log_dir: Path, env: dict[str, str] | None = None) -> Start:
    """Starts `argv` (which must take --grpc-port, --grpc-health-port and --metrics-port) and
    times it to its health service answering SERVING and its ext_proc port accepting."""
    grpc_port, health = free_port(), free_port()
    ports = ["--grpc-port", str(grpc_port), "--grpc-health-port", str(health), "--metrics-port", str(free_port())]
    process = ManagedProcess(name, [*argv, *ports], log_dir, env=env)
    started = time.monotonic()
    process.start()

    def serving() -> bool:
        return health_serving("127.0.0.1", health) and port_open("127.0.0.1", grpc_port)

    try:
        process.wait_ready(serving, timeout=60)
        return Start(time.monotonic() - started, cpu_seconds(process.pid))
    finally:
        process.stop()


# Equal terms with the reference: TLS with a self-signed certificate made at start, no pprof,
# tracing or metrics auth.
_COMMON_FLAGS = ["--enable-pprof=false", "--tracing=false", "--metrics-endpoint-auth=false"]


def picker_env(pycache: Path) -> dict[str, str]:
    """The environment with bytecode cached in `pycache`: the image runs from bytecode compiled
    at build time, which PYTHONDONTWRITEBYTECODE (often set in development) would keep from
    being cached here, making every start compile the picker's sources."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONPYCACHEPREFIX": str(pycache)}


def picker_argv(*source: str) -> list[str]:
    return [sys.executable, "-m", "picker.cli", "serve", "--bind-address", "127.0.0.1", *_COMMON_FLAGS, *source]


def reference_argv(binary: Path) -> list[str]:
    return [str(binary), "--pool-name", POOL, "--pool-namespace", NAMESPACE, *_COMMON_FLAGS]


@dataclass(frozen=True)
class StartTimes:
    """One EPP setup's starts."""

    label: str
    starts: tuple[Start, ...]

    def row(self) -> str:
        s = [start.seconds for start in self.starts]
        cpu = statistics.median(start.cpu_seconds for start in self.starts)
        return f"{self.label:30} {statistics.median(s):6.2f} {min(s):6.2f} {max(s):6.2f} {cpu:6.2f}  {len(s)}"


def measure(label: str, runs: int, start: Callable[[], Start]) -> StartTimes:
    """`runs` timed starts after an untimed one (which fills the page and bytecode caches)."""
    start()
    times = StartTimes(label, tuple(start() for _ in range(runs)))
    print(times.row(), flush=True)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m picker_bench.startup", description=__doc__.splitlines()[0])
    parser.add_argument("--endpoints", type=int, default=256, help="pool size, a multiple of 8 (default 256)")
    parser.add_argument("--runs", type=int, default=5, help="starts of each EPP (default 5)")
    parser.add_argument("--reference-epp", type=Path, metavar="PATH", help="also start the reference EPP's binary")
    parser.add_argument("--no-static", action="store_true", help="skip picker with --endpoints")
    args = parser.parse_args(argv)
    try:
        layout = PoolLayout(args.endpoints)
    except ValueError as exc:
        parser.error(str(exc))
    with tempfile.TemporaryDirectory(prefix="picker-startup-") as tmp:
        log_dir = Path(tmp)
        cluster = KubeCluster()
        cluster.start()
        try:
            new_client: Callable[..., client.ApiClient] = kube_config.new_client_from_config  # untyped upstream
            with new_client(config_file=str(cluster.admin_kubeconfig)) as api:
                create_pool(api, layout)
            kubeconfig = str(cluster.admin_kubeconfig)
            pods = len(layout.pod_ips)
            print(f"{args.endpoints} endpoints ({pods} Pods x {MAX_TARGET_PORTS} target ports)")
            print(f"{'start -> SERVING (s)':30} {'median':>6} {'min':>6} {'max':>6} {'CPU':>6}  runs", flush=True)
            pool_flags = ["--pool-name", POOL, "--pool-namespace", NAMESPACE, "--kubeconfig", kubeconfig]
            env = picker_env(log_dir / "pycache")
            pool = picker_argv(*pool_flags)
            measure("picker, InferencePool", args.runs, lambda: time_to_serving("picker", pool, log_dir, env))
            if not args.no_static:
                static = picker_argv("--endpoints", ",".join(layout.addresses))
                measure(
                    "picker, --endpoints", args.runs, lambda: time_to_serving("picker-static", static, log_dir, env)
                )
            if args.reference_epp is not None:
                reference_env = {**os.environ, "KUBECONFIG": kubeconfig}
                reference = reference_argv(args.reference_epp)
                measure(
                    "reference EPP, InferencePool",
                    args.runs,
                    lambda: time_to_serving("reference-epp", reference, log_dir, reference_env),
                )
        finally:
            cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
