"""`picker bench --capacity`: the per-step verdict, the rate search, its outputs and its flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from picker_bench import capacity, cli
from picker_bench.capacity import CapacityReport, Slo, StepResult, SystemCapacity, capacity_step, judge, next_rate
from picker_bench.loadgen import RequestResult


def request(ttft: float | None, e2e: float | None = None, output: int = 11, error: str | None = None) -> RequestResult:
    return RequestResult(0, 0, 0.0, ttft, e2e, 100, 50, output, "sim-0", error)


def step(rate: float, passed: bool, ttft_p90: float = 0.1, goodput: float | None = None) -> StepResult:
    return StepResult(
        rate=rate,
        offered_rps=rate,
        sent=10,
        errors=0,
        ttft_p50_s=ttft_p90 / 2,
        ttft_p90_s=ttft_p90,
        tpot_p90_s=0.01,
        e2e_p50_s=ttft_p90,
        hit_ratio=0.5,
        goodput_rps=rate if goodput is None else goodput,
        passed=passed,
        verdict="within the SLO" if passed else "TTFT p90 too high",
    )


def test_request_tpot_is_the_time_per_token_after_the_first() -> None:
    assert capacity.request_tpot_s(request(0.2, 1.2, output=11)) == pytest.approx(0.1)
    assert capacity.request_tpot_s(request(0.2, 0.2, output=1)) is None  # one token: no time between tokens
    assert capacity.request_tpot_s(request(None, error="HTTP 503: x")) is None


def test_a_step_passes_only_within_every_threshold_and_without_errors() -> None:
    fast = [request(0.1 + i / 100, 0.6 + i / 100) for i in range(10)]  # TTFT p90 0.181 s, TPOT 0.05 s
    assert judge(4, fast, Slo(0.2), window_s=2.0, pods=2).passed
    passed = judge(4, fast, Slo(0.2, tpot_p90_s=0.06), window_s=2.0, pods=2)
    assert passed.passed and passed.verdict == "within the SLO"
    assert (passed.sent, passed.offered_rps, passed.goodput_rps) == (10, 5.0, 5.0)
    assert passed.tpot_p90_s == pytest.approx(0.05)

    slow_ttft = judge(4, fast, Slo(0.155), window_s=2.0, pods=2)
    assert not slow_ttft.passed and slow_ttft.verdict == "TTFT p90 0.181 s > 0.155 s"
    # Goodput counts each request against the threshold: 6 of the 10 came within 0.155 s.
    assert slow_ttft.goodput_rps == pytest.approx(3.0)

    slow_tpot = judge(4, fast, Slo(0.2, tpot_p90_s=0.04), window_s=2.0, pods=2)
    assert not slow_tpot.passed and slow_tpot.verdict == "TPOT p90 0.05 s > 0.04 s"
    assert slow_tpot.goodput_rps == 0.0

    one_error = judge(4, [*fast, request(None, error="HTTP 503: no healthy upstream")], Slo(0.2), 2.0, 2)
    assert not one_error.passed and one_error.verdict == "1 errors" and one_error.errors == 1
    assert one_error.goodput_rps == pytest.approx(5.0)  # the ten served within the SLO still count

    empty = judge(4, [], Slo(0.2), 2.0, 2)
    assert not empty.passed and empty.verdict == "no requests"


def test_search_runs_rates_in_order_and_stops_at_the_first_failure() -> None:
    rates = (8.0, 2.0, 4.0, 6.0)  # given in any order, run increasing
    assert next_rate([], rates, refine=0) == 2.0
    assert next_rate([step(2, True)], rates, refine=0) == 4.0
    assert next_rate([step(2, True), step(4, True)], rates, refine=0) == 6.0
    assert next_rate([step(2, True), step(4, True), step(6, False)], rates, refine=0) is None  # 8 is never run
    all_passed = [step(r, True) for r in (2, 4, 6, 8)]
    assert next_rate(all_passed, rates, refine=3) is None  # no failure: nothing to bisect
    assert next_rate([step(2, False)], rates, refine=3) is None  # no passing rate to bisect from


def test_search_bisects_between_the_last_pass_and_the_first_failure() -> None:
    rates = (2.0, 4.0, 6.0, 8.0)
    steps = [step(2, True), step(4, True), step(6, False)]
    assert next_rate(steps, rates, refine=2) == 5.0
    steps.append(step(5, True))
    assert next_rate(steps, rates, refine=2) == 5.5
    steps.append(step(5.5, False))
    assert next_rate(steps, rates, refine=2) is None  # two bisections done
    assert capacity_step(steps) == steps[3]


def test_whole_search_against_a_fleet_that_saturates() -> None:
    """The search loop as `run_capacity` drives it, against a fleet whose TTFT p90 grows with the
    rate past the SLO at 7 req/s."""

    def measure(rate: float) -> StepResult:
        return step(rate, passed=rate < 7, ttft_p90=0.1 * rate)

    for refine, capacity_rate, runs in ((0, 6.0, [2, 4, 6, 8]), (3, 6.75, [2, 4, 6, 8, 7, 6.5, 6.75])):
        steps: list[StepResult] = []
        while (rate := next_rate(steps, (2.0, 4.0, 6.0, 8.0, 10.0), refine)) is not None:
            steps.append(measure(rate))
        assert [s.rate for s in steps] == runs
        best = capacity_step(steps)
        assert best is not None and best.rate == capacity_rate


def test_capacity_is_below_the_lowest_failure_even_if_a_higher_rate_passed() -> None:
    noisy = [step(2, True), step(4, False), step(6, True)]
    assert capacity_step(noisy) == noisy[0]
    assert capacity_step([step(2, False)]) is None
    assert capacity_step([]) is None


def test_results_json_report_and_plot(tmp_path: Path) -> None:
    report = CapacityReport("shared-prefix", Slo(0.5, 0.05), "req/s", {"rates": [2, 4, 6]})
    report.systems["round-robin"] = SystemCapacity([step(2, True, 0.2, goodput=1.9), step(4, False, 0.9)])
    report.systems["picker"] = SystemCapacity([step(2, True, 0.1), step(4, True, 0.2), step(6, True, 0.3)])
    report.systems["slow"] = SystemCapacity([step(2, False, 2.0)])
    report.failures["sglang-cache-aware"] = "at 2 req/s: exited early"
    capacity.write(report, tmp_path)
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["mode"] == "capacity" and data["slo"] == {"ttft_p90_s": 0.5, "tpot_p90_s": 0.05}
    assert data["rate_unit"] == "req/s" and data["failures"] == {"sglang-cache-aware": "at 2 req/s: exited early"}
    rr, picker, slow = (data["systems"][name] for name in ("round-robin", "picker", "slow"))
    assert (rr["capacity"], rr["goodput_rps"], rr["limit_found"]) == (2, 1.9, True)
    assert (picker["capacity"], picker["limit_found"]) == (6, False)
    assert (slow["capacity"], slow["goodput_rps"]) == (None, None)
    assert [s["rate"] for s in rr["steps"]] == [2, 4] and rr["steps"][1]["passed"] is False
    assert set(rr["steps"][0]) >= {"ttft_p50_s", "ttft_p90_s", "tpot_p90_s", "e2e_p50_s", "errors", "goodput_rps"}
    assert (tmp_path / capacity.PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.plots == {"capacity": capacity.PLOT}
    md = (tmp_path / "report.md").read_text()
    assert "TTFT p90 <= 0.5 s, TPOT p90 <= 0.05 s" in md and "![capacity](capacity.png)" in md
    text = capacity.terminal_text(report)
    summary = text.split("capacity at", 1)[1].splitlines()
    assert [line.split()[:2] for line in summary[3:]] == [
        ["round-robin", "2"],
        ["picker", ">="],  # no step failed: the capacity is at least the highest rate run
        ["slow", "<"],
        ["sglang-cache-aware", "failed:"],
    ]
    assert "fail: TTFT p90 too high" in text


def test_rates_from_the_flags() -> None:
    def rates(*argv: str) -> tuple[float, ...]:
        return cli.capacity_rates(cli.build_parser().parse_args(["--workload", "shared-prefix", *argv]))

    assert rates("--rates", "8,2,4,4") == (2.0, 4.0, 8.0)
    assert rates("--rate", "4", "--rate-steps", "3", "--rate-factor", "2") == (4.0, 8.0, 16.0)
    assert rates("--rate-steps", "2") == (cli.DEFAULT_RATES["shared-prefix"], cli.DEFAULT_RATES["shared-prefix"] * 1.5)
    trace = cli.build_parser().parse_args(["--workload", "t.jsonl", "--speed", "2", "--rate-steps", "2"])
    assert cli.capacity_rates(trace) == (2.0, 3.0)  # a trace's steps are replay speeds


def test_capacity_plan_generates_each_rate_and_the_window_is_the_step_duration(tmp_path: Path) -> None:
    argv = ["--capacity", "--slo-ttft-p90", "1", "--systems", "round-robin", "--workload", "shared-prefix"]
    args = cli.build_parser().parse_args([*argv, "--rates", "5,10", "--duration", "4", "--out", str(tmp_path)])
    plan = cli.capacity_plan_from_args(args)
    assert (plan.rates, plan.window_s, plan.slo) == ((5.0, 10.0), 4.0, Slo(1.0))
    assert len(plan.bench.sessions) == len(plan.sessions_at(5.0))  # the plan carries the lowest rate's load
    assert len(plan.sessions_at(10.0)) > len(plan.sessions_at(5.0))
    assert all(s.start_s < 4.0 for s in plan.sessions_at(10.0))
    assert "rate" not in dict(plan.bench.settings)  # each step's rate is in the results instead


CAPACITY = ["--capacity", "--systems", "round-robin", "--workload", "shared-prefix"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (CAPACITY, "--capacity needs a positive --slo-ttft-p90"),
        ([*CAPACITY, "--slo-ttft-p90", "0"], "--capacity needs a positive --slo-ttft-p90"),
        ([*CAPACITY, "--slo-ttft-p90", "1", "--slo-tpot-p90", "-1"], "--slo-tpot-p90 must be positive"),
        ([*CAPACITY, "--slo-ttft-p90", "1", "--rates", "2,x"], "not comma-separated numbers"),
        ([*CAPACITY, "--slo-ttft-p90", "1", "--rates", "0,2"], "--rates must be positive"),
        ([*CAPACITY, "--slo-ttft-p90", "1", "--rate-factor", "1"], "--rate-factor must be above 1"),
        ([*CAPACITY, "--slo-ttft-p90", "1", "--rate-steps", "0"], "--rate-steps must be at least 1"),
        ([*CAPACITY, "--slo-ttft-p90", "1", "--refine", "-1"], "--refine must not be negative"),
        ([*CAPACITY, "--slo-ttft-p90", "1", "--bounds-only"], "do not go together"),
        ([*CAPACITY, "--slo-ttft-p90", "1", "--pods", "0"], "--pods"),
        (["--systems", "round-robin", "--workload", "shared-prefix", "--slo-ttft-p90", "1"], "needs --capacity"),
        (["--systems", "round-robin", "--workload", "shared-prefix", "--rates", "1,2"], "--rates needs --capacity"),
    ],
)
def test_capacity_flags_reject_bad_input_without_a_traceback(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert cli.main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "pids").exists()  # nothing was started


def test_a_traces_steps_are_replay_speeds_and_its_window_its_last_arrival(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": 600, "output_length": 4, "hash_ids": [t, t + 1]}) + "\n"
            for t in (0, 1000, 2000, 3000)
        )
    )
    argv = ["--capacity", "--slo-ttft-p90", "1", "--systems", "round-robin", "--workload", str(trace)]
    args = cli.build_parser().parse_args([*argv, "--rates", "1,2", "--duration", "1.5", "--out", str(tmp_path)])
    plan = cli.capacity_plan_from_args(args)
    assert (plan.rate_unit, plan.window_s) == ("x speed", None)
    assert [s.start_s for s in plan.sessions_at(1.0)] == [0.0, 1.0]
    assert [s.start_s for s in plan.sessions_at(2.0)] == [0.0, 0.5, 1.0]
