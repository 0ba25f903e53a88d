"""Systems under test and the simulated fleet behind them: parsed by name, started, stopped.

Prefill/decode (P/D) fleets (`FleetOptions.prefill_pods`): a picker system whose config has a
`pd-profile-handler` routes them disaggregated, as llm-d does: Envoy -> picker -> llm-d's
`pd-sidecar` in front of each decode pod (the endpoint the picker sees for it) -> the decode pod,
the sidecar having first sent the prompt to the prefill pod the picker named in
`x-prefiller-host-port`. Every other system routes the same pods aggregated: a simulated prefill
pod serves a request without `kv_transfer_params` whole, as vLLM with a KV connector does, so
they see a fleet of the same size with nothing disaggregated. llm-d's own P/D (`llmd-pd`) runs
its scheduler with its P/D sample config over the same sidecars (`start_llmd_pd_pool`).

Every process is started through `Launcher`, which writes its PID to `DIR/pids` the moment it
exists and stops everything it started, newest first, however the run ends.
"""

from __future__ import annotations

import ipaddress
import json
import re
import shutil
import signal
import sys
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import yaml
from kubernetes import client

from picker.disaggregation.handlers import PdProfileHandler
from picker.scheduling.labels import ROLE_DECODE, ROLE_LABEL
from picker_bench.envoy import (
    EnvoyProcess,
    baseline_config,
    picker_config,
    replicated_picker_config,
    tcp_relay_config,
)
from picker_bench.llmd import PdSidecar
from picker_bench.llmd_epp import (
    APPROXIMATE_CONFIG,
    llmd_config,
    llmd_env,
    llmd_flags,
    pd_config,
    precise_config,
    precise_hash_seed,
    write_builtin_tokenizer,
)
from picker_bench.process import ManagedProcess, free_port, http_ok, port_open
from picker_bench.reference_epp import ReferenceEpp

HOST = "127.0.0.1"
PD_PROFILE_HANDLER = PdProfileHandler.plugin_type
DECISION_METRIC = "inference_extension_scheduler_e2e_duration_seconds"
ROUTER_POLICIES = {
    "sglang-cache-aware": ("sglang", "cache_aware"),
    "sglang-round-robin": ("sglang", "round_robin"),
    "vllm-router-cache-aware": ("vllm-router", "cache_aware"),
}
EPP_KINDS = ("reference-epp", "llmd", "llmd-precise", "llmd-pd")  # EPP binaries run over a throwaway control plane
LLMD_KINDS = ("llmd", "llmd-precise", "llmd-pd")
# llmd-pd's Pod IPs: loopback addresses no fleet uses (a `--distinct-hosts` one starts at 127.0.0.1)
LLMD_PD_POD_IPS = ipaddress.IPv4Address("127.0.1.1")
KINDS = ("round-robin", "least-request", "picker", *ROUTER_POLICIES, *EPP_KINDS, "external")
# picker[:LABEL]@N[+store]: N replicas behind one Envoy, sharing state through a redis-server
REPLICAS = re.compile(r"@(?P<replicas>\d+)(?P<store>\+store)?$")
MAX_REPLICAS = 16


@dataclass(frozen=True, slots=True)
class SystemSpec:
    """One system to measure, as named on the command line."""

    name: str  # e.g. "round-robin", "picker:approx", "external:http://10.0.0.1:8080"
    kind: str
    config_file: Path | None = None  # picker and EPP systems (None: the default config)
    binary: Path | None = None  # EPP systems: the EPP binary
    log_verbosity: int | None = None  # EPP systems: its -v (None: its default; 4 logs every pick's scores)
    url: str | None = None  # external systems
    replicas: int = 1  # picker systems: picker processes behind one Envoy
    shared_state: bool = False  # picker systems: the replicas share state through a redis-server
    disaggregated: bool = False  # picker systems whose config has a pd-profile-handler
    pd_sidecar: Path | None = None  # disaggregated systems: llm-d's pd-sidecar binary


