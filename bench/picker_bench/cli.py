"""`picker bench`: compare routers side by side on the same simulated fleet and workload."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import TypeVar

from picker.config.builtin_configs import resolve_config_path
from picker.config.schema import ConfigError
from picker_bench import report as reports
from picker_bench import workloads
from picker_bench.capacity import CapacityPlan, Slo, run_capacity, terminal_text
from picker_bench.kube_cluster import KUBE_VERSION, MissingBinaryError, cached_binary, etcd_binary
from picker_bench.llmd_epp import precise_hash_seed
from picker_bench.placement import placement_of, placement_text
from picker_bench.reference_epp import MAX_TARGET_PORTS
from picker_bench.runner import BenchPlan, bounds_of, run
from picker_bench.systems import EPP_KINDS, KINDS, FleetOptions, SystemSpec, parse_systems

WORKLOADS = ("shared-prefix", "multi-turn", "long-doc", "conversation", "multi-tenant", "pd-mix")
# Flags that override one field of a workload spec: flag dest -> spec field.
SPEC_FLAGS = {
    "shared-prefix": {
        "groups": "groups",
        "prompts_per_group": "prompts_per_group",
        "system_prompt_len": "system_prompt_len",
        "question_len": "question_len",
        "output_len": "output_len",
        "group_skew": "group_skew",
    },
    "multi-turn": {
        "sessions": "sessions",
        "turns": "turns",
        "system_prompt_len": "system_prompt_len",
        "question_len": "question_len",
        "output_len": "answer_len",
        "think_time": "think_time_s",
    },
    "long-doc": {
        "documents": "documents",
        "document_len": "document_len",
        "question_len": "question_len",
        "output_len": "output_len",
    },
    "conversation": {
        "applications": "applications",
        "application_skew": "application_skew",
        "system_prompt_len": "system_prompt_len",
        "max_turns": "max_turns",
        "turns_exponent": "turns_exponent",
        "question_len": "user_len",
        "output_len": "answer_len",
        "think_time": "think_time_s",
        "think_scale": "think_scale",
        "one_off_share": "one_off_share",
        "one_off_len": "one_off_len",
    },
    "multi-tenant": {
        "tenants": "tenants",
        "prefixes": "prefixes",
        "system_prompt_len": "system_prompt_len",
        "question_len": "question_len",
        "output_len": "output_len",
        "burst_rate": "burst_rate",
        "burst_start": "burst_start",
        "burst_end": "burst_end",
    },
    "pd-mix": {
        "long_share": "long_share",
        "document_len": "document_len",
        "long_output_len": "long_output_len",
        "applications": "applications",
        "system_prompt_len": "system_prompt_len",
        "question_len": "question_len",
        "output_len": "output_len",
    },
}
# Spec fields for which 0 is a meaningful value (no pause, uniform popularity, no one-offs).
ZERO_ALLOWED = (
    "think_time_s",
    "group_skew",
    "application_skew",
    "turns_exponent",
    "think_scale",
    "one_off_share",
    "burst_start",
    "long_share",
)
WorkloadSpec = (
    workloads.SharedPrefixSpec
    | workloads.MultiTurnSpec
    | workloads.LongDocSpec
    | workloads.ConversationSpec
    | workloads.MultiTenantSpec
    | workloads.PdMixSpec
)
# Sized for a 2-core machine: small enough to run in a minute or two, with KV caches too small
# to hold every shared prefix on every pod, so where a request goes decides whether it hits.
DEFAULT_SPECS: dict[str, WorkloadSpec] = {
    "shared-prefix": workloads.SharedPrefixSpec(
        groups=32, prompts_per_group=16, system_prompt_len=2048, question_len=128, output_len=32
    ),
    "multi-turn": workloads.MultiTurnSpec(
        turns=6, system_prompt_len=256, question_len=128, answer_len=128, think_time_s=1.0
    ),
    "long-doc": workloads.LongDocSpec(documents=16, document_len=6000, question_len=64, output_len=32),
    # Published shapes (see ConversationSpec), pauses and one-offs scaled so that at 10 req/s one
    # pod's cache cannot hold the live conversations while the 4 pods' caches together can.
    "conversation": workloads.ConversationSpec(),
    # Two quiet tenants, a critical one and a noisy one bursting at 12 req/s for 60% of the run:
    # sized for `--pods 2 --max-num-seqs 4 --time-scale 0.25`, where the pool serves about 3.7 req/s
    # (the steady tenants use 40% of it, the burst 3x). Give `--max-concurrency` room for the
    # burst's backlog (e.g. 2000): at the cap the client itself queues every tenant's requests.
    "multi-tenant": workloads.MultiTenantSpec(),
    # Chat with 25% long documents wanting long answers (see PdMixSpec): on 4 pods at 10 req/s an
    # aggregated fleet's decodes stall behind the documents' prefills, which `--pd 2:2` moves to
    # its prefill pods.
    "pd-mix": workloads.PdMixSpec(),
}
# 2048 blocks of 16 tokens hold about 14 of the default 2048-token shared prefixes per pod.
GENERATED_NUM_GPU_BLOCKS = 2048
DEFAULT_DURATION_S = 60.0
# Capacity steps are short: several per system, each a cold fleet.
DEFAULT_CAPACITY_STEP_S = 20.0
DEFAULT_PODS = 4
DEFAULT_RATES = {
    "shared-prefix": 28.0,
    "multi-turn": 20.0,
    "long-doc": 4.0,
    "conversation": 10.0,
    "multi-tenant": 1.2,
    "pd-mix": 10.0,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="picker bench",
        description="Run the same open-loop workload through each system in front of a cold `picker sim` "
        "fleet and compare TTFT, latency, throughput, prefix hit ratio and load spread.",
    )
    p.add_argument(
        "--systems",
        help=f"comma-separated: {', '.join(k for k in KINDS if k not in ('picker', 'external'))}, "
        "picker, picker:LABEL, external:URL (reference-epp needs --reference-epp, llmd, llmd-precise and "
        "llmd-pd --llmd-epp, llmd-precise also --distinct-hosts, llmd-pd (llm-d's P/D) --pd and --pd-sidecar); "
        "picker[:LABEL]@N runs N picker replicas behind one Envoy "
        "(LEAST_REQUEST over them), picker[:LABEL]@N+store makes them share state through a redis-server "
        "(--state-store), e.g. picker:best@3,picker:best@3+store",
    )
    p.add_argument(
        "--bounds-only",
        action="store_true",
        help="print what no router can beat on this workload and fleet (infinite- and fleet-cache "
        "hit ratio, the LRU fleet reference, TTFT floor) and what placement alone does for hits "
        "(picker_bench.placement), and exit without starting anything",
    )
    p.add_argument("--workload", required=True, help=f"{' | '.join(WORKLOADS)} | PATH to a Mooncake JSONL trace")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="output directory (default bench-out)")
    p.add_argument(
        "--duration", type=float, help="seconds of arrivals per system (default 60; a trace plays to its end)"
    )
    p.add_argument("--rate", type=float, help="mean requests/s, Poisson (default depends on the workload)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--speed", type=float, default=1.0, help="trace replay speed factor (default 1)")
    p.add_argument(
        "--picker-config",
        action="append",
        default=[],
        metavar="[LABEL=]FILE",
        help="EndpointPickerConfig for system picker:LABEL (or plain picker); repeatable",
    )
    p.add_argument(
        "--reference-epp",
        type=Path,
        metavar="PATH",
        help="the reference EPP's binary (v1.5.0, `python -m picker_bench.reference_epp` builds it), for "
        "system reference-epp: it runs behind the same Envoy (FULL_DUPLEX_STREAMED) over a throwaway "
        f"kube-apiserver + etcd, its InferencePool's target ports the pods' (so at most {MAX_TARGET_PORTS} pods)",
    )
    p.add_argument(
        "--reference-config",
        type=Path,
        metavar="FILE",
        help="EndpointPickerConfig for system reference-epp (default: the reference's built-in one)",
    )
    p.add_argument(
        "--llmd-epp",
        type=Path,
        metavar="PATH",
        help="llm-d's scheduler binary (v0.4.0, `python -m picker_bench.llmd llmd-epp` builds it), "
        "for systems llmd (approximate) and llmd-precise (on the engines' KV events): run as reference-epp",
    )
    p.add_argument(
        "--llmd-config",
        type=Path,
        metavar="FILE",
        help="EndpointPickerConfig for system llmd (default: llm-d's deploy/config/epp-config.yaml)",
    )
    p.add_argument(
        "--epp-log-verbosity",
        type=int,
        metavar="N",
        help="-v of the reference-epp and llm-d systems (default theirs; 4 logs every pick's scores, at a cost)",
    )
    p.add_argument("--max-concurrency", type=int, default=256, help="client concurrency cap (default 256)")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="seconds after the last arrival before unfinished requests are cut (default 60)",
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    sim = p.add_argument_group("simulated fleet (the same for every system)")
    sim.add_argument("--pods", type=int, help=f"simulated pods (default {DEFAULT_PODS})")
    sim.add_argument(
        "--pd",
        metavar="P:D",
        help="a prefill/decode fleet: P prefill pods then D decode pods (labels llm-d.ai/role), instead of "
        "--pods. Picker systems whose config has a pd-profile-handler, and llmd-pd, route it disaggregated, "
        "through llm-d's pd-sidecar in front of each decode pod (--pd-sidecar); every other system sees its "
        "P+D pods as one aggregated fleet (a prefill pod serves a plain request whole)",
    )
    sim.add_argument(
        "--pd-sidecar",
        type=Path,
        metavar="PATH",
        help="llm-d's pd-sidecar binary (v0.4.0), for P/D picker systems and llmd-pd on a --pd fleet",
    )
    sim.add_argument("--model", default="sim-model")
    sim.add_argument("--profile", default="llama3-8b-h100", help="sim timing profile")
    sim.add_argument("--time-scale", type=float, default=1.0, help="sim runs this many times faster")
    sim.add_argument(
        "--num-gpu-blocks",
        type=int,
        help=f"KV blocks per pod (default {GENERATED_NUM_GPU_BLOCKS} for generated workloads, "
        "the profile's own for traces)",
    )
    sim.add_argument("--block-size", type=int, default=16)
    sim.add_argument("--max-num-seqs", type=int, default=16, help="running requests per pod (default 16)")
    sim.add_argument("--max-num-batched-tokens", type=int, help="token budget per engine step")
    sim.add_argument(
        "--sim-base-port", type=int, default=0, help="pod i on this port+i (default: free ports); for external gateways"
    )
    sim.add_argument(
        "--distinct-hosts",
        action="store_true",
        help="pod i on 127.0.0.(1+i), all at one port (schedulers that key engines by IP, as llmd-precise, need it)",
    )
    capacity = p.add_argument_group("capacity at an SLO")
    capacity.add_argument(
        "--capacity",
        action="store_true",
        help="per system, play the workload at rising rates (a trace: replay speeds), one step of --duration "
        f"(default {DEFAULT_CAPACITY_STEP_S:g} s) each on a cold fleet, until a step breaks the SLO or has an "
        "error; report the highest passing rate and the goodput there",
    )
    capacity.add_argument("--slo-ttft-p90", type=float, metavar="SECONDS", help="--capacity: TTFT p90 SLO (required)")
    capacity.add_argument("--slo-tpot-p90", type=float, metavar="SECONDS", help="--capacity: TPOT p90 SLO (optional)")
    capacity.add_argument(
        "--rates",
        help="--capacity: comma-separated step rates in req/s (a trace: replay speeds), e.g. 2,4,6,8",
    )
    capacity.add_argument(
        "--rate-steps",
        type=int,
        default=4,
        help="--capacity without --rates: this many steps from --rate (a trace: --speed) up (default 4)",
    )
    capacity.add_argument(
        "--rate-factor", type=float, default=1.5, help="--capacity without --rates: each step's rate over the last's"
    )
    capacity.add_argument(
        "--refine",
        type=int,
        default=0,
        help="--capacity: bisect this many times between a system's last passing and first failing rate (default 0)",
    )
    spec = p.add_argument_group("workload shape (defaults sized for a 2-core machine)")
    for flag, kind in (
        ("--groups", int),
        ("--prompts-per-group", int),
        ("--system-prompt-len", int),
        ("--question-len", int),
        ("--output-len", int),
        ("--sessions", int),
        ("--turns", int),
        ("--think-time", float),
        ("--documents", int),
        ("--document-len", int),
        ("--group-skew", float),
        ("--applications", int),
        ("--application-skew", float),
        ("--max-turns", int),
        ("--turns-exponent", float),
        ("--think-scale", float),
        ("--one-off-share", float),
        ("--one-off-len", int),
        ("--tenants", int),
        ("--prefixes", int),
        ("--burst-rate", float),
        ("--burst-start", float),
        ("--burst-end", float),
        ("--long-share", float),
        ("--long-output-len", int),
    ):
        spec.add_argument(flag, type=kind)
    spec.add_argument(
        "--session-keys",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send each conversation's session key as `prompt_cache_key` (default: on)",
    )
    spec.add_argument(
        "--max-tokens",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send each answer's length as `max_tokens` with `ignore_eos` (default: on); with --no-max-tokens "
        "it goes as `min_tokens` only, where the simulated model ends its answer: the router is not told",
    )
    return p


def parse_picker_configs(values: list[str]) -> dict[str, Path]:
    """`LABEL=FILE` or `FILE` (label "") pairs, FILE a path or a built-in config's name
    (`picker-best.yaml`, as `picker serve --config-file` takes it); ValueError if it is neither."""
    configs: dict[str, Path] = {}
    for value in values:
        label, sep, path = value.partition("=")
        if not sep:
            label, path = "", value
        try:
            file = resolve_config_path(path)
        except ConfigError:
            file = Path(path)
        if not file.is_file():
            raise ValueError(f"--picker-config {value}: no such file, nor a built-in config of that name")
        configs[label] = file.resolve()
    return configs


def generate_sessions(spec: WorkloadSpec, rate: float, duration_s: float, seed: int) -> list[workloads.Session]:
    """The sessions of a generated workload; the spec's type names the workload."""
    if isinstance(spec, workloads.SharedPrefixSpec):
        return workloads.shared_prefix(spec, rate, duration_s, seed)
    if isinstance(spec, workloads.MultiTurnSpec):
        return workloads.multi_turn(spec, rate, duration_s, seed)
    if isinstance(spec, workloads.ConversationSpec):
        return workloads.conversation(spec, rate, duration_s, seed)
    if isinstance(spec, workloads.MultiTenantSpec):
        return workloads.multi_tenant(spec, rate, duration_s, seed)
    if isinstance(spec, workloads.PdMixSpec):
        return workloads.pd_mix(spec, rate, duration_s, seed)
    return workloads.long_doc(spec, rate, duration_s, seed)


