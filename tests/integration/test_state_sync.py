"""State sync through a real redis-server, in process: two or three `StateSync`s (each a picker
process's) with their own datastore and prefix index share one stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from picker.datastore.store import Datastore
from picker.discovery.static import parse_endpoint_flag
from picker.prefix.index import PrefixIndex
from picker.state.sync import SharedIndex, StateSync, stream_name
from picker.state.url import parse_store_url
from picker.telemetry import metrics
from tests.redis_server import RedisServer, start_redis

ENDPOINTS = ("10.0.0.5:8000", "10.0.0.6:8000")
INDEX = "prefix/approx-index:31250:30.0"


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = start_redis(tmp_path)
    yield server
    server.stop()


class Process:
    """What one picker process holds: its pool, its index, its link to the store."""

    def __init__(self, url: str, stream: str, **options: int) -> None:
        self.datastore = Datastore()
        self.datastore.set_endpoints(parse_endpoint_flag(",".join(ENDPOINTS)))
        self.index = PrefixIndex()
        self.sync = StateSync(parse_store_url(url), stream, self.datastore, **options)
        self.shared: SharedIndex = self.sync.share_index(INDEX, self.index.insert)

    def pick(self, endpoint: str, hashes: list[int]) -> None:
        """What the producer does after a pick: insert locally, publish."""
        self.index.insert(endpoint, hashes)
        self.shared.publish(endpoint, hashes, None, True)


@pytest.fixture
async def processes(redis_server: RedisServer) -> AsyncIterator[Callable[..., Process]]:
    started: list[Process] = []

    def start(**options: int) -> Process:
        process = Process(redis_server.url, stream_name("ns", "pool"), **options)
        process.sync.start()
        started.append(process)
        return process

    yield start
    for process in started:
        await process.sync.stop()


async def until(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll `condition` on the loop; seconds it took. TimeoutError naming `what` after `timeout`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.005)
    return time.monotonic() - start


def counter(metric: object) -> float:
    return metric._value.get()  # type: ignore[attr-defined,no-any-return]


async def test_a_pick_in_one_process_reaches_the_others_index_within_milliseconds(
    processes: Callable[..., Process],
) -> None:
    a, b = processes(), processes()
    await until(lambda: counter(metrics.STATE_STORE_CONNECTED) == 1, 5, "the store")
    applied = counter(metrics.STATE_APPLIED_INSERTS)
    prompt = [11, 12, 13, 14]
    a.pick(ENDPOINTS[1], prompt)
    took = await until(lambda: b.index.match(prompt) == {ENDPOINTS[1]: 4}, 5, "b to learn a's pick")
    assert took < 0.5, took
    b.pick(ENDPOINTS[0], [21, 22])
    await until(lambda: a.index.match([21, 22]) == {ENDPOINTS[0]: 2}, 5, "a to learn b's pick")
    assert len(a.index) == len(b.index) == 6
    # a read its own batch before b's, and skipped it: each applied just the other's insert
    assert counter(metrics.STATE_APPLIED_INSERTS) - applied == 2


async def test_publishing_is_an_enqueue(processes: Callable[..., Process]) -> None:
    a = processes()
    hashes = list(range(64))
    rounds = []
    for _ in range(5):  # the best round: the cost itself, not the shared machine's interruptions
        start = time.perf_counter()
        for _ in range(1000):
            a.shared.publish(ENDPOINTS[0], hashes, None, True)
        rounds.append((time.perf_counter() - start) / 1000)
        await asyncio.sleep(0)
    assert min(rounds) < 20e-6, rounds  # measured ~1-2 µs


async def test_a_process_that_starts_late_warms_its_index_from_the_stream(
    processes: Callable[..., Process],
) -> None:
    a = processes()
    for n in range(50):
        a.pick(ENDPOINTS[n % 2], [1000 + n, 2000 + n])
    await until(lambda: a.sync.pending == 0, 5, "a to publish")
    late = processes()
    await until(lambda: len(late.index) == 100, 5, "the late process to replay the stream")
    assert late.index.match([1003, 2003]) == {ENDPOINTS[1]: 2}


async def test_garbage_in_the_stream_is_counted_and_skipped(
    redis_server: RedisServer, processes: Callable[..., Process]
) -> None:
    a, b = processes(), processes()
    client = aioredis.Redis(port=redis_server.port)
    bad = counter(metrics.STATE_BAD_MESSAGES)
    await client.xadd(stream_name("ns", "pool"), {b"b": b"\xff\xfe not protobuf"})
    await client.xadd(stream_name("ns", "pool"), {b"other": b"field"})
    await client.aclose()
    a.pick(ENDPOINTS[0], [7, 8, 9])
    await until(lambda: b.index.match([7, 8, 9]) == {ENDPOINTS[0]: 3}, 5, "b to read past the garbage")
    assert counter(metrics.STATE_BAD_MESSAGES) - bad == 4  # two entries, read by a and by b


async def test_inserts_for_endpoints_outside_the_pool_are_skipped(processes: Callable[..., Process]) -> None:
    a, b = processes(), processes()
    b.datastore.set_endpoints(parse_endpoint_flag(ENDPOINTS[0]))
    skipped = counter(metrics.STATE_SKIPPED_INSERTS)
    a.pick(ENDPOINTS[1], [5])
    a.pick(ENDPOINTS[0], [6])
    await until(lambda: b.index.match([6]) == {ENDPOINTS[0]: 1}, 5, "b to apply the known endpoint's insert")
    assert b.index.endpoints() == [ENDPOINTS[0]]
    assert counter(metrics.STATE_SKIPPED_INSERTS) - skipped == 1


async def test_store_down_drops_nothing_it_can_keep_then_resynchronises(
    redis_server: RedisServer, processes: Callable[..., Process], tmp_path: Path
) -> None:
    a, b = processes(max_pending=100), processes()
    await until(lambda: counter(metrics.STATE_STORE_CONNECTED) == 1, 5, "the store")
    a.pick(ENDPOINTS[0], [1])
    await until(lambda: b.index.match([1]) == {ENDPOINTS[0]: 1}, 5, "b to learn a's first pick")
    redis_server.kill()
    unpublished = counter(metrics.STATE_UNPUBLISHED_INSERTS)
    start = time.perf_counter()
    for n in range(150):  # the store is gone: picks go on, at the cost of an enqueue
        a.pick(ENDPOINTS[1], [100 + n])
    assert time.perf_counter() - start < 0.05
    await until(lambda: counter(metrics.STATE_STORE_CONNECTED) == 0, 5, "the failure to be seen")
    assert counter(metrics.STATE_UNPUBLISHED_INSERTS) - unpublished == 50  # beyond the 100 kept
    restarted = start_redis(tmp_path, "redis-restarted", port=redis_server.port)
    try:
        back = time.monotonic()
        took = await until(lambda: b.index.match([249]) == {ENDPOINTS[1]: 1}, 10, "b to learn what a kept")
        print(f"resynchronised {took:.3f}s after the store came back ({time.monotonic() - back:.3f}s)")
        assert all(b.index.match([100 + n]) == {ENDPOINTS[1]: 1} for n in range(50, 150))
        assert counter(metrics.STATE_STORE_CONNECTED) == 1
    finally:
        restarted.stop()
