"""The multi-tenant overload workload: its tenants, burst and headers, the per-tenant numbers and
report, and the objectives the bench hands the picker."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from picker.request.openai import FAIRNESS_ID_HEADER, OBJECTIVE_HEADER
from picker_bench import cli, report, workloads
from picker_bench.loadgen import RequestResult
from picker_bench.runner import BenchPlan
from picker_bench.stats import summarize

SMALL = ["--workload", "multi-tenant", "--bounds-only", "--duration", "20", "--system-prompt-len", "16"]


def plan(tmp_path: Path, *flags: str) -> BenchPlan:
    return cli.plan_from_args(cli.build_parser().parse_args([*SMALL, "--out", str(tmp_path), *flags]))


def test_the_noisy_tenant_bursts_and_every_tenant_keeps_its_own_prefixes(tmp_path: Path) -> None:
    result = plan(tmp_path, "--rate", "3", "--burst-rate", "30", "--burst-start", "0.25", "--burst-end", "0.5")
    prompts = list(workloads.all_prompts(result.sessions))
    assert [s.start_s for s in result.sessions] == sorted(s.start_s for s in result.sessions)
    noisy = [s.start_s for s in result.sessions if s.turns[0].tenant == workloads.NOISY_TENANT]
    in_burst = sum(1 for t in noisy if 5 <= t < 10)
    assert in_burst > 100 and len(noisy) - in_burst < 30  # ~150 in 5 s, ~15 in the other 15 s
    steady = [p for p in prompts if p.tenant != workloads.NOISY_TENANT]
    assert 40 < len(steady) < 80  # 3 req/s for 20 s
    assert {p.tenant for p in prompts} == {"tenant-0", "tenant-1", "tenant-2", workloads.NOISY_TENANT}
    assert {p.objective for p in prompts if p.tenant == "tenant-0"} == {"critical"}
    assert {p.objective for p in prompts if p.tenant != "tenant-0"} == {"standard"}
    prefixes = {p.tenant: {q.messages[0] for q in prompts if q.tenant == p.tenant} for p in prompts}
    assert all(len(own) == 2 for own in prefixes.values())  # the default two system prompts each
    assert len(set().union(*prefixes.values())) == 8  # and no tenant shares one with another
    assert prompts[0].headers() == {FAIRNESS_ID_HEADER: prompts[0].tenant, OBJECTIVE_HEADER: prompts[0].objective}
    assert plan(tmp_path, "--rate", "3").sessions == plan(tmp_path, "--rate", "3").sessions  # deterministic


def test_the_plan_hands_the_workload_objectives_to_the_picker(tmp_path: Path) -> None:
    result = plan(tmp_path)
    assert dict(result.objectives) == workloads.TENANT_OBJECTIVES == {"critical": 10, "standard": 0}
    assert dict(result.settings)["objectives"] == workloads.TENANT_OBJECTIVES
    assert (
        cli.plan_from_args(
            cli.build_parser().parse_args(["--workload", "shared-prefix", "--bounds-only", "--out", str(tmp_path)])
        ).objectives
        == ()
    )  # other workloads name no objectives


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--burst-start", "0.6", "--burst-end", "0.5"], "burst_start < burst_end"),
        (["--burst-rate", "0"], "--burst-rate must be positive"),
        (["--tenants", "0"], "--tenants must be positive"),
    ],
)
def test_bad_multi_tenant_flags_are_rejected(tmp_path: Path, capsys, flags: list[str], message: str) -> None:
    assert cli.main([*SMALL, "--out", str(tmp_path), *flags]) == 2
    assert message in capsys.readouterr().err


def result(tenant: str, objective: str, due: float, ttft: float | None, error: str | None = None) -> RequestResult:
    e2e = None if error else (ttft or 0) + 1
    return RequestResult(0, 0, due, ttft, e2e, 100, 50, 0 if error else 10, "pod-0", error, tenant, objective)


def test_per_tenant_numbers_split_latency_goodput_and_each_kind_of_rejection(tmp_path: Path) -> None:
    results = [
        result("quiet", "standard", 0.0, 0.1),
        result("quiet", "standard", 1.0, 0.3),
        result("noisy", "standard", 0.5, 2.0),
        result("noisy", "standard", 0.6, None, "HTTP 429: flow control queue at capacity"),
        result("noisy", "standard", 0.7, None, "HTTP 503: request timed out in queue"),
        result("noisy", "standard", 0.8, None, "unfinished when the run ended"),
        result("vip", "critical", 2.0, 0.05),
    ]
    summary = summarize(results, 1)
    by_name = {t.tenant: t for t in summary.tenants}
    assert list(by_name) == ["noisy", "quiet", "vip"]
    noisy, quiet = by_name["noisy"], by_name["quiet"]
    assert (noisy.sent, noisy.served, noisy.rejected, noisy.expired, noisy.other_errors) == (4, 1, 1, 1, 1)
    assert quiet.ttft_p50_s == pytest.approx(0.2) and quiet.e2e_p90_s == pytest.approx(1.28)
    assert quiet.goodput_tokens_per_s == pytest.approx(20 / summary.wall_s)
    assert sum(t.goodput_tokens_per_s for t in summary.tenants) == pytest.approx(summary.output_tokens_per_s)
    # Answered by the last arrival (2.0 s): quiet's first (done at 1.1 s) and noisy's (at 3.5 s: no).
    assert summary.arrival_window_tokens_per_s == pytest.approx(10 / 2.0)
    # Decoding by 2.0 s (first token to last): quiet 0.1-1.1 and 1.3-2.0, the others after: 1.7 s of 2.
    assert summary.arrival_window_pods_decoding == pytest.approx(1.7 / 2.0)

    bench = report.BenchReport("multi-tenant", 0.5, {"objectives": workloads.TENANT_OBJECTIVES})
    bench.systems["picker:rr"] = summary
    markdown = report.markdown(bench, {})
    assert "## Per tenant and priority" in markdown
    assert "| picker:rr | vip | critical (10) | 1 | 1 | 50 | 50 |" in markdown
    assert "| picker:rr | noisy | standard (0) | 4 | 1 |" in markdown
    terminal = report.terminal_table(bench)
    assert "goodput tok/s" in terminal and "critical (10)" in terminal
    assert "while requests arrive, out tok/s (pods decoding): picker:rr 5 (0.85)" in terminal
    assert "from the first arrival to the last" in markdown and "picker:rr 5 (0.85)." in markdown

    plain = dataclasses.replace(summary, tenants=())
    bench.systems["picker:rr"] = plain
    assert "Per tenant" not in report.markdown(bench, {})  # workloads without tenants: no such table
