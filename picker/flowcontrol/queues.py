"""The queued requests: one `FlowQueue` per fairness id within a `PriorityBand` per priority.

A flow keeps its requests in a heap on the band's ordering-policy key. A request leaving early
(client gone, TTL) is finalized and its counts drop at once; its heap entry is skipped when it
surfaces, and the heap is compacted when such entries outnumber the live ones.

Prefix affinity: a request that may not go yet (its prefix holders are full) is *parked*: it
moves from the heap to the flow's parked list, kept in the same key order, and keeps its place
in the flow. A band takes the next request by its fairness policy among the flows that have one
that may go now, and within that flow the first by its order that may go; so a flow whose
requests all wait for full holders passes its turn, and a parked request, once it may go,
competes for its flow's turn like any other (a noisy flow's parked requests do not jump ahead
of a quiet flow's).
"""

from __future__ import annotations

import asyncio
import copy
import heapq
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import NamedTuple

from picker.flowcontrol.policies import OrderingPolicy
from picker.flowcontrol.settings import BandSettings
from picker.framework.plugin import Affinity
from picker.framework.request import InferenceRequest


class Outcome(StrEnum):
    """A request's final state in flow control, named as the reference's QueueOutcome."""

    QUEUED = "NotYetFinalized"
    DISPATCHED = "Dispatched"
    REJECTED_CAPACITY = "RejectedCapacity"
    EVICTED_TTL = "EvictedTTL"
    EVICTED_CANCELLED = "EvictedContextCancelled"


class QueuedRequest:
    """One request held by flow control; `future` resolves with its outcome (monotonic times)."""

    __slots__ = (
        "affinity",
        "enqueued_at",
        "fairness_id",
        "future",
        "holders",
        "parked",
        "priority",
        "received_at",
        "request",
        "size",
        "state",
        "timer",
        "ttl",
        "wait_until",
    )

    def __init__(
        self,
        request: InferenceRequest,
        priority: int,
        ttl: float | None,
        received_at: float,
        enqueued_at: float,
        future: asyncio.Future[Outcome],
        affinity: Callable[[], Affinity | None] | None = None,
    ) -> None:
        self.request = request
        self.fairness_id = request.fairness_id
        self.priority = priority
        self.size = request.size_bytes
        self.ttl = ttl
        self.received_at = received_at
        self.enqueued_at = enqueued_at
        self.future = future
        self.state = Outcome.QUEUED
        self.timer: asyncio.TimerHandle | None = None
        # Late binding with prefix affinity: `affinity` says where the prompt's prefix is cached;
        # once asked, `holders` (empty: anywhere will do); once they were all full, the end of
        # the wait for them.
        self.affinity = affinity
        self.holders: frozenset[str] | None = None
        self.wait_until: float | None = None
        self.parked = False  # in its flow's parked list rather than its heap

    @property
    def headers(self) -> Mapping[str, str]:
        return self.request.headers


MayGo = Callable[[QueuedRequest], bool]


def _always(item: QueuedRequest) -> bool:
    return True


class Entry(NamedTuple):
    """A request in its flow, sorted by the ordering policy's key, then arrival (`seq`)."""

    key: tuple[float, ...]
    seq: int
    item: QueuedRequest


class FlowQueue:
    """The queued requests of one fairness id in one band, ordered by the band's policy: a heap
    of those not yet examined and a sorted list of the parked ones (`count` is both)."""

    __slots__ = ("_dead", "_heap", "_ordering", "_parked", "count", "fairness_id")

    def __init__(self, fairness_id: str, ordering: OrderingPolicy) -> None:
        self.fairness_id = fairness_id
        self.count = 0
        self._ordering = ordering
        self._heap: list[Entry] = []
        self._parked: list[Entry] = []
        self._dead = 0

    @property
    def parked(self) -> int:
        return len(self._parked)

    def parked_requests(self) -> list[QueuedRequest]:
        return [entry.item for entry in self._parked]

    def push(self, item: QueuedRequest, seq: int) -> None:
        heapq.heappush(self._heap, Entry(self._ordering.key(item), seq, item))
        self.count += 1

    def _drop_dead_head(self) -> None:
        heap = self._heap
        while heap and heap[0].item.state is not Outcome.QUEUED:
            heapq.heappop(heap)
            self._dead -= 1

    def head(self) -> Entry:
        """The first request by the ordering policy (the flow is not empty)."""
        self._drop_dead_head()
        heap, parked = self._heap, self._parked
        if parked and (not heap or parked[0][:2] < heap[0][:2]):
            return parked[0]
        return heap[0]

    def head_key(self) -> tuple[float, ...]:
        """The ordering key of the next request (the flow is not empty)."""
        return self.head().key

    def ready(self, may_go: MayGo) -> Entry | None:
        """The first request by the ordering policy that may go now, left in place; requests
        met before it that may not are parked (a request leaves the heap once: later cycles ask
        only the parked ones again)."""
        heap, parked = self._heap, self._parked
        i = 0
        while True:
            self._drop_dead_head()
            if i < len(parked) and (not heap or parked[i][:2] < heap[0][:2]):
                if may_go(parked[i].item):
                    return parked[i]
                i += 1
            elif heap:
                if may_go(heap[0].item):
                    return heap[0]
                entry = heapq.heappop(heap)
                entry.item.parked = True
                parked.insert(i, entry)  # before parked[i] (the merge order) and after parked[:i]
                i += 1
            else:
                return None

    def take(self, entry: Entry) -> QueuedRequest:
        """Remove `entry`, found by `ready` with nothing changed since."""
        if entry.item.parked:
            self._parked.remove(entry)
            entry.item.parked = False
        else:
            heapq.heappop(self._heap)  # `entry` is the heap's live head
        self.count -= 1
        return entry.item

    def discard(self, item: QueuedRequest) -> None:
        """`item` (already finalized) left early: uncount it now; a parked entry goes at once,
        a heap entry lazily."""
        self.count -= 1
        if item.parked:
            self._parked = [entry for entry in self._parked if entry.item is not item]
            item.parked = False
            return
        self._dead += 1
        if self._dead > self.count - len(self._parked):
            self._heap = [entry for entry in self._heap if entry.item.state is Outcome.QUEUED]
            heapq.heapify(self._heap)
            self._dead = 0

    def reorder(self, ordering: OrderingPolicy) -> None:
        """Re-key every live request under a new ordering policy (a config reload)."""
        self._ordering = ordering
        self._heap = [Entry(ordering.key(e.item), e.seq, e.item) for e in self._heap if e.item.state is Outcome.QUEUED]
        heapq.heapify(self._heap)
        self._parked = sorted(Entry(ordering.key(e.item), e.seq, e.item) for e in self._parked)
        self._dead = 0


