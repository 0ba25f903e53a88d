"""`picker serve --zap-encoder=json -v=4` behind a real Envoy, through errors, config reloads
and a model server killed: every line it writes is a JSON object, and every routed request
has exactly one request line carrying its x-request-id."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

from picker_bench.process import free_port, wait_until
from picker_bench.soak import MODEL, start_sim_pods
from tests.stack import start_envoy, start_picker

CONFIG = """apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
schedulingProfiles:
- name: default
  plugins:
  - {{pluginRef: queue-scorer, weight: {queue}}}
  - {{pluginRef: kv-cache-utilization-scorer, weight: 1}}
  - {{pluginRef: prefix-cache-scorer, weight: 2}}
"""
MAX_BODY = 64 << 10


def post(url: str, body: bytes, request_id: str) -> int:
    """The status of one completion through Envoy (0 when the connection broke)."""
    req = urllib.request.Request(
        url + "/v1/completions", data=body, headers={"content-type": "application/json", "x-request-id": request_id}
    )
    try:
        with urllib.request.urlopen(req, timeout=15) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as e:
        e.read()
        return int(e.code)
    except (http.client.HTTPException, OSError):
        return 0


def completion(n: int) -> bytes:
    return json.dumps(
        {"model": MODEL, "prompt": f"a shared system prompt, then question {n}", "max_tokens": 2}
    ).encode()


BAD_BODIES = [
    b'{"model": "m", "prompt": "truncated',
    json.dumps({"model": MODEL, "prompt": 5}).encode(),
    b'{"model": "m", "prompt": "not utf-8 \xff"}',
    json.dumps({"prompt": "no model"}).encode(),
    json.dumps({"model": MODEL, "prompt": "x" * (MAX_BODY + 1)}).encode(),
]


def lines_of(path: Path) -> list[dict[str, object]]:
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise AssertionError(f"line {number} of {path} is not JSON ({error}): {line!r}") from None
        assert isinstance(record, dict) and {"level", "ts", "logger", "msg"} <= record.keys(), line
        records.append(record)
    return records


def test_every_line_is_json_and_v4_logs_one_line_per_routed_request(log_dir: Path, tmp_path: Path) -> None:
    doomed_proc, (doomed,) = start_sim_pods(1, log_dir, name="sim-logs-doomed")
    healthy_proc, healthy = start_sim_pods(2, log_dir, name="sim-logs-healthy")
    endpoints, config = tmp_path / "endpoints.yaml", tmp_path / "config.yaml"
    endpoints.write_text("".join(f"- {a}\n" for a in (doomed, *healthy)))
    config.write_text(CONFIG.format(queue=1))
    picker = start_picker(
        log_dir,
        "--zap-encoder=json", "-v=4",
        "--endpoints-file", str(endpoints),
        "--config-file", str(config),
        "--max-body-bytes", str(MAX_BODY),
        "--metrics-staleness-threshold", "500ms",
        name="picker-json-logs",
    )  # fmt: skip
    envoy = start_envoy("duplex", picker.grpc_port, log_dir, name="envoy-json-logs")
    log_path = picker.process.log_path
    statuses: dict[str, int] = {}

    def send(count: int, tag: str) -> None:
        for n in range(count):
            statuses[f"{tag}-{n}"] = post(envoy.url, completion(n), f"{tag}-{n}")

    def logged(text: str) -> bool:
        return text in log_path.read_text(encoding="utf-8", errors="replace")

    try:
        send(10, "ok")
        for n, body in enumerate(BAD_BODIES):
            statuses[f"bad-{n}"] = post(envoy.url, body, f"bad-{n}")
        config.write_text(CONFIG.format(queue=3))  # a reload
        wait_until(lambda: logged("reloaded"), 10, "the config reload")
        config.write_text("plugins: [{type: no-such-scorer}]\n")  # a rejected reload
        wait_until(lambda: logged("rejected"), 10, "the rejected config")
        send(5, "after-reload")
        os.kill(doomed_proc.pid, signal.SIGKILL)  # a model server dies
        wait_until(lambda: logged("failed (connect)"), 10, "the dead pod's scrape failure")
        send(10, "after-fault")
    finally:
        envoy.stop()
        picker.stop()
        doomed_proc.stop()
        healthy_proc.stop()

    assert [statuses[f"bad-{n}"] for n in range(len(BAD_BODIES))] == [400, 400, 400, 400, 413]
    assert all(statuses[f"ok-{n}"] == 200 for n in range(10)), statuses
    records = lines_of(log_path)
    levels = Counter(str(r["level"]) for r in records)
    assert levels["error"] >= 1 and levels["warn"] >= 1 and levels["debug"] >= 1, levels
    assert any("stacktrace" in r for r in records if r["level"] == "error")
    assert any(r["msg"] == "shutting down" for r in records)  # the picker's last words are JSON too

    routed_lines = Counter(str(r["x-request-id"]) for r in records if r["msg"] == "request routed")
    # Rejected bodies are never routed; every other request (a 503 from Envoy for the dead pod
    # included) was routed once.
    routed = {rid for rid, status in statuses.items() if status not in (400, 413)}
    assert routed_lines == Counter(routed)
    for record in records:
        if record["msg"] == "request routed":
            assert record["model"] == MODEL and record["endpoint"] and record["scores"], record
            assert isinstance(record["decisionSeconds"], float)
            assert "question" not in json.dumps(record)  # no prompt text below V(5)


def _start_with_a_busy_port(flag: str) -> list[dict]:
    """The JSON records of a start whose `flag` port is taken (it must fail with exit code 1)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = {"--grpc-port": free_port(), "--grpc-health-port": free_port(), flag: taken.getsockname()[1]}
        result = subprocess.run(
            [sys.executable, "-m", "picker.cli", "serve", "--zap-encoder=json", "--endpoints", "127.0.0.1:1",
             "--bind-address", "127.0.0.1", "--metrics-port", str(free_port()),
             *(f"{name}={port}" for name, port in ports.items())],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert result.returncode == 1 and result.stdout == ""
    return [json.loads(line) for line in result.stderr.splitlines()]


def test_a_failed_start_and_grpc_core_lines_are_json_too() -> None:
    """gRPC's C core (the health server's) writes to fd 2 itself (here: the port it cannot
    bind); with JSON those lines are wrapped as records of the `stderr` logger, and the start
    fails with exit code 1."""
    records = _start_with_a_busy_port("--grpc-health-port")
    assert any(r["logger"] == "stderr" and "Failed to add port" in str(r["msg"]) for r in records), records
    assert any(r["level"] == "error" and str(r["msg"]).startswith("cannot start: Failed to bind") for r in records)


def test_a_busy_ext_proc_port_fails_the_start_with_a_clear_error() -> None:
    records = _start_with_a_busy_port("--grpc-port")
    errors = [str(r["msg"]) for r in records if r["level"] == "error"]
    assert any(m.startswith("cannot start: 127.0.0.1:") and "Address already in use" in m for m in errors), records