def build_sessions(args: argparse.Namespace) -> tuple[str, list[workloads.Session], dict[str, object]]:
    """The workload's name, its sessions and its settings (for results.json), from the flags."""
    if args.duration is not None and args.duration <= 0:
        raise ValueError("--duration must be positive")
    if args.workload in WORKLOADS:
        duration = args.duration or DEFAULT_DURATION_S
        spec = DEFAULT_SPECS[args.workload]
        overrides = {
            field: getattr(args, dest)
            for dest, field in SPEC_FLAGS[args.workload].items()
            if getattr(args, dest) is not None
        }
        for field, value in overrides.items():
            if value < 0 or (value == 0 and field not in ZERO_ALLOWED):
                raise ValueError(f"--{field.replace('_', '-')} must be positive")
        spec = dataclasses.replace(spec, **overrides)
        rate = args.rate or DEFAULT_RATES[args.workload]
        settings = {"rate": rate, "duration_s": duration, "seed": args.seed, **dataclasses.asdict(spec)}
        if isinstance(spec, workloads.MultiTenantSpec):
            settings["objectives"] = workloads.TENANT_OBJECTIVES
        return args.workload, generate_sessions(spec, rate, duration, args.seed), settings
    path = Path(args.workload)
    if not path.is_file():
        raise ValueError(f"--workload {args.workload!r}: not one of {', '.join(WORKLOADS)} and not a trace file")
    records = workloads.read_trace(path)
    settings = {"trace": str(path), "speed": args.speed, "duration_s": args.duration, "seed": args.seed}
    sessions = workloads.trace_replay(records, args.speed, args.duration or math.inf, args.seed)
    return f"trace {path.name} x{args.speed:g}", sessions, settings