def parse_systems(
    names: Sequence[str],
    picker_configs: dict[str, Path],
    reference_epp: Path | None = None,
    reference_config: Path | None = None,
    llmd_epp: Path | None = None,
    llmd_config: Path | None = None,
    epp_log_verbosity: int | None = None,
    pd_sidecar: Path | None = None,
) -> list[SystemSpec]:
    """Validate system names; `picker_configs` maps a label ("" for plain `picker`) to a file;
    `reference-epp` runs the binary `reference_epp` with `reference_config` (None: its default);
    `llmd` runs llm-d's binary `llmd_epp` with `llmd_config` (None: llm-d's approximate sample)
    and `llmd-precise` with its precise-prefix-cache sample, `llmd-pd` with its P/D sample
    (`picker_bench.llmd_epp`); EPPs log at `epp_log_verbosity`; a picker config with a
    `pd-profile-handler`, and `llmd-pd`, reach decode pods through `pd_sidecar`."""
    specs: list[SystemSpec] = []
    for raw in names:
        name = raw.strip()
        replicated = REPLICAS.search(name)
        kind, _, arg = name[: replicated.start() if replicated else None].partition(":")
        if kind not in KINDS:
            raise ValueError(f"unknown system {name!r}; known: {', '.join(KINDS)} (picker:LABEL, external:URL)")
        if kind == "external":
            if not arg.startswith(("http://", "https://")):
                raise ValueError(f"{name!r}: external systems need a URL, e.g. external:http://127.0.0.1:8080")
            specs.append(SystemSpec(name, kind, url=arg.rstrip("/")))
        elif kind == "picker":
            if arg and arg not in picker_configs:
                raise ValueError(f"{name!r}: no --picker-config {arg}=FILE given")
            replicas = int(replicated["replicas"]) if replicated else 1
            if not 1 <= replicas <= MAX_REPLICAS:
                raise ValueError(f"{name!r}: replicas must be 1 to {MAX_REPLICAS}")
            shared = bool(replicated and replicated["store"])
            config = picker_configs.get(arg)
            disaggregated = config is not None and declares_pd(config)
            specs.append(
                SystemSpec(
                    name,
                    kind,
                    config,
                    replicas=replicas,
                    shared_state=shared,
                    disaggregated=disaggregated,
                    pd_sidecar=pd_sidecar if disaggregated else None,
                )
            )
        elif replicated:
            raise ValueError(f"{name!r}: only picker systems take @N replicas")
        elif arg:
            raise ValueError(f"{name!r}: only picker:LABEL and external:URL take an argument")
        elif kind == "reference-epp":
            if reference_epp is None:
                raise ValueError(f"{name!r}: no --reference-epp PATH (the reference EPP's binary) given")
            specs.append(SystemSpec(name, kind, reference_config, reference_epp, epp_log_verbosity))
        elif kind in LLMD_KINDS:
            if llmd_epp is None:
                raise ValueError(f"{name!r}: no --llmd-epp PATH (llm-d's scheduler binary) given")
            config = llmd_config if kind == "llmd" else None
            pd = kind == "llmd-pd"
            if pd and pd_sidecar is None:
                raise ValueError(
                    f"{name!r}: llm-d's P/D runs its pd-sidecar in front of each decode pod: no --pd-sidecar"
                )
            spec = SystemSpec(name, kind, config, llmd_epp, epp_log_verbosity, disaggregated=pd, pd_sidecar=pd_sidecar)
            specs.append(spec)
        else:
            specs.append(SystemSpec(name, kind))
    if len({s.name for s in specs}) != len(specs):
        raise ValueError("a system is named twice")
    if not specs:
        raise ValueError("no systems given")
    return specs


def declares_pd(config_file: Path) -> bool:
    """Whether an EndpointPickerConfig file has a `pd-profile-handler` (a file that cannot be
    read as one says no: the picker refuses it when it starts, with its own message)."""
    try:
        config = yaml.safe_load(config_file.read_text())
    except (OSError, yaml.YAMLError):
        return False
    plugins = config.get("plugins") if isinstance(config, dict) else None
    return isinstance(plugins, list) and any(
        isinstance(plugin, dict) and plugin.get("type") == PD_PROFILE_HANDLER for plugin in plugins
    )


