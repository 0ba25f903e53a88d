"""`picker bench`'s reference-epp system: the reference EPP v1.5.0 binary (built from its Go module
once, cached in ~/.cache/picker/bin) over a real kube-apiserver + etcd, behind the bench's Envoy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from picker_bench.gobuild import GoModuleUnavailableError
from picker_bench.kube_cluster import KUBE_VERSION, MissingBinaryError, cached_binary
from picker_bench.reference_epp import reference_epp_binary
from tests.integration.test_bench_cli import alive_in_groups, bench, finish, started_pids

# On a fresh machine the binary is built first: about 3 minutes of CPU on 2 cores
# (tools/install-test-binaries.sh builds it before the suite, so `make test` does not wait here).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def reference_binary() -> Path:
    try:
        cached_binary("kube-apiserver", KUBE_VERSION)
        return reference_epp_binary()
    except (MissingBinaryError, GoModuleUnavailableError) as exc:
        pytest.fail(str(exc), pytrace=False)


def test_the_reference_epp_routes_the_bench_load_to_the_pods(tmp_path: Path, reference_binary: Path) -> None:
    proc = bench(tmp_path, "--systems", "reference-epp", "--reference-epp", str(reference_binary), "--duration", "3")
    output = finish(proc, 180)
    assert proc.returncode == 0, output
    system = json.loads((tmp_path / "results.json").read_text())["systems"]["reference-epp"]
    assert system["requests"] > 10 and system["errors"] == 0, system
    # From the sims' x-inference-pod. Which of them served is the reference's choice: on one shared
    # prefix its prefix scorer may keep every request on one pod.
    assert system["pods"] and set(system["pods"]) <= {"sim-0", "sim-1"}
    # Its own scheduler histogram, read from its /metrics: it chose the pod of every request.
    assert system["decision_time"]["count"] >= system["requests"]
    names = [line.split()[1] for line in (tmp_path / "pids").read_text().splitlines()]
    assert names == [
        "sim-0-reference-epp",
        "etcd-0-reference-epp",
        "kube-apiserver-0-reference-epp",
        "reference-epp-0-reference-epp",
        "envoy-0-reference-epp",
    ]
    assert alive_in_groups(started_pids(tmp_path)) == []
    # It scraped the sims' pages, and of the metrics its default vLLM engine config reads only
    # the LoRA one was missing (the sim serves none, as vLLM without adapters): queue, running
    # and KV-cache usage reached its scorers.
    lines = (tmp_path / "logs" / "reference-epp-0-reference-epp.log").read_text().splitlines()
    log = [json.loads(line) for line in lines if line.startswith("{")]  # zap's JSON, not client-go's klog
    scrape_errors = {entry["error"] for entry in log if entry.get("msg") == "extract failed"}
    assert scrape_errors == {'metric family "vllm:lora_requests_info" not found'}, scrape_errors
