"""`picker bench --capacity`: the highest arrival rate each system serves within a latency SLO.

Per system, the workload is played at rising rates (Poisson req/s, or a trace's replay speed),
one short step per rate, each on a cold fleet and a freshly started system: every step starts
from the same state, so steps compare like the systems of a plain `picker bench` run, and a
step's backlog or cache never flatters the next. A step passes when no request failed, TTFT p90
is within the SLO and, when one is given, TPOT p90 too. A system stops at its first failing step
(past a failure every higher rate only queues more); with `refine`, the interval between its
last passing rate and its first failing one is then bisected that many times. Its capacity is
the highest passing rate below its lowest failing one, and its goodput the requests per second
of arrivals that met the SLO there (DistServe's per-request definition).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from picker_bench import report as reports
from picker_bench.loadgen import RequestResult
from picker_bench.runner import BenchPlan, file_name, fleet_for, prepare_out_dir, serve_load, write_requests
from picker_bench.stats import percentile, summarize
from picker_bench.workloads import Session

PLOT = "capacity.png"


@dataclass(frozen=True, slots=True)
class Slo:
    """The service level a step must keep: TTFT p90 and, optionally, TPOT p90 (seconds)."""

    ttft_p90_s: float
    tpot_p90_s: float | None = None

    def met_by(self, result: RequestResult) -> bool:
        """Whether one request kept the SLO's thresholds (the per-request test goodput counts)."""
        if result.error is not None or result.ttft_s is None or result.ttft_s > self.ttft_p90_s:
            return False
        tpot = request_tpot_s(result)
        return self.tpot_p90_s is None or tpot is None or tpot <= self.tpot_p90_s


@dataclass(frozen=True, slots=True)
class StepResult:
    """One system at one rate."""

    rate: float  # req/s (Poisson) or replay speed (trace), as the steps are given
    offered_rps: float  # requests sent per second of arrivals
    sent: int
    errors: int
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    tpot_p90_s: float | None
    e2e_p50_s: float | None
    hit_ratio: float
    goodput_rps: float  # requests that met the SLO per second of arrivals
    passed: bool
    verdict: str  # why it passed or failed, e.g. "TTFT p90 1.21 s > 1 s"


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    """A bench plan (systems, fleet, client, output) run as a capacity search. `sessions_at`
    generates the workload at a rate; `window_s` is the arrivals' duration (None: up to each
    step's last arrival, for a trace played whole)."""

    bench: BenchPlan
    slo: Slo
    rates: tuple[float, ...]
    sessions_at: Callable[[float], Sequence[Session]]
    window_s: float | None
    refine: int = 0
    rate_unit: str = "req/s"  # or "x speed" for a trace


@dataclass
class SystemCapacity:
    """One system's steps, in the order they ran."""

    steps: list[StepResult] = field(default_factory=list)

    @property
    def capacity(self) -> StepResult | None:
        """The highest passing step below the lowest failing one (None: none passed)."""
        return capacity_step(self.steps)

    @property
    def limit_found(self) -> bool:
        """Whether a step failed: if none did, the capacity is at least the highest rate run."""
        return any(not step.passed for step in self.steps)

    def to_json(self) -> dict[str, Any]:
        """This system's part of `results.json`."""
        best = self.capacity
        return {
            "capacity": None if best is None else best.rate,
            "goodput_rps": None if best is None else best.goodput_rps,
            "limit_found": self.limit_found,
            "steps": [asdict(step) for step in self.steps],
        }