class Stoppable(Protocol):
    def stop(self) -> None: ...


class Launcher:
    """Starts processes, records their PIDs in `pids_path`, and stops them all (newest first)."""

    def __init__(self, log_dir: Path, pids_path: Path) -> None:
        self.log_dir = log_dir
        self.pids_path = pids_path
        self.running: list[Stoppable] = []

    def start(self, process: ManagedProcess) -> ManagedProcess:
        """Start `process` and record its PID before anything else can fail."""
        self.running.append(process)
        process.start()
        self.record(process.pid, process.name)
        return process

    def hold(self, processes: Stoppable) -> None:
        """Stop `processes` (something that starts its own, and `record`s them) with the rest."""
        self.running.append(processes)

    def record(self, pid: int, name: str) -> None:
        """Write down a started process's PID."""
        with self.pids_path.open("a") as f:
            f.write(f"{pid} {name}\n")

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
    distinct_hosts: bool = False  # pod i on 127.0.0.(1+i), all at one port
    kv_events_endpoint: str | None = None  # every pod connects its publisher here (None: each binds its own)
    hash_seed: str | None = None  # the engines' block-hash seed (None: the sim's default)
    prefill_pods: int = 0  # P/D fleets: the first this many of `pods` prefill, the rest decode

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
        ]
        if self.kv_events_endpoint:
            argv += ["--kv-events-endpoint", self.kv_events_endpoint]
        else:
            argv += ["--kv-events-base-port", "0"]  # every system gets the same fleet; only precise scorers listen
        if self.distinct_hosts:
            argv.append("--distinct-hosts")
        if self.hash_seed is not None:
            argv += ["--hash-seed", self.hash_seed]
        if self.num_gpu_blocks:
            argv += ["--num-gpu-blocks", str(self.num_gpu_blocks)]
        if self.max_num_batched_tokens:
            argv += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.prefill_pods:
            argv += ["--pd", f"{self.prefill_pods}:{self.pods - self.prefill_pods}"]
        return argv


@dataclass(frozen=True, slots=True)
class FleetPod:
    """One started `picker sim` pod, as its ready line names it."""

    name: str
    address: str  # ip:port
    kv_events_address: str | None = None  # tcp://ip:port of its KV-event publisher
    role: str = "both"  # prefill/decode role, its llm-d.ai/role label

    @classmethod
    def parse(cls, line: str) -> FleetPod:
        """`pod <name> http://<ip>:<port>[ kv-events tcp://...][ replay tcp://...][ role <role>]`."""
        words = line.split()
        if len(words) < 3 or words[0] != "pod" or len(words) % 2 == 0:
            raise RuntimeError(f"picker sim printed an unexpected pod line: {line!r}")
        extras = dict(zip(words[3::2], words[4::2]))
        return cls(words[1], words[2].removeprefix("http://"), extras.get("kv-events"), extras.get("role", "both"))


def start_fleet(options: FleetOptions, launcher: Launcher, tag: str) -> tuple[ManagedProcess, list[FleetPod]]:
    """Start a cold `picker sim` fleet; return it and its pods."""
    if options.distinct_hosts and not options.base_port:
        options = replace(options, base_port=free_port())  # one port for every address: the pool's target port
    sim = launcher.start(ManagedProcess(f"sim-{tag}", options.argv(), launcher.log_dir))
    sim.wait_ready(lambda: "ready" in _lines(sim.log_path), timeout=60)
    pods = [FleetPod.parse(line) for line in _lines(sim.log_path) if line.startswith("pod ")]
    if len(pods) != options.pods:
        raise RuntimeError(f"picker sim reported {len(pods)} pods, expected {options.pods}")
    return sim, pods


def write_endpoints_file(pods: Sequence[FleetPod], path: Path) -> Path:
    """The `picker serve --endpoints-file` list for `pods`, with each pod's KV-event publisher
    and its P/D role as the label llm-d's role filters read."""
    entries = []
    for pod in pods:
        entry: dict[str, object] = {"address": pod.address, "name": pod.name, "labels": {ROLE_LABEL: pod.role}}
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