def fleet_shape(args: argparse.Namespace) -> tuple[int, int]:
    """The fleet's pods and, of them, prefill pods (0: not a P/D fleet), from --pods and --pd."""
    if args.pd is None:
        pods = DEFAULT_PODS if args.pods is None else args.pods
        if pods < 1:
            raise ValueError("--pods must be at least 1")
        return pods, 0
    prefill, sep, decode = args.pd.partition(":")
    if not sep or not prefill.isdigit() or not decode.isdigit() or int(prefill) < 1 or int(decode) < 1:
        raise ValueError(f"--pd {args.pd!r}: must be P:D, at least one prefill and one decode pod (e.g. 1:3)")
    pods = int(prefill) + int(decode)
    if args.pods is not None and args.pods != pods:
        raise ValueError(f"--pods {args.pods} disagrees with --pd {args.pd} ({pods} pods)")
    return pods, int(prefill)


def check_pd_sidecar(args: argparse.Namespace, systems: list[SystemSpec]) -> None:
    """A P/D picker system on a P/D fleet needs llm-d's pd-sidecar, checked before anything starts."""
    if args.pd_sidecar is not None and not os.access(args.pd_sidecar, os.X_OK):
        raise ValueError(f"--pd-sidecar {args.pd_sidecar}: not an executable file")
    disaggregated = [spec.name for spec in systems if spec.disaggregated]
    if args.pd is not None and disaggregated and args.pd_sidecar is None:
        raise ValueError(
            f"{', '.join(disaggregated)}: a P/D config on a --pd fleet runs llm-d's pd-sidecar in front of each "
            "decode pod: give --pd-sidecar PATH (e.g. ~/.cache/picker/bin/pd-sidecar-v0.4.0)"
        )


