"""Gateway-level behaviour: shipped configs validate, subset hints, no endpoints, picker restarts."""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from picker.workers.metrics import parse_page
from picker_bench.envoy import MANIFESTS, EnvoyProcess, envoy_binary, picker_config
from picker_bench.process import free_port, wait_until
from tests.stack import Picker, health_status, start_picker


def post(url: str, body: dict, headers: dict | None = None, timeout: float = 5) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json", **(headers or {})}
    )
    return send(req, timeout)


def get(url: str, headers: dict | None = None, timeout: float = 5) -> tuple[int, dict]:
    """A headers-only request: the picker routes it without a body."""
    return send(urllib.request.Request(url, headers=headers or {}), timeout)


def send(req: urllib.request.Request, timeout: float) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        return e.code, json.loads(raw) if raw.startswith(b"{") else {"raw": raw.decode()}


def assert_unavailable_not_internal(picker: Picker, status: int, answer: dict) -> None:
    """The reference's 503 for a request no endpoint can take, and no sign of a picker bug:
    no internal error counted, no traceback logged."""
    assert status == 503 and answer["error"]["code"] == "ServiceUnavailable", (status, answer)
    with urllib.request.urlopen(f"http://127.0.0.1:{picker.metrics_port}/metrics", timeout=5) as r:
        samples = [s for family in parse_page(r.read().decode()) for s in family.samples]
    assert not [
        s for s in samples if s.name == "picker_extproc_stream_errors_total" and s.labels["reason"] == "Internal"
    ]
    assert "Traceback" not in picker.process.log_path.read_text()


@pytest.mark.parametrize("config", sorted(p.name for p in MANIFESTS.glob("*.yaml")))
def test_shipped_envoy_configs_validate(config: str) -> None:
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(MANIFESTS / config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def subset_hint_config(picker_port: int) -> dict:
    """The duplex gateway plus a test-only filter that copies a request header into the
    `envoy.lb.subset_hint` metadata that a gateway would set, forwarded to the picker."""
    config = picker_config("duplex", ("127.0.0.1", free_port()), ("127.0.0.1", picker_port), ("127.0.0.1", free_port()))
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"].insert(
        0,
        {
            "name": "envoy.filters.http.header_to_metadata",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
                "request_rules": [
                    {
                        "header": "x-test-subset",
                        "on_header_present": {
                            "metadata_namespace": "envoy.lb.subset_hint",
                            "key": "x-gateway-destination-endpoint-subset",
                            "type": "STRING",
                        },
                        "remove": True,
                    }
                ],
            },
        },
    )
    ext_proc = hcm["http_filters"][1]["typed_config"]
    ext_proc["metadata_options"]["forwarding_namespaces"] = {"untyped": ["envoy.lb.subset_hint"]}
    return config


def test_subset_hint_is_honoured_and_an_empty_match_is_503(backends, log_dir: Path) -> None:
    addresses, _ = backends
    picker = start_picker(log_dir, "--endpoints", ",".join(addresses), name="picker-subset")
    envoy = EnvoyProcess("envoy-subset", subset_hint_config(picker.grpc_port), log_dir).start()
    try:
        envoy.wait_ready(envoy.ready)
        url = envoy.url + "/v1/completions"
        for target in addresses[1:]:
            for _ in range(4):
                status, answer = post(url, {"model": "m", "prompt": "p"}, {"x-test-subset": target})
                assert status == 200 and answer["backend"] == target
        status, answer = post(url, {"model": "m", "prompt": "p"}, {"x-test-subset": "127.0.0.1:1"})
        assert status == 503 and answer["error"]["code"] == "ServiceUnavailable"
        # A headers-only request is picked without its body, and refused the same way.
        status, answer = get(envoy.url + "/v1/models", {"x-test-subset": "127.0.0.1:1"})
        assert_unavailable_not_internal(picker, status, answer)
        status, answer = get(envoy.url + "/v1/models", {"x-test-subset": addresses[0]})
        assert status == 200 and answer["backend"] == addresses[0]
    finally:
        envoy.stop()
        picker.stop()


def test_no_endpoints_gives_503_until_the_file_lists_one(backends, log_dir: Path, tmp_path: Path) -> None:
    addresses, _ = backends
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text("[]\n")
    picker = start_picker(log_dir, "--endpoints-file", str(endpoints), name="picker-file")
    envoy = EnvoyProcess(
        "envoy-file",
        picker_config(
            "duplex", ("127.0.0.1", free_port()), ("127.0.0.1", picker.grpc_port), ("127.0.0.1", free_port())
        ),
        log_dir,
    ).start()
    try:
        envoy.wait_ready(envoy.ready)
        url = envoy.url + "/v1/completions"
        status, answer = post(url, {"model": "m", "prompt": "p"})
        assert status == 503 and answer["error"]["code"] == "ServiceUnavailable"
        assert_unavailable_not_internal(picker, *get(envoy.url + "/v1/models"))
        endpoints.write_text(f"- address: {addresses[0]}\n  name: only\n")
        wait_until(lambda: post(url, {"model": "m", "prompt": "p"})[0] == 200, 10, "the file change to apply")
        assert post(url, {"model": "m", "prompt": "p"})[1]["backend"] == addresses[0]
        endpoints.write_text("- address: not-an-address\n")  # a bad edit keeps the old list
        status, answer = post(url, {"model": "m", "prompt": "p"})
        assert status == 200 and answer["backend"] == addresses[0]
    finally:
        envoy.stop()
        picker.stop()


