"""`picker bench` end to end: real `picker sim`, Envoy, the picker and peer routers, as subprocesses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from picker_bench.process import wait_until

SMALL = [
    "--workload",
    "shared-prefix",
    "--pods",
    "2",
    "--profile",
    "tiny",
    "--groups",
    "4",
    "--system-prompt-len",
    "256",
    "--question-len",
    "16",
    "--output-len",
    "4",
    "--rate",
    "10",
    "--no-plots",
]


def bench(out: Path, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "picker.cli", "bench", "--out", str(out), *SMALL, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def started_pids(out: Path) -> list[int]:
    path = out / "pids"
    return [int(line.split()[0]) for line in path.read_text().splitlines()] if path.exists() else []


def alive_in_groups(pids: list[int]) -> list[int]:
    """Processes still running whose PID or process group is one the harness started."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        state, pgrp = fields[0], int(fields[2])
        if state != "Z" and (int(entry.name) in pids or pgrp in pids):
            found.append(int(entry.name))
    return found


def finish(proc: subprocess.Popen[bytes], timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"picker bench did not finish:\n{out.decode(errors='replace')}") from None
    return out.decode(errors="replace")


def envoy_upstream_requests(config: Path) -> int:
    document = yaml.safe_load(config.read_text())
    if not isinstance(document, dict):  # seen while the bench is still writing it
        return 0
    admin = document["admin"]["address"]["socket_address"]
    url = f"http://{admin['address']}:{admin['port_value']}/stats?filter=^cluster.backends.upstream_rq_total$"
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return int(r.read().decode().split(": ")[1])
    except (OSError, IndexError, ValueError):
        return 0


