"""Late binding with prefix affinity: a request whose prefix holders are full waits for one of
them (bounded) while requests behind it that can go now are dispatched."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest

from picker.config.flowcontrol import flow_control_settings
from picker.config.loader import build, parse_text
from picker.config.runtime import RuntimeHolder
from picker.config.schema import ConfigError
from picker.datastore.endpoint import Endpoint
from picker.datastore.store import Datastore
from picker.flowcontrol.controller import FlowController
from picker.flowcontrol.policies import (
    SLO_TTFT_HEADER,
    FcfsOrderingPolicy,
    RoundRobinFairnessPolicy,
    SloDeadlineOrderingPolicy,
)
from picker.flowcontrol.settings import DEFAULT_MAX_AFFINITY_WAIT, BandSettings, FlowControlSettings
from picker.framework.cycle_state import CycleState
from picker.framework.handle import Handle
from picker.framework.plugin import Affinity, ProfileRunResult, SchedulingResult
from picker.framework.request import Api, InferenceRequest
from picker.plugins import REGISTRY as PLUGINS
from picker.prefix.plugins import PREFIX_MATCH_KEY, PROMPT_BLOCKS_KEY, ApproxPrefixCacheProducer

FCFS = FcfsOrderingPolicy("fcfs")


def settings(max_affinity_wait: float = 60.0, fairness: object = None) -> FlowControlSettings:
    band = BandSettings(0, 0, fairness or RoundRobinFairnessPolicy("rr"), FCFS)  # type: ignore[arg-type]
    return FlowControlSettings(0, 0, None, 1.0, band, max_affinity_wait=max_affinity_wait)


def request(fairness_id: str = "f", headers: Mapping[str, str] | None = None) -> InferenceRequest:
    return InferenceRequest(
        "r", Api.COMPLETIONS, "m", "m", prompt_text="x", fairness_id=fairness_id, size_bytes=10, headers=headers or {}
    )


class Pool:
    """The pool's saturation and which endpoints have room, set by the test."""

    def __init__(self, saturation: float = 2.0, free: dict[str, bool] | None = None) -> None:
        self.saturation = saturation
        self.free = free if free is not None else {"a": False, "b": True}

    def room_at(self, address: str) -> bool:
        return self.free.get(address, True)


def held_at(*holders: str) -> Affinity:
    return Affinity(frozenset(holders))


class Client:
    """Sends requests through one controller and records the order of their dispatch."""

    def __init__(self, controller: FlowController, config: FlowControlSettings) -> None:
        self.controller = controller
        self.config = config
        self.order: list[str] = []
        self.asked: list[str] = []

    def send(
        self,
        name: str,
        affinity: Affinity | None,
        priority: int = 0,
        fairness_id: str = "f",
        headers: Mapping[str, str] | None = None,
    ) -> asyncio.Task[None]:
        def lookup() -> Affinity | None:
            self.asked.append(name)
            return affinity

        async def one() -> None:
            async with self.controller.dispatched(self.config, request(fairness_id, headers), priority, lookup):
                self.order.append(name)
                await asyncio.sleep(0)  # the handoff lasts across an await

        return asyncio.create_task(one())


async def until(condition: object, seconds: float = 5.0) -> None:
    async with asyncio.timeout(seconds):
        while not condition():  # type: ignore[operator]
            await asyncio.sleep(0.001)


def weighing_lines(
    pool: Pool,
    config: FlowControlSettings,
    rates: Mapping[str, float] | None = None,
    pool_room: Callable[[], dict[str, bool]] | None = None,
) -> FlowController:
    """A controller that weighs the lines: the holders' completion rates (1/s unless `rates`
    says otherwise) and the pool's room."""
    return FlowController(
        lambda: config,
        lambda: pool.saturation,
        room_at=pool.room_at,
        start_rate=lambda h: (rates or {}).get(h, 1.0),
        pool_room=pool_room or (lambda: dict(pool.free)),
    )


async def free_and_finish(pool: Pool, controller: FlowController, address: str, *tasks: asyncio.Task[None]) -> None:
    """`address` gets room: `tasks` are dispatched."""
    pool.free[address] = True
    controller.wake()
    await asyncio.wait_for(asyncio.gather(*tasks), 5.0)


