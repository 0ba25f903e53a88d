"""`python -m picker_bench.bbr`: the CPU per request of picker bbr and the reference bbr v1.5.0
(built from its Go module once, cached in ~/.cache/picker/bin), each behind its own Envoy in duplex
mode over a real kube-apiserver + etcd, in one short run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from picker_bench.bbr import reference_bbr_binary
from picker_bench.gobuild import GoModuleUnavailableError
from picker_bench.kube_cluster import KUBE_VERSION, MissingBinaryError, cached_binary

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_the_bench_measures_both_routers_without_errors() -> None:
    try:
        cached_binary("kube-apiserver", KUBE_VERSION)
        reference_bbr_binary()
    except (MissingBinaryError, GoModuleUnavailableError) as exc:
        pytest.fail(str(exc), pytrace=False)
    run = subprocess.run(
        [sys.executable, "-m", "picker_bench.bbr", "--seconds", "2", "--rate", "20"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout)["duplex 2KB"]
    assert set(results) == {"reference bbr", "picker bbr"}
    for router, figures in results.items():
        assert figures["errors"] == 0, router
        # CPU is read in clock ticks (10 ms): a 2 s run may read none; a figure is all that counts here
        assert figures["cpu_us_per_request"] >= 0, router