def plan_from_args(args: argparse.Namespace) -> BenchPlan:
    """Validate everything up front so a bad flag fails before any process starts."""
    pods, prefill_pods = fleet_shape(args)
    if args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    if args.num_gpu_blocks is not None and args.num_gpu_blocks < 1:
        raise ValueError("--num-gpu-blocks must be positive")
    if args.time_scale <= 0:
        raise ValueError("--time-scale must be positive")
    if args.rate is not None and args.rate <= 0:
        raise ValueError("--rate must be positive")
    if not args.systems and not args.bounds_only:
        raise ValueError("--systems is required (or --bounds-only)")
    systems = (
        parse_systems(
            args.systems.split(","),
            parse_picker_configs(args.picker_config),
            args.reference_epp and args.reference_epp.resolve(),
            args.reference_config and args.reference_config.resolve(),
            args.llmd_epp and args.llmd_epp.resolve(),
            args.llmd_config and args.llmd_config.resolve(),
            args.epp_log_verbosity,
            args.pd_sidecar and args.pd_sidecar.resolve(),
        )
        if args.systems
        else []
    )
    check_reference_epp(args, systems, pods)
    check_pd_sidecar(args, systems)
    workload, sessions, settings = build_sessions(args)
    if not sessions:
        raise ValueError("the workload has no requests within --duration")
    if not args.session_keys:
        sessions = workloads.without_session_keys(sessions)
    settings["session_keys"] = args.session_keys
    settings["max_tokens"] = args.max_tokens
    fleet = FleetOptions(
        pods=pods,
        model=args.model,
        profile=args.profile,
        time_scale=args.time_scale,
        num_gpu_blocks=args.num_gpu_blocks or (GENERATED_NUM_GPU_BLOCKS if args.workload in WORKLOADS else None),
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        base_port=args.sim_base_port,
        distinct_hosts=args.distinct_hosts,
        # every fleet hashes as llm-d's precise scorer's does, so all read alike-hashed events
        hash_seed=precise_hash_seed() if any(spec.kind == "llmd-precise" for spec in systems) else None,
        prefill_pods=prefill_pods,
    )
    return BenchPlan(
        tuple(systems),
        workload,
        tuple(sessions),
        fleet,
        args.out,
        args.max_concurrency,
        args.drain_timeout,
        plots=not args.no_plots,
        settings=tuple(settings.items()),
        announce_lengths=args.max_tokens,
        objectives=tuple(workloads.TENANT_OBJECTIVES.items()) if "objectives" in settings else (),
    )


