"""`python -m picker_bench.startup` over a real kube-apiserver + etcd: it reports a row per setup."""

from __future__ import annotations

import subprocess
import sys

import pytest

from picker_bench.kube_cluster import KUBE_VERSION, MissingBinaryError, cached_binary

pytestmark = [pytest.mark.slow]


def test_the_startup_benchmark_reports_each_setup() -> None:
    try:
        cached_binary("kube-apiserver", KUBE_VERSION)
    except MissingBinaryError as exc:
        pytest.fail(str(exc), pytrace=False)
    argv = [sys.executable, "-m", "picker_bench.startup", "--endpoints", "16", "--runs", "1"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {line[:30].strip(): line[30:].split() for line in result.stdout.splitlines()[2:]}
    assert rows.keys() == {"picker, InferencePool", "picker, --endpoints"}, result.stdout
    for median, minimum, maximum, cpu, runs in rows.values():
        assert 0 < float(minimum) <= float(median) <= float(maximum) and float(cpu) > 0 and runs == "1"
