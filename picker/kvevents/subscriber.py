"""KV-event subscriber: one ZMQ SUB socket per endpoint, feeding the precise prefix index (or
one bound socket that the engines connect to, as llm-d's subscriber is: see below).

Each endpoint's publisher (vLLM `--kv-events-config`, the picker's simulator) is read by its
own asyncio task, so one endpoint's events are applied strictly in order. Sequence numbers
guard completeness:

- the next expected number: apply;
- a jump forward (lost messages): ask the publisher's replay ROUTER socket for the missing
  range; if there is none or it cannot cover the range, mark the endpoint unknown (excluded
  from precise scoring) until its cache is rebuilt by `AllBlocksCleared` or a restart;
- a jump back: the publisher restarted (a new engine, an empty cache): reset the endpoint and
  join the new publisher as below;
- the first message after subscribing: if it is not number 0, replay the history from 0 (what
  the replay window still holds); without it the index starts empty. Either way it may miss
  blocks cached before it joined, but never claims a block that is not cached.

libzmq reconnects a SUB socket by itself when a publisher goes away and comes back. A socket
monitor tells the feed that it reconnected: the next message then cannot be told apart from
a new engine's unless its number is exactly the expected one, so any jump is treated as a
restart. Endpoints removed from the datastore are unsubscribed and forgotten by the index.

With `bind_address` (llm-d's `kvEventsConfig.zmqEndpoint`, e.g. `tcp://*:5557`) the picker binds
one SUB socket there instead and the engines connect to it and publish (vLLM's
`--kv-events-config` with that endpoint and the topic `kv@<pod IP>@<model>`): each message goes to
the endpoints at its topic's IP (all ranks of a data-parallel pod, as llm-d keys by pod IP; a
topic naming `ip:port` goes to that endpoint only),
each with its own sequence, as above; a publisher's reconnect is not seen on a bound socket, so
only a number below the expected one counts as a restart (a jump forward is a gap).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from picker.datastore.endpoint import Endpoint, join_host_port
from picker.datastore.store import Datastore
from picker.kvevents.decode import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    EventMessage,
    decode_batch,
    decode_message,
    decode_seq,
)
from picker.kvevents.precise import PreciseIndex
from picker.telemetry import metrics

log = logging.getLogger(__name__)

_END_OF_REPLAY = -1
_DRAIN_LIMIT = 16  # queued messages applied in a row before the loop serves anything else
_BIND_RETRY_S = 0.1  # while a bound subscriber's address is taken


@dataclass(frozen=True, slots=True)
class SubscriberConfig:
    """Where to find each endpoint's publisher and how to read it.

    `port`: the publisher port on the endpoint's IP, used when the endpoint has no
    `kv_events_address` (None: only endpoints with an address are subscribed).
    `replay_port`: the publisher's replay ROUTER port on the same host (None: no replay);
    see `KVEventSubscriber.replay_address`.
    `model`: the model whose chain seed keys blocks without a LoRA, when the topic
    (`kv@<pod>@<model>`) does not name one.
    `bind_address`: a ZMQ endpoint to bind for the engines to connect to (then `port` and
    `replay_port` are not used); None subscribes to each endpoint's publisher.
    """

    port: int | None = 5557
    bind_address: str | None = None
    replay_port: int | None = None
    topic_filter: str = "kv@"
    model: str = ""
    replay_timeout: float = 1.0


class KVEventSubscriber:
    """Keeps one subscription per datastore endpoint and applies its events to `index`."""

    def __init__(
        self,
        index: PreciseIndex,
        datastore: Datastore,
        config: SubscriberConfig = SubscriberConfig(),
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.index = index
        self.datastore = datastore
        self.config = config
        self._context = context
        self._owns_context = context is None
        self._feeds: dict[str, _Feed] = {}
        self._feeds_by_ip: dict[str, list[_Feed]] = {}  # with `bind_address`: a topic's IP → its feeds
        self._bound: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False

    @property
    def started(self) -> bool:
        return self._started

    @property
    def context(self) -> zmq.asyncio.Context:
        """The ZMQ context of the subscriptions (exists once started)."""
        assert self._context is not None, "start() the subscriber first"
        return self._context

    def start(self) -> None:
        """Subscribe to every current endpoint and follow the datastore (call on the event loop)."""
        if self._started:
            return
        self._started = True
        self._loop = asyncio.get_running_loop()
        if self._context is None:
            self._context = zmq.asyncio.Context()
        self.datastore.add_listener(self._on_endpoints)
        self._on_endpoints({}, self.datastore.endpoints())
        if self.config.bind_address is not None:
            self._bound = self._loop.create_task(self._run_bound(self.config.bind_address), name="kv-events bound")

    async def stop(self) -> None:
        """Close every subscription and stop following the datastore."""
        if not self._started:
            return
        self._started = False
        self.datastore.remove_listener(self._on_endpoints)
        tasks = [feed.task for feed in self._feeds.values() if feed.task is not None]
        if self._bound is not None:
            tasks.append(self._bound)
        self._feeds, self._feeds_by_ip, self._bound = {}, {}, None
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        if self._owns_context and self._context is not None:
            self._context.term()
            self._context = None

    def publisher_address(self, endpoint: Endpoint, rank: int = 0) -> str | None:
        """The ZMQ address of the endpoint's KV-event publisher, if one is known: its
        `kv_events_address`, else `port` + `rank` on its IP (vLLM's data-parallel rank r
        publishes on the configured port + r; see `data_parallel_ranks`); with `bind_address`,
        that address, where every engine publishes."""
        if self.config.bind_address is not None:
            return self.config.bind_address
        if endpoint.kv_events_address:
            return endpoint.kv_events_address
        if self.config.port is None:
            return None
        return f"tcp://{join_host_port(endpoint.ip, self.config.port + rank)}"

    def replay_address(self, endpoint: Endpoint, rank: int = 0) -> str | None:
        """The endpoint's replay ROUTER address on the publisher's host, if replay is configured.

        A publisher on a port other than `port` (a data-parallel rank) has its replay socket
        shifted by the same amount, as vLLM shifts both.
        """
        if self.config.replay_port is None or self.config.bind_address is not None:
            return None
        publisher = self.publisher_address(endpoint, rank)
        if publisher is None:
            return None
        host, _, port_text = publisher.rpartition(":")
        replay_port = self.config.replay_port
        if self.config.port is not None and port_text.isdigit():
            replay_port += int(port_text) - self.config.port
        return f"{host}:{replay_port}"

    def _on_endpoints(self, old: dict[str, Endpoint], new: dict[str, Endpoint]) -> None:
        if not self._started or self._loop is None:
            return
        ranks = data_parallel_ranks(new.values())
        for address in list(self._feeds):
            endpoint = new.get(address)
            feed = self._feeds[address]
            if endpoint is None or self.publisher_address(endpoint, ranks[address]) != feed.address:
                if feed.task is not None:
                    feed.task.cancel()
                del self._feeds[address]
                self.index.forget(address)
                _drop_metrics(address)
        for address, endpoint in new.items():
            if address in self._feeds:
                continue
            publisher = self.publisher_address(endpoint, ranks[address])
            if publisher is None:
                continue
            self.index.track(address, self.config.model)
            feed = _Feed(self, address, publisher, self.replay_address(endpoint, ranks[address]))
            if self.config.bind_address is None:
                feed.task = self._loop.create_task(feed.run(), name=f"kv-events {address}")
            self._feeds[address] = feed
        by_ip: dict[str, list[_Feed]] = {}
        for address, feed in self._feeds.items():
            by_ip.setdefault(new[address].ip, []).append(feed)
        self._feeds_by_ip = by_ip

    async def _run_bound(self, bind_address: str) -> None:
        """Bind (retrying while the address is taken: a reloaded config's subscriber starts
        before the one it replaces stops), then give each message to the feeds of its topic's IP."""
        socket = _sub_socket(self.context, self.config.topic_filter)
        try:
            logged = False
            while True:
                try:
                    socket.bind(bind_address)
                    break
                except zmq.ZMQError as error:
                    if not logged:
                        log.error("kv events: cannot bind %s yet (retrying): %s", bind_address, error)
                        logged = True
                    await asyncio.sleep(_BIND_RETRY_S)
            log.info("kv events: bound %s for the engines to publish to", bind_address)
            queued: zmq.Socket[bytes] = zmq.Socket.shadow(socket.underlying)
            async for batch in _batches(socket, queued):
                for frames in batch:
                    for feed in self._feeds_of(frames[0]):
                        await feed.receive_safely(frames)
        finally:
            socket.close(0)

    def _feeds_of(self, topic: bytes) -> list[_Feed]:
        """The feeds a bound socket's message is for: those at the topic's pod IP
        (`kv@<ip>@<model>`), or the one endpoint it names as `ip:port`."""
        parts = topic.split(b"@", 2)
        pod = parts[1].decode(errors="replace") if len(parts) > 1 else ""
        feed = self._feeds.get(pod)
        return [feed] if feed is not None else self._feeds_by_ip.get(pod, [])


