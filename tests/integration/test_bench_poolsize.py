"""`python -m picker_bench.poolsize`, tiny: pools of 8 and 16 endpoints with real pages to
scrape, real Envoy, real picker, and the scrape load of 16 (at 8, a second picker scraping 8
more); the report has a row per pool, the figures make sense, and so do the ratios of 16 to 8."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from statistics import median

import pytest

pytestmark = [pytest.mark.slow]

SCRAPES_PER_ENDPOINT = 20  # picker's default 50 ms interval


def test_the_poolsize_benchmark_reports_a_sane_row(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    argv = [sys.executable, "-m", "picker_bench.poolsize", "--endpoints", "8,16", "--seconds", "2"]
    argv += ["--idle-seconds", "1", "--rate", "100", "--repeats", "2", "--scrape-load", "16"]
    argv += ["--json", str(out)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    row, larger = report["rows"]
    assert (row["endpoints"], row["epp"], row["errors"], row["rounds"], row["scrape_load"]) == (8, "picker", 0, 2, 16)
    # Every endpoint scraped about every 50 ms (the pages are real: a failed scrape is not counted),
    # the pool's by the routing picker, the 8 others by the second.
    for scrapes in (row["scrapes_per_s"], row["load_scrapes_per_s"]):
        assert 0.5 * 8 * SCRAPES_PER_ENDPOINT <= scrapes <= 1.5 * 8 * SCRAPES_PER_ENDPOINT, row
    assert 0 <= row["idle_cores"] < 2 and 0 <= row["backend_idle_cores"] < 2, row
    assert 0 < row["p50_ms"] <= row["p99_ms"], row
    assert 10 < row["rss_mb"] < 2000 and 0 < row["start_to_serving_s"] < 60, row
    assert (larger["endpoints"], larger["scrape_load"], larger["load_scrapes_per_s"]) == (16, 16, None), larger
    for line in ("|     8 | picker", "|    16 | picker", "  picker 16 / 8 endpoints: added p99 "):
        assert sum(text.startswith(line) for text in result.stdout.splitlines()) == 1, result.stdout
    # Each measure at 16 over 8 from the two rounds of each, inside its resampled interval.
    ratios = {r["measure"]: r for r in report["ratios"]}
    assert set(ratios) == {"added p99", "p99", "CPU per request"}, report["ratios"]
    for ratio in ratios.values():
        assert (ratio["endpoints"], ratio["base_endpoints"]) == (16, 8), ratio
        assert ratio["low"] <= ratio["ratio"] <= ratio["high"], ratio
    p99s = [r["round_p99_ms"] for r in report["rows"]]
    assert ratios["p99"]["ratio"] == pytest.approx(median(p99s[1]) / median(p99s[0])), report