class _Ready(NamedTuple):
    """What a fairness policy sees of a flow that has a request that may go now."""

    fairness_id: str
    key: tuple[float, ...]

    def head_key(self) -> tuple[float, ...]:
        return self.key


class PriorityBand:
    """The flows of one priority, with the band's totals and its fairness policy's state."""

    __slots__ = ("bytes", "count", "fairness_state", "flows", "priority", "settings")

    def __init__(self, priority: int, settings: BandSettings) -> None:
        self.priority = priority
        self.settings = settings
        self.flows: dict[str, FlowQueue] = {}  # non-empty flows only
        self.count = 0
        self.bytes = 0
        self.fairness_state = settings.fairness.new_state()

    def apply(self, settings: BandSettings) -> None:
        """Take new settings (a reload): queued requests stay, re-ordered if the policy changed."""
        old, self.settings = self.settings, settings
        if type(settings.ordering) is not type(old.ordering):
            for flow in self.flows.values():
                flow.reorder(settings.ordering)
        if type(settings.fairness) is not type(old.fairness):
            self.fairness_state = settings.fairness.new_state()

    def add(self, item: QueuedRequest, seq: int) -> None:
        flow = self.flows.get(item.fairness_id)
        if flow is None:
            flow = self.flows[item.fairness_id] = FlowQueue(item.fairness_id, self.settings.ordering)
        flow.push(item, seq)
        self.count += 1
        self.bytes += item.size

    def discard(self, item: QueuedRequest) -> None:
        """`item` (already finalized) left before dispatch."""
        flow = self.flows[item.fairness_id]
        flow.discard(item)
        self._uncount(flow, item)

    @property
    def parked(self) -> int:
        return sum(flow.parked for flow in self.flows.values())

    def parked_requests(self) -> list[QueuedRequest]:
        return [item for flow in self.flows.values() for item in flow.parked_requests()]

    def pop_next(self, may_go: MayGo = _always) -> QueuedRequest | None:
        """The next request that may go now: the fairness policy's pick among the flows that
        have one (by their first such request), then that request; None if there is none.

        The policy picks among all flows first: when that flow's head may go, that is the pick
        (the usual case; no flow's first request that may go orders before its head, so neither
        policy here would pick otherwise). Otherwise each flow's first request that may go is found and the
        policy, its state as before, picks again among those flows by those requests."""
        fairness, flows = self.settings.fairness, self.flows
        before = copy.copy(self.fairness_state)
        fairness_id = fairness.pick(flows, self.fairness_state)
        if fairness_id is None:
            return None
        head = flows[fairness_id].head()
        entry = flows[fairness_id].ready(may_go)
        if entry is not head:
            self.fairness_state = before
            found = {f: e for f, flow in flows.items() if (e := flow.ready(may_go)) is not None}
            if not found:
                return None
            fairness_id = fairness.pick({f: _Ready(f, e.key) for f, e in found.items()}, self.fairness_state)
            assert fairness_id is not None
            entry = found[fairness_id]
        flow = flows[fairness_id]
        item = flow.take(entry)
        self._uncount(flow, item)
        return item

    def _uncount(self, flow: FlowQueue, item: QueuedRequest) -> None:
        self.count -= 1
        self.bytes -= item.size
        if flow.count == 0:
            del self.flows[flow.fairness_id]
