"""State sync through a real redis-server, in process: two or three `StateSync`s (each a picker
process's) with their own datastore, prefix index and TTFT model share one stream."""

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
from picker.prefix.plugins import index_key
from picker.prefix.ttft import TtftModel
from picker.state.messages import decode_batch
from picker.state.sync import SharedIndex, SharedTtft, StateSync, stream_name
from picker.state.url import parse_store_url
from picker.telemetry import metrics
from tests.redis_server import RedisServer, start_redis

ENDPOINTS = ("10.0.0.5:8000", "10.0.0.6:8000")
INDEX = index_key("approx-prefix-cache-producer")  # the default config's producer


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
        self.ttft = TtftModel()
        self.shared_ttft: SharedTtft = self.sync.share_ttft(self.ttft)

    def pick(self, endpoint: str, hashes: list[int]) -> None:
        """What the producer does after a pick: insert locally, publish."""
        self.index.insert(endpoint, hashes)
        self.shared.publish(endpoint, hashes, None, True)

    def in_flight(self) -> dict[str, int]:
        """Requests in flight per endpoint as this process's scheduler sees them."""
        return {state.address: state.in_flight_requests for state in self.datastore.snapshot()}

    def learn(self, endpoint: str, ttft_seconds: float, prompt_tokens: int, cached: int, work_ahead: float) -> None:
        """What the producer does when a response ends: learn locally, publish."""
        self.ttft.observe(endpoint, ttft_seconds, prompt_tokens, cached, work_ahead)
        self.shared_ttft.observed(endpoint, ttft_seconds, prompt_tokens, cached, work_ahead)


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


async def until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `condition` on the loop; TimeoutError naming `what` after `timeout` seconds."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.005)


def counter(metric: object) -> float:
    return metric._value.get()  # type: ignore[attr-defined,no-any-return]


async def test_a_pick_in_one_process_reaches_the_others_index(
    processes: Callable[..., Process],
) -> None:
    a, b = processes(), processes()
    await until(lambda: counter(metrics.STATE_STORE_CONNECTED) == 1, 5, "the store")
    applied = counter(metrics.STATE_APPLIED_INSERTS)
    prompt = [11, 12, 13, 14]
    a.pick(ENDPOINTS[1], prompt)
    await until(lambda: b.index.match(prompt) == {ENDPOINTS[1]: 4}, 5, "b to learn a's pick")
    b.pick(ENDPOINTS[0], [21, 22])
    await until(lambda: a.index.match([21, 22]) == {ENDPOINTS[0]: 2}, 5, "a to learn b's pick")
    assert len(a.index) == len(b.index) == 6
    # a read its own batch before b's, and skipped it: each applied just the other's insert
    assert counter(metrics.STATE_APPLIED_INSERTS) - applied == 2


async def test_publishing_is_an_enqueue(processes: Callable[..., Process]) -> None:
    """A publish does no I/O: it queues the insert, and the sync task sends it once the loop
    runs it (the cost of a publish is `picker bench`'s to measure)."""
    a, b = processes(), processes()
    await until(lambda: counter(metrics.STATE_STORE_CONNECTED) == 1, 5, "the store")
    await until(lambda: a.sync.pending == 0, 5, "a to have nothing queued")
    for n in range(1000):  # the loop never runs meanwhile: nothing can have been sent
        a.shared.publish(ENDPOINTS[0], [3000 + n], None, True)
    assert a.sync.pending == 1000 and len(b.index) == 0
    await until(lambda: a.sync.pending == 0, 5, "a to publish")
    await until(lambda: len(b.index) == 1000, 5, "b to learn a's inserts")


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
    for n in range(150):  # the store is gone: picks go on, at the cost of an enqueue
        a.pick(ENDPOINTS[1], [100 + n])
    # The loop never ran meanwhile: each pick queued its insert, the oldest dropped beyond the 100 kept.
    assert counter(metrics.STATE_UNPUBLISHED_INSERTS) - unpublished == 50
    await until(lambda: counter(metrics.STATE_STORE_CONNECTED) == 0, 5, "the failure to be seen")
    restarted = start_redis(tmp_path, "redis-restarted", port=redis_server.port)
    try:
        await until(lambda: b.index.match([249]) == {ENDPOINTS[1]: 1}, 10, "b to learn what a kept")
        assert all(b.index.match([100 + n]) == {ENDPOINTS[1]: 1} for n in range(50, 150))
        assert counter(metrics.STATE_STORE_CONNECTED) == 1
    finally:
        restarted.stop()


async def test_in_flight_counts_are_added_to_the_others_and_released(processes: Callable[..., Process]) -> None:
    a, b, c = processes(), processes(), processes()
    await until(lambda: counter(metrics.STATE_STORE_CONNECTED) == 1, 5, "the store")
    for _ in range(3):
        a.datastore.acquire(ENDPOINTS[0], 100)
    b.datastore.acquire(ENDPOINTS[0], 10)
    b.datastore.acquire(ENDPOINTS[1], 20)
    await until(lambda: c.in_flight() == {ENDPOINTS[0]: 4, ENDPOINTS[1]: 1}, 5, "c to count a's and b's")
    assert a.in_flight() == {ENDPOINTS[0]: 4, ENDPOINTS[1]: 1}  # its own plus b's
    assert [s.in_flight_tokens for s in c.datastore.snapshot()] == [310, 20]
    assert c.datastore.in_flight(ENDPOINTS[0]) == 0  # its own count (its metric) stays its own
    for _ in range(3):
        a.datastore.release(ENDPOINTS[0], 100)
    await until(lambda: c.in_flight() == {ENDPOINTS[0]: 1, ENDPOINTS[1]: 1}, 5, "c to see a's releases")


