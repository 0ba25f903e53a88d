"""The flow controller: holds requests while the pool is saturated and dispatches them one at a
time, by strict priority between bands, the band's fairness policy between its flows and the
ordering policy within a flow.

Everything runs on the event loop. A waiting request awaits a future (no CPU, no gRPC traffic);
dispatch cycles run when something may have freed room — an arrival, a dispatched request
counted in flight, a request completing, a metrics refresh, an endpoint change — plus a slow
tick while the pool stays saturated (metrics that never refresh must not stall the queue).

Late binding: a dispatched request is scheduled after it leaves the queue, on that moment's
endpoints and metrics. One dispatch is outstanding at a time (the *handoff*): the next cycle
runs once the dispatched request is counted in flight (or fails), so the detector sees it.

Prefix affinity: a cycle dispatches the first request that may go now, by strict priority
between bands, the band's fairness policy among the flows that have such a request and the
flow's ordering policy (`picker.flowcontrol.queues`). A request whose prefix holders are all
full may not go until one of them has room or going elsewhere would be quicker: it is *parked*
in its flow, keeping its place in the flow's order, and requests that may go (a holder with
room, nothing cached) go meanwhile, of its flow or another; the pool idles only when every
queued request waits for a full holder. A parked request that may go again competes for its
flow's turn like any other, so waiting for a holder neither jumps a flow ahead of the others
nor costs it its turns.

Where a request's prefix is cached is asked on its arrival (and, if nothing was then, once more
on its first turn), so each endpoint has a *line*: the queued requests whose prefix it holds. A
request whose holders are all full goes elsewhere only when its place in their lines (timed by
their completion rates) is further than `max_affinity_wait` and a pod with room has no line and
spare capacity (fewer requests wanted it over the last window than it completed). Sent to a pod
whose own requests keep it busy, it would only take their turn, and add work: it recomputes its
prefix and evicts that pod's. A request with nothing cached goes to a pod with the shortest line,
so new prefixes spread by the backlog here, which the pods' metrics do not show. Measured at 120%
load on shared prefixes (BENCHMARKS.md, flow control): bounding the wait by the recompute time
(about 0.3 s) kept a hit ratio of 58% against 78%; sending a request on when its own line was too
long, whatever the other pods' lines, cost 1-2 points against flow control off; now none. A
holder that completed too little lately to be timed is waited for `max_affinity_wait` at most.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
import time
from collections.abc import Callable, Iterator, Mapping
from time import perf_counter
from types import TracebackType
from typing import Any

from picker.datastore.rate import EventRate
from picker.flowcontrol.queues import Outcome, PriorityBand, QueuedRequest
from picker.flowcontrol.settings import FlowControlSettings
from picker.framework.plugin import Affinity
from picker.framework.request import InferenceRequest
from picker.request.errors import RequestError
from picker.telemetry import metrics

# While the pool stays saturated, a dispatch cycle runs at least this often.
SATURATED_TICK_SECONDS = 0.1

SettingsSource = Callable[[], FlowControlSettings | None]
AffinityLookup = Callable[[], Affinity | None]


class FlowController:
    """Queues, dispatch and accounting for one pool.

    `settings` returns the flow-control settings in force (None once the gate is turned off:
    what is still queued is then dispatched without waiting); `saturation` the pool's
    saturation now (dispatch only while it is below the usage limit); `room_at` whether one
    endpoint (by address) is below it (without it, requests never wait for their prefix holders);
    `start_rate` how many requests one endpoint starts a second while it is full (its completion
    rate; 0.0 when unknown) and `pool_room` whether each of the pool's endpoints is below the
    limit: with them a request waits for its full holders unless its turn there is far and a
    pod with room has no line, and one with nothing cached waits for a pod with the shortest line
    (`Backlog`).
    """

    def __init__(
        self,
        settings: SettingsSource,
        saturation: Callable[[], float],
        pool_name: str = "",
        room_at: Callable[[str], bool] | None = None,
        start_rate: Callable[[str], float] | None = None,
        pool_room: Callable[[], Mapping[str, bool]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock`: monotonic seconds, what enqueue times, waits and TTLs are measured with (a
        test drives its own)."""
        self._settings_source = settings
        self._clock = clock
        self._saturation = saturation
        self._room_at = room_at
        self._start_rate = start_rate
        self._pool_room = pool_room
        self._demand: dict[str, EventRate] = {}  # address → requests whose prefix it holds
        # address → the enqueue times (sorted) of the queued requests whose prefix it holds
        self._lines: dict[str, list[float]] = {}
        self._pool = pool_name
        self._settings: FlowControlSettings | None = None
        self._bands: dict[int, PriorityBand] = {}
        self._priorities: list[int] = []  # of the bands, ascending
        self._seq = itertools.count()
        self.count = 0
        self.bytes = 0
        self._handoff: QueuedRequest | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cycle_scheduled = False
        self._tick: asyncio.TimerHandle | None = None
        self._series: dict[tuple[str, ...], list[int]] = {}  # gauge labels → [requests, bytes]
        self._histograms: dict[tuple[Any, ...], Any] = {}

    # -- the request side --------------------------------------------------------------------

    def dispatched(
        self,
        settings: FlowControlSettings,
        request: InferenceRequest,
        priority: int,
        affinity: AffinityLookup | None = None,
    ) -> Dispatch:
        """`async with` it: holds `request` until it is dispatched; the body runs the scheduling
        of the dispatched request, and leaving it lets the next dispatch go. Entering raises
        RequestError when the queue is full (429) or the TTL expires first (503); a cancelled wait
        leaves the queue at once. `affinity` says (when asked, at dispatch time) where the
        request's prefix is cached."""
        return Dispatch(self, settings, request, priority, affinity)

    async def _wait(self, item: QueuedRequest) -> None:
        """Wait for `item`'s dispatch (no suspension when it was dispatched at once)."""
        try:
            await item.future
        except asyncio.CancelledError:
            if item.state is Outcome.QUEUED:
                self._leave(item, Outcome.EVICTED_CANCELLED)
            self._settle(item)  # cancelled just after its dispatch: let the next one go
            raise
        if item.state is Outcome.EVICTED_TTL:
            raise RequestError("ServiceUnavailable", "request timed out in queue: the flow-control TTL expired")

    def _enqueue(
        self,
        settings: FlowControlSettings,
        request: InferenceRequest,
        priority: int,
        affinity: AffinityLookup | None,
    ) -> QueuedRequest:
        started = perf_counter()
        loop = self._loop = asyncio.get_running_loop()
        self._sync(settings)
        ttl = settings.default_ttl
        now = self._clock()  # the body has just arrived: receipt and enqueue are one moment here
        item = QueuedRequest(request, priority, ttl, now, now, loop.create_future(), affinity)
        band = self._bands.get(priority)
        band_settings = band.settings if band is not None else settings.band(priority)
        fits = (
            (not settings.max_bytes or self.bytes + item.size <= settings.max_bytes)
            and (not settings.max_requests or self.count + 1 <= settings.max_requests)
            and (not band_settings.max_bytes or (band.bytes if band else 0) + item.size <= band_settings.max_bytes)
            and (not band_settings.max_requests or (band.count if band else 0) + 1 <= band_settings.max_requests)
        )
        if not fits:
            item.state = Outcome.REJECTED_CAPACITY
            self._observe_enqueue_time(item, Outcome.REJECTED_CAPACITY, started)
            self._observe_queue_time(item)
            raise RequestError("ResourceExhausted", "flow control queue at capacity")
        free_now = not self.count and self._handoff is None and self._has_room(settings)
        if self._room_at is not None:
            self._ask_holders(item, now, last=free_now)
        if free_now and self._may_go(item, Turn(now)):
            # Nothing queued and room in the pool: dispatched at once, without touching the queues.
            item.state = Outcome.DISPATCHED
            self._handoff = item
            item.future.set_result(Outcome.DISPATCHED)
            self._observe_enqueue_time(item, Outcome.QUEUED, started)
            self._observe_queue_time(item)
            return item
        if band is None:
            band = self._bands[priority] = PriorityBand(priority, band_settings)
            bisect.insort(self._priorities, priority)
        band.add(item, next(self._seq))
        if item.holders:
            self._join_lines(item)
        self.count += 1
        self.bytes += item.size
        self._gauge(item, 1)
        if ttl is not None:
            item.timer = loop.call_later(ttl, self._expire, item)
        self._observe_enqueue_time(item, Outcome.QUEUED, started)
        self._cycle()  # work conserving: with room and nothing ahead, it is dispatched right here
        return item

    def _expire(self, item: QueuedRequest) -> None:
        if item.state is Outcome.QUEUED:
            self._leave(item, Outcome.EVICTED_TTL)
            item.future.set_result(Outcome.EVICTED_TTL)

    def _leave(self, item: QueuedRequest, outcome: Outcome) -> None:
        """`item` leaves its queue before dispatch (TTL, client gone)."""
        item.state = outcome
        band = self._bands[item.priority]
        band.discard(item)
        self._drop_if_empty(band)
        self._uncount(item)

    def _drop_if_empty(self, band: PriorityBand) -> None:
        if band.count == 0:
            del self._bands[band.priority]
            self._priorities.remove(band.priority)

    def _uncount(self, item: QueuedRequest) -> None:
        if item.timer is not None:
            item.timer.cancel()
        if item.holders:
            self._leave_lines(item)
        self.count -= 1
        self.bytes -= item.size
        self._gauge(item, -1)
        self._observe_queue_time(item)

    def _settle(self, item: QueuedRequest) -> None:
        if self._handoff is item:
            self._handoff = None
            self.wake()

    # -- dispatch -----------------------------------------------------------------------------

    def wake(self) -> None:
        """Something may have freed room: run a dispatch cycle soon (cheap; call freely)."""
        if self.count and not self._cycle_scheduled and self._handoff is None and self._loop is not None:
            self._cycle_scheduled = True
            self._loop.call_soon(self._cycle)

    def _on_tick(self) -> None:
        self._tick = None
        self.wake()

    def _tick_in(self, seconds: float) -> None:
        """Run a dispatch cycle within `seconds` at the latest."""
        if self._loop is None:
            return
        if self._tick is not None:
            if self._tick.when() <= self._loop.time() + seconds:
                return
            self._tick.cancel()
        self._tick = self._loop.call_later(seconds, self._on_tick)

    def _sync(self, settings: FlowControlSettings | None) -> FlowControlSettings | None:
        """Adopt the settings in force (a reload changes them; queued requests stay)."""
        if settings is not self._settings:
            self._settings = settings
            if settings is not None:
                for priority, band in self._bands.items():
                    band.apply(settings.band(priority))
        return settings

    def _has_room(self, settings: FlowControlSettings | None) -> bool:
        """Whether the pool's saturation is below the usage limit (always, once the gate is off)."""
        if settings is None:
            return True
        return self._saturation() < settings.usage_limit

    def reported_saturation(self) -> float:
        """The pool's saturation as the gate sees it, for the pool-saturation gauge (0.0 while
        the gate is off); the composition root binds the gauge to it."""
        return self._saturation() if self._settings_source() is not None else 0.0

    def _cycle(self) -> None:
        """Dispatch the next request that may go if the pool has room (`_next_to_go`)."""
        self._cycle_scheduled = False
        if self._handoff is not None or not self.count:
            return
        started = perf_counter()
        if not self._has_room(self._sync(self._settings_source())):
            self._tick_in(SATURATED_TICK_SECONDS)
            metrics.FLOW_DISPATCH_CYCLE.observe(perf_counter() - started)
            return
        now = self._clock()
        item = self._next_to_go(now)
        if item is None:  # every queued request waits for a full holder: look again when a wait ends
            self._tick_in(min(SATURATED_TICK_SECONDS, max(0.0, self._parked_wait_ends() - now)))
        else:
            item.state = Outcome.DISPATCHED
            self._uncount(item)
            self._handoff = item
            item.future.set_result(Outcome.DISPATCHED)
        metrics.FLOW_DISPATCH_CYCLE.observe(perf_counter() - started)

    def _next_to_go(self, now: float) -> QueuedRequest | None:
        """Take the first request that may go now: the highest band that has one, its fairness
        policy's flow among those that have one, that flow's first by its order. Requests met on
        the way whose prefix holders are full are parked (each is examined once, then kept in its
        flow's parked list: a cycle costs the parked requests plus the ones it parks)."""
        turn = Turn(now)

        def may_go(item: QueuedRequest) -> bool:
            return self._may_go(item, turn)

        for priority in reversed(self._priorities):
            band = self._bands[priority]
            item = band.pop_next(may_go)
            if item is not None:
                self._drop_if_empty(band)
                return item
        return None

    def _may_go(self, item: QueuedRequest, turn: Turn) -> bool:
        """Whether `item` may be dispatched now: with nothing cached anywhere, when a pod with the
        shortest line has room; else when a holder has room, or its turn at its holders is further
        than the affinity wait while a pod with room has no line and spare capacity."""
        settings = self._settings
        if settings is None or self._room_at is None:
            return True
        holders = item.holders
        if holders is None:  # nothing was cached on arrival: ask again (queued since)
            holders = self._ask_holders(item, turn.now, last=True)
            if holders:
                self._join_lines(item)
        if not holders:
            backlog = self._backlog(turn)
            return backlog is None or backlog.shortest_has_room()
        room = turn.room
        for holder in holders:
            free = room.get(holder)
            if free is None:
                free = room[holder] = self._room_at(holder)
            if free:
                return True
        longest = settings.max_affinity_wait
        if item.wait_until is None:
            item.wait_until = turn.now + longest
        start_rate = self._start_rate
        backlog = self._backlog(turn)
        if start_rate is None or backlog is None or longest <= 0.0:
            return turn.now >= item.wait_until
        rates = [start_rate(h) for h in holders]
        if not all(rates):
            return turn.now >= item.wait_until  # the holder's line cannot be weighed: wait at most `longest`
        if not any(self._has_spare_capacity(address, turn.now) for address in backlog.idle_elsewhere(holders)):
            return False
        return min(backlog.place(h, item.enqueued_at) / rate for h, rate in zip(holders, rates, strict=True)) > longest

    def _ask_holders(self, item: QueuedRequest, now: float, last: bool) -> frozenset[str] | None:
        """Ask where `item`'s prefix is cached (its `holders`): on arrival, so that the lines
        count every queued request, and, when nothing was cached then, once more on its first
        turn (`last`): a request queued behind the first of its prefix finds it placed by then."""
        affinity = item.affinity() if item.affinity is not None else None
        if affinity is not None:
            item.holders = affinity.holders
            for holder in item.holders:
                self._wanted(holder).record(now)
        elif last:
            item.holders = frozenset()
        if item.holders is not None:
            item.affinity = None  # the lookup holds the request's scheduling state: drop it
        return item.holders

    def _join_lines(self, item: QueuedRequest) -> None:
        for holder in item.holders or ():
            bisect.insort(self._lines.setdefault(holder, []), item.enqueued_at)

    def _leave_lines(self, item: QueuedRequest) -> None:
        for holder in item.holders or ():
            line = self._lines[holder]
            del line[bisect.bisect_left(line, item.enqueued_at)]
            if not line:
                del self._lines[holder]

    def _backlog(self, turn: Turn) -> Backlog | None:
        """The lines as this cycle sees them (None without `pool_room` or with no line at all)."""
        if turn.backlog is None and self._pool_room is not None and self._lines:
            room = self._pool_room()
            for address in self._demand.keys() - room.keys():
                del self._demand[address]  # it left the pool
            turn.backlog = Backlog(self._lines, room)
        return turn.backlog

    def _wanted(self, address: str) -> EventRate:
        demand = self._demand.get(address)
        if demand is None:
            demand = self._demand[address] = EventRate()
        return demand

    def _has_spare_capacity(self, address: str, now: float) -> bool:
        """Whether fewer requests want `address` (hold their prefix there) than it completes, or
        either is unknown: a pod its own requests keep full gains nothing from another's but a
        recompute, even when its line is empty for a moment."""
        wanted = self._wanted(address).per_second(now)
        completed = self._start_rate(address) if self._start_rate is not None else 0.0
        return not wanted or not completed or wanted < completed

    def _parked_wait_ends(self) -> float:
        """When the first parked request's wait for its holders ends."""
        return min(
            (
                item.wait_until
                for band in self._bands.values()
                for item in band.parked_requests()
                if item.wait_until is not None
            ),
            default=math.inf,
        )

    # -- metrics ------------------------------------------------------------------------------

    def _labels(self, item: QueuedRequest) -> tuple[str, ...]:
        request = item.request
        return (item.fairness_id, str(item.priority), self._pool, request.model, request.target_model)

    def _gauge(self, item: QueuedRequest, sign: int) -> None:
        """Queue size and bytes per flow and model; a series is dropped when it empties, so
        client-chosen fairness ids do not grow the metrics forever."""
        labels = self._labels(item)
        load = self._series.setdefault(labels, [0, 0])
        load[0] += sign
        load[1] += sign * item.size
        if load[0] == 0:
            del self._series[labels]
            metrics.FLOW_QUEUE_SIZE.remove(*labels)
            metrics.FLOW_QUEUE_BYTES.remove(*labels)
        else:
            metrics.FLOW_QUEUE_SIZE.labels(*labels).set(load[0])
            metrics.FLOW_QUEUE_BYTES.labels(*labels).set(load[1])

    # The histograms' children are looked up in prometheus_client once per label set, keyed by
    # the values they are made of (histograms keep every label set anyway; this keeps the
    # lookup and the label strings off each request).

    def _observe_enqueue_time(self, item: QueuedRequest, outcome: Outcome, started: float) -> None:
        key = (metrics.FLOW_ENQUEUE_DURATION, item.fairness_id, item.priority, outcome)
        child = self._histograms.get(key)
        if child is None:
            labels = (item.fairness_id, str(item.priority), outcome.value)
            child = self._histograms[key] = metrics.FLOW_ENQUEUE_DURATION.labels(*labels)
        child.observe(perf_counter() - started)

    def _observe_queue_time(self, item: QueuedRequest) -> None:
        request = item.request
        key = (
            metrics.FLOW_QUEUE_DURATION,
            item.fairness_id,
            item.priority,
            item.state,
            request.model,
            request.target_model,
        )
        child = self._histograms.get(key)
        if child is None:
            labels = (item.fairness_id, str(item.priority), item.state.value, self._pool, *key[4:])
            child = self._histograms[key] = metrics.FLOW_QUEUE_DURATION.labels(*labels)
        child.observe(self._clock() - item.enqueued_at)

    @property
    def parked(self) -> int:
        """Queued requests that have been examined and wait for a full prefix holder."""
        return sum(band.parked for band in self._bands.values())

    def describe(self) -> dict[str, Any]:
        """Queued requests and bytes, in total and per priority band (for tests and debugging)."""
        return {
            "requests": self.count,
            "bytes": self.bytes,
            "bands": {p: {"requests": b.count, "bytes": b.bytes} for p, b in self._bands.items()},
        }


