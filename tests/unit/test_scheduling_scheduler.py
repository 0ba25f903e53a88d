"""The scheduler cycle, the runtime's per-request surface and the decision log."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from picker.config.runtime import RuntimeHolder
from picker.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState
from picker.datastore.store import Datastore
from picker.framework.cycle_state import CycleState, StateKey
from picker.framework.handle import Handle
from picker.framework.plugin import (
    DataProducer,
    Filter,
    PreRequest,
    ResponseComplete,
    SchedulingResult,
    Scorer,
)
from picker.framework.registry import Registration
from picker.framework.request import InferenceRequest, ResponseOutcome
from picker.plugins import REGISTRY
from picker.request.errors import RequestError
from picker.request.openai import OBJECTIVE_HEADER
from picker.requestcontrol.director import Director, RoutedRequest
from picker.scheduling.pickers import MaxScorePicker
from picker.scheduling.profile_handler import SingleProfileHandler
from picker.scheduling.scheduler import PLUGIN_TIMING_SAMPLE, Scheduler, SchedulerProfile, WeightedScorer
from picker.telemetry.decisions import DecisionLog
from picker.telemetry.metrics import PLUGIN_DURATION, SCHEDULER_E2E
from tests.routing import Router, completion
from tests.unit.test_scheduling_plugins import request, state

HEADER = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"


class FixedScorer(Scorer):
    plugin_type = "test-fixed-scorer"

    def __init__(self, name: str, scores: Sequence[float]) -> None:
        super().__init__(name)
        self.scores = scores

    def score(self, request: InferenceRequest, cycle_state: CycleState, candidates: Sequence[EndpointState]):
        return self.scores[: len(candidates)]


class DropAll(Filter):
    plugin_type = "test-drop-all"

    def filter(self, request: InferenceRequest, cycle_state: CycleState, candidates: Sequence[EndpointState]):
        return []


def scheduler(*scorers: WeightedScorer, filters: Sequence[Filter] = (), log=None) -> Scheduler:
    profile = SchedulerProfile("default", filters, scorers, MaxScorePicker("max-score-picker"))
    return Scheduler(SingleProfileHandler("single-profile-handler"), [profile], log)


async def route(director: Director, objective: str | None = None) -> RoutedRequest:
    """Route a completion request (id r1, model m) through the director."""
    headers = {":path": "/v1/completions", "x-request-id": "r1"}
    if objective is not None:
        headers[OBJECTIVE_HEADER] = objective
    return await director.route(b'{"model":"m","prompt":"hi"}', headers, None)


def test_totals_are_weighted_sums_of_clamped_scores() -> None:
    candidates = [state(1), state(2), state(3)]
    s = scheduler(
        WeightedScorer(FixedScorer("a", [0.5, 1.7, -0.3]), 2.0),
        WeightedScorer(FixedScorer("b", [1.0, 0.0, 0.5]), 3.0),
    )
    result = s.schedule(request(), candidates, CycleState())
    run = result.profile_results["default"]
    assert run is not None
    assert run.totals == pytest.approx([4.0, 2.0, 1.5])  # not normalised by Σweights
    assert run.scores["a"] == [0.5, 1.7, -0.3]  # raw scores kept for the explain log
    assert result.targets == (candidates[0],)
    assert result.primary_profile == "default"


def test_no_candidates_is_503_and_filtered_out_is_429() -> None:
    with pytest.raises(RequestError) as empty:
        scheduler().schedule(request(), [], CycleState())
    assert empty.value.status == 503
    with pytest.raises(RequestError) as filtered:
        scheduler(filters=[DropAll("drop")]).schedule(request(), [state(1)], CycleState())
    assert filtered.value.status == 429


A, B, C = (StateKey(name, list) for name in "abc")


class KeyProducer(DataProducer):
    plugin_type = "test-producer"

    def __init__(
        self, name: str, produces: StateKey[list], consumes: tuple[StateKey[list], ...] = (), fail: bool = False
    ) -> None:
        super().__init__(name)
        self.produces = frozenset({produces})
        self.consumes = frozenset(consumes)
        self.fail = fail

    def prepare(self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle_state: CycleState) -> None:
        if self.fail:
            raise RuntimeError("boom")
        cycle_state[next(iter(self.produces))] = [cycle_state.read(c) for c in self.consumes]


async def test_producers_run_before_scoring_and_a_failure_does_not_fail_the_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first, broken = KeyProducer("first", A), KeyProducer("broken", B, fail=True)
    second = KeyProducer("second", C, consumes=(A,))
    producers = {p.name: p for p in (first, broken, second)}
    monkeypatch.setitem(
        REGISTRY.registrations,
        "test-producer",
        Registration("test-producer", lambda name, parameters, handle: producers[name]),
    )
    router = Router()
    router.set_endpoints([state(1).address])
    router.runtimes.load_text(
        HEADER + "plugins: [{type: queue-scorer}, {name: first, type: test-producer},"
        " {name: broken, type: test-producer}, {name: second, type: test-producer}]\n"
    )
    result = await router.pick(completion("hi"))
    assert result.cycle_state[A] == [] and result.cycle_state[C] == [[]]
    assert B not in result.cycle_state


def test_schedule_observes_e2e_and_plugin_durations() -> None:
    def count(metric: Any, **labels: str) -> float:
        return next(
            (
                sample.value
                for family in metric.collect()
                for sample in family.samples
                if sample.name.endswith("_count") and all(sample.labels.get(k) == v for k, v in labels.items())
            ),
            0.0,
        )

    before = count(SCHEDULER_E2E)
    before_scorer = count(PLUGIN_DURATION, extension_point="Scorer", plugin_name="timed")
    s = scheduler(WeightedScorer(FixedScorer("timed", [1.0]), 1.0))
    results = [
        s.schedule(request(), [state(1)], CycleState(), s.next_cycle_timed()) for _ in range(2 * PLUGIN_TIMING_SAMPLE)
    ]
    # Every request is timed end to end; plugins on one request in PLUGIN_TIMING_SAMPLE.
    assert count(SCHEDULER_E2E) == before + 2 * PLUGIN_TIMING_SAMPLE
    assert count(PLUGIN_DURATION, extension_point="Scorer", plugin_name="timed") == before_scorer + 2
    assert [r.timed for r in results].count(True) == 2


async def test_burst_with_stale_metrics_spreads_over_endpoints() -> None:
    """Metrics lag 50 ms: picks in between must see the picker's own in-flight counts."""
    router = Router()  # the default config
    addresses = [f"10.0.0.{i}:8000" for i in range(1, 5)]
    router.set_endpoints({address: EndpointMetrics(update_time=1.0) for address in addresses})  # one old scrape
    picks = Counter()
    for i in range(8):
        routed = await router.route(completion("hi"), f"r{i}")  # in flight until the end
        picks[routed.targets[0]] += 1
    assert picks == {address: 2 for address in addresses}