def check_reference_epp(args: argparse.Namespace, systems: list[SystemSpec], pods: int) -> None:
    """What the reference-epp and llm-d systems need, checked before anything starts."""
    for flag, binary, config in (
        ("reference", args.reference_epp, args.reference_config),
        ("llmd", args.llmd_epp, args.llmd_config),
    ):
        if binary is not None and not os.access(binary, os.X_OK):
            raise ValueError(f"--{flag}-epp {binary}: not an executable file")
        if config is not None and not config.is_file():
            raise ValueError(f"--{flag}-config {config}: no such file")
    kinds = {spec.kind for spec in systems} & set(EPP_KINDS)
    if not kinds:
        return
    if "llmd-precise" in kinds and not args.distinct_hosts:
        raise ValueError("llmd-precise keys engines by IP (topic kv@<ip>@<model>): add --distinct-hosts")
    if "llmd-pd" in kinds and (args.pd is None or args.distinct_hosts):
        raise ValueError(
            "llmd-pd runs llm-d's P/D: it needs a --pd P:D fleet, without --distinct-hosts (its pd-sidecar "
            "reaches its engine at localhost)"
        )
    by_port = kinds - {"llmd-pd"}  # llmd-pd gives every Pod an address of its own
    if by_port and pods > MAX_TARGET_PORTS and not args.distinct_hosts:
        raise ValueError(
            f"--pods {pods}: the {', '.join(sorted(by_port))} system takes at most {MAX_TARGET_PORTS} pods "
            "on one address (its InferencePool's target ports, one per pod); --distinct-hosts takes more"
        )
    try:
        cached_binary("kube-apiserver", KUBE_VERSION)
        etcd_binary()
    except MissingBinaryError as e:
        raise ValueError(f"the {', '.join(sorted(kinds))} system runs a kube-apiserver and etcd: {e}") from None


