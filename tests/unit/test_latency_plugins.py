"""The reference's latency-predictor plugins on the picker's models: the rules of
pkg/epp/framework/plugins/{requestcontrol/requestdataproducer/predictedlatency,
scheduling/scorer/latency, scheduling/filter/{prefixcacheaffinity,sloheadroomtier},
requestcontrol/admitter/latencyslo} v1.5.0, with the predictions of `TtftModel` and
`TpotModel` in place of the sidecars'."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from picker.config.loader import build, parse_text
from picker.config.runtime import RuntimeHolder
from picker.config.schema import ConfigError
from picker.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState
from picker.datastore.store import Datastore
from picker.framework.cycle_state import CycleState
from picker.framework.handle import Handle
from picker.framework.plugin import ProfileRunResult, SchedulingResult
from picker.framework.request import Api, InferenceRequest, ResponseOutcome, Usage
from picker.latency.plugins import (
    LatencyScorer,
    LatencySloAdmitter,
    PredictedLatencyProducer,
    PrefixCacheAffinityFilter,
    SloHeadroomTierFilter,
)
from picker.latency.prediction import LATENCY_PREDICTIONS_KEY, LatencyPrediction
from picker.prefix.plugins import PREFIX_MATCH_KEY, PrefixMatch
from picker.prefix.prompt_blocks import CHARS, PromptBlocks
from picker.request.errors import RequestError
from picker.requestcontrol.director import Director, prepare

ENDPOINTS = [Endpoint(f"10.0.0.{i}", 8000, name=f"pod-{i}", labels={"role": "decode"}) for i in (1, 2, 3)]


def config(*plugins: Mapping[str, Any], profile: list[str] | None = None) -> str:
    document: dict[str, Any] = {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": list(plugins),
    }
    if profile is not None:
        document["schedulingProfiles"] = [{"name": "default", "plugins": [{"pluginRef": p} for p in profile]}]
    return yaml.safe_dump(document)


def producer_config(**parameters: Any) -> str:
    return config({"type": "predicted-latency-producer", "parameters": parameters}, {"type": "latency-scorer"})


def store(*metrics: EndpointMetrics) -> Datastore:
    datastore = Datastore()
    datastore.set_endpoints(ENDPOINTS)
    for endpoint, scraped in zip(ENDPOINTS, metrics):
        datastore.set_metrics(endpoint.address, scraped)
    return datastore


def request(headers: Mapping[str, str] | None = None, stream: bool = False, request_id: str = "r1") -> InferenceRequest:
    return InferenceRequest(
        request_id, Api.COMPLETIONS, "m", "m", stream=stream, prompt_text="word " * 400, headers=dict(headers or {})
    )


def predict(text: str, datastore: Datastore, req: InferenceRequest) -> tuple[Any, CycleState]:
    """The config's producers run on `req` over `datastore`'s endpoints: (runtime, its CycleState)."""
    runtime = RuntimeHolder(datastore).build(parse_text(text))
    cycle_state = CycleState()
    prepare(runtime, req, datastore.snapshot(), cycle_state)
    return runtime, cycle_state


def test_the_ttft_prediction_is_the_ttft_models_against_the_ttft_slo() -> None:
    datastore = store(EndpointMetrics(), EndpointMetrics(waiting_queue_size=4), EndpointMetrics(waiting_queue_size=40))
    runtime, cycle_state = predict(producer_config(), datastore, request({"x-slo-ttft-ms": "300"}))
    found = cycle_state[LATENCY_PREDICTIONS_KEY]
    producer = runtime.plugins["predicted-latency-producer"]
    assert isinstance(producer, PredictedLatencyProducer)
    prompt_tokens = cycle_state[PREFIX_MATCH_KEY].blocks.prompt_tokens  # nothing cached anywhere yet
    for state in datastore.snapshot():
        prediction = found[state.address]
        expected = producer.ttft.estimate(state, prompt_tokens, 0).seconds * 1000
        assert prediction.ttft_ms == pytest.approx(expected, rel=1e-3)
        assert prediction.ttft_headroom_ms == pytest.approx(300 - prediction.ttft_ms)
        assert prediction.ttft_valid == (prediction.ttft_ms < 300)
        # Not streaming: TPOT does not count.
        assert (prediction.tpot_valid, prediction.tpot_headroom_ms) == (True, 0.0)
    idle, queued, long_queue = (found[e.address] for e in ENDPOINTS)
    assert idle.ttft_ms < queued.ttft_ms < long_queue.ttft_ms
    assert idle.valid and not long_queue.valid


def test_without_an_slo_header_no_endpoint_is_within_it() -> None:
    _, cycle_state = predict(producer_config(), store(), request())
    assert all(
        not p.ttft_valid and p.ttft_headroom_ms == -p.ttft_ms for p in cycle_state[LATENCY_PREDICTIONS_KEY].values()
    )


def test_predict_in_prepare_data_false_leaves_no_predictions() -> None:
    runtime = RuntimeHolder(store()).build(parse_text(producer_config(predictInPrepareData=False)))
    cycle_state = CycleState()
    prepare(runtime, request({"x-slo-ttft-ms": "300"}), store().snapshot(), cycle_state)
    assert LATENCY_PREDICTIONS_KEY not in cycle_state


def finish_streamed(
    producer: PredictedLatencyProducer, address: str, tpot_slo: str, tokens: int, seconds: float
) -> None:
    """One streamed request dispatched to `address`, then answered with `tokens` tokens in
    `seconds` after its first byte."""
    req = request({"x-slo-tpot-ms": tpot_slo}, stream=True, request_id=f"done-{time.monotonic_ns()}")
    cycle_state = CycleState()
    producer.prepare(req, [], cycle_state)
    state = next(s for s in store().snapshot() if s.address == address)
    result = SchedulingResult({"default": ProfileRunResult((state,))}, "default", cycle_state)
    producer.pre_request(req, result)
    producer.response_complete(req, result, ResponseOutcome(address, 200, 0.1, 0.1 + seconds, Usage(10, tokens)))


def test_streaming_mode_learns_tpot_from_streamed_responses_and_checks_it_against_the_buffered_slo() -> None:
    datastore = store()
    runtime = RuntimeHolder(datastore).build(parse_text(producer_config(streamingMode=True, sloBufferFactor=1.5)))
    producer = runtime.plugins["predicted-latency-producer"]
    assert isinstance(producer, PredictedLatencyProducer)
    first, second, _ = (e.address for e in ENDPOINTS)
    finish_streamed(producer, first, "0", tokens=101, seconds=2.0)  # 20 ms a token
    cycle_state = CycleState()
    prepare(runtime, request({"x-slo-ttft-ms": "5000", "x-slo-tpot-ms": "15"}), datastore.snapshot(), cycle_state)
    found = cycle_state[LATENCY_PREDICTIONS_KEY]
    learnt = producer.tpot.seconds(first) * 1000
    assert 0 < learnt <= 20.0 and found[first].tpot_ms == pytest.approx(learnt)
    # SLO 15 ms × 1.5 = 22.5 ms of budget.
    assert found[first].tpot_headroom_ms == pytest.approx(22.5 - learnt)
    assert found[first].tpot_valid
    # The second endpoint has no samples of its own: it reads as the pool.
    assert found[second].tpot_ms == pytest.approx(producer.tpot.seconds(second) * 1000)


def test_a_running_request_with_a_tighter_tpot_slo_lowers_the_endpoints_budget() -> None:
    datastore = store()
    runtime = RuntimeHolder(datastore).build(parse_text(producer_config(streamingMode=True)))
    producer = runtime.plugins["predicted-latency-producer"]
    assert isinstance(producer, PredictedLatencyProducer)
    first = ENDPOINTS[0].address
    running = request({"x-slo-tpot-ms": "8"}, request_id="running")
    cycle_state = CycleState()
    producer.prepare(running, [], cycle_state)
    result = SchedulingResult({"default": ProfileRunResult((datastore.snapshot()[0],))}, "default", cycle_state)
    producer.pre_request(running, result)
    mine = CycleState()
    prepare(runtime, request({"x-slo-tpot-ms": "50"}), datastore.snapshot(), mine)
    found = mine[LATENCY_PREDICTIONS_KEY]
    assert found[first].tpot_headroom_ms == pytest.approx(8 - found[first].tpot_ms)
    assert found[ENDPOINTS[1].address].tpot_headroom_ms == pytest.approx(50 - found[first].tpot_ms)
    producer.response_complete(running, result, ResponseOutcome(first, 200))  # it ends: the budget is back
    again = CycleState()
    prepare(runtime, request({"x-slo-tpot-ms": "50"}), datastore.snapshot(), again)
    assert again[LATENCY_PREDICTIONS_KEY][first].tpot_headroom_ms == pytest.approx(50 - found[first].tpot_ms)


def test_tpot_does_not_count_on_prefill_endpoints() -> None:
    prefill = Endpoint("10.0.0.9", 8000, labels={"role": "prefill"})
    datastore = Datastore()
    datastore.set_endpoints([*ENDPOINTS, prefill])
    _, cycle_state = predict(producer_config(streamingMode=True, endpointRoleLabel="role"), datastore, request())
    found = cycle_state[LATENCY_PREDICTIONS_KEY]
    assert (found[prefill.address].tpot_valid, found[prefill.address].tpot_headroom_ms) == (True, 0.0)
    # No TPOT SLO on a decode endpoint: budget 0, and the prediction is not below it.
    assert not found[ENDPOINTS[0].address].tpot_valid


# -- latency-scorer ---------------------------------------------------------------------------


def state(index: int, waiting: int = 0, kv: float = 0.0, running: int = 0) -> EndpointState:
    metrics = EndpointMetrics(waiting_queue_size=waiting, running_requests_size=running, kv_cache_usage=kv)
    return EndpointState(Endpoint(f"10.0.1.{index}", 8000), metrics)


def with_predictions(candidates: list[EndpointState], *rows: tuple[float, float, int] | None) -> CycleState:
    """A CycleState whose predictions give each candidate (TTFT headroom, TPOT headroom, dispatched)."""
    cycle_state = CycleState()
    cycle_state[LATENCY_PREDICTIONS_KEY] = {
        c.address: LatencyPrediction(100.0, 10.0, ttft >= 0, tpot >= 0, ttft, tpot, dispatched)
        for c, row in zip(candidates, rows)
        if row is not None
        for ttft, tpot, dispatched in [row]
    }
    return cycle_state


def scorer(**parameters: Any) -> LatencyScorer:
    plugin = LatencyScorer.create("latency-scorer", parameters, Handle())
    assert isinstance(plugin, LatencyScorer)
    return plugin


def test_the_scorer_prefers_the_least_headroom_within_the_positive_tier() -> None:
    candidates = [state(1), state(2), state(3), state(4)]
    cycle = with_predictions(candidates, (100.0, 0.0, 1), (300.0, 0.0, 1), (200.0, 0.0, 1), (-50.0, 0.0, 0))
    # Only TTFT headroom varies: it alone counts; least headroom → 1.01 (clamped to 1 when summed).
    assert scorer().score(request(), cycle, candidates) == [1.01, 0.01, 0.51, 0.0]
    assert scorer(headroomSelectionStrategy="most").score(request(), cycle, candidates) == [0.01, 1.01, 0.51, 0.0]


def test_with_every_endpoint_over_its_slo_idle_ones_are_scored_first() -> None:
    candidates = [state(1), state(2), state(3)]
    cycle = with_predictions(candidates, (-10.0, 0.0, 2), (-300.0, 0.0, 0), (-200.0, 0.0, 0))
    assert scorer(headroomSelectionStrategy="most").score(request(), cycle, candidates) == [0.0, 0.01, 1.01]


def test_without_idle_ones_the_least_violated_tier_is_scored() -> None:
    candidates = [state(1), state(2), state(3)]
    # Only TPOT over (first), only TTFT over (second), both (third): the TPOT-only tier wins.
    cycle = with_predictions(candidates, (10.0, -5.0, 1), (-5.0, 1.0, 1), (-1.0, -1.0, 1))
    assert scorer().score(request(), cycle, candidates) == [0.51, 0.0, 0.0]


def test_without_predictions_the_scorer_falls_back_to_its_composite() -> None:
    candidates = [state(1, waiting=0, kv=0.5), state(2, waiting=10, kv=0.0)]
    cycle = CycleState()
    blocks = PromptBlocks(CHARS, (1, 2, 3, 4), 64, 100, 0)
    cycle[PREFIX_MATCH_KEY] = PrefixMatch(blocks, {candidates[1].address: 2})
    # (kv free + relative queue + prefix) / 3: (0.5 + 1 + 0) / 3 and (1 + 0 + 0.5) / 3.
    assert scorer().score(request(), cycle, candidates) == [0.5, 0.5]
    assert scorer(compositeQueueWeight=0).score(request(), cycle, candidates) == [0.25, 0.75]


# -- the filters and the admitter -------------------------------------------------------------


def affinity_filter(**parameters: Any) -> PrefixCacheAffinityFilter:
    plugin = PrefixCacheAffinityFilter.create("f", {"explorationProbability": 0, **parameters}, Handle())
    assert isinstance(plugin, PrefixCacheAffinityFilter)
    return plugin


def test_the_affinity_filter_keeps_the_holders_unless_they_cost_too_much_ttft() -> None:
    candidates = [state(1), state(2), state(3)]
    cycle = with_predictions(candidates, (0, 0, 0), (0, 0, 0), (0, 0, 0))
    cycle[PREFIX_MATCH_KEY] = PrefixMatch(PromptBlocks(CHARS, (1, 2, 3, 4, 5), 64, 100, 0), {candidates[0].address: 5})
    assert affinity_filter().filter(request(), cycle, candidates) == [candidates[0]]
    # The holder is predicted 6 s slower than the best other: past the 5 s penalty, everyone stays.
    found = cycle[LATENCY_PREDICTIONS_KEY]
    found[candidates[0].address] = LatencyPrediction(6100.0, 0.0, False, True, -6100.0, 0.0, 3)
    assert affinity_filter().filter(request(), cycle, candidates) == candidates
    assert affinity_filter(maxTTFTPenaltyMs=0).filter(request(), cycle, candidates) == [candidates[0]]
    assert affinity_filter(affinityThreshold=0).filter(request(), cycle, candidates) == candidates
    explore = PrefixCacheAffinityFilter("f", 0.8, 1.0, rng=random.Random(1))
    assert explore.filter(request(), cycle, candidates) == candidates


def test_the_tier_filter_keeps_the_endpoints_within_their_slos() -> None:
    candidates = [state(1), state(2), state(3)]
    cycle = with_predictions(candidates, (5.0, 0.0, 0), (-5.0, 0.0, 0), None)
    never = SloHeadroomTierFilter("t", 0.0)
    assert never.filter(request(), cycle, candidates) == [candidates[0]]
    # Exploring: the others, including the endpoint without a prediction.
    assert SloHeadroomTierFilter("t", 1.0).filter(request(), cycle, candidates) == candidates[1:]
    assert never.filter(request(), CycleState(), candidates) == candidates


def test_the_admitter_denies_only_sheddable_requests_with_slos_nobody_can_meet() -> None:
    busy = [state(1, running=3, kv=0.5), state(2, running=1, kv=0.3)]
    over = with_predictions(busy, (-5.0, 0.0, 1), (-1.0, 0.0, 1))
    admitter = LatencySloAdmitter("a")
    slo = request({"x-slo-ttft-ms": "100"})
    assert admitter.admit(slo, -1, busy, over) == "no valid endpoint available to serve the request"
    assert admitter.admit(slo, 0, busy, over) is None  # not sheddable
    assert admitter.admit(request(), -1, busy, over) is None  # no SLO
    assert admitter.admit(slo, -1, busy, CycleState()) is None  # no predictions
    assert admitter.admit(slo, -1, [busy[0], state(3, running=0, kv=0.5)], over) is None  # an idle one
    assert admitter.admit(slo, -1, [busy[0], state(3, running=2, kv=0.01)], over) is None  # a cold one
    assert admitter.admit(slo, -1, busy, with_predictions(busy, (-5.0, 0.0, 1), (1.0, 0.0, 1))) is None


async def test_a_denied_request_fails_as_in_the_reference() -> None:
    # Busy but not saturated (fresh metrics): the legacy saturation shedding lets it through.
    busy = EndpointMetrics(running_requests_size=2, kv_cache_usage=0.5, update_time=time.monotonic())
    datastore = store(busy, busy, busy)
    runtimes = RuntimeHolder(datastore)
    runtimes.set_objectives({"batch": -1})
    runtimes.load_text(
        config({"type": "predicted-latency-producer"}, {"type": "latency-slo-admitter"}, {"type": "latency-scorer"})
    )
    director = Director(datastore, runtimes)
    body = json.dumps({"model": "m", "prompt": "hello " * 50}).encode()
    headers = {"x-slo-ttft-ms": "0.001", "x-gateway-inference-objective": "batch"}
    with pytest.raises(RequestError) as denied:
        await director.route(body, headers, None)
    assert (denied.value.status, denied.value.message) == (500, "request cannot be admitted")
    routed = await director.route(body, {"x-slo-ttft-ms": "0.001"}, None)  # not sheddable: routed
    routed.finish()


async def test_the_reference_chart_config_routes_a_repeated_prompt_to_its_holder() -> None:
    datastore = store()
    runtimes = RuntimeHolder(datastore)
    runtimes.load_text(
        (Path(__file__).parents[1] / "data" / "reference_configs" / "chart-latency-predictor.yaml").read_text()
    )
    director = Director(datastore, runtimes)
    body = json.dumps({"model": "m", "prompt": "a long shared system prompt " * 60}).encode()
    targets = []
    for _ in range(6):
        routed = await director.route(body, {"x-slo-ttft-ms": "2000"}, None)
        routed.finish()
        targets.append(routed.targets[0])
    # The strict affinity filter keeps the first pick's endpoint, bar its 1% exploration.
    assert targets[1:].count(targets[0]) >= 4


@pytest.mark.parametrize(
    ("plugin", "error"),
    [
        ({"type": "predicted-latency-producer", "parameters": {"samplingMean": 0}}, "samplingMean: must be > 0"),
        ({"type": "predicted-latency-producer", "parameters": {"sloBufferFactor": -1}}, "sloBufferFactor: must be > 0"),
        ({"type": "predicted-latency-producer", "parameters": {"contextTTL": "5 minutes"}}, "contextTTL:"),
        (
            {"type": "latency-scorer", "parameters": {"headroomSelectionStrategy": "fair"}},
            "headroomSelectionStrategy: must be one of least, most",
        ),
        (
            {"type": "prefix-cache-affinity-filter", "parameters": {"affinityThreshold": 1.5}},
            "affinityThreshold: must be <= 1",
        ),
        (
            {"type": "prefix-cache-affinity-filter", "parameters": {"maxTTFTPenaltyMs": -1}},
            "maxTTFTPenaltyMs: must be >= 0",
        ),
        (
            {"type": "slo-headroom-tier-filter", "parameters": {"epsilonExploreNeg": 2}},
            "epsilonExploreNeg: must be <= 1",
        ),
        ({"type": "latency-slo-admitter", "parameters": {"threshold": 1}}, "threshold: unknown parameter"),
    ],
)
def test_bad_parameters_are_config_errors_naming_the_place(plugin: Mapping[str, Any], error: str) -> None:
    with pytest.raises(ConfigError) as caught:
        build(parse_text(config({"type": "queue-scorer"}, plugin)))
    assert f"plugins[1].parameters.{error}" in str(caught.value)