class Recorder(PreRequest, ResponseComplete):
    plugin_type = "test-recorder"
    calls: list[tuple[str, str]] = []

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> Recorder:
        return cls(name)

    def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        self.calls.append(("pre", result.targets[0].address))

    def response_complete(self, request: InferenceRequest, result: SchedulingResult, outcome: ResponseOutcome) -> None:
        self.calls.append(("done", outcome.endpoint))
        raise RuntimeError("a failing hook is logged, not raised")


async def test_runtime_hooks_priority_and_saturation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(REGISTRY.registrations, "test-recorder", Registration("test-recorder", Recorder.create))
    store = Datastore()
    store.set_endpoints([Endpoint("10.0.0.1", 8000)])
    holder = RuntimeHolder(store)
    holder.set_objectives({"critical": 10, "batch": -1, "unset": None})
    runtime = holder.load_text(HEADER + "plugins: [{type: queue-scorer}, {type: test-recorder}]\n")
    director = Director(store, holder)
    objectives = holder.objectives
    assert objectives.priority(request(objective="batch")) == -1
    assert objectives.priority(request(objective="critical")) == 10
    assert objectives.priority(request(objective="unset")) == 0
    assert objectives.priority(request(objective="unknown")) == 0
    assert objectives.priority(request()) == 0
    assert runtime.saturation_detector.saturation([state(1, waiting=5)]) == 1.0
    assert runtime.saturation_detector.saturation([state(1, waiting=1)]) == pytest.approx(0.2)
    saturated, stale, idle = state(1, waiting=5), state(1, age=None), state(1, waiting=1)
    store.set_metrics(saturated.address, saturated.metrics)
    with pytest.raises(RequestError) as shed:
        await route(director, "batch")
    assert shed.value.status == 429
    store.set_metrics(stale.address, stale.metrics)
    with pytest.raises(RequestError):
        await route(director, "batch")  # unknown load counts as saturated
    store.set_metrics(idle.address, idle.metrics)
    (await route(director, "batch")).finish()
    store.set_metrics(saturated.address, saturated.metrics)
    for objective in ("critical", "unset", None):
        (await route(director, objective)).finish()  # priority >= 0 is never shed

    Recorder.calls = []
    routed = await route(director)
    routed.response_headers(200, "10.0.0.1:8000", "application/json", end_of_stream=True)
    assert Recorder.calls == [("pre", "10.0.0.1:8000"), ("done", "10.0.0.1:8000")]


