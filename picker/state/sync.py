"""Shares what picks teach between picker processes through one Redis/Valkey stream: prefix-index
inserts, each process's in-flight load, and the TTFT model's lessons.

Every process appends its batches to the stream (XADD, MAXLEN ~ bounds the history) and reads
everyone's from its last entry id (XREAD): a process that starts reads the whole retained history
and so warms its index; one that lost the store reads on from where it stopped, replaying what it
missed within the history. Each process skips its own batches (its origin id).

The request path only appends to a bounded in-memory queue (`SharedIndex.publish`,
`SharedTtft`) or marks its in-flight counts changed; a background task drains it in batches
(everything queued while the previous XADD was in flight goes in the next one). While the store
is down or slow the queue fills, the oldest updates are dropped and counted
(`picker_state_unpublished_inserts`), and requests are routed on local state alone: no request
waits for the store.

In-flight load goes as a whole (every endpoint's count, not a change) at most every
`LOAD_MIN_INTERVAL_S` while it changes, and again every third of its expiry while it is not zero;
the others add it to their own counts until it expires (`LOAD_EXPIRES_MS` after its entry was
written, on the store's clock), so the load of a process that died vanishes within that time.
TTFT lessons are merged by sharing the samples, not the rates: every process applies every
observation to its model, as one process would that served all the requests. Rates merged
instead (a mean, or the newest) would count a sample again each time a merged rate came back.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from picker.state.messages import (
    BadMessageError,
    EndpointInFlight,
    IndexInsert,
    InFlightLoad,
    PrefillQueued,
    StateBatch,
    TtftObservation,
    decode_batch,
    encode_batch,
)
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
MAX_BATCH_UPDATES = 256
LOAD_MIN_INTERVAL_S = 0.01  # in-flight load goes out at most this often while it changes
LOAD_EXPIRES_MS = 3000  # the others count it this long after its entry was written
PREFILL_MAX_AGE_S = 1.0  # queued prefill older than this has drained: a replay skips it
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


Update = IndexInsert | TtftObservation | PrefillQueued


class TtftLearner(Protocol):
    """What applies other processes' TTFT lessons (picker.prefix.ttft.TtftModel)."""

    def observe(
        self,
        endpoint: str,
        ttft_seconds: float,
        prompt_tokens: int,
        cached_tokens: int,
        work_ahead_tokens: float,
        remote_prefill: bool = False,
    ) -> None: ...

    def add_backlog(self, endpoint: str, tokens: float, now: float | None = None) -> None: ...


class _RemoteLoad(NamedTuple):
    """Another process's in-flight load and when (monotonic) it stops counting."""

    expires_at: float
    endpoints: Sequence[EndpointInFlight]


def stream_name(namespace: str, pool: str, key: str | None = None) -> str:
    """The stream of one pool's pickers: replicas of other pools on the same store never mix.
    `key` (`--state-store-key`) replaces the pool's identity: deployments with static endpoints
    have none, so two of them on one store would share a stream without it."""
    return f"picker:state:v1:{key}" if key else f"picker:state:v1:{namespace}/{pool or '-'}"


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