@dataclass
class CapacityReport:
    """Everything one capacity search measured."""

    workload: str
    slo: Slo
    rate_unit: str
    settings: dict[str, Any]
    systems: dict[str, SystemCapacity] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)  # system -> why a step could not run
    plots: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The `results.json` document."""
        return {
            "mode": "capacity",
            "workload": self.workload,
            "slo": asdict(self.slo),
            "rate_unit": self.rate_unit,
            "stop_rule": "a system stops at its first failing step (then bisects `refine` times)",
            "settings": self.settings,
            "systems": {name: system.to_json() for name, system in self.systems.items()},
            "failures": self.failures,
        }


def request_tpot_s(result: RequestResult) -> float | None:
    """Time per output token after the first: (E2E - TTFT) / (output tokens - 1); None for a
    failed request or an answer of one token."""
    if result.ttft_s is None or result.e2e_s is None or result.output_tokens < 2:
        return None
    return (result.e2e_s - result.ttft_s) / (result.output_tokens - 1)


def judge(rate: float, results: Sequence[RequestResult], slo: Slo, window_s: float, pods: int) -> StepResult:
    """One step's numbers and verdict from its requests, `window_s` the seconds of arrivals."""
    summary = summarize(results, pods)
    tpot_p90 = percentile([t for r in results if r.error is None and (t := request_tpot_s(r)) is not None], 90)
    failures = []
    if not results:
        failures.append("no requests")
    if summary.errors:
        failures.append(f"{summary.errors} errors")
    if summary.ttft_p90_s is not None and summary.ttft_p90_s > slo.ttft_p90_s:
        failures.append(f"TTFT p90 {summary.ttft_p90_s:.3g} s > {slo.ttft_p90_s:g} s")
    if slo.tpot_p90_s is not None and tpot_p90 is not None and tpot_p90 > slo.tpot_p90_s:
        failures.append(f"TPOT p90 {tpot_p90:.3g} s > {slo.tpot_p90_s:g} s")
    good = sum(slo.met_by(r) for r in results)
    return StepResult(
        rate=rate,
        offered_rps=len(results) / window_s if window_s > 0 else 0.0,
        sent=len(results),
        errors=summary.errors,
        ttft_p50_s=summary.ttft_p50_s,
        ttft_p90_s=summary.ttft_p90_s,
        tpot_p90_s=tpot_p90,
        e2e_p50_s=summary.e2e_p50_s,
        hit_ratio=summary.hit_ratio,
        goodput_rps=good / window_s if window_s > 0 else 0.0,
        passed=not failures,
        verdict="; ".join(failures) or "within the SLO",
    )


def capacity_step(steps: Sequence[StepResult]) -> StepResult | None:
    """The highest passing step below the lowest failing one; None when none is."""
    failing = min((s.rate for s in steps if not s.passed), default=float("inf"))
    return max((s for s in steps if s.passed and s.rate < failing), key=lambda s: s.rate, default=None)


def next_rate(steps: Sequence[StepResult], rates: Sequence[float], refine: int) -> float | None:
    """The next rate to run after `steps` (in the order they ran), or None when the search is
    over: the given `rates` in increasing order until one fails, then `refine` bisections between
    the highest passing rate and the lowest failing one (none when the first rate failed)."""
    done = {s.rate for s in steps}
    failing = [s.rate for s in steps if not s.passed]
    if not failing:
        return next((r for r in sorted(rates) if r not in done), None)
    best = capacity_step(steps)
    bisections = sum(s.rate not in rates for s in steps)
    if best is None or bisections >= refine:
        return None
    middle = (best.rate + min(failing)) / 2
    return None if middle in done else middle


