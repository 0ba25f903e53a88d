"""Systems under test and the simulated fleet behind them: parsed by name, started, stopped.

Every process is started through `Launcher`, which writes its PID to `DIR/pids` the moment it
exists and stops everything it started, newest first, however the run ends.
"""

from __future__ import annotations

import signal
import sys
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from picker.bench.envoy import EnvoyProcess, baseline_config, picker_config
from picker.bench.process import ManagedProcess, free_port, port_open
from picker.bench.stats import DecisionTime, histogram_decision_time

HOST = "127.0.0.1"
DECISION_METRIC = "inference_extension_scheduler_e2e_duration_seconds"
ROUTER_POLICIES = {
    "sglang-cache-aware": ("sglang", "cache_aware"),
    "sglang-round-robin": ("sglang", "round_robin"),
    "vllm-router-cache-aware": ("vllm-router", "cache_aware"),
}
KINDS = ("round-robin", "least-request", "picker", *ROUTER_POLICIES, "external")


@dataclass(frozen=True, slots=True)
class SystemSpec:
    """One system to measure, as named on the command line."""

    name: str  # e.g. "round-robin", "picker:approx", "external:http://10.0.0.1:8080"
    kind: str
    config_file: Path | None = None  # picker systems
    url: str | None = None  # external systems


def parse_systems(names: Sequence[str], picker_configs: dict[str, Path]) -> list[SystemSpec]:
    """Validate system names; `picker_configs` maps a label ("" for plain `picker`) to a file."""
    specs: list[SystemSpec] = []
    for raw in names:
        name = raw.strip()
        kind, _, arg = name.partition(":")
        if kind not in KINDS:
            raise ValueError(f"unknown system {name!r}; known: {', '.join(KINDS)} (picker:LABEL, external:URL)")
        if kind == "external":
            if not arg.startswith(("http://", "https://")):
                raise ValueError(f"{name!r}: external systems need a URL, e.g. external:http://127.0.0.1:8080")
            specs.append(SystemSpec(name, kind, url=arg.rstrip("/")))
        elif kind == "picker":
            if arg and arg not in picker_configs:
                raise ValueError(f"{name!r}: no --picker-config {arg}=FILE given")
            specs.append(SystemSpec(name, kind, config_file=picker_configs.get(arg)))
        elif arg:
            raise ValueError(f"{name!r}: only picker:LABEL and external:URL take an argument")
        else:
            specs.append(SystemSpec(name, kind))
    if len({s.name for s in specs}) != len(specs):
        raise ValueError("a system is named twice")
    if not specs:
        raise ValueError("no systems given")
    return specs


class Launcher:
    """Starts processes, records their PIDs in `pids_path`, and stops them all (newest first)."""

    def __init__(self, log_dir: Path, pids_path: Path) -> None:
        self.log_dir = log_dir
        self.pids_path = pids_path
        self.running: list[ManagedProcess] = []

    def start(self, process: ManagedProcess) -> ManagedProcess:
        """Start `process` and record its PID before anything else can fail."""
        self.running.append(process)
        process.start()
        with self.pids_path.open("a") as f:
            f.write(f"{process.pid} {process.name}\n")
        return process

    def stop(self) -> None:
        """Stop every process still running, newest first.

        Ctrl-C and SIGTERM are held back meanwhile (and delivered after), so a second Ctrl-C
        cannot leave a child running.
        """
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            while self.running:
                self.running.pop().stop()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)


@dataclass(frozen=True, slots=True)
class FleetOptions:
    """`picker sim` sizing, the same for every system."""

    pods: int
    model: str = "sim-model"
    profile: str = "llama3-8b-h100"
    time_scale: float = 1.0
    num_gpu_blocks: int | None = None  # None = the profile's own size
    block_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int | None = None
    max_model_len: int = 32768
    base_port: int = 0  # 0 = free ports; fixed ports let an external gateway point at the fleet

    def argv(self) -> list[str]:
        """The `picker sim` command line."""
        argv = [
            sys.executable,
            "-m",
            "picker.cli",
            "sim",
            "--pods",
            str(self.pods),
            "--host",
            HOST,
            "--base-port",
            str(self.base_port),
            "--model",
            self.model,
            "--profile",
            self.profile,
            "--time-scale",
            str(self.time_scale),
            "--block-size",
            str(self.block_size),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--max-model-len",
            str(self.max_model_len),
            "--tokenizer",
            "builtin",
            "--kv-events-base-port",
            "0",  # every system gets the same fleet; only the precise scorer listens
        ]
        if self.num_gpu_blocks:
            argv += ["--num-gpu-blocks", str(self.num_gpu_blocks)]
        if self.max_num_batched_tokens:
            argv += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        return argv


