"""The ConfigMap workflow (`picker serve --config-map`, the chart's `configSource: api`) on a real
kube-apiserver, with the chart's ServiceAccount, real Envoy and simulated vLLM pods (`picker sim`):
the ConfigMap is read before the picker is Ready; an invalid one fails the start with its error
(the reference crash-loops on it); a missing one is waited for, alive but not Ready (the
reference's pod waits for the ConfigMap its config file is mounted from); its weights and
data-layer settings apply from the first request and on every edit; `picker_config_info`,
`GET /config` and `picker config show --live` name the config in force."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from grpc_health.v1 import health_pb2
from kubernetes import client

from picker_bench.process import ManagedProcess, free_port, wait_until
from tests.e2e.kube_resources import patch_config_map
from tests.e2e.kube_stack import serve_args, sim_pool
from tests.stack import Picker, health_status, serving, start_envoy, start_picker

KEY = "default-plugins.yaml"  # the chart's ConfigMap key
HEADER = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
INVALID = HEADER + "plugins: [{type: no-such-scorer}]\n"
MODEL = "sim-model"
DEADLINE = 10.0  # a ConfigMap edit reaching the running picker, on a shared 2-core machine


def config_text(prefix_weight: int, metrics_path: str) -> str:
    """A config with the prefix-cache-scorer at `prefix_weight` that scrapes `metrics_path`."""
    return HEADER + (
        "plugins:\n"
        "- type: queue-scorer\n"
        "- type: prefix-cache-scorer\n"
        f"- {{type: metrics-data-source, parameters: {{path: {metrics_path}}}}}\n"
        "- type: core-metrics-extractor\n"
        "schedulingProfiles:\n"
        "- name: default\n"
        "  plugins:\n"
        "  - {pluginRef: queue-scorer, weight: 1}\n"
        f"  - {{pluginRef: prefix-cache-scorer, weight: {prefix_weight}}}\n"
    )


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@contextmanager
def config_map_holding(api: client.ApiClient, release: dict[str, str], text: str) -> Iterator[None]:
    """The release's ConfigMap holds `text` within the block, and its chart text after."""
    ns, name = release["namespace"], release["config_map"]
    chart_text = client.CoreV1Api(api).read_namespaced_config_map(name, ns).data[KEY]
    patch_config_map(api, ns, name, {KEY: text})
    try:
        yield
    finally:
        patch_config_map(api, ns, name, {KEY: chart_text})


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as response:
        body: bytes = response.read()
        return body


def live_config(picker_metrics_port: int) -> dict[str, Any]:
    described: dict[str, Any] = json.loads(get(f"http://127.0.0.1:{picker_metrics_port}/config"))
    return described


def metric(picker: Picker, line_start: str) -> list[str]:
    """The /metrics lines starting with `line_start`."""
    page = get(f"http://127.0.0.1:{picker.metrics_port}/metrics").decode()
    return [line for line in page.splitlines() if line.startswith(line_start)]


def complete(url: str) -> int:
    """One completion through Envoy; its status."""
    body = json.dumps({"model": MODEL, "prompt": "hello " * 40, "max_tokens": 2}).encode()
    request = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def newest_weights(picker: Picker) -> dict[str, float]:
    decisions = json.loads(get(f"http://127.0.0.1:{picker.metrics_port}/debug/decisions"))["decisions"]
    newest = decisions[0]
    weights: dict[str, float] = newest["profiles"][newest["primary_profile"]]["weights"]
    return weights


@pytest.fixture(scope="module")
def sims(admin_api: client.ApiClient, picker_release: dict[str, str]) -> Iterator[list[str]]:
    """Two simulated vLLM pods on consecutive 127.0.0.x hosts, as Ready pods of the release's pool."""
    with sim_pool(admin_api, picker_release, "config-map-sims") as pods:
        yield pods