def _sub_socket(context: zmq.asyncio.Context, topic_filter: str) -> zmq.asyncio.Socket:
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVHWM, 100_000)
    socket.setsockopt(zmq.RECONNECT_IVL, 100)
    socket.setsockopt(zmq.RECONNECT_IVL_MAX, 5_000)
    socket.setsockopt(zmq.SUBSCRIBE, topic_filter.encode())
    return socket


async def _batches(
    socket: zmq.asyncio.Socket, queued: zmq.Socket[bytes], pending: Callable[[], bool] = lambda: False
) -> AsyncIterator[list[list[bytes]]]:
    """The socket's messages in batches: one awaited, then what is already queued (read through
    the plain `queued` shadow: the asyncio socket's future per call cost more than decoding a
    typical message, BENCHMARKS.md, issue 13), at most `_DRAIN_LIMIT`, ending early when
    `pending()` says something must be seen between two messages."""
    while True:
        batch = [await socket.recv_multipart()]
        while len(batch) < _DRAIN_LIMIT and not pending():
            try:
                batch.append(queued.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
        yield batch
        if len(batch) == _DRAIN_LIMIT:
            # More may be queued, and awaiting a ready socket does not yield: let the request
            # path run between batches (a 1,000-block message takes ~1 ms).
            await asyncio.sleep(0)


def data_parallel_ranks(endpoints: Iterable[Endpoint]) -> dict[str, int]:
    """Each endpoint's rank among the endpoints on its IP, in port order.

    An InferencePool lists a data-parallel vLLM as one endpoint per rank (target ports
    8000, 8001, ...), and rank r publishes KV events on the configured port + r.
    """
    by_ip: dict[str, list[Endpoint]] = {}
    for endpoint in endpoints:
        by_ip.setdefault(endpoint.ip, []).append(endpoint)
    return {
        endpoint.address: rank
        for group in by_ip.values()
        for rank, endpoint in enumerate(sorted(group, key=lambda e: e.port))
    }


class _Feed:
    """The subscription of one endpoint: its socket, its sequence and its metric children."""

    task: asyncio.Task[None] | None = None  # its own socket's reader (none on a bound socket)

    def __init__(self, owner: KVEventSubscriber, endpoint: str, address: str, replay_address: str | None) -> None:
        self.owner = owner
        self.index = owner.index
        self.endpoint = endpoint
        self.address = address
        self.replay_address = replay_address
        self.expected: int | None = None  # next sequence number; None until the first message
        self.reconnected = False  # the socket reconnected since the last message
        self.model = owner.config.model
        self._stored = metrics.KV_EVENTS.labels(endpoint, "BlockStored")
        self._removed = metrics.KV_EVENTS.labels(endpoint, "BlockRemoved")
        self._cleared = metrics.KV_EVENTS.labels(endpoint, "AllBlocksCleared")
        self._unknown_type = metrics.KV_EVENTS.labels(endpoint, "unknown")
        self._evicted = metrics.KV_BLOCKS_EVICTED.labels(endpoint)
        self._decode_errors = metrics.KV_EVENT_DECODE_ERRORS.labels(endpoint)
        self._gaps = metrics.KV_EVENT_GAPS.labels(endpoint)
        self._known = metrics.KV_STATE_KNOWN.labels(endpoint)
        self._known.set(1)

    async def run(self) -> None:
        socket = _sub_socket(self.owner.context, self.owner.config.topic_filter)
        monitor = socket.get_monitor_socket(zmq.EVENT_CONNECTED)  # before connecting: see every connection
        try:
            socket.connect(self.address)
        except zmq.ZMQError as error:
            log.error("kv events: cannot subscribe to %s for %s: %s", self.address, self.endpoint, error)
            socket.disable_monitor()
            monitor.close(0)
            socket.close(0)
            return
        log.info("kv events: subscribed to %s for %s", self.address, self.endpoint)
        connections = 0
        queued: zmq.Socket[bytes] = zmq.Socket.shadow(socket.underlying)
        connection_events: zmq.Socket[bytes] = zmq.Socket.shadow(monitor.underlying)
        try:
            # A pending connection event ends a batch: the messages after it are told apart.
            async for batch in _batches(socket, queued, lambda: bool(connection_events.poll(0))):
                for frames in batch:
                    # libzmq queues a connection's CONNECTED event before any of its messages.
                    while connection_events.poll(0):
                        event = parse_monitor_message(connection_events.recv_multipart())["event"]
                        if event == zmq.EVENT_CONNECTED:
                            connections += 1
                            self.reconnected = connections > 1
                    await self.receive_safely(frames)
        finally:
            socket.disable_monitor()
            monitor.close(0)
            socket.close(0)

    async def receive_safely(self, frames: list[bytes]) -> None:
        """`receive`, where a bug does not end the subscription: the state is suspect then."""
        try:
            await self.receive(frames)
        except Exception:
            log.exception("kv events: failed to apply a message from %s", self.endpoint)
            self._set_unknown()

    async def receive(self, frames: list[bytes]) -> None:
        """Check one message's sequence number, recover what is missing, apply it."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self._decode_errors.inc()
            log.warning(
                "kv events: %s sent a message of %d frames, not [topic, seq, payload]", self.endpoint, len(frames)
            )
            return
        seq = decode_seq(frames[1])
        message: EventMessage | None = None
        decode_error: EventDecodeError | None = None
        try:
            message = decode_message(frames)
        except EventDecodeError as error:
            decode_error = error
        else:
            self._take_model(message.topic)  # before any replay, whose batches carry no topic
        expected, reconnected = self.expected, self.reconnected
        self.reconnected = False
        if expected is None:
            if seq > 0:
                await self._recover(0, seq, joining=True)
        elif seq < expected or (reconnected and seq != expected):
            # A new engine process (its own numbering from 0) or, after a reconnect, one that
            # may be: only its history counts, so start over from it.
            metrics.KV_EVENT_PUBLISHER_RESTARTS.labels(self.endpoint).inc()
            log.info("kv events: %s publisher restarted (seq %d after %d)", self.endpoint, seq, expected - 1)
            self._reset()
            if seq > 0:
                await self._recover(0, seq, joining=True)
        elif seq > expected:
            self._gaps.inc()
            log.warning("kv events: %s lost messages %d..%d", self.endpoint, expected, seq - 1)
            await self._recover(expected, seq, joining=False)
        self.expected = seq + 1
        if decode_error is not None:
            self._undecodable(seq, decode_error)
        elif message is not None:
            self.apply(message.batch)

    def apply(self, batch: EventBatch) -> None:
        index, endpoint = self.index, self.endpoint
        for event in batch.events:
            index.apply(endpoint, event)
            if isinstance(event, BlockStored):
                self._stored.inc()
            elif isinstance(event, BlockRemoved):
                self._removed.inc()
                self._evicted.inc(len(event.block_hashes))
            elif isinstance(event, AllBlocksCleared):
                self._cleared.inc()
                self._known.set(1)
            else:
                self._unknown_type.inc()

    async def _recover(self, start: int, stop: int, *, joining: bool) -> None:
        """Replay messages [start, stop). A gap needs all of them, or the endpoint goes unknown;
        a joiner takes the replayed tail it can get (its index only misses older blocks)."""
        replayed = await self._replay(start) if self.replay_address else None
        tail = _contiguous_tail([(seq, payload) for seq, payload in replayed or () if start <= seq < stop], stop)
        complete = bool(tail) and tail[0][0] == start
        if replayed is not None:
            metrics.KV_EVENT_REPLAYS.labels(self.endpoint, "complete" if complete else "incomplete").inc()
        if joining:
            self._reset()
        elif not complete:
            self._set_unknown()
            return
        for seq, payload in tail:
            try:
                batch = decode_batch(payload)
            except EventDecodeError as error:
                self._undecodable(seq, error)
                continue
            self.apply(batch)

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Every buffered message from `start` on, per the replay socket; None if it fails."""
        context = self.owner.context
        assert self.replay_address is not None
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.owner.config.replay_timeout
        received: list[tuple[int, bytes]] = []
        try:
            dealer.connect(self.replay_address)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0 or not await dealer.poll(remaining * 1000):
                    log.warning("kv events: replay from %s timed out", self.replay_address)
                    self._replay_failed()
                    return None
                frames = await dealer.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    log.warning("kv events: malformed replay reply from %s", self.replay_address)
                    self._replay_failed()
                    return None
                seq = decode_seq(frames[1])
                if seq == _END_OF_REPLAY:
                    return received
                received.append((seq, frames[2]))
        except zmq.ZMQError as error:
            log.warning("kv events: replay from %s failed: %s", self.replay_address, error)
            self._replay_failed()
            return None
        finally:
            dealer.close(0)

    def _replay_failed(self) -> None:
        metrics.KV_EVENT_REPLAYS.labels(self.endpoint, "failed").inc()

    def _undecodable(self, seq: int, error: EventDecodeError) -> None:
        """A message that cannot be decoded lost its events: that is a gap replay cannot fill."""
        self._decode_errors.inc()
        log.warning("kv events: message %d from %s is undecodable: %s", seq, self.endpoint, error)
        self._set_unknown()

    def _take_model(self, topic: str) -> None:
        parts = topic.split("@", 2)
        model = parts[2] if len(parts) == 3 and parts[2] else self.owner.config.model
        if model != self.model:
            self.model = model
            self.index.track(self.endpoint, model)

    def _reset(self) -> None:
        self.index.reset(self.endpoint)
        self._known.set(1)

    def _set_unknown(self) -> None:
        self.index.mark_unknown(self.endpoint)
        self._known.set(0)


def _contiguous_tail(messages: list[tuple[int, bytes]], stop: int) -> list[tuple[int, bytes]]:
    """The longest run of `messages` with consecutive sequence numbers ending at `stop - 1`."""
    messages = sorted(messages, key=lambda m: m[0])
    expected = stop - 1
    first = len(messages)
    while first > 0 and messages[first - 1][0] == expected:
        first -= 1
        expected -= 1
    return messages[first:]


def _drop_metrics(endpoint: str) -> None:
    """Forget a departed endpoint's metric series, so pod churn does not grow them forever."""
    series = (
        [(metrics.KV_EVENTS, (endpoint, t)) for t in ("BlockStored", "BlockRemoved", "AllBlocksCleared", "unknown")]
        + [(metrics.KV_EVENT_REPLAYS, (endpoint, o)) for o in ("complete", "incomplete", "failed")]
        + [
            (m, (endpoint,))
            for m in (
                metrics.KV_EVENT_GAPS,
                metrics.KV_EVENT_DECODE_ERRORS,
                metrics.KV_EVENT_PUBLISHER_RESTARTS,
                metrics.KV_BLOCKS_EVICTED,
                metrics.KV_STATE_KNOWN,
            )
        ]
    )
    for metric, labels in series:
        try:
            metric.remove(*labels)
        except KeyError:
            pass
