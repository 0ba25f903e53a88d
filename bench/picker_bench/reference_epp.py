"""The reference EPP (v1.5.0's `epp` binary) run beside the picker, for side-by-side benchmarks.

It reads its endpoints only from a Kubernetes API, so this starts a real one (etcd +
kube-apiserver, `picker_bench.kube_cluster`) with the project's CRDs, an InferencePool v1 and one
Pod whose status says Running and Ready at a local IP: the pool's target ports are the backend's
ports, one endpoint each (at most 8, the CRD's limit). Its standalone mode
(`--endpoint-selector`) cannot start in v1.5.0: it requires a pool name that its flag
validation forbids.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from kubernetes import client
from kubernetes import config as kube_config

from picker_bench.kube_cluster import KubeCluster
from picker_bench.kube_resources import (
    apply_manifests,
    create_pod,
    put_pool,
    set_pod_ready,
    wait_crds_established,
)
from picker_bench.process import ManagedProcess, free_port, health_serving, port_open

POD_LABELS = {"app": "bench-backend"}
NAMESPACE = "default"  # the API server creates it at start
POOL = "bench"
CRDS = Path(__file__).resolve().parents[2] / "manifests" / "crds"
MAX_TARGET_PORTS = 8  # the InferencePool v1 CRD's maxItems


def start_reference_epp(
    binary: Path, kubeconfig: Path, pool: str, namespace: str, grpc_port: int, tls: bool, log_dir: Path
) -> ManagedProcess:
    """The reference `epp` for pool namespace/name, with `kubeconfig`'s credentials, serving
    ext_proc on `grpc_port`; returns once its health service says SERVING."""
    health, metrics = free_port(), free_port()
    argv = [
        str(binary),
        "--pool-name",
        pool,
        "--pool-namespace",
        namespace,
        "--grpc-port",
        str(grpc_port),
        "--grpc-health-port",
        str(health),
        "--metrics-port",
        str(metrics),
        f"--secure-serving={str(tls).lower()}",
        # pprof's block and mutex profiling cost it about 30% CPU per request; tracing is off in
        # its chart's defaults, and metrics auth would only add TokenReviews at scrape time.
        "--enable-pprof=false",
        "--tracing=false",
        "--metrics-endpoint-auth=false",
    ]
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    process = ManagedProcess("reference-epp", argv, log_dir, env=env).start()
    process.wait_ready(lambda: health_serving("127.0.0.1", health) and port_open("127.0.0.1", grpc_port), timeout=60)
    return process


class ReferenceEpp:
    """The control plane and the reference EPP over it; `start()` returns once it serves."""

    def __init__(self, binary: Path, host: str, ports: list[int], tls: bool, log_dir: Path) -> None:
        if not os.access(binary, os.X_OK):
            raise FileNotFoundError(f"--reference-epp {binary}: not an executable file")
        if not 1 <= len(ports) <= MAX_TARGET_PORTS:
            raise ValueError(f"the reference EPP takes 1 to {MAX_TARGET_PORTS} target ports, not {len(ports)}")
        self.binary, self.host, self.ports, self.tls, self.log_dir = binary, host, ports, tls, log_dir
        self.grpc_port = free_port()
        self.cluster: KubeCluster | None = None
        self.process: ManagedProcess | None = None
        self.startup_seconds = float("nan")  # from process start to SERVING, once started

    def start(self) -> ReferenceEpp:
        self.cluster = KubeCluster()
        self.cluster.start()
        new_client: Callable[..., client.ApiClient] = kube_config.new_client_from_config  # untyped upstream
        with new_client(config_file=str(self.cluster.admin_kubeconfig)) as api:
            crds = sorted(CRDS.glob("*.yaml"))
            apply_manifests(api, crds)
            wait_crds_established(api, [crd.stem for crd in crds])
            put_pool(api, NAMESPACE, POOL, POD_LABELS, self.ports)
            create_pod(api, NAMESPACE, "bench-backend", POD_LABELS)
            set_pod_ready(api, NAMESPACE, "bench-backend", self.host)
        started = time.monotonic()
        self.process = start_reference_epp(
            self.binary, self.cluster.admin_kubeconfig, POOL, NAMESPACE, self.grpc_port, self.tls, self.log_dir
        )
        self.startup_seconds = time.monotonic() - started
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
        if self.cluster is not None:
            self.cluster.stop()