def run_capacity(plan: CapacityPlan, log: Callable[[str], None] = print) -> CapacityReport:
    """Search every system's capacity in turn; always stops every process it started."""
    bench = plan.bench
    launcher, objectives = prepare_out_dir(bench.out_dir, bench.objectives)
    report = CapacityReport(
        bench.workload,
        plan.slo,
        plan.rate_unit,
        {
            "fleet": asdict(bench.fleet),
            "rates": list(plan.rates),
            "refine": plan.refine,
            "max_concurrency": bench.max_concurrency,
            "python": sys.version.split()[0],
            **dict(bench.settings),
        },
    )
    log(
        f"capacity of {bench.workload} at TTFT p90 <= {plan.slo.ttft_p90_s:g} s"
        + ("" if plan.slo.tpot_p90_s is None else f", TPOT p90 <= {plan.slo.tpot_p90_s:g} s")
        + f": rates {', '.join(f'{r:g}' for r in sorted(plan.rates))} {plan.rate_unit}"
    )
    # The same sessions at a rate for every system; the plan already holds the lowest rate's.
    workloads: dict[float, Sequence[Session]] = {min(plan.rates): bench.sessions}
    try:
        for index, spec in enumerate(bench.systems):
            system = report.systems[spec.name] = SystemCapacity()
            while (rate := next_rate(system.steps, plan.rates, plan.refine)) is not None:
                sessions = workloads.setdefault(rate, plan.sessions_at(rate))
                fleet = fleet_for(bench.fleet, longest_tokens(sessions))
                tag = f"{index}-{spec.kind}-{len(system.steps)}"
                label = f"{spec.name} @ {rate:g}"
                try:
                    results, _ = serve_load(spec, sessions, bench, fleet, launcher, tag, objectives, label)
                except (RuntimeError, TimeoutError, OSError) as e:
                    report.failures[spec.name] = f"at {rate:g} {plan.rate_unit}: {e}"
                    log(f"{spec.name}: could not be measured at {rate:g} {plan.rate_unit}: {e}")
                    if not system.steps:
                        del report.systems[spec.name]
                    break
                finally:
                    launcher.stop()
                write_requests(results, bench.out_dir / "requests" / file_name(spec.name) / f"{rate:g}.jsonl")
                window = plan.window_s or max((s.start_s for s in sessions), default=0.0)
                step = judge(rate, results, plan.slo, window, fleet.pods)
                system.steps.append(step)
                log(f"{label} {plan.rate_unit}: {'pass' if step.passed else 'FAIL'} ({step.verdict})")
                write(report, bench.out_dir, with_plot=False)  # partial results survive a later failure
    finally:
        launcher.stop()
    write(report, bench.out_dir, with_plot=bench.plots)
    return report


def longest_tokens(sessions: Sequence[Session]) -> int:
    """The longest prompt plus its output, in the simulator's tokens: the fleet's minimum max_model_len."""
    return max((len(p.token_ids()) + p.max_tokens for s in sessions for p in s.turns), default=0)


def step_rows(report: CapacityReport) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the steps table (shared by the terminal and markdown forms)."""
    header = [
        "system",
        f"rate ({report.rate_unit})",
        "offered req/s",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "TPOT p90 ms",
        "E2E p50 ms",
        "errors",
        "goodput req/s",
        "SLO",
    ]
    rows = []
    for name, system in report.systems.items():
        for step in sorted(system.steps, key=lambda s: s.rate):
            rows.append(
                [
                    name,
                    f"{step.rate:g}",
                    f"{step.offered_rps:.2f}",
                    reports.ms(step.ttft_p50_s),
                    reports.ms(step.ttft_p90_s),
                    reports.ms(step.tpot_p90_s),
                    reports.ms(step.e2e_p50_s),
                    str(step.errors),
                    f"{step.goodput_rps:.2f}",
                    "pass" if step.passed else "fail: " + step.verdict,
                ]
            )
    return header, rows


def capacity_rows(report: CapacityReport) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the summary: each system's capacity and goodput there."""
    header = ["system", f"capacity ({report.rate_unit})", "offered req/s", "goodput req/s", "TTFT p90 ms"]
    rows = []
    for name, system in report.systems.items():
        best = system.capacity
        if best is None:
            lowest = min((s.rate for s in system.steps), default=None)
            below = "-" if lowest is None else f"< {lowest:g}"
            rows.append([name, below, "-", "-", "-"])
        else:
            rows.append(
                [
                    name,
                    ("" if system.limit_found else ">= ") + f"{best.rate:g}",
                    f"{best.offered_rps:.2f}",
                    f"{best.goodput_rps:.2f}",
                    reports.ms(best.ttft_p90_s),
                ]
            )
    for name, why in report.failures.items():
        rows.append([name, "failed: " + why.splitlines()[0][:60], "", "", ""])
    return header, rows


