"""The KV-event subscriber against real ZMQ publishers speaking vLLM's wire format.

The test publisher binds an XPUB socket (a PUB that also reports subscriptions, so a test can
wait until the subscriber is connected instead of sleeping) and an optional replay ROUTER.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
import zmq
import zmq.asyncio

from picker.datastore.endpoint import Endpoint
from picker.datastore.store import Datastore
from picker.kvevents.decode import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
)
from picker.kvevents.precise import PreciseIndex
from picker.kvevents.subscriber import (
    _DRAIN_LIMIT,
    KVEventSubscriber,
    SubscriberConfig,
    data_parallel_ranks,
)
from picker.prefix.hashing import chain_seed, token_block_hashes
from picker.telemetry import metrics
from picker_bench.process import free_port, wait_until
from tests.kv_event_encoder import ENCODINGS, Encoding, encode_batch, encode_message

HOST = "127.0.0.1"
MODEL = "m"
SIZE = 4


async def until(condition: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    """Poll `condition` until it holds; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


class Publisher:
    """One engine's KV-event publisher: numbered batches, a replay buffer, fault switches."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        port: int = 0,
        replay_port: int | None = None,
        encoding: Encoding = "positional",
        connect: str | None = None,
    ) -> None:
        """A publisher bound on `port` (0: any), or connected to a bound subscriber at `connect`."""
        self.ctx = ctx
        self.encoding = encoding
        self.topic = f"kv@{HOST}:8000@{MODEL}"
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if connect is None:
            self.port = _bind(self.pub, port)
            self.address = f"tcp://{HOST}:{self.port}"
        else:
            # Every subscriber's subscription is reported: a new one may come before the old one left.
            self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
            self.pub.connect(connect)
            self.port, self.address = 0, connect
        self.router: zmq.asyncio.Socket | None = None
        self.replay_port: int | None = None
        self._replay_task: asyncio.Task[None] | None = None
        if replay_port is not None:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.replay_port = _bind(self.router, replay_port)
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    async def subscribed(self) -> None:
        """Wait for a subscriber's subscription message (past the unsubscription of one that left)."""
        while True:
            assert await self.pub.poll(5000), "no subscriber connected"
            message = await self.pub.recv()
            if not message.startswith(b"\x00kv@"):
                assert message.startswith(b"\x01kv@"), message
                return

    def publish(self, *events: KVEvent, lost: bool = False) -> None:
        """Send one batch; `lost` numbers and buffers it without sending (a dropped message)."""
        frames = encode_message(self.topic, self.seq, EventBatch(time.time(), events, 0), self.encoding)
        self.buffer.append((self.seq, frames[2]))
        self.seq += 1
        if not lost:
            self.pub.send_multipart(frames)

    def send_raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    async def _serve_replay(self) -> None:
        assert self.router is not None
        while True:
            identity, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in self.buffer:
                if seq >= first:
                    await self.router.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([identity, b"", b"\xff" * 8, b""])

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            try:
                await self._replay_task
            except asyncio.CancelledError:
                pass
        self.pub.close(0)
        if self.router is not None:
            self.router.close(0)


def _bind(socket: zmq.asyncio.Socket, port: int) -> int:
    if port == 0:
        return socket.bind_to_random_port(f"tcp://{HOST}")

    def bound() -> bool:
        try:
            socket.bind(f"tcp://{HOST}:{port}")
        except zmq.ZMQError:
            return False  # the previous owner of the port may still be closing
        return True

    wait_until(bound, 5, f"port {port} to be free again", interval=0.01)
    return port


def stored(tokens: list[int], first: int = 0) -> BlockStored:
    hashes = token_block_hashes(tokens, SIZE, 77)  # the engine's own chain, unrelated to the picker's
    return BlockStored(
        tuple(hashes[first:]), hashes[first - 1] if first else None, tuple(tokens[first * SIZE :]), SIZE, medium="GPU"
    )


def engine_keys(tokens: list[int]) -> list[int]:
    return token_block_hashes(tokens, SIZE, 77)


def own_keys(tokens: list[int]) -> list[int]:
    return token_block_hashes(tokens, SIZE, chain_seed(MODEL))


PROMPT = list(range(1, 41))  # 10 blocks
OTHER = list(range(500, 520))  # 5 blocks


