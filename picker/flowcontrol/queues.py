"""The queued requests: one `FlowQueue` per fairness id within a `PriorityBand` per priority.

A flow keeps its requests in a heap on the band's ordering-policy key. A request leaving early
(client gone, TTL) is finalized and its counts drop at once; its heap entry is skipped when it
surfaces, and the heap is compacted when such entries outnumber the live ones.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Callable, Mapping
from enum import StrEnum

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
        # once asked, `holders` (empty: anywhere will do) and the end of the wait for them.
        self.affinity = affinity
        self.holders: frozenset[str] | None = None
        self.wait_until = 0.0

    @property
    def headers(self) -> Mapping[str, str]:
        return self.request.headers


class FlowQueue:
    """The queued requests of one fairness id in one band, ordered by the band's policy."""

    __slots__ = ("_dead", "_heap", "_ordering", "count", "fairness_id")

    def __init__(self, fairness_id: str, ordering: OrderingPolicy) -> None:
        self.fairness_id = fairness_id
        self.count = 0
        self._ordering = ordering
        self._heap: list[tuple[tuple[float, ...], int, QueuedRequest]] = []
        self._dead = 0

    def push(self, item: QueuedRequest, seq: int) -> None:
        heapq.heappush(self._heap, (self._ordering.key(item), seq, item))
        self.count += 1

    def _drop_dead_head(self) -> None:
        heap = self._heap
        while heap and heap[0][2].state is not Outcome.QUEUED:
            heapq.heappop(heap)
            self._dead -= 1

    def head_key(self) -> tuple[float, ...]:
        """The ordering key of the next request (the flow is not empty)."""
        self._drop_dead_head()
        return self._heap[0][0]

    def pop(self) -> QueuedRequest:
        """Take the next request (the flow is not empty)."""
        self._drop_dead_head()
        self.count -= 1
        return heapq.heappop(self._heap)[2]

    def discard(self, item: QueuedRequest) -> None:
        """`item` (already finalized) left early: uncount it now, drop its entry lazily."""
        self.count -= 1
        self._dead += 1
        if self._dead > self.count:
            self._heap = [entry for entry in self._heap if entry[2].state is Outcome.QUEUED]
            heapq.heapify(self._heap)
            self._dead = 0

    def reorder(self, ordering: OrderingPolicy) -> None:
        """Re-key every live request under a new ordering policy (a config reload)."""
        self._ordering = ordering
        self._heap = [(ordering.key(e[2]), e[1], e[2]) for e in self._heap if e[2].state is Outcome.QUEUED]
        heapq.heapify(self._heap)
        self._dead = 0


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

    def pop_next(self) -> QueuedRequest | None:
        """The next request by the fairness policy, then the flow's order; None if empty."""
        fairness_id = self.settings.fairness.pick(self.flows, self.fairness_state)
        if fairness_id is None:
            return None
        flow = self.flows[fairness_id]
        item = flow.pop()
        self._uncount(flow, item)
        return item

    def _uncount(self, flow: FlowQueue, item: QueuedRequest) -> None:
        self.count -= 1
        self.bytes -= item.size
        if flow.count == 0:
            del self.flows[flow.fairness_id]