@dataclass(frozen=True, slots=True)
class Gateway:
    """A started system: where clients send, and where its pickers' metrics are (if any)."""

    url: str
    metrics_urls: tuple[str, ...] = ()

    def metrics_page(self) -> str | None:
        """Its EPPs' /metrics pages (every picker replica's, or the reference's or llm-d's), joined;
        None without an EPP or when one cannot be read."""
        pages = []
        try:
            for url in self.metrics_urls:
                with urllib.request.urlopen(url, timeout=5) as r:
                    pages.append(r.read().decode())
        except OSError:
            return None
        return "\n".join(pages) if pages else None


def start_sidecars(binary: Path, pods: Sequence[FleetPod], launcher: Launcher, tag: str) -> list[FleetPod]:
    """llm-d's `pd-sidecar` (NIXL v2 connector, plain HTTP) in front of each decode pod, started
    and healthy; `pods` with each decode pod's address replaced by its sidecar's."""
    fronted = []
    for pod in pods:
        if pod.role != ROLE_DECODE:
            fronted.append(pod)
            continue
        vllm_port = int(pod.address.rpartition(":")[2])
        sidecar = PdSidecar(binary, vllm_port, launcher.log_dir, f"pd-sidecar-{tag}-{pod.name}")
        launcher.start(sidecar.process)
        sidecar.wait_ready()
        fronted.append(replace(pod, address=sidecar.address))
    return fronted


def system_fleet(spec: SystemSpec, fleet: FleetOptions) -> FleetOptions:
    """The fleet `spec` runs on: `fleet`, except that llm-d's precise scorer binds the socket every
    engine connects its KV-event publisher to, and reads hashes seeded as its config says."""
    if spec.kind != "llmd-precise":
        return fleet
    return replace(fleet, kv_events_endpoint=f"tcp://{HOST}:{free_port()}", hash_seed=precise_hash_seed())


def start_system(
    spec: SystemSpec,
    pods: Sequence[FleetPod],
    launcher: Launcher,
    tag: str,
    objectives: Path | None = None,
    fleet: FleetOptions | None = None,
) -> Gateway:
    """Start `spec` in front of `pods` (started as `fleet`, `system_fleet`'s) and wait until it
    accepts requests; a picker reads the workload's InferenceObjectives (priorities) from
    `objectives`; a disaggregated picker system reaches the decode pods through its
    `pd_sidecar`s."""
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
        if spec.disaggregated and any(pod.role == ROLE_DECODE for pod in pods):
            if spec.pd_sidecar is None:
                raise RuntimeError(f"{spec.name}: a P/D config on a P/D fleet needs llm-d's pd-sidecar (--pd-sidecar)")
            pods = start_sidecars(spec.pd_sidecar, pods, launcher, tag)
        argv = ["--endpoints-file", str(write_endpoints_file(pods, log_dir / f"endpoints-{tag}.yaml"))]
        if spec.config_file:
            argv += ["--config-file", str(spec.config_file)]
        if objectives:
            argv += ["--objectives-file", str(objectives)]
        if spec.shared_state:
            argv += ["--state-store", start_redis(launcher, tag)]
        replicated = spec.replicas > 1 or spec.shared_state
        if replicated:
            argv.append("--health-checking")  # Envoy's health check tells live replicas from dead ones
        names = [f"picker-{tag}-{n}" for n in range(spec.replicas)] if replicated else [f"picker-{tag}"]
        started = [start_picker(launcher, name, argv) for name in names]
        pickers = [(HOST, grpc) for grpc, _ in started]
        if replicated:
            config = replicated_picker_config("duplex", listen, pickers, admin, tls=False)
        else:
            config = picker_config("duplex", listen, pickers[0], admin, tls=False)
        envoy = EnvoyProcess(f"envoy-{tag}", config, log_dir)
        launcher.start(envoy)
        envoy.wait_ready(envoy.ready)
        return Gateway(envoy.url, tuple(url for _, url in started))
    if spec.kind in EPP_KINDS:
        fleet = fleet or FleetOptions(pods=len(pods))
        epp = start_epp(spec, fleet, pods, launcher, tag)
        config = picker_config("duplex", listen, (HOST, epp.grpc_port), admin, tls=False)
        envoy = EnvoyProcess(f"envoy-{tag}", config, log_dir)
        launcher.start(envoy)
        envoy.wait_ready(envoy.ready)
        if spec.kind == "llmd-precise":
            warm_up(envoy.url, fleet.model)
        return Gateway(envoy.url, (epp.metrics_url,))
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
        process.wait_ready(lambda: http_ok(url + "/v1/models") or http_ok(url + "/health"), timeout=90)
        return Gateway(url)
    assert spec.kind == "external" and spec.url
    return Gateway(spec.url)


