"""Flow-control policy plugins, with the reference's type names and meaning.

- Ordering policies order the requests of one flow: each gives a request a sort key, smallest
  first (`fcfs-ordering-policy`: arrival; `edf-ordering-policy`: enqueue time + TTL;
  `slo-deadline-ordering-policy`: receipt + the `x-slo-ttft-ms` header).
- Fairness policies choose which flow of a priority band dispatches next
  (`global-strict-fairness-policy`: the flow whose head orders first, one global order;
  `round-robin-fairness-policy`: the next flow by fairness id after the last one served).
- `static-usage-limit-policy`: the saturation ceiling below which the pool takes requests.
"""

from __future__ import annotations

import bisect
import math
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from picker.framework.handle import Handle
from picker.framework.parameters import Parameters
from picker.framework.plugin import Plugin

# The reference's header for slo-deadline-ordering-policy: the TTFT objective in milliseconds.
SLO_TTFT_HEADER = "x-slo-ttft-ms"


class Orderable(Protocol):
    """What an ordering policy reads of a queued request (monotonic seconds)."""

    @property
    def enqueued_at(self) -> float: ...
    @property
    def received_at(self) -> float: ...
    @property
    def ttl(self) -> float | None: ...
    @property
    def headers(self) -> Mapping[str, str]: ...


class FlowView(Protocol):
    """What a fairness policy reads of a flow: its fairness id and the key of its head."""

    @property
    def fairness_id(self) -> str: ...
    def head_key(self) -> tuple[float, ...]: ...


class FlowControlPolicy(Plugin):
    """Any policy the `flowControl` section names by reference."""

    def __init__(self, name: str) -> None:
        super().__init__(name)


class OrderingPolicy(FlowControlPolicy):
    """Orders the requests within a flow: the smallest `key` dispatches first."""

    @abstractmethod
    def key(self, item: Orderable) -> tuple[float, ...]: ...


class FcfsOrderingPolicy(OrderingPolicy):
    """First come, first served by the time the request entered flow control."""

    plugin_type = "fcfs-ordering-policy"

    def key(self, item: Orderable) -> tuple[float, ...]:
        return (item.enqueued_at,)


class EdfOrderingPolicy(OrderingPolicy):
    """Earliest deadline (enqueue time + TTL) first; no TTL orders last; ties by arrival."""

    plugin_type = "edf-ordering-policy"

    def key(self, item: Orderable) -> tuple[float, ...]:
        deadline = math.inf if item.ttl is None else item.enqueued_at + item.ttl
        return (deadline, item.enqueued_at)


class SloDeadlineOrderingPolicy(OrderingPolicy):
    """Earliest SLO deadline (receipt + `x-slo-ttft-ms`) first; none or malformed orders last;
    ties by arrival."""

    plugin_type = "slo-deadline-ordering-policy"

    def key(self, item: Orderable) -> tuple[float, ...]:
        raw = item.headers.get(SLO_TTFT_HEADER, "").strip()
        deadline = math.inf
        if raw.isdigit():  # the reference accepts a non-negative integer only
            deadline = item.received_at + int(raw) / 1000.0
        return (deadline, item.enqueued_at)


class FairnessPolicy(FlowControlPolicy):
    """Chooses the flow of a band that dispatches next. Its per-band state (a cursor) lives
    in the object `new_state` returns, so one policy instance serves many bands."""

    def new_state(self) -> Any:
        return None

    @abstractmethod
    def pick(self, flows: Mapping[str, FlowView], state: Any) -> str | None:
        """The fairness id of the next flow among `flows` (all non-empty), or None."""


class GlobalStrictFairnessPolicy(FairnessPolicy):
    """Ignores flow isolation: the flow whose head request orders first (one global order)."""

    plugin_type = "global-strict-fairness-policy"

    def pick(self, flows: Mapping[str, FlowView], state: Any) -> str | None:
        best: str | None = None
        best_key: tuple[float, ...] = ()
        for fairness_id, flow in flows.items():
            key = flow.head_key()
            if best is None or key < best_key:
                best, best_key = fairness_id, key
        return best


class RoundRobinCursor:
    """The fairness id served last in one band."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last: str | None = None


class RoundRobinFairnessPolicy(FairnessPolicy):
    """Cycles through the flows in fairness-id order: the first id after the last one served
    (wrapping), so each competing flow gets an equal share of dispatches."""

    plugin_type = "round-robin-fairness-policy"

    def new_state(self) -> RoundRobinCursor:
        return RoundRobinCursor()

    def pick(self, flows: Mapping[str, FlowView], state: Any) -> str | None:
        assert isinstance(state, RoundRobinCursor)
        if not flows:
            return None  # the cursor stays: a band that drains must not favour the lowest id next
        ids: Sequence[str] = sorted(flows)
        index = 0 if state.last is None else bisect.bisect_right(ids, state.last) % len(ids)
        state.last = ids[index]
        return state.last


class StaticUsageLimitPolicy(FlowControlPolicy):
    """The pool takes requests while its saturation is below `threshold` (default 1.0)."""

    plugin_type = "static-usage-limit-policy"

    def __init__(self, name: str, threshold: float = 1.0) -> None:
        super().__init__(name)
        self.threshold = threshold


def _create(cls: type[FlowControlPolicy]) -> Any:
    def create(name: str, parameters: Mapping[str, Any], handle: Handle) -> FlowControlPolicy:
        params = Parameters(parameters)
        policy: FlowControlPolicy
        if cls is StaticUsageLimitPolicy:
            policy = StaticUsageLimitPolicy(name, params.number("threshold", 1.0))
        else:
            policy = cls(name)
        policy.parameters = params.finish()
        return policy

    return create


POLICY_CLASSES: tuple[type[FlowControlPolicy], ...] = (
    GlobalStrictFairnessPolicy,
    RoundRobinFairnessPolicy,
    FcfsOrderingPolicy,
    EdfOrderingPolicy,
    SloDeadlineOrderingPolicy,
    StaticUsageLimitPolicy,
)
# (type, factory) for the plugin registry.
POLICY_FACTORIES = tuple((cls.plugin_type, _create(cls)) for cls in POLICY_CLASSES)
# The policies the reference uses where flowControl names none, always present by these names.
DEFAULT_POLICIES = (
    FcfsOrderingPolicy.plugin_type,
    GlobalStrictFairnessPolicy.plugin_type,
    StaticUsageLimitPolicy.plugin_type,
)