def capacity_rates(args: argparse.Namespace) -> tuple[float, ...]:
    """The step rates, increasing: `--rates`, or `--rate-steps` from the base rate (a trace's
    `--speed`) up by `--rate-factor`."""
    if args.rates:
        try:
            rates = sorted({float(value) for value in args.rates.split(",")})
        except ValueError:
            raise ValueError(f"--rates {args.rates!r}: not comma-separated numbers") from None
        if rates[0] <= 0:
            raise ValueError("--rates must be positive")
        return tuple(rates)
    if args.rate_steps < 1:
        raise ValueError("--rate-steps must be at least 1")
    if args.rate_factor <= 1:
        raise ValueError("--rate-factor must be above 1")
    trace = args.workload not in WORKLOADS
    base = args.speed if trace else args.rate or DEFAULT_RATES[args.workload]
    return tuple(round(base * args.rate_factor**step, 6) for step in range(args.rate_steps))


def capacity_plan_from_args(args: argparse.Namespace) -> CapacityPlan:
    """Validate a `--capacity` run up front; its bench plan carries the lowest rate's workload."""
    if args.bounds_only:
        raise ValueError("--capacity and --bounds-only do not go together")
    if args.slo_ttft_p90 is None or args.slo_ttft_p90 <= 0:
        raise ValueError("--capacity needs a positive --slo-ttft-p90 (seconds)")
    if args.slo_tpot_p90 is not None and args.slo_tpot_p90 <= 0:
        raise ValueError("--slo-tpot-p90 must be positive")
    if args.refine < 0:
        raise ValueError("--refine must not be negative")
    rates = capacity_rates(args)
    trace = args.workload not in WORKLOADS
    duration = args.duration or DEFAULT_CAPACITY_STEP_S

    def at(rate: float) -> argparse.Namespace:
        return argparse.Namespace(**{**vars(args), "speed" if trace else "rate": rate, "duration": duration})

    def sessions_at(rate: float) -> Sequence[workloads.Session]:
        _, sessions, _ = build_sessions(at(rate))
        return sessions if args.session_keys else workloads.without_session_keys(sessions)

    bench = plan_from_args(at(rates[0]))
    return CapacityPlan(
        dataclasses.replace(bench, settings=tuple((k, v) for k, v in bench.settings if k not in ("rate", "speed"))),
        Slo(args.slo_ttft_p90, args.slo_tpot_p90),
        rates,
        sessions_at,
        window_s=None if trace else duration,  # a trace's window is its last arrival
        refine=args.refine,
        rate_unit="x speed" if trace else "req/s",
    )


