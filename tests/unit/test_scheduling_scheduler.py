"""The scheduler cycle, the runtime's per-request surface and the decision log."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any, Mapping, Sequence

import pytest

from picker.config.loader import build, parse_text
from picker.config.runtime import Runtime, RuntimeHolder
from picker.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState
from picker.datastore.store import Datastore
from picker.request.errors import RequestError
from picker.request.model import InferenceRequest, ResponseOutcome
from picker.scheduling.decisions import DecisionLog
from picker.scheduling.framework import (
    CycleState,
    DataProducer,
    Filter,
    Handle,
    PreRequest,
    ResponseComplete,
    Scorer,
    SchedulingResult,
)
from picker.scheduling.pickers import MaxScorePicker
from picker.scheduling.profile_handler import SingleProfileHandler
from picker.scheduling.scheduler import PLUGIN_TIMING_SAMPLE, Scheduler, SchedulerProfile, WeightedScorer
from picker.telemetry.metrics import PLUGIN_DURATION, SCHEDULER_E2E
from tests.unit.test_scheduling_plugins import request, state


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


def scheduler(*scorers: WeightedScorer, filters: Sequence[Filter] = (), producers=(), log=None) -> Scheduler:  # noqa: ANN001
    profile = SchedulerProfile("default", filters, scorers, MaxScorePicker("max-score-picker"))
    return Scheduler(SingleProfileHandler("single-profile-handler"), [profile], producers, log)


def test_totals_are_weighted_sums_of_clamped_scores() -> None:
    candidates = [state(1), state(2), state(3)]
    s = scheduler(
        WeightedScorer(FixedScorer("a", [0.5, 1.7, -0.3]), 2.0),
        WeightedScorer(FixedScorer("b", [1.0, 0.0, 0.5]), 3.0),
    )
    result = s.schedule(request(), candidates)
    run = result.profile_results["default"]
    assert run is not None
    assert run.totals == pytest.approx([4.0, 2.0, 1.5])  # not normalised by Σweights
    assert run.scores["a"] == [0.5, 1.7, -0.3]  # raw scores kept for the explain log
    assert result.targets == (candidates[0],)
    assert result.primary_profile == "default"


def test_no_candidates_is_503_and_filtered_out_is_429() -> None:
    with pytest.raises(RequestError) as empty:
        scheduler().schedule(request(), [])
    assert empty.value.status == 503
    with pytest.raises(RequestError) as filtered:
        scheduler(filters=[DropAll("drop")]).schedule(request(), [state(1)])
    assert filtered.value.status == 429


class KeyProducer(DataProducer):
    plugin_type = "test-producer"

    def __init__(self, name: str, produces: str, consumes: str = "", fail: bool = False) -> None:
        super().__init__(name)
        self.produces = frozenset({produces})
        self.consumes = frozenset({consumes} - {""})
        self.fail = fail

    def prepare(self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle_state: CycleState) -> None:
        if self.fail:
            raise RuntimeError("boom")
        cycle_state[next(iter(self.produces))] = [cycle_state.get(c) for c in self.consumes]


def test_producers_run_before_scoring_and_a_failure_does_not_fail_the_request() -> None:
    first, broken = KeyProducer("first", "a"), KeyProducer("broken", "b", fail=True)
    second = KeyProducer("second", "c", consumes="a")
    result = scheduler(producers=[first, broken, second]).schedule(request(), [state(1)])
    assert result.cycle_state["a"] == [] and result.cycle_state["c"] == [[]]
    assert "b" not in result.cycle_state


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
    results = [s.schedule(request(), [state(1)]) for _ in range(2 * PLUGIN_TIMING_SAMPLE)]
    # Every request is timed end to end; plugins on one request in PLUGIN_TIMING_SAMPLE.
    assert count(SCHEDULER_E2E) == before + 2 * PLUGIN_TIMING_SAMPLE
    assert count(PLUGIN_DURATION, extension_point="Scorer", plugin_name="timed") == before_scorer + 2
    assert [r.timed for r in results].count(True) == 2


def test_burst_with_stale_metrics_spreads_over_endpoints() -> None:
    """Metrics lag 50 ms: picks in between must see the picker's own in-flight counts."""
    store = Datastore()
    store.set_endpoints(Endpoint(f"10.0.0.{i}", 8000) for i in range(1, 5))
    for address in store.endpoints():
        store.set_metrics(address, EndpointMetrics(update_time=1.0))  # one old scrape: all idle
    runtime = RuntimeHolder(store).current  # the default config
    picks = Counter()
    for _ in range(8):
        target = runtime.scheduler.schedule(request(), store.snapshot()).targets[0]
        store.acquire(target.address, 10)
        picks[target.address] += 1
    assert picks == {address: 2 for address in store.endpoints()}


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


