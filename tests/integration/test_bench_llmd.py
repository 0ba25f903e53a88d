"""`picker bench`'s llmd and llmd-precise systems: llm-d's scheduler v0.4.0 (built from its Go
module once, cached in ~/.cache/picker/bin) over a real kube-apiserver + etcd, behind the bench's
Envoy, beside picker:precise, on a fleet with one address per pod whose engines send vLLM's KV
events (sha256_cbor block hashes) to llm-d's bound subscriber."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from picker.config.builtin_configs import BUILTIN_DIR
from tests.integration.test_bench_cli import alive_in_groups, bench, finish, started_pids

PICKER_PRECISE = BUILTIN_DIR / "picker-precise.yaml"

# On a fresh machine the binary is built first: about 20 minutes of CPU on 2 cores (the Rust
# tokenizers library, then the Go build; tools/install-test-binaries.sh builds it before the
# suite, so `make test` does not wait here).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]


def counter(page: str, name: str, labels: str = "") -> float:
    """The sum of a counter's samples on a /metrics page whose labels contain `labels`."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{(?P<labels>[^}}]*)}})? (?P<value>\S+)$", re.MULTILINE)
    return sum(float(m["value"]) for m in pattern.finditer(page) if labels in (m["labels"] or ""))


def test_llmd_approximate_and_precise_beside_picker_precise(tmp_path: Path, llmd_binary: Path) -> None:
    systems = "llmd,llmd-precise,picker:precise"
    proc = bench(
        tmp_path,
        *("--systems", systems, "--picker-config", f"precise={PICKER_PRECISE}", "--llmd-epp", str(llmd_binary)),
        *("--distinct-hosts", "--epp-log-verbosity", "4", "--duration", "4"),
    )
    output = finish(proc, 600)
    assert proc.returncode == 0, output
    report = json.loads((tmp_path / "results.json").read_text())
    # Every fleet hashes blocks as llm-d's precise config says (its hashSeed), on one address per pod.
    assert report["settings"]["fleet"]["hash_seed"] == "42" and report["settings"]["fleet"]["distinct_hosts"]
    results = report["systems"]
    for name in systems.split(","):
        assert results[name]["requests"] > 10 and results[name]["errors"] == 0, (name, results[name])
        # Its own scheduler histogram, read from its /metrics: it chose the pod of every request.
        assert results[name]["decision_time"]["count"] >= results[name]["requests"], name
    names = [line.split()[1] for line in (tmp_path / "pids").read_text().splitlines()]
    assert "llmd-epp-0-llmd" in names and "llmd-epp-1-llmd-precise" in names, names
    assert alive_in_groups(started_pids(tmp_path)) == []
    logs = tmp_path / "logs"
    pages = tmp_path / "requests"

    # llm-d precise indexed the engines' events (BlockStored by topic kv@<pod IP>@<model>) and
    # found requests' blocks on a pod: its block keys are the engines' sha256_cbor hashes.
    llmd = (pages / "llmd-precise.metrics.txt").read_text()
    assert counter(llmd, "kvcache_index_admissions_total") > 0
    assert counter(llmd, "kvcache_index_lookup_hits_total") > 0
    # ... and its scores name the pods holding them by address: at most the 16 blocks (256 tokens)
    # of a group's shared prefix (the role markers and its system prompt; the question differs),
    # all 16 once a pod has served the group. Which pods those are is llm-d's choice: it may keep
    # every group on one pod in a 4 s run.
    log = (logs / "llmd-epp-1-llmd-precise.log").read_text().splitlines()
    # zap's console encoding: time, level, logger, caller, message, then the fields as JSON
    scores = [json.loads(line.split("\t")[-1])["scores"] for line in log if "\tGot pod scores\t" in line]
    assert len(scores) >= results["llmd-precise"]["requests"]
    named = [(ip, blocks) for score in scores for ip, blocks in (score or {}).items()]  # null: under a block
    assert named and {ip for ip, _ in named} <= {"127.0.0.1", "127.0.0.2"}, named
    assert max(blocks for _, blocks in named) == 16 and min(blocks for _, blocks in named) > 0, named

    # picker:precise read its own fleet's events (each pod binds its publisher) from both pods.
    picker = (pages / "picker-precise.metrics.txt").read_text()
    for pod in ("127.0.0.1", "127.0.0.2"):
        assert counter(picker, "picker_kv_events_total", f'endpoint="{pod}:') > 0, pod