class SharedTtft:
    """A TTFT model's link to the store (from `StateSync.share_ttft`)."""

    __slots__ = ("_learner", "_sync")

    def __init__(self, sync: StateSync, learner: TtftLearner) -> None:
        self._sync = sync
        self._learner = learner

    def observed(
        self,
        endpoint: str,
        ttft_seconds: float,
        prompt_tokens: int,
        cached_tokens: int,
        work_ahead_tokens: float,
        remote_prefill: bool = False,
    ) -> None:
        """Queue a response's lesson for the other processes: no I/O, never blocks."""
        self._sync.enqueue(
            TtftObservation(endpoint, ttft_seconds, prompt_tokens, cached_tokens, work_ahead_tokens, remote_prefill)
        )

    def queued(self, endpoint: str, tokens: float) -> None:
        """Queue a pick's uncached prompt tokens at `endpoint` for the others' backlog."""
        self._sync.enqueue(PrefillQueued(endpoint, tokens))

    def close(self) -> None:
        """Stop applying other processes' TTFT lessons to this model (it is gone)."""
        self._sync.unshare_ttft(self._learner)


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
        load_expires_ms: int = LOAD_EXPIRES_MS,
    ) -> None:
        self.url = url
        self.stream = stream
        self.datastore = datastore
        self.stream_length = stream_length
        self.max_pending = max_pending
        self.load_expires_ms = load_expires_ms
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
        self._ttft: list[TtftLearner] = []  # every shared model learns every lesson (the endpoints')
        self._pending: deque[Update] = deque()
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
        self._load_changed = False  # this process's in-flight counts changed since last sent
        self._load_sent_at = float("-inf")  # monotonic
        self._load_nonzero = False  # the last load sent was not zero: it is refreshed
        self._remote_loads: dict[str, _RemoteLoad] = {}  # per origin
        self._store_clock_offset: float | None = None  # the store's wall clock minus ours, seconds
        datastore.add_in_flight_listener(self._in_flight_changed)

    # -- the request path ------------------------------------------------------------------

    def enqueue(self, update: Update) -> None:
        pending = self._pending
        if len(pending) >= self.max_pending:
            pending.popleft()
            STATE_UNPUBLISHED_INSERTS.inc()
        pending.append(update)
        self._wake.set()

    def _in_flight_changed(self) -> None:
        if not self._load_changed:
            self._load_changed = True
            self._wake.set()

    # -- indexes ---------------------------------------------------------------------------

    def share_index(self, name: str, sink: IndexSink) -> SharedIndex:
        """Publish what the index `name` learns; apply other processes' inserts for it with `sink`."""
        self._sinks[name] = sink
        return SharedIndex(self, name)

    def unshare(self, name: str) -> None:
        self._sinks.pop(name, None)

    def share_ttft(self, learner: TtftLearner) -> SharedTtft:
        """Publish what the TTFT model learns; apply other processes' lessons to `learner`."""
        self._ttft.append(learner)
        return SharedTtft(self, learner)

    def unshare_ttft(self, learner: TtftLearner) -> None:
        if learner in self._ttft:
            self._ttft.remove(learner)

    @property
    def pending(self) -> int:
        """Updates queued, not yet published."""
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
        self.datastore.remove_in_flight_listener(self._in_flight_changed)
        await self._client.aclose()

    # -- background ------------------------------------------------------------------------

    async def _publish_loop(self) -> None:
        backoff = _Backoff()
        pending = self._pending
        while await self._work_to_send():
            if self._unsent is None:
                updates = [pending.popleft() for _ in range(min(len(pending), MAX_BATCH_UPDATES))]
                inserts = [u for u in updates if isinstance(u, IndexInsert)]
                self._recent.append(inserts)
                self._sequence += 1
                batch = StateBatch(
                    self.origin,
                    self._sequence,
                    inserts,
                    self._load_report() if self._load_wait(time.monotonic()) == 0.0 else None,
                    [u for u in updates if isinstance(u, TtftObservation)],
                    [u for u in updates if isinstance(u, PrefillQueued)],
                )
                self._unsent = (encode_batch(batch), len(inserts))
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
        """Wait for updates, a batch to send again or the in-flight load due; False once stopping."""
        while self._running and not self._pending and self._unsent is None:
            wait = self._load_wait(time.monotonic())
            if wait == 0.0:
                break
            self._wake.clear()
            try:
                async with asyncio.timeout(wait):
                    await self._wake.wait()
            except TimeoutError:
                pass
        return self._running

    def _load_wait(self, now: float) -> float | None:
        """Seconds until the in-flight load is due (0: now), None while nothing is to send."""
        due = []
        if self._load_changed:
            due.append(self._load_sent_at + LOAD_MIN_INTERVAL_S)
        if self._load_nonzero:
            due.append(self._load_sent_at + self.load_expires_ms / 3000)
        return max(0.0, min(due) - now) if due else None

    def _load_report(self) -> InFlightLoad:
        endpoints = tuple(EndpointInFlight(*entry) for entry in self.datastore.local_in_flight())
        self._load_changed = False
        self._load_sent_at = time.monotonic()
        self._load_nonzero = bool(endpoints)
        return InFlightLoad(endpoints, self.load_expires_ms)

    async def _read_loop(self) -> None:
        # Apply nothing before the pool is known: inserts for endpoints not (yet) in it are skipped.
        while not self.datastore.synced:
            await asyncio.sleep(SYNCED_POLL_S)
        backoff = _Backoff()
        while self._running:
            self._expire_loads()
            try:
                if self._store_clock_offset is None:
                    seconds, micros = await self._client.time()
                    self._store_clock_offset = seconds + micros / 1e6 - time.time()
                reply: Any = await self._client.xread(
                    {self.stream: self.last_id}, count=READ_COUNT, block=READ_BLOCK_MS
                )
            except _STORE_ERRORS as error:
                self._failed("read", error)
                self._store_clock_offset = None  # the store may come back elsewhere
                await backoff.wait()
                continue
            self._answered("read")
            backoff.reset()
            for _stream, entries in reply or ():
                for entry_id, fields in entries:
                    self.last_id = entry_id
                    self._apply(fields.get(FIELD) if isinstance(fields, dict) else None, self._entry_age(entry_id))
            await asyncio.sleep(0)  # a long replay leaves room for requests between reads

    def _entry_age(self, entry_id: bytes) -> float:
        """Seconds since the store wrote the entry `entry_id` (its id starts with the store's
        clock in ms: no clock of another host is trusted)."""
        written_ms = int(entry_id.split(b"-", 1)[0])
        return time.time() + (self._store_clock_offset or 0.0) - written_ms / 1000

    def _apply(self, data: bytes | None, age: float = 0.0) -> None:
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
        if batch.in_flight is not None:
            self._apply_load(batch.origin, batch.in_flight, age)
        for ttft in self._ttft:
            for o in batch.observations:
                if known(o.endpoint) is not None:
                    ttft.observe(
                        o.endpoint,
                        o.ttft_seconds,
                        o.prompt_tokens,
                        o.cached_tokens,
                        o.work_ahead_tokens,
                        o.remote_prefill,
                    )
            if age < PREFILL_MAX_AGE_S:
                for p in batch.prefills:
                    if known(p.endpoint) is not None:
                        ttft.add_backlog(p.endpoint, p.tokens)

    def _apply_load(self, origin: str, load: InFlightLoad, age: float) -> None:
        left = load.expires_ms / 1000 - age
        if left > 0:
            self._remote_loads[origin] = _RemoteLoad(time.monotonic() + left, load.endpoints)
        elif self._remote_loads.pop(origin, None) is None:
            return  # an expired report (a replay) of a process not counted
        self._sum_remote_loads()

    def _expire_loads(self) -> None:
        now = time.monotonic()
        expired = [origin for origin, load in self._remote_loads.items() if load.expires_at <= now]
        if expired:
            for origin in expired:
                del self._remote_loads[origin]
            self._sum_remote_loads()

    def _sum_remote_loads(self) -> None:
        requests: dict[str, int] = {}
        tokens: dict[str, int] = {}
        for load in self._remote_loads.values():
            for e in load.endpoints:
                requests[e.endpoint] = requests.get(e.endpoint, 0) + e.requests
                tokens[e.endpoint] = tokens.get(e.endpoint, 0) + e.tokens
        self.datastore.set_remote_in_flight(requests, tokens)

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
