"""Shares what picks teach between picker processes through one Redis/Valkey stream.

Every process appends its batches to the stream (XADD, MAXLEN ~ bounds the history) and reads
everyone's from its last entry id (XREAD): a process that starts reads the whole retained history
and so warms its index; one that lost the store reads on from where it stopped, replaying what it
missed within the history. Each process skips its own batches (its origin id).

The request path only appends to a bounded in-memory queue (`SharedIndex.publish`); a background
task drains it in batches (everything queued while the previous XADD was in flight goes in the
next one). While the store is down or slow the queue fills, the oldest inserts are dropped and
counted (`picker_state_unpublished_inserts`), and requests are routed on local state alone: no
request waits for the store.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from picker.state.messages import BadMessageError, IndexInsert, StateBatch, decode_batch, encode_batch
from picker.state.url import StoreUrl
from picker.telemetry.metrics import (
    STATE_APPLIED_INSERTS,
    STATE_BAD_MESSAGES,
    STATE_MISSED_BATCHES,
    STATE_PUBLISHED_INSERTS,
    STATE_SKIPPED_INSERTS,
    STATE_STORE_CONNECTED,
    STATE_STORE_ERRORS,
    STATE_UNPUBLISHED_INSERTS,
)

if TYPE_CHECKING:
    from picker.datastore.store import Datastore

log = logging.getLogger(__name__)

# Applies another process's insert to a local index: (endpoint, hashes, capacity, count_reuse).
IndexSink = Callable[[str, Sequence[int], int | None, bool], None]

FIELD = b"b"  # the stream entry's one field: an encoded StateBatch
STREAM_LENGTH = 5000  # entries the stream keeps (approximately): the history a late process replays
MAX_PENDING_INSERTS = 10_000  # queued while the store is away; older ones are dropped, counted
MAX_BATCH_INSERTS = 256
# Batches published last before the store failed are sent again once it answers: a store that
# crashed (without persistence) lost those the others had not read yet. Inserts are idempotent.
RESEND_BATCHES = 32
READ_COUNT = 256
READ_BLOCK_MS = 1000
SOCKET_TIMEOUT_S = 2.0  # above READ_BLOCK_MS: a blocked XREAD is not a timeout
CONNECT_TIMEOUT_S = 1.0
BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 2.0
SYNCED_POLL_S = 0.05
_STORE_ERRORS = (RedisError, OSError, asyncio.TimeoutError)


def stream_name(namespace: str, pool: str) -> str:
    """The stream of one pool's pickers: replicas of other pools on the same store never mix."""
    return f"picker:state:v1:{namespace}/{pool or '-'}"


class _Backoff:
    """Exponential waits between retries while the store fails, reset once it answers."""

    def __init__(self) -> None:
        self.delay = BACKOFF_MIN_S

    async def wait(self) -> None:
        await asyncio.sleep(self.delay)
        self.delay = min(self.delay * 2, BACKOFF_MAX_S)

    def reset(self) -> None:
        self.delay = BACKOFF_MIN_S


class SharedIndex:
    """One prefix index's link to the store (from `StateSync.share_index`)."""

    __slots__ = ("_sync", "name")

    def __init__(self, sync: StateSync, name: str) -> None:
        self._sync = sync
        self.name = name

    def publish(self, endpoint: str, hashes: Sequence[int], capacity: int | None, count_reuse: bool) -> None:
        """Queue an insert for the other processes: no I/O, never blocks."""
        self._sync.enqueue(IndexInsert(self.name, endpoint, hashes, capacity, count_reuse))

    def close(self) -> None:
        """Stop applying other processes' inserts to this index (its config is gone)."""
        self._sync.unshare(self.name)