def check_no_capacity_flags(args: argparse.Namespace) -> None:
    """The capacity flags mean nothing without `--capacity`: say so rather than ignore them."""
    for flag in ("slo_ttft_p90", "slo_tpot_p90", "rates"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag.replace('_', '-')} needs --capacity")


def execute_capacity(plan: CapacityPlan) -> int:
    """Run a validated capacity search and print its tables; 130 on Ctrl-C, 1 if a system failed."""
    report = interruptible(lambda: run_capacity(plan))
    if report is None:
        return 130
    out = plan.bench.out_dir
    print()
    print(terminal_text(report))
    print(f"\nresults: {out / 'results.json'}  report: {out / 'report.md'}")
    if report.plots:
        print("plots:   " + "  ".join(str(out / name) for name in report.plots.values()))
    return 1 if report.failures else 0


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM unwinds like Ctrl-C, through every `finally` that stops children


Outcome = TypeVar("Outcome")


def interruptible(work: Callable[[], Outcome]) -> Outcome | None:
    """`work()`, SIGTERM unwinding it like Ctrl-C; None (and a note) when either interrupted it."""
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return work()
    except KeyboardInterrupt:
        print("\npicker bench: interrupted; every started process was stopped", file=sys.stderr)
        return None
    finally:
        signal.signal(signal.SIGTERM, previous)


def execute(plan: BenchPlan) -> int:
    """Run a validated plan and print the table; 130 on Ctrl-C, 1 if a system failed."""
    report = interruptible(lambda: run(plan))
    if report is None:
        return 130
    print()
    print(reports.terminal_table(report))
    for line in reports.attribution_lines(report):
        print(line)
    print(f"\nresults: {plan.out_dir / 'results.json'}  report: {plan.out_dir / 'report.md'}")
    if report.plots:
        print("plots:   " + "  ".join(str(plan.out_dir / name) for name in report.plots.values()))
    return 1 if report.failures else 0


def main(argv: list[str]) -> int:
    """Entry point of `picker bench`."""
    args = build_parser().parse_args(argv)
    try:
        if args.capacity:
            return execute_capacity(capacity_plan_from_args(args))
        check_no_capacity_flags(args)
        plan = plan_from_args(args)
    except ValueError as e:
        print(f"picker bench: {e}", file=sys.stderr)
        return 2
    if args.bounds_only:
        bounds = bounds_of(plan.sessions, plan.fleet)
        print(f"{plan.workload}: {sum(len(s.turns) for s in plan.sessions)} requests on {plan.fleet.pods} pods")
        print(
            f"infinite-cache bound {bounds.hit_ratio:.1%}, fleet-cache bound {bounds.fleet_hit_ratio:.1%}, "
            f"LRU fleet {bounds.lru_hit_ratio:.1%}, "
            f"TTFT floor {reports.floor_text(bounds.ttft_floor_s)}, E2E floor {reports.floor_text(bounds.e2e_floor_s)}"
        )
        if plan.fleet.pods >= 2:
            print(placement_text(placement_of(plan.sessions, plan.fleet)))
        return 0
    return execute(plan)