def warm_up(url: str, model: str, timeout: float = 120) -> None:
    """One chat request shorter than a KV block (so no engine caches anything of it) through the
    gateway at `url`, answered: llm-d's precise scorer imports transformers into its embedded
    Python at its first chat request, seconds of CPU that would otherwise stall the first
    requests of a short run."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", body.encode(), {"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        response.read()


def start_picker(launcher: Launcher, name: str, flags: Sequence[str]) -> tuple[int, str]:
    """One `picker serve` with `flags` on free ports, started and ready: its ext_proc port and
    its metrics URL."""
    grpc, health, metrics = free_port(), free_port(), free_port()
    argv = [sys.executable, "-m", "picker.cli", "serve", *flags, "--bind-address", HOST]
    argv += ["--grpc-port", str(grpc), "--grpc-health-port", str(health), "--metrics-port", str(metrics)]
    picker = launcher.start(ManagedProcess(name, [*argv, "--secure-serving=false"], launcher.log_dir))
    metrics_url = f"http://{HOST}:{metrics}/metrics"
    picker.wait_ready(lambda: port_open(HOST, health) and http_ok(metrics_url), timeout=60)
    return grpc, metrics_url


def pool_addresses(pods: Sequence[FleetPod]) -> tuple[list[str], list[int]]:
    """The InferencePool's Pod addresses and target ports for `pods`: one address with a port per
    pod, or one address per pod at one port (`--distinct-hosts`)."""
    hosts_ports = [pod.address.rpartition(":") for pod in pods]
    hosts = list(dict.fromkeys(host for host, _, _ in hosts_ports))
    ports = list(dict.fromkeys(int(port) for _, _, port in hosts_ports))
    if (len(hosts) == 1 and len(ports) == len(pods)) or (len(ports) == 1 and len(hosts) == len(pods)):
        return hosts, ports
    raise RuntimeError(f"an EPP needs the fleet on one IP (a port per pod) or an IP per pod at one port, not {pods}")


def start_llmd_pd_pool(
    spec: SystemSpec, pods: Sequence[FleetPod], launcher: Launcher, tag: str
) -> tuple[list[str], list[int], list[dict[str, str]]]:
    """The pool llm-d's P/D scheduler sees, laid out as llm-d deploys it: every Pod at its own IP
    and the pool's one target port, labelled with its `llm-d.ai/role`; a prefill Pod is its
    engine, a decode Pod its pd-sidecar (in front of its engine). Returns the Pods' IPs, the
    target port and their role labels.

    The sidecar listens on every address at its port and reaches its engine at `localhost`, so
    here the engines and sidecars sit on 127.0.0.1 at ports of their own, and one Envoy relays
    each Pod's IP at the target port to them over TCP (`LLMD_PD_POD_IPS` on): one local hop that
    llm-d does not have, on the prefill and the decode path and the EPP's metrics scrapes."""
    assert spec.pd_sidecar is not None
    if any(not pod.address.startswith(f"{HOST}:") for pod in pods):
        raise RuntimeError(
            f"{spec.name}: llm-d's pd-sidecar reaches its engine at localhost: not with --distinct-hosts"
        )
    fronted = start_sidecars(spec.pd_sidecar, pods, launcher, tag)
    hosts = [str(LLMD_PD_POD_IPS + index) for index in range(len(pods))]
    target_port = free_port(hosts[0])
    relays = [((host, target_port), pod.address) for host, pod in zip(hosts, fronted)]
    relay = EnvoyProcess(f"pod-relay-{tag}", tcp_relay_config(relays, (HOST, free_port())), launcher.log_dir)
    launcher.start(relay)
    relay.wait_ready(relay.ready)
    return hosts, [target_port], [{ROLE_LABEL: pod.role} for pod in pods]


