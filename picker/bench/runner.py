"""One bench run: for each system, a cold fleet, the system, the same load, then tear-down."""

from __future__ import annotations

import asyncio
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from picker.bench import progress as live
from picker.bench import report as reports
from picker.bench.bound import PrefixBound
from picker.bench.loadgen import LoadOptions, Progress, RequestResult, run_load
from picker.bench.report import BenchReport
from picker.bench.stats import SystemResult, summarize
from picker.bench.systems import (
    FleetOptions,
    Launcher,
    SystemSpec,
    start_fleet,
    start_system,
)
from picker.bench.workloads import Session, all_prompts


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
    plots: bool = True
    settings: tuple[tuple[str, object], ...] = ()  # workload knobs, recorded in results.json


def bound_of(sessions: Sequence[Session], block_size: int) -> tuple[float, int]:
    """The infinite-cache hit ratio of every prompt in `sessions`, and the longest prompt."""
    bound = PrefixBound(block_size)
    longest = 0
    for prompt in all_prompts(sessions):
        tokens = prompt.token_ids()
        bound.add(tokens)
        longest = max(longest, len(tokens) + prompt.max_tokens)
    return bound.ratio, longest


def run(plan: BenchPlan, log: Callable[[str], None] = print) -> BenchReport:
    """Measure every system in turn; always stops every process it started."""
    plan.out_dir.mkdir(parents=True, exist_ok=True)
    pids = plan.out_dir / "pids"
    pids.write_text("")
    logs = plan.out_dir / "logs"
    shutil.rmtree(logs, ignore_errors=True)  # readiness is read from the logs: never from an earlier run's
    launcher = Launcher(logs, pids)
    bound, longest = bound_of(plan.sessions, plan.fleet.block_size)
    fleet = plan.fleet
    if longest > fleet.max_model_len:
        fleet = replace(fleet, max_model_len=longest)
    requests = sum(len(s.turns) for s in plan.sessions)
    report = BenchReport(
        plan.workload, bound,
        {
            "fleet": asdict(fleet), "sessions": len(plan.sessions), "requests": requests,
            "max_concurrency": plan.max_concurrency, "python": sys.version.split()[0], **dict(plan.settings),
        },
    )
    log(f"workload {plan.workload}: {requests} requests in {len(plan.sessions)} sessions, "
        f"infinite-cache bound {bound * 100:.1f}%")
    try:
        for index, spec in enumerate(plan.systems):
            tag = f"{index}-{spec.kind}"
            try:
                report.systems[spec.name] = _measure(spec, plan, fleet, launcher, tag, requests)
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
    spec: SystemSpec, plan: BenchPlan, fleet: FleetOptions, launcher: Launcher, tag: str, requests: int
) -> SystemResult:
    """One system: a cold fleet, the system in front of it, the whole workload, the numbers."""
    _, pods = start_fleet(fleet, launcher, tag)
    gateway = start_system(spec, pods, launcher, tag)
    options = LoadOptions(gateway.url, fleet.model, plan.max_concurrency, drain_timeout_s=plan.drain_timeout_s)
    counters = Progress(requests)

    async def measured() -> list[RequestResult]:
        display = asyncio.create_task(live.show(spec.name, counters))
        try:
            return await run_load(plan.sessions, options, counters)
        finally:
            display.cancel()
            await asyncio.gather(display, return_exceptions=True)

    results = asyncio.run(measured())
    return summarize(results, fleet.pods, gateway.decision_time())
