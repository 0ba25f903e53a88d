"""One bench run: for each system, a cold fleet, the system, the same load, then tear-down."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import yaml

from picker_bench import progress as live
from picker_bench import report as reports
from picker_bench.attribution import attribute
from picker_bench.bound import PrefixBound, PromptBlocks, decode_floor_s, prefill_floor_s
from picker_bench.loadgen import LoadOptions, Progress, RequestResult, run_load
from picker_bench.report import BenchReport
from picker_bench.stats import SystemResult, histogram_decision_time, percentile, summarize
from picker_bench.systems import (
    DECISION_METRIC,
    FleetOptions,
    Launcher,
    SystemSpec,
    start_fleet,
    start_system,
    system_fleet,
)
from picker_bench.workloads import Prompt, Session
from picker_sim.engine import answer_ids
from picker_sim.profiles import get_profile


@dataclass(frozen=True, slots=True)
class BenchPlan:
    """What to run: systems, one workload (already generated), the fleet and the client."""

    systems: tuple[SystemSpec, ...]
    workload: str
    sessions: tuple[Session, ...]
    fleet: FleetOptions
    out_dir: Path
    max_concurrency: int = 256
    drain_timeout_s: float = 60.0
    announce_lengths: bool = True  # answers' lengths sent as max_tokens (else as min_tokens: unannounced)
    plots: bool = True
    settings: tuple[tuple[str, object], ...] = ()  # workload knobs, recorded in results.json
    objectives: tuple[tuple[str, int], ...] = ()  # the workload's InferenceObjectives: name, priority


@dataclass(frozen=True, slots=True)
class WorkloadBounds:
    """What no router can beat on a workload and fleet (`picker_bench.bound`)."""

    hit_ratio: float
    fleet_hit_ratio: float  # with the fleet's KV capacity and optimal eviction
    lru_hit_ratio: float  # with the fleet's KV capacity as one LRU cache (a reference, not a bound)
    ttft_floor_s: dict[str, float | None]  # p50/p90/p99 of the infinite-cache, idle-engine TTFT
    e2e_floor_s: dict[str, float | None]  # ... and completion time, each answer decoded alone
    longest_tokens: int  # the longest prompt plus its output: the fleet's minimum max_model_len


def prompt_blocks(sessions: Sequence[Session], block_size: int) -> list[list[PromptBlocks]]:
    """Every prompt cut into the fleet's blocks, with the simulator's answer, indexed
    [session][turn] like the request records."""
    return [[_blocks(prompt, block_size) for prompt in session.turns] for session in sessions]


def _blocks(prompt: Prompt, block_size: int) -> PromptBlocks:
    ids = prompt.token_ids()
    return PromptBlocks.of(ids, block_size, answer_ids(ids, prompt.max_tokens))


def arrival_order(sessions: Sequence[Session]) -> list[tuple[int, int]]:
    """(session, turn) of every prompt in the order they are expected to arrive: a later turn at
    its session's start plus the think times before it, as if every answer were instant."""
    due = []
    for index, session in enumerate(sessions):
        at = session.start_s
        for turn in range(len(session.turns)):
            due.append((at, index, turn))
            if turn < len(session.think_s):
                at += session.think_s[turn]
    return [(index, turn) for _, index, turn in sorted(due)]


def pod_blocks(fleet: FleetOptions) -> int:
    """KV blocks per pod: the fleet's setting or its profile's."""
    return fleet.num_gpu_blocks or get_profile(fleet.profile).num_gpu_blocks


def bounds_of(
    sessions: Sequence[Session], fleet: FleetOptions, blocks: Sequence[Sequence[PromptBlocks]] | None = None
) -> WorkloadBounds:
    """The infinite- and fleet-cache hit ratios, the LRU fleet figure and the TTFT and E2E floors of
    `sessions` on `fleet`, the prompts taken in arrival order; `blocks` (`prompt_blocks` of the
    same sessions at the fleet's block size) saves cutting the prompts again."""
    if blocks is None:
        blocks = prompt_blocks(sessions, fleet.block_size)
    bound = PrefixBound(fleet.block_size)
    profile = get_profile(fleet.profile)
    budget = fleet.max_num_batched_tokens or profile.max_num_batched_tokens
    longest = 0
    ttft_floors = []
    e2e_floors = []
    for index, turn in arrival_order(sessions):
        prompt = blocks[index][turn]
        hit = bound.add_blocks(prompt)
        output = sessions[index].turns[turn].max_tokens
        ttft = prefill_floor_s(prompt.tokens - hit, profile, fleet.time_scale, budget)
        ttft_floors.append(ttft)
        e2e_floors.append(ttft + decode_floor_s(prompt.tokens, output, profile, fleet.time_scale))
        longest = max(longest, prompt.tokens + output)
    ttft_floor = {f"p{q}": percentile(ttft_floors, q) for q in (50, 90, 99)}
    e2e_floor = {f"p{q}": percentile(e2e_floors, q) for q in (50, 90, 99)}
    capacity = fleet.pods * pod_blocks(fleet)
    return WorkloadBounds(
        bound.ratio, bound.fleet_ratio(capacity), bound.lru_ratio(capacity), ttft_floor, e2e_floor, longest
    )


def prepare_out_dir(out_dir: Path, objectives: tuple[tuple[str, int], ...]) -> tuple[Launcher, Path | None]:
    """A launcher writing into `out_dir` (its `pids` file emptied, its `logs` fresh) and the
    InferenceObjectives file for the systems, when the workload names objectives."""
    out_dir.mkdir(parents=True, exist_ok=True)
    pids = out_dir / "pids"
    pids.write_text("")
    logs = out_dir / "logs"
    shutil.rmtree(logs, ignore_errors=True)  # readiness is read from the logs: never from an earlier run's
    launcher = Launcher(logs, pids)
    if not objectives:
        return launcher, None
    logs.mkdir(parents=True)
    path = logs / "objectives.yaml"
    path.write_text(yaml.safe_dump(dict(objectives)))
    return launcher, path