async def test_a_request_waits_for_its_full_holder_while_later_ones_go_and_goes_first_when_it_frees() -> None:
    pool = Pool()
    config = settings()
    controller = FlowController(lambda: config, lambda: pool.saturation, room_at=pool.room_at)
    client = Client(controller, config)
    tasks = [
        client.send("on-a-1", held_at("a")),
        client.send("on-b", held_at("b")),
        client.send("uncached", None),
        client.send("on-a-2", held_at("a")),
    ]
    await until(lambda: controller.count == 4)
    pool.saturation = 0.5  # room in the pool, none at a
    controller.wake()
    await until(lambda: client.order == ["on-b", "uncached"] and controller.parked == 2)
    # Each asked on arrival; the one with nothing cached once more on its turn (its prefix may
    # have been placed while it waited).
    assert controller.count == 2 and client.asked == ["on-a-1", "on-b", "uncached", "on-a-2", "uncached"]
    pool.free["a"] = True  # a frees a slot: its requests go in their order, before anything newer
    late = client.send("late-uncached", None)
    controller.wake()
    await asyncio.gather(*tasks, late)
    assert client.order == ["on-b", "uncached", "on-a-1", "on-a-2", "late-uncached"]
    assert controller.count == 0 and controller.parked == 0 and controller.bytes == 0


async def test_the_wait_for_a_full_holder_ends_at_max_affinity_wait() -> None:
    pool = Pool()
    pool.saturation = 0.5
    config = settings(max_affinity_wait=0.05)
    now = [100.0]  # the controller's clock, moved by the test
    controller = FlowController(lambda: config, lambda: pool.saturation, room_at=pool.room_at, clock=lambda: now[0])
    client = Client(controller, config)
    sent = client.send("on-a", held_at("a"))  # a stays full
    await until(lambda: controller.parked == 1)
    now[0] += 0.04  # within the wait: a cycle keeps it parked
    controller.wake()
    await asyncio.sleep(0)  # the cycle runs before this task resumes
    assert client.order == [] and controller.parked == 1
    now[0] += 0.02  # past it: the controller's own timer lets it go, nothing else wakes it
    await asyncio.wait_for(sent, 5.0)
    assert client.order == ["on-a"] and controller.parked == 0


async def test_a_request_goes_elsewhere_only_when_its_turn_is_far_and_a_pod_with_room_has_no_line() -> None:
    # a and b each start one request a second; maxAffinityWait 3 s. Four requests wait for a and
    # four for b, both full. b frees: its own line goes first (a's fourth, 4 s from its turn at
    # a, waits while b has a line), then a's fourth goes to b; a's first three wait for a.
    pool = Pool(0.5, {"a": False, "b": False})
    config = settings(max_affinity_wait=3.0)
    rates = {"a": 1.0, "b": 1.0}
    controller = weighing_lines(pool, config, rates)
    client = Client(controller, config)
    on_a = [client.send(f"a{i}", held_at("a")) for i in range(1, 5)]
    await until(lambda: controller.parked == 4)
    on_b = [client.send(f"b{i}", held_at("b")) for i in range(1, 5)]
    await until(lambda: controller.parked == 8)
    assert client.order == []  # no pod has room: nothing goes, however long the lines
    pool.free["b"] = True
    controller.wake()
    await asyncio.wait_for(asyncio.gather(*on_b, on_a[3]), 5.0)
    assert client.order == ["b1", "b2", "b3", "b4", "a4"] and controller.parked == 3
    rates["c"] = 0.0
    pool.free["c"] = False
    unknown = client.send("unknown", held_at("a", "c"))  # c's rate unknown: it may wait for it
    await until(lambda: controller.parked == 4)
    await free_and_finish(pool, controller, "a", *on_a[:3], unknown)
    assert client.order[5:] == ["a1", "a2", "a3", "unknown"]


async def test_a_request_counts_in_its_holders_line_from_its_arrival() -> None:
    # While the pool is full nothing is examined. Then b frees: a's fourth and fifth (turns 4 s
    # and 5 s away at a, beyond the 3 s wait) leave b's room to b1, queued behind them and never
    # examined yet, and go to b only once b has no line.
    pool = Pool(free={"a": False, "b": False})
    config = settings(max_affinity_wait=3.0)
    controller = weighing_lines(pool, config)
    client = Client(controller, config)
    on_a = [client.send(f"a{i}", held_at("a")) for i in range(1, 6)]
    on_b = client.send("b1", held_at("b"))
    await until(lambda: controller.count == 6)
    assert controller.parked == 0
    pool.saturation = 0.5
    pool.free["b"] = True
    controller.wake()
    await asyncio.wait_for(asyncio.gather(on_b, *on_a[3:]), 5.0)
    assert client.order == ["b1", "a4", "a5"]
    await free_and_finish(pool, controller, "a", *on_a[:3])
    assert client.order[3:] == ["a1", "a2", "a3"]


