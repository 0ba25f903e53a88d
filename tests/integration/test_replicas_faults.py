"""Three `picker serve` replicas behind one real Envoy (LEAST_REQUEST over them), sharing state
through a real redis-server, in front of real `picker sim` pods: each replica's scheduler counts
the others' requests in flight, and a replica killed with -9 under load fails only the requests
in flight on it (FailClose: Envoy answers 500 or cuts the response) while the others keep
routing; its in-flight counts vanish from the survivors within their expiry."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from picker.state.sync import LOAD_EXPIRES_MS
from picker_bench.envoy import REPLICA_EJECTION_SECONDS, EnvoyProcess, replicated_picker_config
from picker_bench.process import free_port, wait_until
from picker_bench.soak import start_sim_pods
from tests.integration.test_reliability_faults import gauge, post
from tests.redis_server import RedisServer, start_redis
from tests.stack import Picker, start_picker

REPLICAS = 3
LONG_REQUESTS = 3  # long generations (7,000 tokens: seconds on the tiny profile) held in flight
LOAD_THREADS = 8
KILL_NOTICE_SECONDS = 0.2  # a dead replica's connection reset reaching Envoy
READ_WAIT_SECONDS = 1.0  # a replica reads the stream in blocking waits of up to this
HEALTHY = "cluster.ext_proc.membership_healthy"  # neither failing the health check nor ejected
CHECKED_HEALTHY = "cluster.ext_proc.health_check.healthy"  # passing the health check


@pytest.fixture
def redis_server(log_dir: Path) -> Iterator[RedisServer]:
    server = start_redis(log_dir, "redis-replicas")
    yield server
    server.stop()


@pytest.fixture
def sim_pods(log_dir: Path) -> Iterator[list[str]]:
    sim, pods = start_sim_pods(3, log_dir, name="sim-replicas")
    yield pods
    sim.stop()


@pytest.fixture
def replicas(redis_server: RedisServer, sim_pods: list[str], log_dir: Path) -> Iterator[list[Picker]]:
    started: list[Picker] = []
    try:
        for n in range(REPLICAS):
            started.append(
                start_picker(
                    log_dir,
                    "--endpoints",
                    ",".join(sim_pods),
                    "--state-store",
                    redis_server.url,
                    "--health-checking",  # Envoy's health check of the ext_proc port
                    "--enable-debug-decisions",
                    name=f"picker-replica-{n}",
                )
            )
        yield started
    finally:
        for picker in started:
            picker.stop()


@pytest.fixture
def envoy(replicas: list[Picker], log_dir: Path) -> Iterator[EnvoyProcess]:
    pickers = [("127.0.0.1", picker.grpc_port) for picker in replicas]
    config = replicated_picker_config("duplex", ("127.0.0.1", free_port()), pickers, ("127.0.0.1", free_port()))
    process = EnvoyProcess("envoy-replicas", config, log_dir).start()
    try:
        process.wait_ready(process.ready)
        # Until its health check has passed a replica gets no streams (nor does the cluster route
        # in panic mode, to every replica alike).
        wait_until(lambda: process.stat(HEALTHY) == REPLICAS, 30, "healthy replicas")
        yield process
    finally:
        process.stop()


def seen_in_flight(picker: Picker) -> int:
    """Requests in flight at all the pods, as `picker` saw them at its newest decision."""
    with urllib.request.urlopen(f"http://127.0.0.1:{picker.metrics_port}/debug/decisions", timeout=5) as r:
        decisions = json.loads(r.read())["decisions"]
    if not decisions:
        return -1
    (profile,) = decisions[0]["profiles"].values()
    return sum(candidate["in_flight"] for candidate in profile["candidates"])


def own_in_flight(picker: Picker) -> float:
    return gauge(picker.metrics_port, "picker_in_flight_requests")


def routed(picker: Picker) -> float:
    return gauge(picker.metrics_port, "picker_requests_routed_total")


def decided_with(url: str, pickers: list[Picker], in_flight: int) -> bool:
    """Send one request; whether one of `pickers` then decided seeing `in_flight` requests."""
    post(url)
    return any(seen_in_flight(picker) == in_flight for picker in pickers)


@contextmanager
def load(url: str) -> Iterator[list[tuple[float, int]]]:
    """LOAD_THREADS clients looping through Envoy; (start, status) of every request."""
    results: list[tuple[float, int]] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            begin = time.monotonic()
            results.append((begin, post(url)[0]))

    threads = [threading.Thread(target=loop) for _ in range(LOAD_THREADS)]
    for thread in threads:
        thread.start()
    try:
        yield results
    finally:
        stop.set()
        for thread in threads:
            thread.join()


def test_a_replica_killed_under_load_fails_only_its_requests_in_flight(
    replicas: list[Picker], envoy: EnvoyProcess
) -> None:
    pool = ThreadPoolExecutor(LONG_REQUESTS)
    try:
        long = [pool.submit(post, envoy.url, None, 60, 7_000) for _ in range(LONG_REQUESTS)]
        wait_until(lambda: sum(map(own_in_flight, replicas)) == LONG_REQUESTS, 20, "the long requests routed")
        doomed = max(replicas, key=own_in_flight)
        held = own_in_flight(doomed)
        survivors = [picker for picker in replicas if picker is not doomed]
        # Shared in-flight counts: a survivor's scheduler sees every replica's long requests,
        # the doomed one's included, not only its own.
        wait_until(lambda: decided_with(envoy.url, survivors, LONG_REQUESTS), 10, "a survivor to count them all")
        with load(envoy.url) as results:
            wait_until(lambda: len(results) >= 100, 30, "load through every replica")
            before = [routed(picker) for picker in survivors]
            assert doomed.process.proc is not None
            killed_at = time.monotonic()
            os.kill(doomed.process.pid, signal.SIGKILL)
            doomed.process.proc.wait(10)
            # Envoy ejected it at once; its health check marks it unhealthy before the ejection
            # ends, so no stream goes to it again.
            wait_until(lambda: envoy.stat(CHECKED_HEALTHY) == REPLICAS - 1, 10, "the health check to see it dead")
            ejection_over = killed_at + REPLICA_EJECTION_SECONDS + 0.5
            wait_until(lambda: sum(1 for b, _ in results if b > ejection_over) >= 100, 30, "load after the ejection")
        long_statuses = [future.result(timeout=60)[0] for future in long]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    failed = [(round(begin - killed_at, 3), status) for begin, status in results if status != 200]
    # FailClose: the requests whose streams the dead replica held fail (Envoy's 500, or a cut
    # response): those in flight at the kill, and those Envoy put on its connections in the
    # moment before the kernel's reset reached it; none later.
    assert all(at < KILL_NOTICE_SECONDS for at, _ in failed), failed
    assert len(failed) <= LOAD_THREADS, failed
    assert sorted(status == 200 for status in long_statuses) == [False] * int(held) + [True] * (
        LONG_REQUESTS - int(held)
    )
    assert all(routed(picker) > count for picker, count in zip(survivors, before, strict=True))
    assert envoy.stat("cluster.ext_proc.outlier_detection.ejections_enforced_total") == 1
    # The dead replica never said its requests ended: the survivors stop counting them once its
    # last report expires.
    wait_until(
        lambda: decided_with(envoy.url, survivors, 0),
        LOAD_EXPIRES_MS / 1000 + READ_WAIT_SECONDS + 2,
        "the dead replica's in-flight counts to expire",
    )