def serve_until_exit(release: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`picker serve` for the release, run until it exits by itself (within a minute)."""
    ports = [str(free_port()) for _ in range(3)]
    return subprocess.run(
        [sys.executable, "-m", "picker.cli", "serve", "--bind-address", "127.0.0.1", "--secure-serving=false"]
        + ["--grpc-port", ports[0], "--grpc-health-port", ports[1], "--metrics-port", ports[2]]
        + serve_args(release),
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,
    )


def test_an_invalid_config_map_fails_the_start_with_its_error(admin_api, picker_release) -> None:
    with config_map_holding(admin_api, picker_release, INVALID):
        result = serve_until_exit(picker_release)
    assert result.returncode == 1, result.stderr
    assert 'plugins[0].type: unknown plugin type "no-such-scorer"' in result.stderr


def test_a_config_map_without_a_config_fails_the_start_naming_the_key(admin_api, picker_release) -> None:
    ns, name = picker_release["namespace"], picker_release["config_map"]
    with config_map_holding(admin_api, picker_release, INVALID):
        patch_config_map(admin_api, ns, name, {KEY: None, "notes.txt": "no config here"})  # type: ignore[dict-item]
        try:
            result = serve_until_exit(picker_release)
        finally:
            patch_config_map(admin_api, ns, name, {"notes.txt": None})  # type: ignore[dict-item]
    assert result.returncode == 1, result.stderr
    assert f"ConfigMap {ns}/{name} has no key ending in .yaml holding the EndpointPickerConfig" in result.stderr


def test_a_missing_config_map_is_waited_for_without_serving(admin_api, picker_release, tmp_path: Path) -> None:
    """The process waits (as the reference's pod waits for its config volume) and answers health
    as the reference does before it has synced: NOT_SERVING for every name, liveness included."""
    ns, name = picker_release["namespace"], picker_release["config_map"]
    core = client.CoreV1Api(admin_api)
    chart_text = core.read_namespaced_config_map(name, ns).data[KEY]
    core.delete_namespaced_config_map(name, ns)
    waiting = f"ConfigMap {ns}/{name} does not exist: waiting"

    def start(process_name: str, health: int, metrics: int) -> ManagedProcess:
        argv = [sys.executable, "-m", "picker.cli", "serve", "--bind-address", "127.0.0.1", "--secure-serving=false"]
        argv += ["--grpc-port", str(free_port()), "--grpc-health-port", str(health), "--metrics-port", str(metrics)]
        process = ManagedProcess(process_name, argv + serve_args(picker_release), tmp_path).start()
        process.wait_ready(lambda: waiting in process.log_tail(), 30)
        return process

    try:
        stopped = start("picker-stopped-while-waiting", free_port(), free_port())
        try:  # a SIGTERM while waiting ends the wait and the process
            assert stopped.proc is not None
            os.killpg(stopped.pid, signal.SIGTERM)
            assert stopped.proc.wait(10) == 0
        finally:
            stopped.stop()
        health, metrics = free_port(), free_port()
        process = start("picker-waiting", health, metrics)
        try:
            for service in ("liveness", "readiness", "inference-extension"):
                assert health_status(health, service) == health_pb2.HealthCheckResponse.NOT_SERVING
            text = config_text(4, "/metrics")
            core.create_namespaced_config_map(ns, {"metadata": {"name": name}, "data": {KEY: text}})
            process.wait_ready(lambda: serving(health), 30)
            described = live_config(metrics)
            assert (described["origin"], described["sha256"]) == (f"ConfigMap {ns}/{name}", sha256(text))
        finally:
            process.stop()
    finally:
        body = {"metadata": {"name": name}, "data": {KEY: chart_text}}
        try:
            core.replace_namespaced_config_map(name, ns, body)
        except client.ApiException as exc:
            if exc.status != 404:
                raise
            core.create_namespaced_config_map(ns, body)


def test_weights_and_data_layer_apply_from_the_first_request_and_on_every_edit(
    admin_api, picker_release, sims: list[str], tmp_path: Path
) -> None:
    ns, name = picker_release["namespace"], picker_release["config_map"]
    first = config_text(7, "/no-such-metrics")  # weights and a scrape path of its own from the start
    with config_map_holding(admin_api, picker_release, first):
        picker = start_picker(tmp_path, *serve_args(picker_release), "--enable-debug-decisions", tls=False)
        try:
            envoy = start_envoy("buffered", picker.grpc_port, tmp_path, tls=False)
            try:
                url = envoy.url + "/v1/completions"
                assert complete(url) == 200
                assert newest_weights(picker) == {"queue-scorer": 1.0, "prefix-cache-scorer": 7.0}
                source = f'source="ConfigMap {ns}/{name}"'
                assert metric(picker, "picker_config_info{") == [
                    f'picker_config_info{{hash="{sha256(first)[:16]}",{source}}} 1.0'
                ]
                # The data layer scrapes the configured path, which the pods do not serve.
                wait_until(
                    lambda: all(
                        metric(picker, f'picker_scrape_errors_total{{endpoint="{pod}",reason="http_status"}}')
                        for pod in sims
                    ),
                    DEADLINE,
                    "scrapes of /no-such-metrics to fail",
                )

                edited = config_text(5, "/metrics")
                patch_config_map(admin_api, ns, name, {KEY: edited})
                wait_until(lambda: live_config(picker.metrics_port)["sha256"] == sha256(edited), DEADLINE, "the edit")
                assert metric(picker, "picker_config_info{") == [
                    f'picker_config_info{{hash="{sha256(edited)[:16]}",{source}}} 1.0'
                ]
                assert complete(url) == 200
                assert newest_weights(picker)["prefix-cache-scorer"] == 5.0
                # Now the pods' metrics pages are scraped: their metrics are fresh.
                wait_until(
                    lambda: all(
                        float(metric(picker, f'picker_metrics_age_seconds{{endpoint="{pod}"}}')[0].split()[1]) < 1.0
                        for pod in sims
                    ),
                    DEADLINE,
                    "fresh metrics from /metrics",
                )
                shown = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "picker.cli",
                        "config",
                        "show",
                        "--live",
                        f"http://127.0.0.1:{picker.metrics_port}",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=30,
                    check=True,
                ).stdout
                assert f"# sha256: {sha256(edited)}\n" in shown and f"# source: ConfigMap {ns}/{name}\n" in shown
                assert "  - pluginRef: prefix-cache-scorer\n    weight: 5.0\n" in shown
            finally:
                envoy.stop()
        finally:
            picker.stop()