class StateSync:
    """This process's publisher to and reader of the shared state stream."""

    def __init__(
        self,
        url: StoreUrl,
        stream: str,
        datastore: Datastore,
        *,
        password: str | None = None,
        stream_length: int = STREAM_LENGTH,
        max_pending: int = MAX_PENDING_INSERTS,
    ) -> None:
        self.url = url
        self.stream = stream
        self.datastore = datastore
        self.stream_length = stream_length
        self.max_pending = max_pending
        self.origin = uuid.uuid4().hex
        # Retries are this class's (with backoff, in the background), not the client's.
        self._client = aioredis.Redis(
            host=url.host,
            port=url.port,
            db=url.db,
            username=url.username,
            password=password if password is not None else url.password,
            ssl=url.tls,
            socket_timeout=SOCKET_TIMEOUT_S,
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),
            client_name=f"picker-{self.origin[:12]}",
        )
        self._sinks: dict[str, IndexSink] = {}
        self._pending: deque[IndexInsert] = deque()
        self._wake = asyncio.Event()
        self._unsent: tuple[bytes, int] | None = None  # a batch whose XADD failed: sent again as is
        self._recent: deque[Sequence[IndexInsert]] = deque(maxlen=RESEND_BATCHES)  # published last
        self._resend = False  # set by a failure: `_recent` goes out again once the store answers
        self._sequence = 0
        self._sequences: dict[str, int] = {}  # the last sequence read per origin
        self._healthy = {"publish": True, "read": True}
        self._failing_since: float | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._running = False
        self.last_id = b"0-0"  # the last stream entry read

    # -- the request path ------------------------------------------------------------------

    def enqueue(self, insert: IndexInsert) -> None:
        pending = self._pending
        if len(pending) >= self.max_pending:
            pending.popleft()
            STATE_UNPUBLISHED_INSERTS.inc()
        pending.append(insert)
        self._wake.set()

    # -- indexes ---------------------------------------------------------------------------

    def share_index(self, name: str, sink: IndexSink) -> SharedIndex:
        """Publish what the index `name` learns; apply other processes' inserts for it with `sink`."""
        self._sinks[name] = sink
        return SharedIndex(self, name)

    def unshare(self, name: str) -> None:
        self._sinks.pop(name, None)

    @property
    def pending(self) -> int:
        """Inserts queued, not yet published."""
        return len(self._pending) + (self._unsent[1] if self._unsent else 0)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        STATE_STORE_CONNECTED.set(0)
        self._running = True
        self._tasks = [
            asyncio.create_task(self._publish_loop(), name="state-publish"),
            asyncio.create_task(self._read_loop(), name="state-read"),
        ]
        log.info("sharing state through %s, stream %s (origin %s)", self.url.redacted, self.stream, self.origin)

    async def stop(self) -> None:
        # The loops also check `_running`: redis-py may turn a cancellation in the middle of a
        # command into a connection error, which the loops would otherwise retry.
        self._running = False
        self._wake.set()
        while pending := [task for task in self._tasks if not task.done()]:
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=1.0)
        self._tasks = []
        await self._client.aclose()

    # -- background ------------------------------------------------------------------------

    async def _publish_loop(self) -> None:
        backoff = _Backoff()
        pending = self._pending
        while await self._work_to_send():
            if self._unsent is None:
                inserts = [pending.popleft() for _ in range(min(len(pending), MAX_BATCH_INSERTS))]
                self._recent.append(inserts)
                self._sequence += 1
                self._unsent = (encode_batch(StateBatch(self.origin, self._sequence, inserts)), len(inserts))
            data, count = self._unsent
            try:
                await self._client.xadd(self.stream, {FIELD: data}, maxlen=self.stream_length, approximate=True)
            except _STORE_ERRORS as error:
                self._failed("publish", error)
                self._resend = True
                await backoff.wait()
                continue
            self._unsent = None
            if self._resend:
                self._resend_recent()
            STATE_PUBLISHED_INSERTS.inc(count)
            self._answered("publish")
            backoff.reset()

    def _resend_recent(self) -> None:
        """Queue the batches published last before the failure again, ahead of newer inserts,
        as re-announcements (not counted as blocks sent again), as far as the queue has room."""
        self._resend = False
        room = self.max_pending - len(self._pending)
        again = [replace(i, count_reuse=False) for batch in self._recent for i in batch]
        self._recent.clear()
        if room > 0:
            self._pending.extendleft(reversed(again[-room:]))

    async def _work_to_send(self) -> bool:
        """Wait for inserts (or a batch to send again); False once stopping."""
        while not self._pending and self._unsent is None and self._running:
            self._wake.clear()
            await self._wake.wait()
        return self._running

    async def _read_loop(self) -> None:
        # Apply nothing before the pool is known: inserts for endpoints not (yet) in it are skipped.
        while not self.datastore.synced:
            await asyncio.sleep(SYNCED_POLL_S)
        backoff = _Backoff()
        while self._running:
            try:
                reply: Any = await self._client.xread(
                    {self.stream: self.last_id}, count=READ_COUNT, block=READ_BLOCK_MS
                )
            except _STORE_ERRORS as error:
                self._failed("read", error)
                await backoff.wait()
                continue
            self._answered("read")
            backoff.reset()
            for _stream, entries in reply or ():
                for entry_id, fields in entries:
                    self.last_id = entry_id
                    self._apply(fields.get(FIELD) if isinstance(fields, dict) else None)
            await asyncio.sleep(0)  # a long replay leaves room for requests between reads

    def _apply(self, data: bytes | None) -> None:
        if not isinstance(data, bytes):
            STATE_BAD_MESSAGES.inc()
            return
        try:
            batch = decode_batch(data)
        except BadMessageError as error:
            STATE_BAD_MESSAGES.inc()
            log.debug("skipped a state-store entry: %s", error)
            return
        if batch.origin == self.origin:
            return
        last = self._sequences.get(batch.origin)
        if last is not None and batch.sequence > last + 1:
            STATE_MISSED_BATCHES.inc(batch.sequence - last - 1)
        self._sequences[batch.origin] = max(last or 0, batch.sequence)
        sinks, known = self._sinks, self.datastore.get
        applied = skipped = 0
        for insert in batch.inserts:
            sink = sinks.get(insert.index)
            if sink is None or known(insert.endpoint) is None:
                skipped += 1
                continue
            sink(insert.endpoint, insert.hashes, insert.capacity, insert.count_reuse)
            applied += 1
        STATE_APPLIED_INSERTS.inc(applied)
        if skipped:
            STATE_SKIPPED_INSERTS.inc(skipped)

    def _failed(self, operation: str, error: BaseException) -> None:
        STATE_STORE_ERRORS.labels(operation).inc()
        STATE_STORE_CONNECTED.set(0)
        if self._failing_since is None:
            self._failing_since = time.monotonic()
            log.warning(
                "state store %s failed (%s): routing on local state, retrying",
                self.url.redacted,
                f"{operation}: {error or type(error).__name__}",
            )
        self._healthy[operation] = False

    def _answered(self, operation: str) -> None:
        self._healthy[operation] = True
        if all(self._healthy.values()):
            STATE_STORE_CONNECTED.set(1)
            if self._failing_since is not None:
                log.info(
                    "state store %s answers again after %.1fs; %d inserts pending",
                    self.url.redacted,
                    time.monotonic() - self._failing_since,
                    self.pending,
                )
                self._failing_since = None
