"""The overhead bench's CPU accounting (a process's own CPU and the whole machine's), its baseline
tree and its rounds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from time import perf_counter, process_time

import pytest

from picker_bench.overhead import cpu_seconds, machine_cpu, median_over, tree_env, with_added_latency


def _burn(seconds: float) -> None:
    end = process_time() + seconds
    while process_time() < end:
        pass


def test_busy_machine_time_covers_the_cpu_this_process_burns() -> None:
    busy_before, total_before = machine_cpu()
    own_before = cpu_seconds(os.getpid())
    started = perf_counter()
    _burn(0.3)
    elapsed = perf_counter() - started
    busy_after, total_after = machine_cpu()
    own = cpu_seconds(os.getpid()) - own_before
    busy, total = busy_after - busy_before, total_after - total_before
    assert own >= 0.2  # clock ticks are 10 ms: allow rounding
    assert busy >= own - 0.05  # the machine was at least as busy as this process
    assert busy <= total + 1e-9  # never more busy than there was time (equal when fully busy, up to rounding)
    assert total >= elapsed * 0.5  # all cores' time passed, at least most of one core's


def test_a_baseline_tree_runs_its_own_sources_not_the_checkout_it_is_started_from(tmp_path: Path) -> None:
    # `python -m` from a checkout puts the checkout first on sys.path: the baseline must still win.
    for tree, marker in ((tmp_path / "checkout", "checkout"), (tmp_path / "baseline", "baseline")):
        (tree / "probe_tree").mkdir(parents=True)
        (tree / "probe_tree" / "__init__.py").write_text("")
        (tree / "probe_tree" / "__main__.py").write_text(f"print({marker!r})")
    out = subprocess.run(
        [sys.executable, "-m", "probe_tree"],
        cwd=tmp_path / "checkout",
        env=tree_env(tmp_path / "baseline"),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert out.strip() == "baseline"


def test_rounds_report_each_figures_median_and_latency_added_within_its_own_round() -> None:
    def round_of(base: float, gate_off: float, gate_on: float, cpu: float) -> dict[str, dict[str, dict[str, float]]]:
        return with_added_latency(
            {
                "envoy alone": {
                    "2KB": {"serial_p50_ms": base / 4, "p50_ms": base, "p99_ms": base, "picker_cpu_us": 0.0}
                },
                "off": {
                    "2KB": {
                        "serial_p50_ms": gate_off / 4,
                        "p50_ms": gate_off,
                        "p99_ms": gate_off * 2,
                        "picker_cpu_us": cpu,
                    }
                },
                "on": {
                    "2KB": {
                        "serial_p50_ms": gate_on / 4,
                        "p50_ms": gate_on,
                        "p99_ms": gate_on * 2,
                        "picker_cpu_us": cpu + 10,
                    }
                },
            }
        )

    # the machine's state shifts every variant of a round alike; the added latency cancels it
    rounds = [round_of(1.0, 2.0, 2.1, 100), round_of(5.0, 6.0, 6.2, 300), round_of(0.5, 1.5, 1.6, 200)]
    medians = median_over(rounds)
    assert medians["on"]["2KB"]["added_p50_ms"] == 1.1 and medians["off"]["2KB"]["added_p50_ms"] == 1.0
    assert medians["on"]["2KB"]["p50_ms"] == 2.1 and medians["on"]["2KB"]["picker_cpu_us"] == 210
    assert medians["on"]["2KB"]["added_serial_p50_ms"] == pytest.approx(0.275)
    assert medians["envoy alone"]["2KB"]["added_p50_ms"] == 0.0