async def test_a_pod_whose_own_requests_keep_it_full_takes_none_of_another_pods_line() -> None:
    # b has completed as many requests a second as have wanted it (ten in the window, 1/s):
    # when its line is empty for a moment, a's far requests still wait for a; once b completes
    # more than want it (2/s), it has spare capacity and takes those whose turn at a is far.
    pool = Pool(0.5, {"a": False, "b": True})
    config = settings(max_affinity_wait=3.0)
    rates = {"a": 1.0, "b": 1.0}
    looked: list[int] = []  # the cycles that weighed the lines

    def pool_room() -> dict[str, bool]:
        looked.append(1)
        return dict(pool.free)

    controller = weighing_lines(pool, config, rates, pool_room)
    client = Client(controller, config)
    await asyncio.wait_for(asyncio.gather(*(client.send(f"b{i}", held_at("b")) for i in range(10))), 5.0)
    on_a = [client.send(f"a{i}", held_at("a")) for i in range(1, 6)]
    await until(lambda: controller.parked == 5)
    cycles = len(looked)
    controller.wake()
    await until(lambda: len(looked) > cycles)
    assert controller.parked == 5 and len(client.order) == 10
    rates["b"] = 2.0
    controller.wake()
    await asyncio.wait_for(asyncio.gather(*on_a[3:]), 5.0)
    assert client.order[10:] == ["a4", "a5"] and controller.parked == 3
    await free_and_finish(pool, controller, "a", *on_a[:3])
    assert client.order[12:] == ["a1", "a2", "a3"]


async def test_a_request_with_nothing_cached_waits_for_a_pod_with_the_shortest_line() -> None:
    # Three requests wait for a and one for b, both full; then a frees. A request with nothing
    # cached, though in a higher band, leaves a's room to a's own line until a's line is no
    # longer than b's: a new prefix goes where the backlog is shortest, not where a slot freed.
    pool = Pool(0.5, {"a": False, "b": False})
    config = settings()
    controller = weighing_lines(pool, config)
    client = Client(controller, config)
    waiting = [client.send(name, held_at(name[0])) for name in ("a1", "a2", "a3", "b1")]
    await until(lambda: controller.parked == 4)
    new = client.send("new", None, priority=1)
    await until(lambda: controller.count == 5)
    pool.free["a"] = True
    controller.wake()
    await asyncio.wait_for(asyncio.gather(new, *waiting[:3]), 5.0)
    assert client.order == ["a1", "a2", "new", "a3"]
    pool.free["b"] = True
    controller.wake()
    await asyncio.wait_for(waiting[3], 5.0)
    assert client.order[4:] == ["b1"]


async def test_without_affinity_wait_or_with_room_at_a_holder_it_is_plain_late_binding() -> None:
    pool = Pool()
    pool.saturation = 0.5
    config = settings(max_affinity_wait=0.0)  # maxAffinityWait 0s: never waits for a holder
    controller = FlowController(lambda: config, lambda: pool.saturation, room_at=pool.room_at)
    client = Client(controller, config)
    await asyncio.wait_for(asyncio.gather(client.send("on-a", held_at("a")), client.send("on-b", held_at("a", "b"))), 5)
    assert client.order == ["on-a", "on-b"] and controller.parked == 0


async def test_a_parked_request_keeps_its_priority_and_leaves_at_once_when_cancelled() -> None:
    pool = Pool()
    config = settings()
    controller = FlowController(lambda: config, lambda: pool.saturation, room_at=pool.room_at)
    client = Client(controller, config)
    high = client.send("high-on-a", held_at("a"), priority=5)
    low = client.send("low-on-a", held_at("a"), priority=0)
    gone = client.send("gone-on-a", held_at("a"), priority=5)
    await until(lambda: controller.count == 3)
    pool.saturation = 0.5
    controller.wake()
    await until(lambda: controller.parked == 3)
    gone.cancel()
    await until(lambda: controller.count == 2 and controller.parked == 2)
    pool.free["a"] = True
    controller.wake()
    await asyncio.gather(high, low)
    assert client.order == ["high-on-a", "low-on-a"]
    assert controller.count == 0 and controller.bytes == 0


