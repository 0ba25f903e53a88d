"""Flow control without the network: the policies, the queue accounting and the controller's
dispatch on a saturation the test sets (the integration tests drive it through Envoy)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping

import hypothesis
import pytest
from hypothesis import given
from hypothesis import strategies as st

from picker.config.flowcontrol import DEFAULT_BAND_MAX_BYTES, flow_control_settings
from picker.config.loader import build, parse_text
from picker.flowcontrol.controller import FlowController
from picker.flowcontrol.policies import (
    EdfOrderingPolicy,
    FcfsOrderingPolicy,
    GlobalStrictFairnessPolicy,
    RoundRobinFairnessPolicy,
    SloDeadlineOrderingPolicy,
)
from picker.flowcontrol.queues import Outcome, PriorityBand, QueuedRequest
from picker.flowcontrol.settings import BandSettings, FlowControlSettings
from picker.framework.handle import Handle
from picker.framework.request import Api, InferenceRequest
from picker.request.errors import RequestError

FCFS = FcfsOrderingPolicy("fcfs")
STRICT = GlobalStrictFairnessPolicy("strict")
ROUND_ROBIN = RoundRobinFairnessPolicy("rr")


def request(
    fairness_id: str = "default-flow", size: int = 10, headers: Mapping[str, str] | None = None
) -> InferenceRequest:
    return InferenceRequest(
        "r", Api.COMPLETIONS, "m", "m", prompt_text="x", fairness_id=fairness_id, size_bytes=size, headers=headers or {}
    )


def item(
    at: float, fairness_id: str = "a", ttl: float | None = None, headers: Mapping[str, str] | None = None
) -> QueuedRequest:
    """A queued request (call inside a running loop: it holds a future)."""
    future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
    return QueuedRequest(request(fairness_id, headers=headers), 0, ttl, at, at, future)


def settings(fairness: object = STRICT, **limits: int) -> FlowControlSettings:
    band = BandSettings(limits.get("band_bytes", 0), limits.get("band_requests", 0), fairness, FCFS)  # type: ignore[arg-type]
    return FlowControlSettings(limits.get("max_bytes", 0), limits.get("max_requests", 0), None, 1.0, band)


async def test_ordering_policies_order_by_arrival_deadline_and_slo() -> None:
    early, late = item(1.0, ttl=30), item(2.0, ttl=5)
    assert FCFS.key(early) < FCFS.key(late)
    assert EdfOrderingPolicy("e").key(late) < EdfOrderingPolicy("e").key(early)  # deadline 7 before 31
    assert EdfOrderingPolicy("e").key(item(0.0))[0] == math.inf  # no TTL: last
    slo = SloDeadlineOrderingPolicy("s")
    tight, loose = item(2.0, headers={"x-slo-ttft-ms": "100"}), item(1.0, headers={"x-slo-ttft-ms": "5000"})
    assert slo.key(tight) < slo.key(loose)
    assert slo.key(item(0.0, headers={"x-slo-ttft-ms": "-3"}))[0] == math.inf  # malformed: last


async def test_round_robin_alternates_flows_and_global_strict_keeps_one_order() -> None:
    band = PriorityBand(0, BandSettings(0, 0, ROUND_ROBIN, FCFS))
    for i in range(4):
        band.add(item(float(i), "a"), i)
    for i in range(4, 6):
        band.add(item(float(i), "b"), i)
    assert [band.pop_next().fairness_id for _ in range(6)] == ["a", "b", "a", "b", "a", "a"]  # type: ignore[union-attr]
    strict = PriorityBand(0, BandSettings(0, 0, STRICT, FCFS))
    for i, flow in enumerate("aabba"):
        strict.add(item(float(i), flow), i)
    assert [strict.pop_next().enqueued_at for _ in range(5)] == [0.0, 1.0, 2.0, 3.0, 4.0]  # type: ignore[union-attr]
    assert strict.pop_next() is None and strict.flows == {}


async def test_a_request_leaving_early_is_uncounted_at_once_and_never_dispatched() -> None:
    band = PriorityBand(0, BandSettings(0, 0, STRICT, FCFS))
    items = [item(float(i)) for i in range(3)]
    for i, queued in enumerate(items):
        band.add(queued, i)
    items[0].state = Outcome.EVICTED_CANCELLED
    band.discard(items[0])
    assert (band.count, band.bytes) == (2, 20)
    assert band.pop_next() is items[1]
    assert band.pop_next() is items[2] and band.count == 0 and band.bytes == 0


def test_the_settings_take_the_reference_defaults_and_only_with_the_gate() -> None:
    text = """apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- {type: round-robin-fairness-policy}