def test_routing_resumes_after_the_picker_restarts(backends, log_dir: Path) -> None:
    addresses, _ = backends
    port = free_port()
    picker = start_picker(log_dir, "--endpoints", ",".join(addresses), name="picker-r1", grpc_port=port)
    envoy = EnvoyProcess(
        "envoy-restart",
        picker_config("duplex", ("127.0.0.1", free_port()), ("127.0.0.1", port), ("127.0.0.1", free_port())),
        log_dir,
    ).start()
    try:
        envoy.wait_ready(envoy.ready)
        url = envoy.url + "/v1/completions"
        assert post(url, {"model": "m", "prompt": "p"})[0] == 200
        picker.stop()
        # FailClose: while the picker is down, Envoy answers 500 itself.
        assert post(url, {"model": "m", "prompt": "p"})[0] == 500
        picker = start_picker(log_dir, "--endpoints", ",".join(addresses), name="picker-r2", grpc_port=port)
        wait_until(lambda: post(url, {"model": "m", "prompt": "p"})[0] == 200, 15, "routing to resume")
        statuses = [post(url, {"model": "m", "prompt": f"p{i}"})[0] for i in range(20)]
        assert statuses == [200] * 20
    finally:
        envoy.stop()
        picker.stop()


@pytest.mark.parametrize("early_body", [True, False])
def test_streamed_mode_routes_and_delivers_the_body(backends, log_dir: Path, early_body: bool) -> None:
    """STREAMED: with the body sent early the pick waits for it; without, the pick is made
    on the headers (Envoy has forwarded them already) and the body passes through."""
    addresses, _ = backends
    picker = start_picker(log_dir, "--endpoints", ",".join(addresses), name=f"picker-streamed-{early_body}")
    config = picker_config(
        "buffered", ("127.0.0.1", free_port()), ("127.0.0.1", picker.grpc_port), ("127.0.0.1", free_port())
    )
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = hcm["http_filters"][0]["typed_config"]
    ext_proc["processing_mode"]["request_body_mode"] = "STREAMED"
    ext_proc["send_body_without_waiting_for_header_response"] = early_body
    envoy = EnvoyProcess(f"envoy-streamed-{early_body}", config, log_dir).start()
    try:
        envoy.wait_ready(envoy.ready)
        for size in (10, 300_000):
            body = {"model": "m", "prompt": "x" * size}
            status, answer = post(envoy.url + "/v1/completions", body)
            assert status == 200
            assert answer["headers"]["x-gateway-destination-endpoint"] == answer["backend"]
            assert answer["body_len"] == len(json.dumps(body).encode())
        status, answer = post(envoy.url + "/v1/completions", {"prompt": "no model"})
        assert status == (400 if early_body else 200)  # without the early body there is nothing to check
    finally:
        envoy.stop()
        picker.stop()


def test_sigterm_drains_reporting_not_serving_while_still_routing(backends, log_dir: Path) -> None:
    """A rolling restart: readiness goes NOT_SERVING at once, requests keep being routed for
    `--shutdown-delay`, then the process exits by itself."""
    addresses, _ = backends
    picker = start_picker(log_dir, "--endpoints", ",".join(addresses), "--shutdown-delay", "3s", name="picker-drain")
    envoy = EnvoyProcess(
        "envoy-drain",
        picker_config(
            "duplex", ("127.0.0.1", free_port()), ("127.0.0.1", picker.grpc_port), ("127.0.0.1", free_port())
        ),
        log_dir,
    ).start()
    try:
        envoy.wait_ready(envoy.ready)
        url = envoy.url + "/v1/completions"
        assert post(url, {"model": "m", "prompt": "p"})[0] == 200
        picker.process.proc.send_signal(signal.SIGTERM)
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        wait_until(lambda: health_status(picker.health_port, "readiness") == not_serving, 2, "NOT_SERVING")
        assert health_status(picker.health_port, "liveness") == health_pb2.HealthCheckResponse.SERVING
        assert picker.process.alive()
        assert [post(url, {"model": "m", "prompt": f"p{i}"})[0] for i in range(5)] == [200] * 5
        wait_until(lambda: not picker.process.alive(), 10, "the picker to exit after the delay")
        assert picker.process.proc.returncode == 0
    finally:
        envoy.stop()
        picker.stop()
