"""Two `picker serve` replicas sharing one real redis-server (`--state-store`), each behind its own
real Envoy, in front of the same real backends: a replica that starts late warms its index from
the stream, a prompt first routed by one replica is routed to the same backend by the other, and
killing redis-server under load fails no request; once it is back both resynchronise."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from picker_bench.process import wait_until
from tests.integration.test_reliability_faults import gauge
from tests.redis_server import RedisServer, start_redis
from tests.stack import Picker, start_envoy, start_picker

INDEX_SIZE = "inference_extension_prefix_indexer_size"
CONNECTED = "picker_state_store_connected"
LOAD_THREADS = 4


def prompt(n: int) -> str:
    """A prompt of many 64-character blocks, its own from the first block on."""
    return f"conversation {n:05d}: " + "the same long system prompt, again and again. " * 40


def post(url: str, text: str) -> tuple[int, str]:
    """(status, the backend that answered or '') of one completion through Envoy."""
    body = json.dumps({"model": "m", "prompt": text, "max_tokens": 1}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())["backend"]
    except urllib.error.HTTPError as e:
        e.read()
        return e.code, ""
    except OSError:
        return 0, ""


def index_size(picker: Picker) -> float:
    return gauge(picker.metrics_port, INDEX_SIZE)


@contextmanager
def load(urls: list[str]) -> Iterator[list[int]]:
    """Clients looping through every Envoy with fresh prompts; the status of every request."""
    statuses: list[int] = []
    stop = threading.Event()

    def loop(worker: int) -> None:
        n = 0
        while not stop.is_set():
            statuses.append(post(urls[worker % len(urls)], prompt(100_000 + worker * 10_000 + n))[0])
            n += 1

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(LOAD_THREADS)]
    for thread in threads:
        thread.start()
    try:
        yield statuses
    finally:
        stop.set()
        for thread in threads:
            thread.join()


@pytest.fixture
def redis_server(log_dir: Path) -> Iterator[RedisServer]:
    server = start_redis(log_dir, "redis-serve")
    yield server
    server.stop()


def test_replicas_share_the_prefix_index_through_redis_and_survive_its_loss(
    backends: tuple[list[str], object], redis_server: RedisServer, log_dir: Path
) -> None:
    shared = ("--endpoints", ",".join(backends[0]), "--state-store", redis_server.url)
    a = start_picker(log_dir, *shared, name="picker-state-a", tls=False)
    envoy_a = start_envoy("buffered", a.grpc_port, log_dir, tls=False, name="envoy-state-a")
    b = envoy_b = None
    try:
        first = {n: post(envoy_a.url, prompt(n)) for n in range(12)}
        assert {status for status, _ in first.values()} == {200}
        assert len({backend for _, backend in first.values()}) > 1  # spread: routing them again means something
        # b starts late and replays the stream: the same index as a
        b = start_picker(log_dir, *shared, name="picker-state-b", tls=False)
        wait_until(lambda: index_size(b) == index_size(a) > 0, 10, "b to warm its index from the stream")
        envoy_b = start_envoy("buffered", b.grpc_port, log_dir, tls=False, name="envoy-state-b")
        assert {n: post(envoy_b.url, prompt(n)) for n in first} == first  # each prompt where a sent it
        # and b's picks reach a
        fresh = post(envoy_b.url, prompt(500))
        wait_until(lambda: index_size(a) == index_size(b), 5, "a to learn b's pick")
        assert post(envoy_a.url, prompt(500)) == fresh

        with load([envoy_a.url, envoy_b.url]) as statuses:
            wait_until(lambda: len(statuses) >= 40, 30, "load to run")
            redis_server.kill()
            wait_until(
                lambda: gauge(a.metrics_port, CONNECTED) == gauge(b.metrics_port, CONNECTED) == 0, 10, "loss seen"
            )
            during = len(statuses)
            wait_until(lambda: len(statuses) >= during + 40, 30, "load without the store")
        assert statuses and set(statuses) == {200}, [s for s in statuses if s != 200]
        restarted = start_redis(log_dir, "redis-serve-restarted", port=redis_server.port)
        back = time.monotonic()
        try:
            wait_until(
                lambda: gauge(a.metrics_port, CONNECTED) == gauge(b.metrics_port, CONNECTED) == 1,
                15,
                "both replicas to reconnect",
            )
            reconnected = time.monotonic() - back
            # what each learnt alone meanwhile was kept, and the batches a crashed store lost
            # unread are sent again: the indexes agree again
            wait_until(lambda: index_size(b) == index_size(a), 10, "the indexes to agree after the restart")
            synced = time.monotonic() - back
            print(f"store back: reconnected in {reconnected:.3f}s, indexes equal {synced:.3f}s after the restart")
            later = post(envoy_a.url, prompt(900))
            wait_until(lambda: index_size(b) == index_size(a), 5, "b to learn a's pick after the restart")
            assert post(envoy_b.url, prompt(900)) == later
        finally:
            restarted.stop()
    finally:
        for proc in (envoy_b, b, envoy_a, a):
            if proc is not None:
                proc.stop()
