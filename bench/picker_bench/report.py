"""Bench outputs: terminal table, `results.json`, `report.md` and PNG plots (matplotlib, Agg)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from picker_bench.attribution import CATEGORIES
from picker_bench.stats import SystemResult

PLOTS = {"ttft_cdf": "ttft_cdf.png", "hit_ratio": "hit_ratio.png", "load_spread": "load_spread.png"}


@dataclass
class BenchReport:
    """Everything one `picker bench` run measured."""

    workload: str
    bound_hit_ratio: float
    settings: dict[str, Any]
    systems: dict[str, SystemResult] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)  # system -> why it could not be measured
    fleet_bound_hit_ratio: float | None = None  # the fleet's KV capacity, optimal eviction
    lru_bound_hit_ratio: float | None = None  # the fleet's KV capacity as one LRU cache: a reference
    ttft_floor_s: dict[str, float | None] = field(default_factory=dict)  # p50/p90/p99 no router can beat
    e2e_floor_s: dict[str, float | None] = field(default_factory=dict)  # the same for completion time
    plots: dict[str, str] = field(default_factory=dict)  # plot key -> file name, once written

    def to_json(self) -> dict[str, Any]:
        """The `results.json` document."""
        return {
            "workload": self.workload,
            "bound_hit_ratio": self.bound_hit_ratio,
            "fleet_bound_hit_ratio": self.fleet_bound_hit_ratio,
            "lru_bound_hit_ratio": self.lru_bound_hit_ratio,
            "ttft_floor_s": self.ttft_floor_s,
            "e2e_floor_s": self.e2e_floor_s,
            "settings": self.settings,
            "systems": {name: result.to_json() for name, result in self.systems.items()},
            "failures": self.failures,
        }


def ms(value: float | None, digits: int = 0) -> str:
    """Seconds as milliseconds (`digits` decimals), `-` for none."""
    return "-" if value is None else f"{value * 1000:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def floor_text(floor: dict[str, float | None]) -> str:
    """`p50/p90/p99 A/B/C ms` of a TTFT or E2E floor, or `-` when it was not computed."""
    if not floor:
        return "-"
    return "p50/p90/p99 " + "/".join(ms(floor.get(q)) for q in ("p50", "p90", "p99")) + " ms"


def table_rows(report: BenchReport) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the comparison table (shared by the terminal and markdown forms)."""
    header = [
        "system",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "TTFT p99 ms",
        "E2E p50 ms",
        "TPOT p90 ms",
        "out tok/s",
        "hit ratio",
        "bound",
        "LRU fleet",
        "requests",
        "errors",
        "hotspot",
        "decision p50 ms",
    ]
    rows = []
    for name, r in report.systems.items():
        decision = r.decision_time
        rows.append(
            [
                name,
                ms(r.ttft_p50_s),
                ms(r.ttft_p90_s),
                ms(r.ttft_p99_s),
                ms(r.e2e_p50_s),
                ms(r.tpot_p90_s, 1),  # a few ms per token: 1 ms steps are too coarse
                f"{r.output_tokens_per_s:.0f}",
                _pct(r.hit_ratio),
                _pct(report.bound_hit_ratio),
                _pct(report.lru_bound_hit_ratio),
                str(r.requests),
                str(r.errors),
                "-" if r.hotspot is None else f"{r.hotspot:.2f}",
                "-"
                if decision is None
                else (f"<={decision.p50_s * 1000:.2f}" if decision.p50_s else f"{decision.mean_s * 1000:.2f}"),
            ]
        )
    for name, why in report.failures.items():
        rows.append([name, "failed: " + why.splitlines()[0][:60]] + [""] * (len(header) - 2))
    return header, rows