def start_epp(
    spec: SystemSpec, fleet: FleetOptions, pods: Sequence[FleetPod], launcher: Launcher, tag: str
) -> ReferenceEpp:
    """The reference EPP or llm-d's over its own control plane, started and serving: the
    fleet's pods as Pods of an InferencePool (`pool_addresses`); llm-d's as `llmd_epp` says."""
    assert spec.binary is not None
    config_file, role = spec.config_file, "reference-epp"
    verbosity = [] if spec.log_verbosity is None else [f"--v={spec.log_verbosity}"]
    llmd: dict[str, Any] = {"extra_args": verbosity}
    if spec.kind in LLMD_KINDS:
        role = "llmd-epp"
        llmd = {"extra_args": [*verbosity, *llmd_flags()], "extra_env": llmd_env()}
        if spec.kind == "llmd" and config_file is None:
            config_file = llmd_config(APPROXIMATE_CONFIG)
    if spec.kind == "llmd-pd":
        hosts, ports, llmd["pod_labels"] = start_llmd_pd_pool(spec, pods, launcher, tag)
        config_file = launcher.log_dir / f"llmd-pd-config-{tag}.yaml"
        config_file.write_text(yaml.safe_dump(pd_config(), sort_keys=False))
    else:
        hosts, ports = pool_addresses(pods)
    if spec.kind == "llmd-precise":
        if len(hosts) != len(pods) or fleet.kv_events_endpoint is None:
            raise RuntimeError("llmd-precise keys engines by IP: it needs --distinct-hosts (one address per pod)")
        workdir = launcher.log_dir / f"llmd-{tag}"
        write_builtin_tokenizer(workdir / fleet.model)
        config_file = workdir / "precise-prefix-cache-config.yaml"
        precise = precise_config(fleet.block_size, fleet.kv_events_endpoint, fleet.model)
        config_file.write_text(yaml.safe_dump(precise, sort_keys=False))
        llmd["cwd"] = workdir  # its embedded Python finds the chat template at ./<model>
    epp = ReferenceEpp(
        spec.binary,
        hosts,
        ports,
        tls=False,
        log_dir=launcher.log_dir,
        config_file=config_file,
        name=f"{role}-{tag}",
        on_spawn=lambda pid, process: launcher.record(pid, f"{process}-{tag}"),
        role=role,
        **llmd,
    )
    launcher.hold(epp)
    try:
        return epp.start()
    except client.ApiException as e:  # the API server refused an object: a failed system, not a crash
        raise RuntimeError(f"the {role}'s control plane: {e}") from None


def start_redis(launcher: Launcher, tag: str) -> str:
    """A fresh redis-server for one system's replicas (nothing persisted); its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server not found: run tools/install-test-binaries.sh (Debian redis-server)")
    port = free_port()
    redis = launcher.start(ManagedProcess(f"redis-{tag}", redis_argv(binary, port, launcher.log_dir), launcher.log_dir))
    redis.wait_ready(lambda: port_open(HOST, port), timeout=20)
    return f"redis://{HOST}:{port}/0"


def redis_argv(binary: str, port: int, data_dir: Path, name: str = "redis", password: str | None = None) -> list[str]:
    """A redis-server on HOST:`port` that persists nothing (its files, if any, in `data_dir`)."""
    argv = [binary, "--bind", HOST, "--port", str(port), "--save", "", "--appendonly", "no"]
    argv += ["--dir", str(data_dir), "--dbfilename", f"{name}.rdb"]
    return [*argv, "--requirepass", password] if password else argv