def slo_text(slo: Slo) -> str:
    """`TTFT p90 <= 1 s, TPOT p90 <= 0.05 s`."""
    text = f"TTFT p90 <= {slo.ttft_p90_s:g} s"
    return text if slo.tpot_p90_s is None else f"{text}, TPOT p90 <= {slo.tpot_p90_s:g} s"


def terminal_text(report: CapacityReport) -> str:
    """The steps table and the capacity summary, for the terminal."""
    header, rows = step_rows(report)
    return (
        f"{reports.aligned(header, rows, text_columns=(0, len(header) - 1))}\n\n"
        f"capacity at {slo_text(report.slo)}, no errors:\n{reports.aligned(*capacity_rows(report))}"
    )


def markdown(report: CapacityReport) -> str:
    """`report.md` of a capacity search."""
    out = [
        f"# picker bench --capacity: {report.workload}",
        "",
        (
            f"SLO: **{slo_text(report.slo)}**, and no failed request. Each system ran the workload at rising "
            f"rates ({report.rate_unit}), every step on a cold fleet and a freshly started system, and stopped at "
            "its first failing step (then bisected between its last pass and that failure, if asked). Capacity: "
            "the highest passing rate below the lowest failing one (`>=` when no step failed). Goodput: "
            "requests per second of arrivals whose own TTFT (and TPOT) met the SLO's thresholds."
        ),
        "",
        *reports.markdown_table(*capacity_rows(report)),
        "",
        "## Steps",
        "",
        *reports.markdown_table(*step_rows(report)),
        "",
        "TPOT = (E2E - TTFT) / (output tokens - 1) per request. Offered req/s = requests sent per second of arrivals.",
        "",
        "## Settings",
        "",
        "```json",
        json.dumps(report.settings, indent=2),
        "```",
        "",
    ]
    out += [f"![{key}]({path})" for key, path in report.plots.items()]
    return "\n".join(out) + "\n"


def plot(report: CapacityReport, out_dir: Path) -> dict[str, str]:
    """The capacity curves: TTFT p90 and goodput against rate per system, the SLO as a line
    (filled markers pass, hollow ones fail); {plot key: file name}, none without matplotlib."""
    plt = reports.pyplot()
    if plt is None or not any(system.steps for system in report.systems.values()):
        return {}
    fig, (latency, goodput) = plt.subplots(1, 2, figsize=(11, 4.5))
    for name, system in report.systems.items():
        steps = sorted((s for s in system.steps if s.ttft_p90_s is not None), key=lambda s: s.rate)
        if not steps:
            continue
        (line,) = latency.plot([s.rate for s in steps], [(s.ttft_p90_s or 0) * 1000 for s in steps], label=name)
        for step in steps:
            face = line.get_color() if step.passed else "none"
            latency.plot([step.rate], [(step.ttft_p90_s or 0) * 1000], "o", color=line.get_color(), mfc=face)
        goodput.plot([s.rate for s in steps], [s.goodput_rps for s in steps], "o-", color=line.get_color(), label=name)
    latency.axhline(report.slo.ttft_p90_s * 1000, color="tab:red", linestyle="--", label="SLO")
    latency.set_yscale("log")
    latency.set_xlabel(f"rate ({report.rate_unit})")
    latency.set_ylabel("TTFT p90 (ms, log scale)")
    latency.set_title(f"TTFT p90 against rate (hollow: failed): {report.workload}")
    latency.grid(True, alpha=0.3)
    latency.legend()
    goodput.set_xlabel(f"rate ({report.rate_unit})")
    goodput.set_ylabel("goodput (req/s within the SLO)")
    goodput.set_title("Goodput against rate")
    goodput.grid(True, alpha=0.3)
    goodput.legend()
    return {"capacity": reports.save(fig, out_dir / PLOT)}


def write(report: CapacityReport, out_dir: Path, with_plot: bool = True) -> None:
    """Write results.json, report.md and (optionally) the plot."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")
    report.plots = plot(report, out_dir) if with_plot else {}
    (out_dir / "report.md").write_text(markdown(report))
