"""A short soak (the `python -m picker_bench.soak` command, 30 s): nothing lost, nothing grows."""

from __future__ import annotations

from pathlib import Path

import pytest

from picker_bench.soak import SoakOptions, run_soak

pytestmark = pytest.mark.slow


def test_thirty_second_soak_loses_nothing_and_stays_bounded(log_dir: Path) -> None:
    options = SoakOptions(
        seconds=30, rate=20, pods=3, warmup_s=6, window_s=6, lru_capacity=200, log_dir=log_dir / "soak"
    )
    report = run_soak(options)
    assert report.sent >= 550
    assert report.lost == 0, report.summary()
    assert report.by_kind.get("bad-request", 0) > 0 and report.by_kind.get("streaming", 0) > 0
    # The index filled and then evicted rather than grew: the capacity was reached, never passed.
    assert report.index_max == report.index_capacity, report.summary()
    # Every check of the command holds (RSS, index, nothing left open), except the drift of p99
    # between 6 s windows of ~120 decisions, which CPU contention on a shared CI machine can
    # move by a histogram bucket: decision time is the command's to judge (and the benchmarks'),
    # not a test's. Here the picker decides in every window: no stall, no stop.
    assert [f for f in report.failures if not f.startswith("p99")] == [], report.summary()
    assert report.windows and all(w.p99_decision_ms is not None for w in report.windows if w.requests), report.summary()