async def load_reports_span(redis_server: RedisServer, origin: str) -> float:
    """Seconds between the first and the last in-flight report of `origin` in the stream."""
    client = aioredis.Redis(port=redis_server.port)
    try:
        entries = await client.xrange(stream_name("ns", "pool"))
    finally:
        await client.aclose()
    written = [
        int(entry_id.split(b"-")[0]) / 1000
        for entry_id, fields in entries
        if (batch := decode_batch(fields[b"b"])).origin == origin and batch.in_flight is not None
    ]
    return written[-1] - written[0] if written else 0.0


async def test_a_dead_process_s_in_flight_counts_expire(
    redis_server: RedisServer, processes: Callable[..., Process]
) -> None:
    a, b = processes(load_expires_ms=600), processes()
    for _ in range(2):
        a.datastore.acquire(ENDPOINTS[1], 50)
    await until(lambda: b.in_flight()[ENDPOINTS[1]] == 2, 5, "b to count a's requests")
    # a refreshes a load that is not zero before it expires: it stays counted past its expiry
    deadline = time.monotonic() + 5
    while await load_reports_span(redis_server, a.sync.origin) < 1.2:
        assert b.in_flight()[ENDPOINTS[1]] == 2
        assert time.monotonic() < deadline, "a stopped refreshing its load"
        await asyncio.sleep(0.05)
    assert b.in_flight()[ENDPOINTS[1]] == 2
    await a.sync.stop()  # dies with its requests in flight: nothing says they ended
    await until(lambda: b.in_flight()[ENDPOINTS[1]] == 0, 5, "a's load to expire at b")
    late = processes()
    await until(lambda: late.sync.last_id == b.sync.last_id, 5, "the late process to replay the stream")
    assert late.in_flight() == {ENDPOINTS[0]: 0, ENDPOINTS[1]: 0}  # a's old reports had expired


async def test_every_process_learns_every_ttft_observation(processes: Callable[..., Process]) -> None:
    a, b = processes(), processes()
    await until(lambda: counter(metrics.STATE_STORE_CONNECTED) == 1, 5, "the store")
    for n in range(10):  # prefill samples (no queue ahead): 2,000 tokens in 0.2 s, 10,000 tokens/s
        a.learn(ENDPOINTS[0], 0.21, 2000 + n, 0, 0.0)
    b.learn(ENDPOINTS[1], 0.11, 1000, 0, 0.0)
    await until(lambda: b.ttft.rates(ENDPOINTS[0]).prefill_samples == 10, 5, "b to learn a's samples")
    await until(lambda: a.ttft.rates(ENDPOINTS[1]).prefill_samples == 1, 5, "a to learn b's sample")
    # the same samples make the same model: both route as one that served all the requests would
    # (within 0.1%: each applies its own samples first, so the EWMA saw them in another order)
    for endpoint in ENDPOINTS:
        assert a.ttft.prefill_rate(endpoint) == pytest.approx(b.ttft.prefill_rate(endpoint), rel=1e-3)
    assert a.ttft.pool.prefill_samples == b.ttft.pool.prefill_samples == 11
    assert a.ttft.prefill_rate(ENDPOINTS[0]) > 2 * TtftModel().prefill_rate(ENDPOINTS[0])
    late = processes()
    await until(lambda: late.ttft.pool.prefill_samples == 11, 5, "the late process to learn from the stream")


async def test_queued_prefill_reaches_the_others_backlog(processes: Callable[..., Process]) -> None:
    a, b = processes(), processes()
    await until(lambda: counter(metrics.STATE_STORE_CONNECTED) == 1, 5, "the store")
    a.ttft.add_backlog(ENDPOINTS[1], 40_000)
    a.shared_ttft.queued(ENDPOINTS[1], 40_000)
    # 40,000 tokens drain at the prior 5,000 tokens/s: b still sees most of them
    await until(lambda: b.ttft.backlog(ENDPOINTS[1]) > 30_000, 5, "b to add a's queued prefill")
    assert b.ttft.backlog(ENDPOINTS[0]) == 0


async def test_while_the_store_is_down_the_others_counts_expire_and_come_back_after(
    redis_server: RedisServer, processes: Callable[..., Process], tmp_path: Path
) -> None:
    a, b = processes(load_expires_ms=600), processes(load_expires_ms=600)
    a.datastore.acquire(ENDPOINTS[0], 10)
    await until(lambda: b.in_flight()[ENDPOINTS[0]] == 1, 5, "b to count a's request")
    redis_server.kill()
    # b hears nothing more from a: it routes on its own counts once a's report has expired
    await until(lambda: b.in_flight()[ENDPOINTS[0]] == 0, 5, "a's report to expire at b")
    restarted = start_redis(tmp_path, "redis-restarted", port=redis_server.port)
    try:
        # a refreshes its report (still not zero) once the store answers
        await until(lambda: b.in_flight()[ENDPOINTS[0]] == 1, 10, "a's report to come back")
    finally:
        restarted.stop()