async def test_round_robin_turns_go_on_while_a_flow_waits_for_its_holder() -> None:
    pool = Pool()
    config = settings()
    controller = FlowController(lambda: config, lambda: pool.saturation, room_at=pool.room_at)
    client = Client(controller, config)
    tasks = [client.send("x-on-a", held_at("a"), fairness_id="x")]
    tasks += [client.send(f"x{i}", None, fairness_id="x") for i in range(2)]
    tasks += [client.send(f"y{i}", None, fairness_id="y") for i in range(2)]
    await until(lambda: controller.count == 5)
    pool.saturation = 0.5
    controller.wake()
    await until(lambda: len(client.order) == 4)
    # x's turns go to its requests that may go; the flows alternate.
    assert client.order == ["x0", "y0", "x1", "y1"] and controller.parked == 1
    pool.saturation = 2.0
    tasks += [client.send(f"y{i}", None, fairness_id="y") for i in range(2, 4)]
    await until(lambda: controller.count == 3)
    pool.free["a"] = True
    pool.saturation = 0.5
    controller.wake()
    await asyncio.gather(*tasks)
    assert client.order[4:] == ["x-on-a", "y2", "y3"]  # at x's turn, after y1


async def test_a_noisy_flows_parked_requests_take_turns_with_a_quiet_flows() -> None:
    pool = Pool()
    config = settings()
    controller = FlowController(lambda: config, lambda: pool.saturation, room_at=pool.room_at)
    client = Client(controller, config)
    tasks = [client.send(f"noisy{i}", held_at("a"), fairness_id="noisy") for i in range(6)]
    await until(lambda: controller.count == 6)
    pool.saturation = 0.5  # room in the pool, none at a: the noisy requests are parked
    controller.wake()
    await until(lambda: controller.parked == 6)
    tasks += [client.send(f"quiet{i}", held_at("a"), fairness_id="quiet") for i in range(2)]
    await until(lambda: controller.parked == 8)
    pool.free["a"] = True
    controller.wake()
    await asyncio.gather(*tasks)
    assert client.order == ["noisy0", "quiet0", "noisy1", "quiet1", "noisy2", "noisy3", "noisy4", "noisy5"]


async def test_parked_requests_of_a_flow_go_by_its_ordering_policy() -> None:
    pool = Pool()
    band = BandSettings(0, 0, RoundRobinFairnessPolicy("rr"), SloDeadlineOrderingPolicy("slo"))
    config = FlowControlSettings(0, 0, None, 1.0, band, max_affinity_wait=60.0)
    controller = FlowController(lambda: config, lambda: pool.saturation, room_at=pool.room_at)
    client = Client(controller, config)
    pool.saturation = 0.5
    loose = client.send("loose", held_at("a"), headers={SLO_TTFT_HEADER: "60000"})
    await until(lambda: controller.parked == 1)
    tight = client.send("tight", held_at("a"), headers={SLO_TTFT_HEADER: "100"})  # parked after, due first
    await until(lambda: controller.parked == 2)
    pool.free["a"] = True
    controller.wake()
    await asyncio.gather(loose, tight)
    assert client.order == ["tight", "loose"]


def test_max_affinity_wait_is_read_from_the_flow_control_section() -> None:
    text = """apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
flowControl: {maxAffinityWait: 250ms}
"""
    loaded = build(parse_text(text), Handle())
    resolved = flow_control_settings(loaded.config, loaded.plugins)
    assert resolved is not None and resolved.max_affinity_wait == 0.25
    default = build(parse_text(text.replace("{maxAffinityWait: 250ms}", "{}")), Handle())
    resolved = flow_control_settings(default.config, default.plugins)
    assert resolved is not None and resolved.max_affinity_wait == DEFAULT_MAX_AFFINITY_WAIT
    with pytest.raises(ConfigError, match="maxAffinityWait"):
        parse_text(text.replace("250ms", "soon"))