def fleet_for(fleet: FleetOptions, longest_tokens: int) -> FleetOptions:
    """`fleet` with a `max_model_len` that admits the workload's longest prompt plus its output."""
    return replace(fleet, max_model_len=longest_tokens) if longest_tokens > fleet.max_model_len else fleet


def run(plan: BenchPlan, log: Callable[[str], None] = print) -> BenchReport:
    """Measure every system in turn; always stops every process it started."""
    launcher, objectives = prepare_out_dir(plan.out_dir, plan.objectives)
    blocks = prompt_blocks(plan.sessions, plan.fleet.block_size)
    bounds = bounds_of(plan.sessions, plan.fleet, blocks)
    fleet = fleet_for(plan.fleet, bounds.longest_tokens)
    requests = sum(len(s.turns) for s in plan.sessions)
    report = BenchReport(
        plan.workload,
        bounds.hit_ratio,
        {
            "fleet": asdict(fleet),
            "sessions": len(plan.sessions),
            "requests": requests,
            "max_concurrency": plan.max_concurrency,
            "python": sys.version.split()[0],
            **dict(plan.settings),
        },
        fleet_bound_hit_ratio=bounds.fleet_hit_ratio,
        lru_bound_hit_ratio=bounds.lru_hit_ratio,
        ttft_floor_s=bounds.ttft_floor_s,
        e2e_floor_s=bounds.e2e_floor_s,
    )
    log(
        f"workload {plan.workload}: {requests} requests in {len(plan.sessions)} sessions, "
        f"infinite-cache bound {bounds.hit_ratio * 100:.1f}%, fleet-cache bound {bounds.fleet_hit_ratio * 100:.1f}%, "
        f"LRU fleet {bounds.lru_hit_ratio * 100:.1f}%, TTFT floor {reports.floor_text(bounds.ttft_floor_s)}, "
        f"E2E floor {reports.floor_text(bounds.e2e_floor_s)}"
    )
    try:
        for index, spec in enumerate(plan.systems):
            tag = f"{index}-{spec.kind}"
            try:
                report.systems[spec.name] = _measure(spec, plan, fleet, launcher, tag, blocks, objectives)
            except (RuntimeError, TimeoutError, OSError) as e:
                report.failures[spec.name] = str(e)
                log(f"{spec.name}: could not be measured: {e}")
            finally:
                launcher.stop()
            reports.write(report, plan.out_dir, with_plots=False)  # partial results survive a later failure
    finally:
        launcher.stop()
    reports.write(report, plan.out_dir, with_plots=plan.plots)
    return report


def _measure(
    spec: SystemSpec,
    plan: BenchPlan,
    fleet: FleetOptions,
    launcher: Launcher,
    tag: str,
    blocks: Sequence[Sequence[PromptBlocks]],
    objectives: Path | None,
) -> SystemResult:
    """One system: a cold fleet, the system in front of it, the whole workload, the numbers and
    where its prompt tokens' cache hits went (`picker_bench.attribution`)."""
    results, page = serve_load(spec, plan.sessions, plan, fleet, launcher, tag, objectives, spec.name)
    write_requests(results, plan.out_dir / "requests" / f"{file_name(spec.name)}.jsonl")
    if page is not None:  # the picker's own view of the run (predictions, hits), for analysis
        (plan.out_dir / "requests" / f"{file_name(spec.name)}.metrics.txt").write_text(page)
    attribution = attribute(results, blocks, fleet.block_size, pod_blocks(fleet))
    decision_time = histogram_decision_time(page, DECISION_METRIC) if page is not None else None
    return replace(summarize(results, fleet.pods, decision_time), attribution=attribution)


def serve_load(
    spec: SystemSpec,
    sessions: Sequence[Session],
    plan: BenchPlan,
    fleet: FleetOptions,
    launcher: Launcher,
    tag: str,
    objectives: Path | None,
    label: str,
) -> tuple[list[RequestResult], str | None]:
    """Start a cold fleet and the system in front of it (the caller stops them), play `sessions`
    through it with a live progress line under `label`; every request's result and the system's
    final metrics page (`Gateway.metrics_page`)."""
    fleet = system_fleet(spec, fleet)
    _, pods = start_fleet(fleet, launcher, tag)
    gateway = start_system(spec, pods, launcher, tag, objectives, fleet)
    options = LoadOptions(
        gateway.url,
        fleet.model,
        plan.max_concurrency,
        drain_timeout_s=plan.drain_timeout_s,
        announce_lengths=plan.announce_lengths,
    )
    counters = Progress(sum(len(s.turns) for s in sessions))

    async def measured() -> list[RequestResult]:
        display = asyncio.create_task(live.show(label, counters))
        try:
            return await run_load(sessions, options, counters)
        finally:
            display.cancel()
            await asyncio.gather(display, return_exceptions=True)

    return asyncio.run(measured()), gateway.metrics_page()


def file_name(system: str) -> str:
    """A system's name as a file name (`picker:best` -> `picker-best`)."""
    return system.replace(":", "-")


def write_requests(results: Sequence[RequestResult], path: Path) -> None:
    """One JSON line per request (session, turn, pod, TTFT, cached tokens...), for analysis beyond
    the summary: which pod served which prompt, and what it found cached."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(asdict(r)) + "\n" for r in results))
