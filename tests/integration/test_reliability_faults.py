"""Faults around the picker, with real processes: model servers die mid-request, metrics pages
hang or turn to garbage, Envoy dies mid-request, the picker crashes under load.

Covered elsewhere (not repeated here): a KV-event publisher that restarts or drops batches
(tests/integration/test_kvevents_subscriber.py: restarted publisher resets the endpoint, gaps
replayed or the endpoint marked unknown; tests/integration/test_kvevents_sim.py: sim pods crash
and evict), a picker restarted while Envoy runs (test_extproc_gateway.py), config flips under
load (test_scheduling_envoy.py), a scrape that hangs inside the collector alone
(test_datalayer_collector.py).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from picker_bench.envoy import EnvoyProcess, picker_config
from picker_bench.process import ManagedProcess, free_port, wait_until
from picker_bench.soak import MODEL, scrape, start_sim_pods
from tests.stack import start_envoy, start_picker

PINNED_CONFIG = """apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: header-based-testing-filter
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: header-based-testing-filter
  - pluginRef: queue-scorer
  - pluginRef: max-score-picker
"""
PIN = "test-epp-endpoint-selection"


def post(url: str, headers: dict[str, str] | None = None, timeout: float = 10, max_tokens: int = 2) -> tuple[int, str]:
    """(status, the sim pod that answered or '') of one completion through Envoy; status 0 when
    the connection broke mid-response."""
    body = json.dumps({"model": MODEL, "prompt": "fault test", "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(
        url + "/v1/completions", data=body, headers={"content-type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return r.status, r.headers.get("x-inference-address", "")
    except urllib.error.HTTPError as e:
        e.read()
        return e.code, ""
    except (http.client.HTTPException, OSError):
        return 0, ""


def gauge(metrics_port: int, name: str, endpoint: str | None = None) -> float:
    samples = scrape(metrics_port)
    if endpoint is None:
        return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))
    return samples.get(f'{name}{{endpoint="{endpoint}"}}', 0.0)


def set_fault(address: str, **faults: object) -> None:
    req = urllib.request.Request(
        f"http://{address}/sim/fault", data=json.dumps(faults).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200


@pytest.fixture()
def doomed_and_healthy_pods(log_dir: Path) -> Iterator[tuple[ManagedProcess, str, list[str]]]:
    """One sim pod in its own process (to be killed) and two healthy ones."""
    doomed_proc, (doomed,) = start_sim_pods(1, log_dir, name="sim-doomed")
    try:
        healthy_proc, healthy = start_sim_pods(2, log_dir, name="sim-healthy")
    except Exception:
        doomed_proc.stop()
        raise
    yield doomed_proc, doomed, healthy
    doomed_proc.stop()
    healthy_proc.stop()


def _in_flight_on(url: str, pinned: str, count: int) -> tuple[ThreadPoolExecutor, list]:
    """`count` long generations (7000 tokens: seconds on the tiny profile) pinned to one pod, in the background."""
    pool = ThreadPoolExecutor(count)
    futures = [pool.submit(post, url, {PIN: pinned}, 40, 7_000) for _ in range(count)]
    return pool, futures


def test_a_model_server_killed_mid_request_releases_its_slots_and_is_avoided_once_stale(
    doomed_and_healthy_pods, log_dir: Path, tmp_path: Path
) -> None:
    doomed_proc, doomed, healthy = doomed_and_healthy_pods
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text("".join(f"- {a}\n" for a in (doomed, *healthy)))
    picker = start_picker(
        log_dir,
        "--endpoints-file",
        str(endpoints),
        "--config-text",
        PINNED_CONFIG,
        "--metrics-staleness-threshold",
        "500ms",
        name="picker-pod-dies",
    )
    envoy = start_envoy("duplex", picker.grpc_port, log_dir, name="envoy-pod-dies")
    try:
        port = picker.metrics_port
        pool, futures = _in_flight_on(envoy.url, doomed, 4)
        wait_until(lambda: gauge(port, "picker_in_flight_requests", doomed) == 4, 10, "4 requests in flight")
        os.kill(doomed_proc.pid, signal.SIGKILL)  # the model server dies with the requests inside
        statuses = [f.result(timeout=15)[0] for f in futures]
        pool.shutdown()
        assert all(500 <= s < 600 for s in statuses), statuses  # answered at once by Envoy, never hung
        wait_until(lambda: gauge(port, "picker_in_flight_requests", doomed) == 0, 5, "slots released")
        # Each stream ends when Envoy resets it after the 5xx (the picker waits idle for that).
        wait_until(lambda: gauge(port, "picker_extproc_streams_active") == 0, 10, "streams to end")
        # Still listed but its scrapes fail: once stale it gets no request while fresh pods exist.
        wait_until(lambda: gauge(port, "picker_metrics_age_seconds", doomed) > 0.5, 5, "the dead pod to go stale")
        anywhere = {PIN: ",".join([doomed, *healthy])}  # the filter keeps all three: the scorer picks
        outcomes = [post(envoy.url, anywhere) for _ in range(20)]
        assert all(status == 200 and pod in healthy for status, pod in outcomes), outcomes
        # Discovery drops it: it stays out.
        endpoints.write_text("".join(f"- {a}\n" for a in healthy))
        wait_until(
            lambda: f"{endpoints}: 2 endpoints" in picker.process.log_path.read_text(),
            10,
            "the picker to re-read the endpoints file",
        )
        served = [post(envoy.url, anywhere) for _ in range(30)]
        assert all(status == 200 and pod in healthy for status, pod in served), served
        assert picker.process.alive()
    finally:
        envoy.stop()
        picker.stop()


def test_envoy_killed_mid_request_releases_the_pickers_slots_and_a_new_envoy_routes(
    doomed_and_healthy_pods, log_dir: Path
) -> None:
    _, busy, healthy = doomed_and_healthy_pods
    picker = start_picker(
        log_dir, "--endpoints", ",".join([busy, *healthy]), "--config-text", PINNED_CONFIG, name="picker-envoy-dies"
    )
    envoy = start_envoy("duplex", picker.grpc_port, log_dir, name="envoy-dies")
    try:
        pool, futures = _in_flight_on(envoy.url, busy, 3)
        wait_until(lambda: gauge(picker.metrics_port, "picker_extproc_streams_active") == 3, 10, "3 open streams")
        os.killpg(envoy.pid, signal.SIGKILL)
        for f in futures:
            f.exception(timeout=15)  # the clients see their connection drop
        pool.shutdown()
        wait_until(lambda: gauge(picker.metrics_port, "picker_extproc_streams_active") == 0, 5, "streams closed")
        assert gauge(picker.metrics_port, "picker_in_flight_requests", busy) == 0
        envoy.stop()
        envoy = start_envoy("duplex", picker.grpc_port, log_dir, name="envoy-reborn")
        served = [post(envoy.url, {PIN: healthy[i % 2]}) for i in range(10)]
        assert served == [(200, healthy[i % 2]) for i in range(10)]
    finally:
        envoy.stop()
        picker.stop()


def test_metrics_pages_that_hang_or_are_garbage_go_stale_and_never_block_routing(log_dir: Path) -> None:
    sim, (hanging, garbage, fine) = start_sim_pods(3, log_dir, name="sim-bad-metrics")
    picker = None
    envoy = None
    try:
        set_fault(hanging, metrics_delay=3600)
        set_fault(garbage, metrics_garbage=True)
        picker = start_picker(
            log_dir,
            "--endpoints",
            ",".join([hanging, garbage, fine]),
            "--metrics-staleness-threshold",
            "500ms",
            "--refresh-prometheus-metrics-interval",
            "100ms",
            name="picker-bad-metrics",
        )
        envoy = start_envoy("duplex", picker.grpc_port, log_dir, name="envoy-bad-metrics")
        port = picker.metrics_port

        def stale_as_expected() -> bool:
            samples = scrape(port)
            errors = {k for k, v in samples.items() if k.startswith("picker_scrape_errors_total{") and v > 0}
            return (
                any(hanging in k and "timeout" in k for k in errors)
                and any(garbage in k for k in errors)
                and samples.get(f'picker_metrics_age_seconds{{endpoint="{hanging}"}}', 0) > 0.5
                and samples.get(f'picker_metrics_age_seconds{{endpoint="{fine}"}}', 99) < 0.5
                and samples.get('inference_pool_ready_pods{name=""}', -1) == 1
            )

        wait_until(stale_as_expected, 10, "the two bad endpoints to be stale and the good one fresh")
        # Routing goes on while the hanging page's scrapes time out one after another, and avoids
        # the endpoints it cannot see while one is fresh: 30 requests, all by the pod with good
        # metrics. (Routing reads the datastore, never a scrape; how fast it answers is the
        # overhead benchmark's to measure.)
        pool = ThreadPoolExecutor(6)
        results = list(pool.map(lambda _: post(envoy.url), range(30)))
        pool.shutdown()
        assert all(answer == (200, fine) for answer in results), results
        # With no fresh endpoint at all, every endpoint is a candidate again: routing goes on.
        set_fault(fine, metrics_garbage=True)
        wait_until(lambda: gauge(port, "picker_metrics_age_seconds", fine) > 0.5, 5, "the last pod to go stale")
        served = {post(envoy.url) for _ in range(30)}
        assert {status for status, _ in served} == {200} and len({pod for _, pod in served}) >= 2, served
        assert picker.process.alive()
    finally:
        for proc in (envoy, picker and picker.process, sim):
            if proc is not None:
                proc.stop()


@dataclass(frozen=True, slots=True)
class RestartOutcome:
    """Statuses of requests finished before the stop, sent after routing resumed, and between."""

    before: list[int]
    gap: list[int]
    after: list[int]


def restart_under_load(addresses: list[str], log_dir: Path, sig: signal.Signals) -> RestartOutcome:
    """Four clients loop through Envoy (duplex, FailClose) while the picker gets `sig` and a new
    picker starts on the same port."""
    port = free_port()
    picker = start_picker(log_dir, "--endpoints", ",".join(addresses), grpc_port=port, name=f"picker-load-{sig.name}")
    envoy = EnvoyProcess(
        f"envoy-load-{sig.name}",
        picker_config("duplex", ("127.0.0.1", free_port()), ("127.0.0.1", port), ("127.0.0.1", free_port())),
        log_dir,
    ).start()
    results: list[tuple[float, float, int]] = []  # (start, end, status)
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            begin = time.monotonic()
            status, _ = post(envoy.url, timeout=10)
            results.append((begin, time.monotonic(), status))

    workers = [threading.Thread(target=load) for _ in range(4)]
    try:
        envoy.wait_ready(envoy.ready)
        for w in workers:
            w.start()
        wait_until(lambda: len(results) >= 40, 10, "load to run")
        stopped_at = time.monotonic()
        os.killpg(picker.process.pid, sig)
        picker.process.proc.wait(10)
        picker = start_picker(
            log_dir, "--endpoints", ",".join(addresses), grpc_port=port, name=f"picker-load-{sig.name}-2"
        )
        ready_at = time.monotonic()
        wait_until(lambda: any(b > ready_at and s == 200 for b, _, s in results[-4:]), 10, "routing to resume")
        resumed = time.monotonic()
        wait_until(lambda: sum(1 for b, _, _ in results if b > resumed) >= 40, 15, "load after the restart")
    finally:
        stop.set()
        for w in workers:
            if w.is_alive():
                w.join()
        envoy.stop()
        picker.stop()
    return RestartOutcome(
        before=[s for b, e, s in results if e < stopped_at],
        gap=[s for b, e, s in results if e >= stopped_at and b <= resumed],
        after=[s for b, _, s in results if b > resumed],
    )


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["crash", "graceful"])
def test_only_the_gap_fails_when_the_picker_restarts_under_load(backends, log_dir: Path, sig: signal.Signals) -> None:
    """FailClose (the shipped configs): requests during the picker's absence get Envoy's 500;
    every request before the stop and after the restart succeeds."""
    outcome = restart_under_load(backends[0], log_dir, sig)
    assert outcome.before and set(outcome.before) == {200}
    assert outcome.after and set(outcome.after) == {200}, outcome
    # FailClose: Envoy's own 500, or (crash) a response cut off mid-stream; never a hang or a misroute.
    assert set(outcome.gap) <= {200, 500, 0}, outcome.gap


def test_fail_open_routes_without_the_picker_only_where_the_client_says(backends, log_dir: Path) -> None:
    """Documents `failure_mode_allow: true` (not shipped): with the picker down Envoy skips it,
    so the original-destination cluster sees no picker header. A plain request fails (buffered:
    503 "no healthy upstream"; duplex: that or Envoy's 500). In buffered mode a client that sets
    x-gateway-destination-endpoint itself is proxied wherever it says: FailOpen hands routing,
    and any reachable address, to the client. Duplex mode mostly answered 500 even then.
    The shipped configs are FailClose."""
    addresses, _ = backends
    for shipped in ("gateway.yaml", "buffered.yaml"):
        text = (Path(__file__).resolve().parents[2] / "manifests" / "envoy" / shipped).read_text()
        assert "failure_mode_allow: false" in text
    closed_port = free_port()  # nothing listens: the picker is down
    for mode in ("duplex", "buffered"):
        config = picker_config(mode, ("127.0.0.1", free_port()), ("127.0.0.1", closed_port), ("127.0.0.1", free_port()))
        hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        for http_filter in hcm["http_filters"]:
            if http_filter["name"] == "envoy.filters.http.ext_proc":
                http_filter["typed_config"]["failure_mode_allow"] = True
        envoy = EnvoyProcess(f"envoy-fail-open-{mode}", config, log_dir).start()
        try:
            envoy.wait_ready(envoy.ready)
            # Duplex: Envoy's 500 when the stream fails, or 503 when it fails open without a
            # destination (timing decides); buffered always fails open.
            assert post(envoy.url)[0] in ((500, 503) if mode == "duplex" else (503,))
            steered = post_raw(envoy.url, {"x-gateway-destination-endpoint": addresses[2]})
            if mode == "buffered":
                assert steered == (200, addresses[2])
                assert envoy.stat("http.inference_gateway.ext_proc.failure_mode_allowed") == 2
            else:  # duplex fails closed in practice; if it ever passes, it is where the client said
                assert steered in ((500, ""), (200, addresses[2])), steered
        finally:
            envoy.stop()


def post_raw(url: str, headers: dict[str, str]) -> tuple[int, str]:
    """(status, the test backend that answered or '') of one completion through Envoy."""
    req = urllib.request.Request(
        url + "/v1/completions",
        data=b'{"model": "m", "prompt": "x"}',
        headers={"content-type": "application/json", **headers},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())["backend"]
    except urllib.error.HTTPError as e:
        e.read()
        return e.code, ""