def test_the_producer_names_the_prefix_holder_and_the_prompt_is_hashed_once() -> None:
    store = Datastore()
    addresses = ["10.0.0.1:8000", "10.0.0.2:8000"]
    store.set_endpoints([Endpoint(a.split(":")[0], 8000, name=a) for a in addresses])
    registration = PLUGINS.lookup("approx-prefix-cache-producer")
    assert registration is not None
    producer = registration.factory("approx-prefix-cache-producer", {}, Handle(store))
    assert isinstance(producer, ApproxPrefixCacheProducer)
    prompt = "You are a helpful assistant. " * 40

    def completion(question: str) -> InferenceRequest:
        return InferenceRequest("r", Api.COMPLETIONS, "m", "m", prompt_text=prompt + question)

    first = completion("one")
    assert producer.affinity(first, store.snapshot(), CycleState()) is None  # cached nowhere yet
    state = store.snapshot()[1]
    cycle_state = CycleState()
    producer.prepare(first, store.snapshot(), cycle_state)
    routed = SchedulingResult({"default": ProfileRunResult((state,))}, "default", cycle_state)
    producer.pre_request(first, routed)  # routed to the second endpoint

    second, queued = completion("two"), CycleState()
    affinity = producer.affinity(second, store.snapshot(), queued)
    assert affinity is not None and affinity.holders == {state.address}
    hashed = queued.read(PROMPT_BLOCKS_KEY)
    calls: list[InferenceRequest] = []
    original = producer.hasher.hash
    producer.hasher.hash = lambda *args: calls.append(args[0]) or original(*args)  # type: ignore[method-assign]
    producer.prepare(second, store.snapshot(), queued)  # the scheduling after dispatch reuses the blocks
    assert calls == [] and queued.read(PREFIX_MATCH_KEY) is not None
    assert queued.read(PROMPT_BLOCKS_KEY) is hashed


def test_the_runtime_names_its_affinity_source_once_when_built() -> None:
    holder = RuntimeHolder()
    source = holder.current.affinity_source  # the default config scores prefixes
    assert isinstance(source, ApproxPrefixCacheProducer)
    assert [s.plugin for s in holder.current.producers] == [source]
    text = """apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins: [{type: queue-scorer}, {type: max-score-picker}]
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer}, {pluginRef: max-score-picker}]
"""
    assert holder.build(parse_text(text)).affinity_source is None  # nothing knows where prefixes are


def test_the_queues_prefix_match_serves_the_scheduling_until_the_index_changes() -> None:
    store = Datastore()
    store.set_endpoints([Endpoint(f"10.0.0.{i}", 8000) for i in (1, 2)])
    first_pod, second_pod = store.snapshot()
    registration = PLUGINS.lookup("approx-prefix-cache-producer")
    assert registration is not None
    producer = registration.factory("approx-prefix-cache-producer", {}, Handle(store))
    assert isinstance(producer, ApproxPrefixCacheProducer)
    prompt = "You are a helpful assistant. " * 40

    def routed_to(state: object, question: str) -> None:
        request, cycle_state = completion(question), CycleState()
        producer.prepare(request, store.snapshot(), cycle_state)
        producer.pre_request(request, SchedulingResult({"default": ProfileRunResult((state,))}, "default", cycle_state))

    def completion(question: str) -> InferenceRequest:
        return InferenceRequest("r", Api.COMPLETIONS, "m", "m", prompt_text=prompt + question)

    routed_to(second_pod, "one")
    reads: list[int] = []
    match = producer.index.match
    producer.index.match = lambda hashes: reads.append(1) or match(hashes)  # type: ignore[method-assign]

    at_once, state = completion("two"), CycleState()
    assert producer.affinity(at_once, store.snapshot(), state) == Affinity(frozenset({second_pod.address}))
    producer.prepare(at_once, store.snapshot(), state)  # dispatched at once: nothing changed since
    assert len(reads) == 1

    queued, state = completion("three"), CycleState()
    assert producer.affinity(queued, store.snapshot(), state) == Affinity(frozenset({second_pod.address}))
    routed_to(first_pod, "four")  # while it waited, the prefix went to the other pod as well
    producer.prepare(queued, store.snapshot(), state)
    prefix = state.read(PREFIX_MATCH_KEY)
    assert (
        prefix is not None and prefix.matched_blocks(first_pod.address) == prefix.matched_blocks(second_pod.address) > 0
    )