class Harness:
    """A datastore with one endpoint per publisher, a subscriber and its index."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.ctx = ctx
        self.index = PreciseIndex(SIZE)
        self.datastore = Datastore()
        self.subscriber: KVEventSubscriber | None = None
        self.publishers: list[Publisher] = []

    async def start(self, *publishers: Publisher, replay_port: int | None = None) -> list[str]:
        self.publishers.extend(publishers)
        endpoints = [Endpoint(HOST, 9000 + i, kv_events_address=p.address) for i, p in enumerate(publishers)]
        self.datastore.set_endpoints(endpoints)
        port = publishers[0].port if replay_port is not None else None
        config = SubscriberConfig(port=port, replay_port=replay_port, model=MODEL, replay_timeout=2.0)
        self.subscriber = KVEventSubscriber(self.index, self.datastore, config, self.ctx)
        self.subscriber.start()
        for p in publishers:
            await p.subscribed()
        return [e.address for e in endpoints]

    def score(self, endpoint: str, tokens: list[int]) -> float:
        return self.index.score(own_keys(tokens), [endpoint])[0]

    async def close(self) -> None:
        if self.subscriber is not None:
            await self.subscriber.stop()
        for p in self.publishers:
            await p.close()


@pytest.fixture
async def harness() -> Harness:  # type: ignore[misc]
    ctx = zmq.asyncio.Context()
    h = Harness(ctx)
    try:
        yield h
    finally:
        await h.close()
        ctx.term()


def counter(metric: object, *labels: str) -> float:
    return metric.labels(*labels)._value.get()  # type: ignore[attr-defined]


@pytest.mark.parametrize("encoding", ENCODINGS)
async def test_events_build_the_index_in_both_encodings(harness: Harness, encoding: Encoding) -> None:
    pub = Publisher(harness.ctx, encoding=encoding)
    (ep,) = await harness.start(pub)
    evicted_before = counter(metrics.KV_BLOCKS_EVICTED, ep)
    pub.publish(stored(PROMPT[:24]))
    pub.publish(stored(PROMPT, first=6), stored(OTHER))
    await until(lambda: harness.score(ep, PROMPT) == 1.0, what="the prompt to be cached")
    assert harness.score(ep, OTHER) == 1.0
    pub.publish(BlockRemoved(tuple(engine_keys(PROMPT)[7:]), "GPU"))
    await until(lambda: harness.score(ep, PROMPT) == 0.7, what="the eviction")
    assert counter(metrics.KV_BLOCKS_EVICTED, ep) - evicted_before == 3
    pub.publish(AllBlocksCleared())
    await until(lambda: len(harness.index) == 0, what="the clear")
    assert harness.index.is_known(ep)


async def test_a_burst_longer_than_one_drain_is_applied_in_order_without_gaps(harness: Harness) -> None:
    # The feed reads queued messages in batches of _DRAIN_LIMIT; every message of a burst
    # spanning several batches must be applied once, in order (no gap, nothing dropped).
    pub = Publisher(harness.ctx)
    (ep,) = await harness.start(pub)
    gaps = counter(metrics.KV_EVENT_GAPS, ep)
    removed = counter(metrics.KV_EVENTS, ep, "BlockRemoved")
    messages = 3 * _DRAIN_LIMIT + 1
    for _ in range(messages // 2):
        pub.publish(stored(PROMPT))
        pub.publish(BlockRemoved(tuple(engine_keys(PROMPT)), "GPU"))
    pub.publish(stored(PROMPT[:20]))  # the last message decides what is cached
    await until(lambda: counter(metrics.KV_EVENTS, ep, "BlockRemoved") - removed == messages // 2, what="the burst")
    await until(lambda: harness.score(ep, PROMPT) == 0.5, what="the last message")
    assert counter(metrics.KV_EVENT_GAPS, ep) == gaps and harness.index.is_known(ep)


async def test_a_gap_is_filled_from_the_replay_socket(harness: Harness) -> None:
    pub = Publisher(harness.ctx, replay_port=0)
    (ep,) = await harness.start(pub, replay_port=pub.replay_port)
    pub.publish(stored(PROMPT[:8]))
    await until(lambda: harness.score(ep, PROMPT) == 0.2)
    gaps = counter(metrics.KV_EVENT_GAPS, ep)
    pub.publish(stored(PROMPT[:20], first=2), lost=True)
    pub.publish(BlockRemoved((engine_keys(PROMPT)[4],)), lost=True)
    pub.publish(stored(OTHER))
    await until(lambda: harness.score(ep, OTHER) == 1.0, what="the message after the gap")
    assert harness.index.is_known(ep)
    assert harness.score(ep, PROMPT) == 0.4  # blocks 0-3: the replayed store, then the replayed removal
    assert counter(metrics.KV_EVENT_GAPS, ep) == gaps + 1
    assert counter(metrics.KV_EVENT_REPLAYS, ep, "complete") >= 1


async def test_a_gap_without_replay_makes_the_endpoint_unknown_until_cleared(harness: Harness) -> None:
    pub = Publisher(harness.ctx)
    (ep,) = await harness.start(pub)
    pub.publish(stored(PROMPT))
    await until(lambda: harness.score(ep, PROMPT) == 1.0)
    pub.publish(BlockRemoved(tuple(engine_keys(PROMPT))), lost=True)
    pub.publish(stored(OTHER))
    await until(lambda: not harness.index.is_known(ep), what="the gap")
    assert harness.score(ep, PROMPT) == 0.0 and harness.score(ep, OTHER) == 0.0
    assert metrics.KV_STATE_KNOWN.labels(ep)._value.get() == 0
    pub.publish(AllBlocksCleared(), stored(PROMPT[:20]))
    await until(lambda: harness.index.is_known(ep), what="the rebuild")
    await until(lambda: harness.score(ep, PROMPT) == 0.5)
    assert harness.score(ep, OTHER) == 0.0


async def test_replay_that_cannot_cover_the_gap_makes_the_endpoint_unknown(harness: Harness) -> None:
    pub = Publisher(harness.ctx, replay_port=0)
    (ep,) = await harness.start(pub, replay_port=pub.replay_port)
    pub.publish(stored(PROMPT))
    await until(lambda: harness.score(ep, PROMPT) == 1.0)
    pub.publish(stored(OTHER), lost=True)
    pub.buffer.clear()  # the publisher's replay window no longer holds the lost message
    pub.publish(stored(OTHER))
    await until(lambda: not harness.index.is_known(ep), what="the unrecoverable gap")
    assert counter(metrics.KV_EVENT_REPLAYS, ep, "incomplete") >= 1


async def test_decode_errors_are_counted_and_never_stop_the_subscriber(harness: Harness) -> None:
    pub = Publisher(harness.ctx)
    (ep,) = await harness.start(pub)
    errors = counter(metrics.KV_EVENT_DECODE_ERRORS, ep)
    pub.send_raw([pub.topic.encode(), b"\x00"])  # not [topic, seq, payload]: ignored
    pub.send_raw([pub.topic.encode(), b"\x01\x02", b"x"])  # bad sequence frame: ignored
    pub.publish(stored(PROMPT))
    await until(lambda: harness.score(ep, PROMPT) == 1.0)
    assert harness.index.is_known(ep)
    # A numbered message whose payload is garbage lost its events: the endpoint goes unknown.
    pub.send_raw([pub.topic.encode(), pub.seq.to_bytes(8, "big"), b"\xc1garbage"])
    pub.seq += 1
    pub.send_raw(
        [
            pub.topic.encode(),
            pub.seq.to_bytes(8, "big"),
            encode_batch(EventBatch(0.0, (BlockStored((1,), None, (1,), 0),))),
        ]
    )
    pub.seq += 1
    await until(lambda: counter(metrics.KV_EVENT_DECODE_ERRORS, ep) == errors + 4, what="four decode errors")
    assert not harness.index.is_known(ep)
    pub.publish(AllBlocksCleared(), stored(OTHER))
    await until(lambda: harness.score(ep, OTHER) == 1.0, what="recovery after the bad messages")
    assert harness.index.is_known(ep)


async def test_a_restarted_publisher_resets_the_endpoint(harness: Harness) -> None:
    pub = Publisher(harness.ctx)
    (ep,) = await harness.start(pub)
    pub.publish(stored(PROMPT))
    pub.publish(stored(OTHER))
    await until(lambda: harness.score(ep, OTHER) == 1.0)
    restarts = counter(metrics.KV_EVENT_PUBLISHER_RESTARTS, ep)
    port = pub.port
    await pub.close()
    harness.publishers.remove(pub)
    again = Publisher(harness.ctx, port=port)  # a new engine process: sequence from 0, empty cache
    harness.publishers.append(again)
    await again.subscribed()  # libzmq reconnected the SUB socket by itself
    again.publish(stored(OTHER[:8]))
    await until(lambda: counter(metrics.KV_EVENT_PUBLISHER_RESTARTS, ep) == restarts + 1, what="the restart")
    await until(lambda: harness.score(ep, OTHER) == 0.4)
    assert harness.score(ep, PROMPT) == 0.0 and harness.index.is_known(ep)


async def test_a_late_joiner_replays_the_history(harness: Harness) -> None:
    pub = Publisher(harness.ctx, replay_port=0)
    pub.publish(stored(PROMPT))  # before anyone subscribed
    pub.publish(BlockRemoved((engine_keys(PROMPT)[5],)))
    (ep,) = await harness.start(pub, replay_port=pub.replay_port)
    pub.publish(stored(OTHER))
    await until(lambda: harness.score(ep, OTHER) == 1.0)
    assert harness.score(ep, PROMPT) == 0.5 and harness.index.is_known(ep)


async def test_a_late_joiner_without_replay_starts_empty_but_known(harness: Harness) -> None:
    pub = Publisher(harness.ctx)
    pub.publish(stored(PROMPT))
    (ep,) = await harness.start(pub)
    pub.publish(stored(OTHER))
    await until(lambda: harness.score(ep, OTHER) == 1.0)
    assert harness.score(ep, PROMPT) == 0.0 and harness.index.is_known(ep)


async def test_a_bound_subscriber_gives_each_engines_events_to_the_endpoints_at_its_topics_ip(
    harness: Harness,
) -> None:
    """llm-d's way round: the picker binds, the engines connect and publish with the topic
    `kv@<pod IP>@<model>`, each numbering its own messages from 0."""
    bind = f"tcp://{HOST}:{free_port(HOST)}"
    pods = [Endpoint("127.0.0.1", 9700), Endpoint("127.0.0.2", 9700), Endpoint("127.0.0.2", 9701)]  # their own metrics
    harness.datastore.set_endpoints(pods)
    config = SubscriberConfig(bind_address=bind, model=MODEL)
    harness.subscriber = KVEventSubscriber(harness.index, harness.datastore, config, harness.ctx)
    harness.subscriber.start()
    engines = []
    for ip in ("127.0.0.1", "127.0.0.2", "127.0.0.9"):  # the last one's pod is not in the pool
        engine = Publisher(harness.ctx, connect=bind)
        engine.topic = f"kv@{ip}@{MODEL}"
        harness.publishers.append(engine)
        await engine.subscribed()
        engines.append(engine)
    engines[0].publish(stored(PROMPT))
    engines[1].publish(stored(OTHER))
    engines[2].publish(stored(OTHER))
    engines[0].publish(stored(OTHER))  # its own second message: no gap, no restart
    a, b, b_rank = (pod.address for pod in pods)
    await until(lambda: harness.score(a, OTHER) == 1.0 and harness.score(b, OTHER) == 1.0, what="the events")
    assert harness.score(a, PROMPT) == 1.0 and harness.score(b, PROMPT) == 0.0
    assert harness.score(b_rank, OTHER) == 1.0  # both ranks of the pod at 127.0.0.2, as llm-d keys by IP
    assert counter(metrics.KV_EVENT_GAPS, a) == 0 and counter(metrics.KV_EVENT_PUBLISHER_RESTARTS, a) == 0


async def test_a_bound_subscriber_whose_address_is_taken_binds_once_it_is_free(harness: Harness) -> None:
    """A reloaded config's subscriber starts before the one it replaces has stopped: it binds
    once that one lets the address go, and then gets the engines' events."""
    bind = f"tcp://{HOST}:{free_port(HOST)}"
    pod = Endpoint("127.0.0.1", 9710)
    harness.datastore.set_endpoints([pod])
    config = SubscriberConfig(bind_address=bind, model=MODEL)
    old = KVEventSubscriber(PreciseIndex(SIZE), harness.datastore, config, harness.ctx)
    old.start()
    harness.subscriber = KVEventSubscriber(harness.index, harness.datastore, config, harness.ctx)
    harness.subscriber.start()  # the address is the old one's
    engine = Publisher(harness.ctx, connect=bind)
    engine.topic = f"kv@127.0.0.1@{MODEL}"
    harness.publishers.append(engine)
    await engine.subscribed()  # the old subscriber's
    await old.stop()
    await engine.subscribed()  # the new one's, bound now
    engine.publish(stored(PROMPT))
    await until(lambda: harness.score(pod.address, PROMPT) == 1.0, what="the new subscriber's events")