def tenant_rows(report: BenchReport) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the per-tenant table: each system's tenants and their objectives'
    priorities (from the workload's `objectives` setting); no rows when no request named a tenant."""
    header = [
        "system",
        "tenant",
        "objective (priority)",
        "sent",
        "served",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "E2E p50 ms",
        "E2E p90 ms",
        "goodput tok/s",
        "429",
        "503",
        "other errors",
    ]
    priorities = report.settings.get("objectives") or {}
    rows = []
    for name, r in report.systems.items():
        for t in r.tenants:
            objective = "-" if t.objective is None else f"{t.objective} ({priorities.get(t.objective, '?')})"
            rows.append(
                [
                    name,
                    t.tenant,
                    objective,
                    str(t.sent),
                    str(t.served),
                    ms(t.ttft_p50_s),
                    ms(t.ttft_p90_s),
                    ms(t.e2e_p50_s),
                    ms(t.e2e_p90_s),
                    f"{t.goodput_tokens_per_s:.0f}",
                    str(t.rejected),
                    str(t.expired),
                    str(t.other_errors),
                ]
            )
    return header, rows


def terminal_table(report: BenchReport) -> str:
    """A plain aligned table for the terminal; with tenants, the per-tenant one and the rates while
    requests arrive."""
    text = aligned(*table_rows(report))
    header, rows = tenant_rows(report)
    if not rows:
        return text
    window = _arrival_window(report)
    return f"{text}\n\n{aligned(header, rows)}\nwhile requests arrive, out tok/s (pods decoding): {window}"


def _arrival_window(report: BenchReport) -> str:
    return ", ".join(
        f"{name} {r.arrival_window_tokens_per_s:.0f} ({r.arrival_window_pods_decoding:.2f})"
        for name, r in report.systems.items()
    )


def aligned(header: list[str], rows: list[list[str]], text_columns: Sequence[int] = (0,)) -> str:
    """A plain table: the `text_columns` (the first) left-aligned, the others right-aligned."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        cells = [c.ljust(w) if i in text_columns else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(cells).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def attribution_lines(report: BenchReport) -> list[str]:
    """One line per system: where its prompt tokens' cache hits went (`picker_bench.attribution`)."""
    return [f"{name}: {r.attribution.summary()}" for name, r in report.systems.items() if r.attribution is not None]


def attribution_markdown(report: BenchReport) -> list[str]:
    """The `report.md` section: per system, prompt tokens and share by category."""
    out = [
        "## Where the prompt tokens went",
        "",
        (
            "Each request's prompt tokens, split by replaying the requests in dispatch order against an LRU model "
            "of each pod's KV cache (`bench/picker_bench/attribution.py` says how): what the engine reported cached, "
            "then the misses an infinite cache would have hit, by cause, then what no earlier prompt had."
        ),
        "",
    ]
    for name, r in report.systems.items():
        a = r.attribution
        if a is None:
            continue
        out += [f"### {name}", "", "| category | tokens | share |", "|---|---|---|"]
        out += [f"| {label} | {a.tokens[key]} | {_pct(a.share(key))} |" for key, label in CATEGORIES.items()]
        out += [
            "",
            (
                f"{a.requests} requests. The cache model predicts {_pct(a.model_ratio)} "
                f"cached, and exactly the engine's cached tokens for {_pct(a.model_exact)} of the requests."
            ),
        ]
        if a.holder_busier is not None:
            out.append(
                f"Misses on another pod: {a.other_pod_requests} requests; the pod holding the longer prefix had more "
                f"requests in flight than the chosen pod in {_pct(a.holder_busier)} of them (median difference "
                f"{a.in_flight_gap_p50:+g})."
            )
        out.append("")
    return out


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """The lines of a markdown table."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def markdown(report: BenchReport, plots: dict[str, str]) -> str:
    """`report.md`: settings, the table, per-pod spread, plots."""
    header, rows = table_rows(report)
    out = [
        f"# picker bench: {report.workload}",
        "",
        (
            f"Infinite-cache bound on the prompts sent: **{_pct(report.bound_hit_ratio)}** "
            "(no router can hit more); fleet-cache bound: "
            f"**{_pct(report.fleet_bound_hit_ratio)}** (one cache of the whole fleet's KV blocks with "
            "optimal offline eviction: no router can hit more on this fleet); LRU fleet: "
            f"**{_pct(report.lru_bound_hit_ratio)}** (the same cache evicting least recently used, as engines "
            "do, prompts in arrival order: what perfect routing would hit if the fleet were one pool; a "
            "reference, not a bound)."
        ),
        "",
        (
            f"TTFT floor: **{floor_text(report.ttft_floor_s)}**, every prompt with its infinite-cache hits prefilled "
            "alone on an idle simulated engine (no router's TTFT percentiles can be lower). E2E floor: "
            f"**{floor_text(report.e2e_floor_s)}**, each answer then decoded alone on that engine."
        ),
        "",
        *markdown_table(header, rows),
        "",
        (
            "TTFT is measured from when each request was due (open loop) to its first streamed content chunk. "
            "Hit ratio = sum(cached_tokens) / sum(prompt_tokens) from the servers' usage. Hotspot = pods x the "
            "busiest pod's share of requests (1.00 = perfectly even). Decision time is the picker's "
            "`inference_extension_scheduler_e2e_duration_seconds` median bucket."
        ),
        "",
    ]
    header, rows = tenant_rows(report)
    if rows:
        out += [
            "## Per tenant and priority",
            "",
            *markdown_table(header, rows),
            "",
            (
                "Goodput = output tokens of the tenant's served requests per second of the system's whole run "
                "(first arrival to last answer), so the tenants' goodputs add up to the system's out tok/s. "
                "429: rejected (flow-control queue full, or shed); 503: expired in the flow-control queue (TTL) "
                "or no endpoint."
            ),
            "",
            "While requests arrive (from the first arrival to the last: the same window for every system, "
            "whichever run ends first), the output tok/s of the requests answered by then and, in brackets, "
            "the requests decoding per pod on average (first token to last; under overload below the pods' "
            "batch when they ran short of work): " + _arrival_window(report) + ".",
            "",
        ]
    out += [
        "## Requests per pod",
        "",
    ]
    pods = sorted({pod for r in report.systems.values() for pod in r.pods})
    if pods:
        out += ["| system | " + " | ".join(pods) + " |", "|" + "---|" * (len(pods) + 1)]
        for name, r in report.systems.items():
            cells = [
                f"{r.pods.get(p, {}).get('requests', 0)} ({r.pods.get(p, {}).get('prompt_tokens', 0) // 1000}k tok)"
                for p in pods
            ]
            out.append(f"| {name} | " + " | ".join(cells) + " |")
        out.append("")
    if any(r.attribution is not None for r in report.systems.values()):
        out += attribution_markdown(report)
    errors = {name: r.error_kinds for name, r in report.systems.items() if r.error_kinds}
    if errors:
        out += ["## Errors", ""] + [f"- {name}: {kinds}" for name, kinds in errors.items()] + [""]
    out += ["## Settings", "", "```json", json.dumps(report.settings, indent=2), "```", ""]
    out += [f"![{key}]({path})" for key, path in plots.items()]
    return "\n".join(out) + "\n"


def pyplot() -> Any:
    """`matplotlib.pyplot` on the Agg backend, or None (with a note) when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:  # picker-bench depends on it, but an install without dependencies lacks it
        print("picker bench: matplotlib is not installed, so no plots (pip install matplotlib)", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(report: BenchReport, out_dir: Path) -> dict[str, str]:
    """Write the PNG plots; return {plot key: file name} (none without matplotlib)."""
    plt = pyplot()
    written: dict[str, str] = {}
    names = list(report.systems)
    if plt is None or not names:
        return written

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in names:
        ttfts = report.systems[name].ttfts_s
        if ttfts:
            ax.plot([t * 1000 for t in ttfts], [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF: {report.workload}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    written["ttft_cdf"] = save(fig, out_dir / PLOTS["ttft_cdf"])

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ratios = [report.systems[n].hit_ratio * 100 for n in names]
    bars = ax.bar(names, ratios, color="tab:blue")
    ax.bar_label(bars, fmt="%.1f%%")
    ax.axhline(report.bound_hit_ratio * 100, color="tab:red", linestyle="--", label="infinite-cache bound")
    ax.set_ylabel("prefix cache hit ratio (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"Prefix hit ratio: {report.workload}")
    ax.legend()
    ax.tick_params(axis="x", labelrotation=20)
    written["hit_ratio"] = save(fig, out_dir / PLOTS["hit_ratio"])

    pods = sorted({pod for n in names for pod in report.systems[n].pods})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        counts = [report.systems[name].pods.get(p, {}).get("requests", 0) for p in pods]
        ax.bar([x + i * width for x in range(len(pods))], counts, width, label=name)
    ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(pods))], pods)
    ax.set_ylabel("requests")
    ax.set_title("Load spread per pod")
    ax.legend()
    written["load_spread"] = save(fig, out_dir / PLOTS["load_spread"])
    return written


def save(fig: Any, path: Path) -> str:
    """Write `fig` to `path` and close it; the file's name."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def write(report: BenchReport, out_dir: Path, with_plots: bool = True) -> dict[str, str]:
    """Write results.json, ttfts.json, report.md and (optionally) the plots; return the plots."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")
    (out_dir / "ttfts.json").write_text(json.dumps({n: r.ttfts_s for n, r in report.systems.items()}) + "\n")
    report.plots = plot(report, out_dir) if with_plots else {}
    (out_dir / "report.md").write_text(markdown(report, report.plots))
    return report.plots
