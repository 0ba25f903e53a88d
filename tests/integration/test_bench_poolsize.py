"""`python -m picker_bench.poolsize`, tiny: one pool of 8 endpoints with real pages to scrape,
real Envoy, real picker; the report has its row, and the figures make sense."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

SCRAPES_PER_ENDPOINT = 20  # picker's default 50 ms interval


def test_the_poolsize_benchmark_reports_a_sane_row(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    argv = [sys.executable, "-m", "picker_bench.poolsize", "--endpoints", "8", "--seconds", "2"]
    argv += ["--idle-seconds", "1", "--rate", "100", "--repeats", "2", "--json", str(out)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    [row] = json.loads(out.read_text())
    assert (row["endpoints"], row["epp"], row["errors"], row["rounds"]) == (8, "picker", 0, 2)
    # Every endpoint scraped about every 50 ms (the pages are real: a failed scrape is not counted).
    assert 0.5 * 8 * SCRAPES_PER_ENDPOINT <= row["scrapes_per_s"] <= 1.5 * 8 * SCRAPES_PER_ENDPOINT, row
    assert 0 <= row["idle_cores"] < 2 and 0 <= row["backend_idle_cores"] < 2, row
    assert 0 < row["p50_ms"] <= row["p99_ms"], row
    assert 10 < row["rss_mb"] < 2000 and 0 < row["start_to_serving_s"] < 60, row
    table_rows = [line for line in result.stdout.splitlines() if line.startswith("|     8 | picker")]
    assert len(table_rows) == 1, result.stdout