async def test_endpoints_follow_the_datastore(harness: Harness) -> None:
    first, second = Publisher(harness.ctx), Publisher(harness.ctx)
    a, b = await harness.start(first, second)
    first.publish(stored(PROMPT))
    second.publish(stored(PROMPT[:20]))
    await until(lambda: harness.index.score(own_keys(PROMPT), [a, b]) == [1.0, 0.5])
    harness.datastore.set_endpoints([e for e in harness.datastore.endpoints().values() if e.address == b])
    assert harness.index.endpoints() == [b]
    assert harness.index.score(own_keys(PROMPT), [a, b]) == [0.0, 0.5]
    third = Publisher(harness.ctx)
    harness.publishers.append(third)
    harness.datastore.set_endpoints(
        [*harness.datastore.endpoints().values(), Endpoint(HOST, 9100, kv_events_address=third.address)]
    )
    await third.subscribed()
    third.publish(stored(OTHER))
    await until(lambda: harness.index.score(own_keys(OTHER), [f"{HOST}:9100"]) == [1.0], what="the new endpoint")


def test_endpoints_on_one_ip_are_data_parallel_ranks_in_port_order() -> None:
    endpoints = [Endpoint("10.0.0.1", 8001), Endpoint("10.0.0.2", 9000), Endpoint("10.0.0.1", 8000)]
    assert data_parallel_ranks(endpoints) == {"10.0.0.1:8000": 0, "10.0.0.1:8001": 1, "10.0.0.2:9000": 0}