def test_sigint_mid_run_stops_every_child(tmp_path: Path) -> None:
    proc = bench(tmp_path, "--systems", "round-robin,least-request", "--duration", "60")
    try:
        config = tmp_path / "logs" / "envoy-0-round-robin.yaml"
        wait_until(lambda: config.exists() and envoy_upstream_requests(config) > 2, 45, "load through Envoy")
        pids = started_pids(tmp_path)
        assert len(pids) == 2  # the fleet and Envoy
        assert alive_in_groups(pids)
        proc.send_signal(signal.SIGINT)
        output = finish(proc, 30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, output
    assert "interrupted" in output and "Traceback" not in output
    assert alive_in_groups(started_pids(tmp_path)) == []


def test_short_comparison_writes_results(tmp_path: Path) -> None:
    proc = bench(tmp_path, "--systems", "round-robin,picker,sglang-round-robin", "--duration", "3")
    output = finish(proc, 120)
    assert proc.returncode == 0, output
    results = json.loads((tmp_path / "results.json").read_text())
    assert 0.5 < results["bound_hit_ratio"] < 1
    assert set(results["systems"]) == {"round-robin", "picker", "sglang-round-robin"}
    for name, system in results["systems"].items():
        assert system["requests"] > 10 and system["errors"] == 0, (name, system)
        assert 0 < system["hit_ratio"] <= results["fleet_bound_hit_ratio"] <= results["bound_hit_ratio"]
        # every request's first token comes before its last, so each TTFT quantile is at most E2E's
        assert system["ttft_p50_s"] <= system["ttft_p99_s"] <= system["e2e_p99_s"]
        assert system["ttft_p50_s"] <= system["e2e_p50_s"]
        assert set(system["pods"]) == {"sim-0", "sim-1"}  # from x-inference-pod, through every gateway
        floor = results["ttft_floor_s"]  # a lower bound for every system
        assert 0 < floor["p50"] <= system["ttft_p50_s"] and floor["p99"] <= system["ttft_p99_s"], (name, floor)
        e2e_floor = results["e2e_floor_s"]  # ... and for completion time, above the TTFT floor
        assert floor["p50"] < e2e_floor["p50"] <= system["e2e_p50_s"], (name, e2e_floor)
        requests = (tmp_path / "requests" / f"{name}.jsonl").read_text().splitlines()
        assert len(requests) == system["requests"] and json.loads(requests[0])["pod"] in system["pods"]
    assert results["systems"]["picker"]["decision_time"]["count"] >= results["systems"]["picker"]["requests"]
    page = (tmp_path / "requests" / "picker.metrics.txt").read_text()  # the picker's view, kept for analysis
    assert "inference_extension_scheduler_e2e_duration_seconds_count" in page
    assert "round-robin" in output and "results.json" in output
    assert len(started_pids(tmp_path)) == 7  # a fleet and a gateway per system, plus the picker itself
    assert alive_in_groups(started_pids(tmp_path)) == []


def test_a_system_that_cannot_start_is_reported_and_cleaned_up(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(
        "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
        "plugins:\n- type: no-such-plugin\n"
    )
    proc = bench(tmp_path / "out", "--systems", "picker:bad", "--picker-config", f"bad={config}", "--duration", "2")
    output = finish(proc, 60)
    assert proc.returncode == 1, output
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["systems"] == {} and "exited early" in results["failures"]["picker:bad"]
    assert "Traceback" not in output
    pids = started_pids(tmp_path / "out")
    assert len(pids) == 2 and alive_in_groups(pids) == []  # the fleet was started, and stopped


def test_picker_replicas_behind_one_envoy_with_a_shared_store(tmp_path: Path) -> None:
    proc = bench(tmp_path, "--systems", "picker@2+store", "--duration", "3")
    output = finish(proc, 120)
    assert proc.returncode == 0, output
    system = json.loads((tmp_path / "results.json").read_text())["systems"]["picker@2+store"]
    assert system["requests"] > 10 and system["errors"] == 0, system
    assert system["decision_time"]["count"] >= system["requests"]  # both replicas' pages, summed
    names = [line.split()[1] for line in (tmp_path / "pids").read_text().splitlines()]
    assert names == ["sim-0-picker", "redis-0-picker", "picker-0-picker-0", "picker-0-picker-1", "envoy-0-picker"]
    for n in range(2):  # each replica shared its state through the system's own redis-server
        assert (
            "sharing state through redis://127.0.0.1:" in (tmp_path / "logs" / f"picker-0-picker-{n}.log").read_text()
        )
    assert alive_in_groups(started_pids(tmp_path)) == []


def capacity_search(out: Path, slo_ttft_p90: str) -> tuple[str, dict[str, Any]]:
    """A short capacity search of round robin and the picker: rate steps 4 and 8 req/s, 2 s each."""
    proc = bench(
        out,
        "--systems",
        "round-robin,picker",
        "--capacity",
        "--slo-ttft-p90",
        slo_ttft_p90,
        "--rates",
        "4,8",
        "--duration",
        "2",
    )
    output = finish(proc, 150)
    assert proc.returncode == 0, output
    assert "Traceback" not in output
    return output, json.loads((out / "results.json").read_text())


def test_capacity_search_with_a_generous_slo_passes_every_step(tmp_path: Path) -> None:
    output, results = capacity_search(tmp_path, "30")
    assert results["mode"] == "capacity" and results["slo"] == {"ttft_p90_s": 30.0, "tpot_p90_s": None}
    assert results["settings"]["rates"] == [4.0, 8.0] and results["failures"] == {}
    assert set(results["systems"]) == {"round-robin", "picker"}
    for name, system in results["systems"].items():
        assert (system["capacity"], system["limit_found"]) == (8.0, False), (name, system)
        assert [step["rate"] for step in system["steps"]] == [4.0, 8.0]
        for step in system["steps"]:
            assert step["passed"] and step["errors"] == 0 and step["sent"] > 0, (name, step)
            # every request met the SLO, so goodput is the offered rate
            assert step["goodput_rps"] == step["offered_rps"] > 0
            assert step["ttft_p50_s"] <= step["ttft_p90_s"] <= 30 and step["tpot_p90_s"] > 0
            requests = (tmp_path / "requests" / name / f"{step['rate']:g}.jsonl").read_text().splitlines()
            assert len(requests) == step["sent"]
        assert system["goodput_rps"] == system["steps"][1]["goodput_rps"]
    assert "capacity at TTFT p90 <= 30 s, no errors" in output and ">= 8" in output
    assert "| picker | >= 8 |" in (tmp_path / "report.md").read_text()
    # each step had its own cold fleet and gateway: 2 steps x (fleet, Envoy) + 2 x (fleet, picker, Envoy)
    assert len(started_pids(tmp_path)) == 10
    assert alive_in_groups(started_pids(tmp_path)) == []


def test_capacity_search_with_an_impossible_slo_fails_at_the_first_step(tmp_path: Path) -> None:
    output, results = capacity_search(tmp_path, "0.000001")
    for name, system in results["systems"].items():
        assert (system["capacity"], system["goodput_rps"], system["limit_found"]) == (None, None, True), name
        (step,) = system["steps"]  # the search stopped there: 8 req/s was never run
        assert step["rate"] == 4.0 and not step["passed"] and step["goodput_rps"] == 0.0
        assert step["verdict"].startswith("TTFT p90 ") and step["verdict"].endswith(" s > 1e-06 s")
    assert "round-robin @ 4 req/s: FAIL" in output and "< 4" in output
    assert len(started_pids(tmp_path)) == 5
    assert alive_in_groups(started_pids(tmp_path)) == []
