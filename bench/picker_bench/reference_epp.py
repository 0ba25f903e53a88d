"""The reference EPP (v1.5.0's `epp` binary) run beside the picker, for side-by-side benchmarks.

It reads its endpoints only from a Kubernetes API, so this starts a real one (etcd +
kube-apiserver, `picker_bench.kube_cluster`) with the project's CRDs, an InferencePool v1 and a
Pod per backend address whose status says Running and Ready at that IP: the pool's target ports
are the backends' ports, one endpoint per Pod and port (at most 8 ports, the CRD's limit). Its standalone mode
(`--endpoint-selector`) cannot start in v1.5.0: it requires a pool name that its flag
validation forbids.

The binary is a build of the Go module `sigs.k8s.io/gateway-api-inference-extension@v1.5.0`,
whose source tree (charts, docs, test data) the tests also read as an oracle:
`reference_epp_binary()` builds it once into the binary cache; `python -m picker_bench.reference_epp`
does so and prints its path.

llm-d's scheduler (`picker_bench.llmd.llmd_epp_binary()`) is a GIE runner with llm-d's plugins
and runs the same way; `picker_bench.llmd_epp` says what else it needs.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from kubernetes import client
from kubernetes import config as kube_config

from picker_bench.gobuild import GoModule, print_built
from picker_bench.kube_cluster import KubeCluster
from picker_bench.kube_resources import (
    apply_manifests,
    create_pod,
    put_pool,
    set_pod_ready,
    wait_crds_established,
)
from picker_bench.process import ManagedProcess, free_port, health_serving, port_open

REFERENCE_VERSION = "v1.5.0"
POD_LABELS = {"app": "bench-backend"}
NAMESPACE = "default"  # the API server creates it at start
POOL = "bench"
CRDS = Path(__file__).resolve().parents[2] / "manifests" / "crds"
MAX_TARGET_PORTS = 8  # the InferencePool v1 CRD's maxItems


REFERENCE = GoModule("sigs.k8s.io/gateway-api-inference-extension", REFERENCE_VERSION)


def start_reference_epp(
    binary: Path,
    kubeconfig: Path,
    pool: str,
    namespace: str,
    grpc_port: int,
    tls: bool,
    log_dir: Path,
    *,
    config_file: Path | None = None,
    name: str = "reference-epp",
    role: str = "reference-epp",
    metrics_port: int | None = None,
    extra_args: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    on_spawn: Callable[[int, str], None] | None = None,
) -> ManagedProcess:
    """The reference `epp` (or an EPP built on it, as llm-d's, with `extra_args`) for pool
    namespace/name, with `kubeconfig`'s credentials, serving ext_proc on `grpc_port`; returns once
    its health service says SERVING. `config_file` is its EndpointPickerConfig (None: its
    built-in default); `on_spawn(pid, role)` hears of the process the moment it exists."""
    health = free_port()
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
        str(metrics_port or free_port()),
        f"--secure-serving={str(tls).lower()}",
        # pprof's block and mutex profiling cost it about 30% CPU per request; tracing is off in
        # its chart's defaults, and metrics auth would only add TokenReviews at scrape time.
        "--enable-pprof=false",
        "--tracing=false",
        "--metrics-endpoint-auth=false",
        *extra_args,
    ]
    # Its metric names need no flags (v1.5.0 refuses the old ones): the built-in vLLM engine
    # config reads vllm:num_requests_waiting and vllm:kv_cache_usage_perc, as the sim serves.
    if config_file is not None:
        argv += ["--config-file", str(config_file)]
    env = {**os.environ, **(extra_env or {}), "KUBECONFIG": str(kubeconfig)}
    process = ManagedProcess(name, argv, log_dir, env=env, cwd=cwd).start()
    if on_spawn is not None:
        on_spawn(process.pid, role)
    process.wait_ready(lambda: health_serving("127.0.0.1", health) and port_open("127.0.0.1", grpc_port), timeout=60)
    return process


def reference_dir() -> Path:
    """The module's read-only directory in the Go module cache (fetched the first time)."""
    return REFERENCE.source_dir()


def reference_epp_binary() -> Path:
    """The reference EPP's binary in the binary cache (`epp-v1.5.0`), built from its module the
    first time (a few minutes of CPU on 2 cores, at the lowest priority)."""
    return REFERENCE.binary("./cmd/epp", "epp")


class ReferenceEpp:
    """The control plane and the reference EPP (or one built on it, as llm-d's) over it;
    `start()` returns once it serves.

    The pool's endpoints are one Pod per address in `hosts`, each with every port in `ports`
    (the InferencePool's target ports): one address with a port per backend, or one address per
    backend at one port (IP-keyed schedulers such as llm-d's precise one tell pods apart only so).
    `config_file` is its EndpointPickerConfig (None: its built-in default); `pod_labels` are
    each Pod's labels beside the pool's selector (llm-d's P/D roles), in the order of `hosts`;
    `extra_args`, `extra_env` and `cwd` are for EPPs that need more; `on_spawn(pid, role)` hears of every
    process started ("etcd", "kube-apiserver", `role`) the moment it exists; `name` names the
    EPP's log file.
    """

    def __init__(
        self,
        binary: Path,
        hosts: Sequence[str],
        ports: list[int],
        tls: bool,
        log_dir: Path,
        config_file: Path | None = None,
        name: str = "reference-epp",
        on_spawn: Callable[[int, str], None] | None = None,
        *,
        role: str = "reference-epp",
        pod_labels: Sequence[Mapping[str, str]] = (),
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        if not os.access(binary, os.X_OK):
            raise FileNotFoundError(f"--{role} {binary}: not an executable file")
        if not 1 <= len(ports) <= MAX_TARGET_PORTS:
            raise ValueError(f"the reference EPP takes 1 to {MAX_TARGET_PORTS} target ports, not {len(ports)}")
        if not hosts or len(set(hosts)) != len(hosts):
            raise ValueError(f"the pool's Pods need distinct addresses, not {list(hosts)}")
        if pod_labels and len(pod_labels) != len(hosts):
            raise ValueError(f"{len(pod_labels)} Pods' labels for {len(hosts)} Pods")
        self.binary, self.hosts, self.ports, self.tls, self.log_dir = binary, list(hosts), ports, tls, log_dir
        self.config_file, self.name, self.on_spawn, self.role = config_file, name, on_spawn, role
        self.extra_args, self.extra_env, self.cwd = list(extra_args), dict(extra_env or {}), cwd
        self.pod_labels = [{**POD_LABELS, **labels} for labels in pod_labels] or [POD_LABELS] * len(self.hosts)
        self.grpc_port, self.metrics_port = free_port(), free_port()
        self.cluster: KubeCluster | None = None
        self.process: ManagedProcess | None = None
        self.startup_seconds = float("nan")  # from process start to SERVING, once started

    def start(self) -> ReferenceEpp:
        self.cluster = KubeCluster(self.on_spawn)
        self.cluster.start()
        new_client: Callable[..., client.ApiClient] = kube_config.new_client_from_config  # untyped upstream
        with new_client(config_file=str(self.cluster.admin_kubeconfig)) as api:
            crds = sorted(CRDS.glob("*.yaml"))
            apply_manifests(api, crds)
            wait_crds_established(api, [crd.stem for crd in crds])
            put_pool(api, NAMESPACE, POOL, POD_LABELS, self.ports)
            for i, host in enumerate(self.hosts):
                pod = "bench-backend" if len(self.hosts) == 1 else f"bench-backend-{i}"
                create_pod(api, NAMESPACE, pod, self.pod_labels[i])
                set_pod_ready(api, NAMESPACE, pod, host)
        started = time.monotonic()
        self.process = start_reference_epp(
            self.binary,
            self.cluster.admin_kubeconfig,
            POOL,
            NAMESPACE,
            self.grpc_port,
            self.tls,
            self.log_dir,
            config_file=self.config_file,
            name=self.name,
            role=self.role,
            metrics_port=self.metrics_port,
            extra_args=self.extra_args,
            extra_env=self.extra_env,
            cwd=self.cwd,
            on_spawn=self.on_spawn,
        )
        self.startup_seconds = time.monotonic() - started
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
        if self.cluster is not None:
            self.cluster.stop()


def main() -> int:
    """`python -m picker_bench.reference_epp`: build the binary if it is not cached; print its path."""
    return print_built(reference_epp_binary, "picker_bench.reference_epp")


if __name__ == "__main__":
    sys.exit(main())
