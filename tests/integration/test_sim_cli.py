"""`picker sim` as a process: the ready protocol, addresses, clean stop, bad flags."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request

from tests.sim_fixtures import start_sim, stop_process

LINE = re.compile(r"^pod (\S+) http://([\d.]+):(\d+)(?: kv-events tcp://([\d.]+):(\d+))? role both$")


def _get(url: str) -> tuple[int, dict[str, str], bytes]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status, dict(resp.headers), resp.read()


def test_pods_lines_then_ready_and_sigterm_stops_cleanly() -> None:
    proc, lines = start_sim(
        [
            "--pods",
            "3",
            "--host",
            "127.0.0.1",
            "--base-port",
            "0",
            "--kv-events-base-port",
            "0",
            "--profile",
            "tiny",
            "--model",
            "m1",
        ]
    )
    try:
        assert len(lines) == 3
        for i, line in enumerate(lines):
            m = LINE.match(line)
            assert m, line
            name, ip, port, kv_ip, kv_port = m.groups()
            assert name == f"sim-{i}" and ip == kv_ip == "127.0.0.1" and kv_port
            status, headers, body = _get(f"http://{ip}:{port}/v1/models")
            assert status == 200 and b'"m1"' in body
            assert headers["x-inference-pod"] == name and headers["x-inference-address"] == f"{ip}:{port}"
    finally:
        assert stop_process(proc) == 0


def test_distinct_hosts_put_each_pod_on_its_own_address() -> None:
    proc, lines = start_sim(
        ["--pods", "2", "--host", "127.0.0.11", "--base-port", "0", "--distinct-hosts", "--profile", "tiny"]
    )
    try:
        ips = [LINE.match(line).group(2) for line in lines]  # type: ignore[union-attr]
        assert ips == ["127.0.0.11", "127.0.0.12"]
        for line in lines:
            url = line.split()[2]
            assert _get(url + "/health")[0] == 200
    finally:
        assert stop_process(proc) == 0


def test_kv_events_endpoint_with_a_star_binds_each_pod_like_vllm() -> None:
    proc, lines = start_sim(
        ["--pods", "2", "--host", "127.0.0.13", "--base-port", "0", "--distinct-hosts", "--profile", "tiny"]
        + ["--kv-events-endpoint", "tcp://*:0"]
    )
    try:
        matches = [LINE.match(line) for line in lines]
        assert [m.group(4) for m in matches if m] == ["127.0.0.13", "127.0.0.14"]  # each pod's own address
    finally:
        assert stop_process(proc) == 0


def test_bad_flags_give_a_clear_error_not_a_traceback() -> None:
    for args, text in (
        (["--pods", "0"], "--pods must be at least 1"),
        (["--host", "localhost"], "IPv4 address"),
        (["--error-rate", "3"], "fraction"),
        (["--tokenizer", "/no/such/dir", "--base-port", "0"], "/no/such/dir"),
        (["--kv-events-endpoint", "ipc:///tmp/kv"], "binds only as tcp://*:PORT"),
        (["--kv-events-endpoint", "tcp://*:5557", "--kv-events-base-port", "5557"], "without --kv-events-base-port"),
        (["--kv-events-endpoint", "udp://10.0.0.1:5557"], "must be a tcp:// endpoint"),
        (["--prefix-caching-hash-algo", "md5"], "invalid choice"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "picker.cli", "sim", *args], capture_output=True, text=True, timeout=30
        )
        assert result.returncode != 0, args
        assert text in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr
