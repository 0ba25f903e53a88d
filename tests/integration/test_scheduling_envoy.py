"""Scheduling through the real Envoy: admission, config hot reload under load, explanations."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from picker_bench.process import wait_until
from tests.stack import start_envoy, start_picker


def post(url: str, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps({"model": "m", "prompt": "x"}).encode(),
        headers={"content-type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        return e.code, json.loads(raw) if raw.startswith(b"{") else {"raw": raw.decode(errors="replace")}


def config(pinned: bool) -> str:
    """With `pinned`, the test filter keeps only the endpoint a request names in its
    `test-epp-endpoint-selection` header; without it, requests spread over the pool."""
    filter_plugin = "- type: header-based-testing-filter\n" if pinned else ""
    filter_ref = "  - pluginRef: header-based-testing-filter\n" if pinned else ""
    return f"""apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
{filter_plugin}- type: queue-scorer
- type: random-picker
schedulingProfiles:
- name: default
  plugins:
{filter_ref}  - pluginRef: queue-scorer
  - pluginRef: random-picker
"""


def replace(path: Path, text: str) -> None:
    staged = path.with_suffix(".new")
    staged.write_text(text)
    os.replace(staged, path)


def test_sheddable_requests_get_429_while_the_pool_is_saturated(backends, log_dir: Path, tmp_path: Path) -> None:
    addresses, _ = backends
    objectives = tmp_path / "objectives.yaml"
    objectives.write_text(
        "apiVersion: inference.networking.x-k8s.io/v1alpha2\nkind: InferenceObjective\n"
        "metadata: {name: batch}\nspec: {priority: -1, poolRef: {name: pool}}\n---\n"
        "apiVersion: inference.networking.x-k8s.io/v1alpha2\nkind: InferenceObjective\n"
        "metadata: {name: chat}\nspec: {priority: 10, poolRef: {name: pool}}\n"
    )
    # The stand-in backends serve no /metrics, so every endpoint is stale: saturated.
    picker = start_picker(
        log_dir, "--endpoints", ",".join(addresses), "--objectives-file", str(objectives), name="picker-shed"
    )
    envoy = start_envoy("duplex", picker.grpc_port, log_dir, name="envoy-shed")
    try:
        status, answer = post(envoy.url, {"x-gateway-inference-objective": "batch"})
        assert status == 429 and answer["error"]["code"] == "ResourceExhausted"
        assert post(envoy.url, {"x-gateway-inference-objective": "chat"})[0] == 200
        assert post(envoy.url)[0] == 200  # no objective: priority 0, never shed
        assert post(envoy.url, {"x-gateway-inference-objective": "unknown"})[0] == 200
    finally:
        envoy.stop()
        picker.stop()


def test_config_flips_under_load_lose_no_request(backends, log_dir: Path, tmp_path: Path) -> None:
    addresses, _ = backends
    pinned = addresses[0]
    path = tmp_path / "config.yaml"
    path.write_text(config(pinned=True))
    picker = start_picker(log_dir, "--endpoints", ",".join(addresses), "--config-file", str(path), name="picker-reload")
    envoy = start_envoy("duplex", picker.grpc_port, log_dir, name="envoy-reload")
    results: list[tuple[float, int, str]] = []  # (time, status, backend)
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            status, answer = post(envoy.url, {"test-epp-endpoint-selection": pinned})
            results.append((time.monotonic(), status, answer.get("backend", "")))

    def follows(is_pinned: bool, since: float) -> bool:
        recent = [b for t, _, b in results[-6:] if t > since]
        return len(recent) >= 3 and (
            all(b == pinned for b in recent) if is_pinned else any(b != pinned for b in recent)
        )

    worker = threading.Thread(target=load)
    worker.start()
    try:
        wait_until(lambda: follows(True, 0), 5, "the first decisions")
        for text, is_pinned in (
            (config(False), False),
            ("kind: Nonsense\n", False),
            (config(True), True),
            ("plugins: [", True),
            (config(False), False),
        ):
            changed = time.monotonic()
            replace(path, text)
            # The deadline allows for a loaded machine (file poll, rebuild, then three answers).
            wait_until(
                lambda: follows(is_pinned, changed), 15.0, f"decisions to follow the config (pinned={is_pinned})"
            )
    finally:
        stop.set()
        worker.join()
        envoy.stop()
        picker.stop()
    assert len(results) > 20
    assert [r for r in results if r[1] != 200] == []


def test_debug_decisions_explain_every_score(backends, log_dir: Path) -> None:
    addresses, _ = backends
    picker = start_picker(
        log_dir, "--endpoints", ",".join(addresses), "--enable-debug-decisions", name="picker-explain"
    )
    envoy = start_envoy("duplex", picker.grpc_port, log_dir, name="envoy-explain")
    try:
        status, answer = post(envoy.url)
        assert status == 200
        url = f"http://127.0.0.1:{picker.metrics_port}/debug/decisions"
        with urllib.request.urlopen(url, timeout=5) as r:
            decisions = json.loads(r.read())["decisions"]
        assert decisions, "the decision was recorded"
        text = json.dumps(decisions[0])
        assert answer["backend"] in text and "queue-scorer" in text
    finally:
        envoy.stop()
        picker.stop()


def test_debug_decisions_are_off_by_default(backends, log_dir: Path) -> None:
    addresses, _ = backends
    picker = start_picker(log_dir, "--endpoints", ",".join(addresses), name="picker-noexplain")
    try:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{picker.metrics_port}/debug/decisions", timeout=5)
            raise AssertionError("the debug endpoint answered")
        except urllib.error.HTTPError as e:
            assert e.code == 404
    finally:
        picker.stop()