def test_replay_address_is_shifted_with_the_publisher_port() -> None:
    subscriber = KVEventSubscriber(PreciseIndex(), Datastore(), SubscriberConfig(port=5557, replay_port=5600))
    assert subscriber.publisher_address(Endpoint("10.1.2.3", 8000)) == "tcp://10.1.2.3:5557"
    assert subscriber.replay_address(Endpoint("10.1.2.3", 8000)) == "tcp://10.1.2.3:5600"
    rank2 = Endpoint("10.1.2.3", 8002, kv_events_address="tcp://10.1.2.3:5559")
    assert subscriber.replay_address(rank2) == "tcp://10.1.2.3:5602"
    assert subscriber.publisher_address(Endpoint("10.1.2.3", 8001), 1) == "tcp://10.1.2.3:5558"
    assert subscriber.replay_address(Endpoint("10.1.2.3", 8001), 1) == "tcp://10.1.2.3:5601"
    assert (
        KVEventSubscriber(PreciseIndex(), Datastore(), SubscriberConfig(port=None)).publisher_address(
            Endpoint("::1", 8000)
        )
        is None
    )
    assert (
        KVEventSubscriber(PreciseIndex(), Datastore(), SubscriberConfig(port=5557)).publisher_address(
            Endpoint("fd00::1", 8000)
        )
        == "tcp://[fd00::1]:5557"
    )


async def test_a_restarted_publisher_that_ran_ahead_is_not_taken_for_a_gap(harness: Harness) -> None:
    pub = Publisher(harness.ctx, replay_port=0)
    (ep,) = await harness.start(pub, replay_port=pub.replay_port)
    pub.publish(stored(PROMPT))
    pub.publish(stored(OTHER[:8]))
    await until(lambda: harness.score(ep, OTHER) == 0.4)
    port, replay_port = pub.port, pub.replay_port
    await pub.close()
    harness.publishers.remove(pub)
    again = Publisher(harness.ctx, port=port, replay_port=replay_port)
    harness.publishers.append(again)
    for _ in range(5):  # the new engine publishes before the subscriber is back
        again.publish(stored(OTHER[:4]), lost=True)
    await again.subscribed()
    again.publish(stored(OTHER))  # seq 5: beyond the old expected 2, yet not a gap of the old stream
    await until(lambda: harness.score(ep, OTHER) == 1.0)
    assert harness.score(ep, PROMPT) == 0.0  # the old engine's blocks are gone
    assert harness.index.is_known(ep)
