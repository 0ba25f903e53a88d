"""`picker_bench.placement`: what placement alone can do for hits over per-pod LRU caches."""

from __future__ import annotations

from pathlib import Path

import pytest

from picker_bench import cli
from picker_bench.placement import MATURITY, placement_results

SHARED = (1, 2, 3, 4)  # a prefix every third prompt repeats


def one_off(n: int) -> tuple[int, ...]:
    return tuple(1000 + 10 * n + j for j in range(4))


def workload(prompts: int) -> list[tuple[tuple[int, ...], int]]:
    """Every third prompt the shared prefix (all of it can hit), the others one-offs that would
    push it out of a 6-block cache."""
    return [(SHARED, 4) if n % 3 == 0 else (one_off(n), 4) for n in range(prompts)]


def test_keeping_one_offs_away_from_a_reused_prefix_keeps_its_hits_and_affinity_does_not() -> None:
    results = placement_results(workload(300), pods=2, capacity_blocks=6, block_tokens=16)
    affinity, oracle = results["affinity"], results["future-oracle"]
    # Two one-offs between repeats, spread over both pods by work: the prefix is evicted often.
    assert affinity.hit_ratio < 0.2
    # Knowing the one-offs never come back, they all go to one pod, the prefix hits on the other.
    assert oracle.hit_ratio == pytest.approx(99 * 4 / 1200, abs=0.01)
    assert oracle.imbalance > affinity.imbalance >= 1.0


def test_the_reuse_class_placement_cannot_tell_a_prefix_from_one_offs_of_its_class() -> None:
    # The prefix's first prompt looks like the one-offs (nothing cached, short): once a class's
    # rate is judged (after MATURITY prompts) it goes where they go.
    results = placement_results(workload(3 * MATURITY), pods=2, capacity_blocks=6, block_tokens=16)
    assert 0.0 <= results["reuse-class"].hit_ratio <= results["future-oracle"].hit_ratio


def test_one_pod_has_no_placement_to_choose() -> None:
    with pytest.raises(ValueError, match="two pods"):
        placement_results(workload(3), pods=1, capacity_blocks=6, block_tokens=16)


def test_bounds_only_reports_placement(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--workload", "shared-prefix", "--bounds-only", "--duration", "5", "--rate", "4", "--pods", "2"]
    assert cli.main([*flags, "--out", str(tmp_path)]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("placement alone, load aside: affinity ")
    assert "reuse-class" in line and "future-oracle" in line