- {type: edf-ordering-policy}
- {type: static-usage-limit-policy, parameters: {threshold: 0.9}}
flowControl:
  maxBytes: 1Gi
  maxRequests: 2k
  defaultRequestTTL: 1m30s
  usageLimitPolicyPluginRef: static-usage-limit-policy
  defaultPriorityBand: {maxRequests: 50}
  priorityBands:
  - {priority: 10, maxBytes: 5Mi, fairnessPolicyRef: round-robin-fairness-policy, orderingPolicyRef: edf-ordering-policy}
"""
    loaded = build(parse_text(text), Handle())
    resolved = flow_control_settings(loaded.config, loaded.plugins)
    assert resolved is not None
    assert (resolved.max_bytes, resolved.max_requests, resolved.default_ttl, resolved.usage_limit) == (
        1 << 30,
        2000,
        90.0,
        0.9,
    )
    assert resolved.band(10).max_bytes == 5 << 20 and resolved.band(10).max_requests == 0
    assert isinstance(resolved.band(10).fairness, RoundRobinFairnessPolicy)
    assert isinstance(resolved.band(10).ordering, EdfOrderingPolicy)
    other = resolved.band(-3)  # any other priority: the template with the reference's defaults
    assert (other.max_bytes, other.max_requests) == (DEFAULT_BAND_MAX_BYTES, 50)
    assert isinstance(other.fairness, GlobalStrictFairnessPolicy) and isinstance(other.ordering, FcfsOrderingPolicy)
    gate_off = build(parse_text(text.replace("featureGates: [flowControl]\n", "")), Handle())
    assert flow_control_settings(gate_off.config, gate_off.plugins) is None


class Pool:
    """The saturation the controller sees, set by the test."""

    def __init__(self) -> None:
        self.saturation = 2.0


async def test_dispatch_is_strictly_by_priority_then_fcfs_one_handoff_at_a_time() -> None:
    pool = Pool()
    config = settings()
    controller = FlowController(lambda: config, lambda: pool.saturation)
    order: list[str] = []

    async def one(name: str, priority: int) -> None:
        async with controller.dispatched(config, request(), priority):
            order.append(name)
            await asyncio.sleep(0)  # the handoff lasts across an await: nothing else dispatches

    tasks = [asyncio.create_task(one(f"low{i}", -1)) for i in range(3)]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(one("high", 5)))
    await asyncio.sleep(0)
    assert controller.count == 4 and order == []
    pool.saturation = 0.0
    controller.wake()
    await asyncio.gather(*tasks)
    assert order == ["high", "low0", "low1", "low2"]
    assert controller.count == 0 and controller.bytes == 0


async def test_capacity_rejects_with_429_and_ttl_expires_with_503() -> None:
    pool = Pool()
    config = settings(max_requests=1)
    controller = FlowController(lambda: config, lambda: pool.saturation)

    async def one(cfg: FlowControlSettings) -> None:
        async with controller.dispatched(cfg, request(), 0):
            pass

    waiting = asyncio.create_task(one(config))
    await asyncio.sleep(0)
    with pytest.raises(RequestError) as rejected:
        await one(config)
    assert rejected.value.status == 429
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert controller.count == 0  # the cancelled request left the queue at once
    short = FlowControlSettings(0, 0, 0.05, 1.0, config.default_band)
    with pytest.raises(RequestError) as expired:
        await asyncio.wait_for(one(short), 5)
    assert expired.value.status == 503 and controller.count == 0


async def test_byte_limits_count_global_and_band_sizes() -> None:
    config = settings(max_bytes=25, band_bytes=15)
    controller = FlowController(lambda: config, lambda: 5.0)

    async def one(size: int, priority: int) -> None:
        async with controller.dispatched(config, request(size=size), priority):
            pass

    first = asyncio.create_task(one(10, 0))
    await asyncio.sleep(0)
    with pytest.raises(RequestError):  # band 0: 10 + 10 > 15
        await one(10, 0)
    second = asyncio.create_task(one(10, 1))
    await asyncio.sleep(0)
    with pytest.raises(RequestError):  # global: 20 + 10 > 25
        await one(10, 2)
    assert controller.describe() == {
        "requests": 2,
        "bytes": 20,
        "bands": {0: {"requests": 1, "bytes": 10}, 1: {"requests": 1, "bytes": 10}},
    }
    for task in (first, second):
        task.cancel()
    await asyncio.gather(first, second, return_exceptions=True)
    assert controller.describe()["requests"] == 0


async def test_turning_the_gate_off_dispatches_what_is_queued() -> None:
    config: FlowControlSettings | None = settings()
    controller = FlowController(lambda: config, lambda: 9.0)
    done: list[int] = []

    async def one(i: int) -> None:
        assert config is not None
        async with controller.dispatched(config, request(), 0):
            done.append(i)

    tasks = [asyncio.create_task(one(i)) for i in range(5)]
    await asyncio.sleep(0)
    assert done == []
    config = None  # a reload without the gate
    controller.wake()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert done == [0, 1, 2, 3, 4]


async def test_a_reload_reorders_queued_requests_under_the_new_policies() -> None:
    band = PriorityBand(0, BandSettings(0, 0, STRICT, FCFS))
    first = item(1.0, headers={"x-slo-ttft-ms": "9000"})
    second = item(2.0, headers={"x-slo-ttft-ms": "10"})
    band.add(first, 0)
    band.add(second, 1)
    band.apply(BandSettings(0, 0, ROUND_ROBIN, SloDeadlineOrderingPolicy("slo")))
    assert band.pop_next() is second  # the tighter SLO now goes first; nothing was lost
    assert band.pop_next() is first and band.count == 0


async def test_a_reload_reorders_parked_requests_too_and_a_parked_request_can_leave() -> None:
    band = PriorityBand(0, BandSettings(0, 0, STRICT, FCFS))
    first = item(1.0, headers={"x-slo-ttft-ms": "9000"})
    second = item(2.0, headers={"x-slo-ttft-ms": "10"})
    gone = item(3.0)
    for seq, queued in enumerate((first, second, gone)):
        band.add(queued, seq)
    assert band.pop_next(lambda _: False) is None and band.parked == 3  # all wait for a full holder
    gone.state = Outcome.EVICTED_CANCELLED
    band.discard(gone)
    assert band.parked == 2 and band.count == 2
    band.apply(BandSettings(0, 0, ROUND_ROBIN, SloDeadlineOrderingPolicy("slo")))
    assert band.pop_next() is second and band.pop_next() is first
    assert band.count == 0 and band.flows == {}


OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.tuples(st.sampled_from("ab"), st.integers(0, 30))),  # flow, SLO seconds
        st.tuples(st.just("pop"), st.integers(0, 2**12 - 1)),  # bit i: the i-th live request may not go
        st.tuples(st.just("leave"), st.integers(0, 11)),
    ),
    max_size=60,
)


@hypothesis.settings(max_examples=500, deadline=None)
@given(operations=OPERATIONS, round_robin=st.booleans())
# A request due before one already parked, both held, then free: the earlier due goes first.
@hypothesis.example([("add", ("a", 30)), ("pop", 1), ("add", ("a", 0)), ("pop", 3), ("pop", 0)], False)
# The band drains between two turns: the flow served last still goes after the other.
@hypothesis.example([("add", ("a", 0)), ("pop", 0), ("pop", 0), ("add", ("a", 0)), ("add", ("b", 0)), ("pop", 0)], True)
def test_a_band_takes_by_fairness_among_flows_that_have_a_request_that_may_go(
    operations: list[tuple[str, object]], round_robin: bool
) -> None:
    """Against a plain model: the flow is the policy's among the flows with a request that may go
    (round-robin: the first such after the last served; global-strict: the one whose such request
    is due first), the request that flow's first due that may go; parking is invisible. Requests
    are ordered by SLO deadline, which later arrivals may beat."""
    loop = asyncio.new_event_loop()
    ordering = SloDeadlineOrderingPolicy("slo")
    try:
        band = PriorityBand(0, BandSettings(0, 0, ROUND_ROBIN if round_robin else STRICT, ordering))
        live: list[QueuedRequest] = []  # in deadline order
        last: str | None = None
        for seq, (op, arg) in enumerate(operations):
            if op == "add":
                flow, slo = arg  # type: ignore[misc]
                headers = {"x-slo-ttft-ms": str(slo * 1000 + seq)}  # no two deadlines alike
                queued = QueuedRequest(request(flow, headers=headers), 0, None, seq, seq, loop.create_future())
                band.add(queued, seq)
                live.append(queued)
                live.sort(key=ordering.key)
            elif op == "leave" and live:
                gone = live.pop(int(arg) % len(live))  # type: ignore[call-overload]
                gone.state = Outcome.EVICTED_TTL
                band.discard(gone)
            elif op == "pop":
                held = {id(q) for i, q in enumerate(live) if int(arg) >> i & 1}  # type: ignore[call-overload]
                ready = [q for q in live if id(q) not in held]
                expected: QueuedRequest | None = None
                if ready and round_robin:
                    flows = sorted({q.fairness_id for q in ready})
                    after = [f for f in flows if last is None or f > last]
                    flow = (after or flows)[0]
                    expected = next(q for q in ready if q.fairness_id == flow)
                elif ready:
                    expected = ready[0]
                taken = band.pop_next(lambda q: id(q) not in held)
                assert taken is expected
                if taken is not None:
                    live.remove(taken)
                    last = taken.fairness_id
            assert band.count == len(live) and band.parked <= len(live)
    finally:
        loop.close()
