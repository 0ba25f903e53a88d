"""The overhead bench's CPU accounting (a process's own CPU and the whole machine's) and its baseline tree."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from time import perf_counter, process_time

from picker.bench.overhead import cpu_seconds, machine_cpu, tree_env


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
    assert busy <= total  # never more busy than there was time
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