def test_runtime_hooks_priority_and_saturation(monkeypatch: pytest.MonkeyPatch) -> None:
    from picker.scheduling import registry

    monkeypatch.setitem(registry._REGISTRY, "test-recorder", registry.Registration("test-recorder", Recorder.create))
    config = parse_text(
        "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
        "plugins: [{type: queue-scorer}, {type: test-recorder}]\n"
    )
    runtime = Runtime(build(config), objectives={"critical": 10, "batch": -1, "unset": None})
    assert runtime.priority(request(objective="batch")) == -1
    assert runtime.priority(request(objective="critical")) == 10
    assert runtime.priority(request(objective="unset")) == 0
    assert runtime.priority(request(objective="unknown")) == 0
    assert runtime.priority(request()) == 0
    assert runtime.saturation([state(1, waiting=5)]) == 1.0
    assert runtime.saturation([state(1, waiting=1)]) == pytest.approx(0.2)
    saturated, stale, idle = [state(1, waiting=5)], [state(1, age=None)], [state(1, waiting=1)]
    with pytest.raises(RequestError) as shed:
        runtime.admit(request(objective="batch"), saturated)
    assert shed.value.status == 429
    with pytest.raises(RequestError):
        runtime.admit(request(objective="batch"), stale)  # unknown load counts as saturated
    runtime.admit(request(objective="batch"), idle)
    for objective in ("critical", "unset", None):
        runtime.admit(request(objective=objective), saturated)  # priority >= 0 is never shed

    Recorder.calls = []
    result = runtime.scheduler.schedule(request(), [state(1)])
    runtime.pre_request(request(), result)
    runtime.response_complete(request(), result, ResponseOutcome(endpoint="10.0.0.1:8000", status=200))
    assert Recorder.calls == [("pre", "10.0.0.1:8000"), ("done", "10.0.0.1:8000")]


def test_holder_objectives_apply_to_the_current_runtime() -> None:
    holder = RuntimeHolder()
    holder.set_objectives({"batch": -5})
    assert holder.current.priority(request(objective="batch")) == -5
    holder.load_text("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins: [{type: queue-scorer}]\n")
    assert holder.current.priority(request(objective="batch")) == -5  # survives a reload


def test_decision_log_records_scores_and_is_bounded() -> None:
    log = DecisionLog(capacity=2)
    s = scheduler(WeightedScorer(FixedScorer("a", [0.2, 0.9]), 2.0), log=log)
    for _ in range(3):
        s.schedule(request(), [state(1, waiting=3, in_flight=1), state(2)])
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


class SlowPreparer(DataProducer):
    plugin_type = "test-slow-preparer"
    produces = frozenset({"slow"})

    def __init__(self, name: str, block: bool) -> None:
        super().__init__(name)
        self.block = block
        self.prepared: list[str] = []

    async def prepare_async(self, request: InferenceRequest, candidates: Sequence[EndpointState]) -> None:
        if self.block:
            await asyncio.Event().wait()  # never set: only the 400 ms bound ends it
        self.prepared.append(request.request_id)

    def prepare(self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle_state: CycleState) -> None:
        cycle_state["slow"] = list(self.prepared)


async def test_prepare_async_runs_before_schedule_and_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from picker.scheduling import registry

    for block in (False, True):
        preparer = SlowPreparer("test-slow-preparer", block)
        monkeypatch.setitem(
            registry._REGISTRY,
            "test-slow-preparer",
            registry.Registration("test-slow-preparer", lambda name, parameters, handle, p=preparer: p),
        )
        config = parse_text(
            "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
            "plugins: [{type: queue-scorer}, {type: test-slow-preparer}]\n"
        )
        runtime = Runtime(build(config))
        started = time.monotonic()
        await runtime.prepare_async(request(), [state(1)])
        result = runtime.scheduler.schedule(request(), [state(1)])
        if block:
            assert 0.35 < time.monotonic() - started < 2.0
            assert result.cycle_state["slow"] == []
        else:
            assert result.cycle_state["slow"] == ["r1"]


def test_a_scorer_returning_the_wrong_number_of_scores_is_named() -> None:
    with pytest.raises(RuntimeError, match="scorer 'short' returned 1 scores for 2 candidates"):
        scheduler(WeightedScorer(FixedScorer("short", [1.0]), 1.0)).schedule(request(), [state(1), state(2)])