@dataclass(frozen=True, slots=True)
class FleetPod:
    """One started `picker sim` pod, as its ready line names it."""

    name: str
    address: str  # ip:port
    kv_events_address: str | None = None  # tcp://ip:port of its KV-event publisher

    @classmethod
    def parse(cls, line: str) -> FleetPod:
        """`pod <name> http://<ip>:<port>[ kv-events tcp://...][ replay tcp://...]`."""
        words = line.split()
        if len(words) < 3 or words[0] != "pod" or len(words) % 2 == 0:
            raise RuntimeError(f"picker sim printed an unexpected pod line: {line!r}")
        extras = dict(zip(words[3::2], words[4::2]))
        return cls(words[1], words[2].removeprefix("http://"), extras.get("kv-events"))


def start_fleet(options: FleetOptions, launcher: Launcher, tag: str) -> tuple[ManagedProcess, list[FleetPod]]:
    """Start a cold `picker sim` fleet; return it and its pods."""
    sim = launcher.start(ManagedProcess(f"sim-{tag}", options.argv(), launcher.log_dir))
    sim.wait_ready(lambda: "ready" in _lines(sim.log_path), timeout=60)
    pods = [FleetPod.parse(line) for line in _lines(sim.log_path) if line.startswith("pod ")]
    if len(pods) != options.pods:
        raise RuntimeError(f"picker sim reported {len(pods)} pods, expected {options.pods}")
    return sim, pods


def write_endpoints_file(pods: Sequence[FleetPod], path: Path) -> Path:
    """The `picker serve --endpoints-file` list for `pods`, with each pod's KV-event publisher."""
    entries = []
    for pod in pods:
        entry = {"address": pod.address, "name": pod.name}
        if pod.kv_events_address:
            entry["kvEventsAddress"] = pod.kv_events_address
        entries.append(entry)
    path.write_text(yaml.safe_dump(entries, sort_keys=False))
    return path


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            status: int = r.status
            return status == 200
    except OSError:
        return False


@dataclass(frozen=True, slots=True)
class Gateway:
    """A started system: where clients send, and where the picker's metrics are (if any)."""

    url: str
    metrics_url: str | None = None

    def decision_time(self) -> DecisionTime | None:
        """The picker's scheduling-time histogram, if this system has one."""
        if not self.metrics_url:
            return None
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=5) as r:
                return histogram_decision_time(r.read().decode(), DECISION_METRIC)
        except OSError:
            return None


def start_system(
    spec: SystemSpec, pods: Sequence[FleetPod], launcher: Launcher, tag: str, objectives: Path | None = None
) -> Gateway:
    """Start `spec` in front of `pods` and wait until it accepts requests; a picker reads the
    workload's InferenceObjectives (priorities) from `objectives`."""
    log_dir = launcher.log_dir
    backends = [pod.address for pod in pods]
    admin = (HOST, free_port())
    listen = (HOST, free_port())
    if spec.kind in ("round-robin", "least-request"):
        envoy = EnvoyProcess(f"envoy-{tag}", baseline_config(spec.kind, listen, backends, admin), log_dir)
        launcher.start(envoy)
        envoy.wait_ready(envoy.ready)
        return Gateway(envoy.url)
    if spec.kind == "picker":
        grpc, health, metrics = free_port(), free_port(), free_port()
        argv = [
            sys.executable,
            "-m",
            "picker.cli",
            "serve",
            "--endpoints-file",
            str(write_endpoints_file(pods, log_dir / f"endpoints-{tag}.yaml")),
            "--grpc-port",
            str(grpc),
            "--grpc-health-port",
            str(health),
            "--metrics-port",
            str(metrics),
            "--bind-address",
            HOST,
            "--secure-serving=false",
        ]
        if spec.config_file:
            argv += ["--config-file", str(spec.config_file)]
        if objectives:
            argv += ["--objectives-file", str(objectives)]
        picker = launcher.start(ManagedProcess(f"picker-{tag}", argv, log_dir))
        metrics_url = f"http://{HOST}:{metrics}/metrics"
        picker.wait_ready(lambda: port_open(HOST, health) and _http_ok(metrics_url), timeout=60)
        envoy = EnvoyProcess(f"envoy-{tag}", picker_config("duplex", listen, (HOST, grpc), admin, tls=False), log_dir)
        launcher.start(envoy)
        envoy.wait_ready(envoy.ready)
        return Gateway(envoy.url, metrics_url)
    if spec.kind in ROUTER_POLICIES:
        router, policy = ROUTER_POLICIES[spec.kind]
        port, prometheus = listen[1], free_port()
        urls = [f"http://{b}" for b in backends]
        if router == "sglang":
            argv = [sys.executable, "-m", "sglang_router.launch_router"]
        else:
            argv = [str(Path(sys.executable).parent / "vllm-router")]
        argv += [
            "--host",
            HOST,
            "--port",
            str(port),
            "--worker-urls",
            *urls,
            "--policy",
            policy,
            "--prometheus-host",
            HOST,
            "--prometheus-port",
            str(prometheus),
        ]
        process = launcher.start(ManagedProcess(f"{router}-{tag}", argv, log_dir))
        url = f"http://{HOST}:{port}"
        process.wait_ready(lambda: _http_ok(url + "/v1/models") or _http_ok(url + "/health"), timeout=90)
        return Gateway(url)
    assert spec.kind == "external" and spec.url
    return Gateway(spec.url)