def test_objectives_are_swapped_whole_and_survive_a_reload_without_touching_a_runtime() -> None:
    holder = RuntimeHolder()
    runtime, before = holder.current, holder.objectives
    holder.set_objectives({"batch": -5})
    assert holder.objectives.priority(request(objective="batch")) == -5
    assert before.priority(request(objective="batch")) == 0  # a request that read the old value keeps it
    assert holder.current is runtime
    holder.load_text("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins: [{type: queue-scorer}]\n")
    assert holder.objectives.priority(request(objective="batch")) == -5  # survives a reload
    with pytest.raises(AttributeError):
        holder.current.parser = runtime.parser  # type: ignore[misc]  # a built runtime is immutable


def test_decision_log_records_scores_and_is_bounded() -> None:
    log = DecisionLog(capacity=2)
    s = scheduler(WeightedScorer(FixedScorer("a", [0.2, 0.9]), 2.0), log=log)
    for _ in range(3):
        s.schedule(request(), [state(1, waiting=3, in_flight=1), state(2)], CycleState())
    assert len(log) == 2
    newest = log.entries(limit=1)
    assert len(newest) == 1
    entry = newest[0]
    assert entry["request_id"] == "r1" and entry["model"] == "m"
    assert entry["targets"] == ["10.0.0.2:8000"]
    profile = entry["profiles"]["default"]
    assert profile["weights"] == {"a": 2.0}
    assert profile["candidates"][0] == {
        "endpoint": "10.0.0.1:8000",
        "scores": {"a": 0.2},
        "total": pytest.approx(0.4),
        "waiting": 3,
        "running": 0,
        "kv_cache_usage": 0.0,
        "in_flight": 1,
    }
    with pytest.raises(ValueError):
        DecisionLog(0)


SLOW = StateKey("slow", list)


class SlowPreparer(DataProducer):
    plugin_type = "test-slow-preparer"
    produces = frozenset({SLOW})

    def __init__(self, name: str, block: bool) -> None:
        super().__init__(name)
        self.block = block
        self.started: list[str] = []
        self.prepared: list[str] = []

    async def prepare_async(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle_state: CycleState
    ) -> None:
        self.started.append(request.request_id)
        if self.block:
            await asyncio.Event().wait()  # never set: only the 400 ms bound ends it
        self.prepared.append(request.request_id)

    def prepare(self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle_state: CycleState) -> None:
        cycle_state[SLOW] = list(self.prepared)


async def test_prepare_async_runs_before_schedule_and_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    store = Datastore()
    store.set_endpoints([Endpoint("10.0.0.1", 8000)])
    for block in (False, True):
        preparer = SlowPreparer("test-slow-preparer", block)
        monkeypatch.setitem(
            REGISTRY.registrations,
            "test-slow-preparer",
            Registration("test-slow-preparer", lambda name, parameters, handle, p=preparer: p),
        )
        holder = RuntimeHolder(store)
        holder.load_text(HEADER + "plugins: [{type: queue-scorer}, {type: test-slow-preparer}]\n")
        routed = await route(Director(store, holder))
        routed.finish()
        assert preparer.started == ["r1"]  # awaited before scheduling
        if block:
            # It never ends by itself, yet the request was routed: the bound ended the wait, and
            # scheduling went on without what it would have prepared.
            assert routed.result.cycle_state[SLOW] == []
        else:
            assert routed.result.cycle_state[SLOW] == ["r1"]


def test_a_scorer_returning_the_wrong_number_of_scores_is_named() -> None:
    with pytest.raises(RuntimeError, match="scorer 'short' returned 1 scores for 2 candidates"):
        scheduler(WeightedScorer(FixedScorer("short", [1.0]), 1.0)).schedule(
            request(), [state(1), state(2)], CycleState()
        )


async def test_the_director_leaves_stale_endpoints_out_unless_none_is_fresh() -> None:
    fresh, stale = "10.0.0.1:8000", "10.0.0.2:8000"
    scraped = Router(staleness_threshold=60.0)
    scraped.set_endpoints(
        {
            fresh: EndpointMetrics(waiting_queue_size=4, update_time=time.monotonic()),
            stale: EndpointMetrics(update_time=1.0),
        }
    )
    for i in range(3):  # the stale one's empty queue would win, and nothing is finished
        assert (await scraped.route(completion("hi"), f"r{i}")).destination == fresh
    unscraped = Router(staleness_threshold=60.0)  # nothing scrapes: no endpoint is fresh, all stay
    unscraped.set_endpoints([fresh, stale])
    picks = {(await unscraped.route(completion("hi"), f"r{i}")).destination for i in range(2)}
    assert picks == {fresh, stale}  # spread by the picker's own in-flight counts