class Turn:
    """What one dispatch cycle learns at most once: the room at each holder it asks about and,
    when a request's holders are all full, the lines (`Backlog`)."""

    __slots__ = ("backlog", "now", "room")

    def __init__(self, now: float) -> None:
        self.now = now
        self.room: dict[str, bool] = {}
        self.backlog: Backlog | None = None


class Backlog:
    """The lines (per endpoint, the enqueue times of the queued requests whose prefix it holds,
    sorted; a request with several holders is in each of theirs) and which endpoints have room,
    as one dispatch cycle sees them."""

    __slots__ = ("_lines", "_room", "_shortest")

    def __init__(self, lines: Mapping[str, list[float]], room: Mapping[str, bool]) -> None:
        self._lines = lines
        self._room = room
        self._shortest = min((len(lines.get(address, ())) for address in room), default=0)

    def place(self, holder: str, enqueued_at: float) -> int:
        """The place in `holder`'s line of a request enqueued at `enqueued_at` (1: next)."""
        return bisect.bisect_left(self._lines.get(holder, ()), enqueued_at) + 1

    def idle_elsewhere(self, holders: frozenset[str]) -> Iterator[str]:
        """The endpoints other than `holders` with room and no request waiting for them."""
        lines = self._lines
        return (a for a, free in self._room.items() if free and a not in holders and a not in lines)

    def shortest_has_room(self) -> bool:
        """Whether an endpoint with room has no more requests waiting for it than any other:
        a request with nothing cached goes there, so new prefixes spread by the whole backlog
        (the scheduler sees only what is in flight at the pods)."""
        return any(free and len(self._lines.get(address, ())) <= self._shortest for address, free in self._room.items())


class Dispatch:
    """One request's passage through flow control, as an async context manager (a class rather
    than a generator: this runs for every request while the gate is on)."""

    __slots__ = ("_affinity", "_controller", "_item", "_priority", "_request", "_settings")

    def __init__(
        self,
        controller: FlowController,
        settings: FlowControlSettings,
        request: InferenceRequest,
        priority: int,
        affinity: AffinityLookup | None,
    ) -> None:
        self._controller = controller
        self._settings = settings
        self._request = request
        self._priority = priority
        self._affinity = affinity
        self._item: QueuedRequest | None = None

    async def __aenter__(self) -> bool:
        """Whether the request waited (False: dispatched at once, the pool as it was on arrival)."""
        controller = self._controller
        item = self._item = controller._enqueue(self._settings, self._request, self._priority, self._affinity)
        waited = not item.future.done()
        await controller._wait(item)
        return waited

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._item is not None:
            self._controller._settle(self._item)
