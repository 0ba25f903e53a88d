"""Built-in plugins against the reference semantics (gie-epp.md §3.3, §7.1), ties included."""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest

from picker.datalayer.plugins import CoreMetricsExtractor, MetricsDataSource
from picker.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState
from picker.framework.cycle_state import CycleState
from picker.framework.durations import parse_duration
from picker.framework.handle import Handle
from picker.framework.parameters import Parameters, PluginConfigError
from picker.framework.request import Api, InferenceRequest
from picker.scheduling.filters import HeaderBasedTestingFilter
from picker.scheduling.pickers import MaxScorePicker, RandomPicker, WeightedRandomPicker
from picker.scheduling.saturation import UtilizationDetector
from picker.scheduling.scorers import (
    KVCacheUtilizationScorer,
    LoraAffinityScorer,
    QueueScorer,
    RunningRequestsSizeScorer,
    TokenLoadScorer,
)


def state(
    index: int,
    *,
    waiting: int = 0,
    running: int = 0,
    kv: float = 0.0,
    in_flight: int = 0,
    tokens: int = 0,
    age: float | None = 0.0,
    active: frozenset[str] = frozenset(),
    waiting_models: frozenset[str] = frozenset(),
    max_lora: int = 0,
) -> EndpointState:
    """An endpoint 10.0.0.<index>:8000 whose metrics are `age` seconds old (None: never scraped)."""
    metrics = EndpointMetrics(
        waiting_queue_size=waiting,
        running_requests_size=running,
        kv_cache_usage=kv,
        active_models=active,
        waiting_models=waiting_models,
        max_active_models=max_lora,
        update_time=0.0 if age is None else time.monotonic() - age,
    )
    return EndpointState(Endpoint(f"10.0.0.{index}", 8000, name=f"pod-{index}"), metrics, in_flight, tokens)


def request(model: str = "m", headers: dict[str, str] | None = None, objective: str | None = None) -> InferenceRequest:
    return InferenceRequest(
        request_id="r1",
        api=Api.COMPLETIONS,
        model=model,
        target_model=model,
        prompt_text="hi",
        headers=headers or {},
        objective=objective,
    )


def score(scorer, candidates):
    return list(scorer.score(request(), CycleState(), candidates))


# -- scorers ----------------------------------------------------------------------------------


def test_queue_scorer_min_max_normalises_waiting_queue() -> None:
    scores = score(QueueScorer("q"), [state(1, waiting=0), state(2, waiting=5), state(3, waiting=10)])
    assert scores == [1.0, 0.5, 0.0]


def test_queue_scorer_all_equal_scores_one() -> None:
    assert score(QueueScorer("q"), [state(1, waiting=3), state(2, waiting=3)]) == [1.0, 1.0]


def test_queue_scorer_counts_in_flight_requests_not_yet_scraped() -> None:
    # Scrape shows nothing yet, but the picker has sent 3 requests to the first endpoint.
    assert score(QueueScorer("q"), [state(1, in_flight=3), state(2)]) == [0.0, 1.0]
    # Once the scrape shows them (running 2 + waiting 1), they are not counted twice.
    fresh = [state(1, waiting=1, running=2, in_flight=3), state(2, waiting=1)]
    assert score(QueueScorer("q"), fresh) == [1.0, 1.0]


def test_running_requests_scorer_min_max_and_in_flight() -> None:
    scorer = RunningRequestsSizeScorer("r")
    assert score(scorer, [state(1, running=4), state(2, running=0), state(3, running=2)]) == [0.0, 1.0, 0.5]
    assert score(scorer, [state(1, running=1, in_flight=4), state(2, running=2)]) == [0.0, 1.0]


def test_kv_cache_utilization_scorer_is_one_minus_usage() -> None:
    assert score(KVCacheUtilizationScorer("kv"), [state(1, kv=0.0), state(2, kv=0.25), state(3, kv=1.0)]) == [
        1.0,
        0.75,
        0.0,
    ]


def test_lora_affinity_scorer_tiers() -> None:
    lora = frozenset({"m"})
    candidates = [
        state(1, active=lora, max_lora=1),  # running: 1.0 even when full
        state(2, active=frozenset({"x"}), max_lora=2),  # room for one more adapter: 0.8
        state(3, waiting_models=lora, active=frozenset({"x"}), max_lora=2),  # full, adapter waiting: 0.6
        state(4, active=frozenset({"x", "y"}), max_lora=2),  # full, adapter absent: 0
        state(5, waiting_models=lora, max_lora=4),  # waiting but has room: the room tier wins (0.8)
    ]
    assert score(LoraAffinityScorer("l"), candidates) == [1.0, 0.8, 0.6, 0.0, 0.8]


def test_token_load_scorer_formula_and_parameter() -> None:
    scorer = TokenLoadScorer.create("t", {"queueThresholdTokens": 1000}, Handle())
    assert score(scorer, [state(1, tokens=0), state(2, tokens=250), state(3, tokens=5000)]) == [1.0, 0.75, 0.0]
    assert TokenLoadScorer.create("t", {}, Handle()).queue_threshold_tokens == 4194304
    with pytest.raises(PluginConfigError, match="queueThresholdTokens: must be > 0"):
        TokenLoadScorer.create("t", {"queueThresholdTokens": 0}, Handle())


@pytest.mark.parametrize("factory", [QueueScorer.create, KVCacheUtilizationScorer.create, LoraAffinityScorer.create])
def test_parameterless_scorers_reject_parameters(factory) -> None:
    with pytest.raises(PluginConfigError, match="hashBlockSize: unknown parameter"):
        factory("s", {"hashBlockSize": 64}, Handle())


# -- pickers ----------------------------------------------------------------------------------


def test_max_score_picker_picks_the_highest() -> None:
    candidates = [state(1), state(2), state(3)]
    assert MaxScorePicker("p").pick(CycleState(), candidates, [0.2, 0.9, 0.5]) == (candidates[1],)


def test_max_score_picker_breaks_ties_at_random() -> None:
    candidates = [state(1), state(2), state(3)]
    picker = MaxScorePicker("p", rng=random.Random(7))
    picks = Counter(picker.pick(CycleState(), candidates, [1.0, 1.0, 0.5])[0].address for _ in range(400))
    assert set(picks) == {candidates[0].address, candidates[1].address}
    assert min(picks.values()) > 120  # roughly even, never the lower score


def test_max_score_picker_several_targets_sorted_with_random_ties() -> None:
    candidates = [state(i) for i in range(1, 6)]
    picker = MaxScorePicker.create("p", {"maxNumOfEndpoints": 3}, Handle())
    seen_second = set()
    for _ in range(100):
        targets = picker.pick(CycleState(), candidates, [0.1, 0.8, 0.8, 0.9, 0.2])
        assert targets[0] is candidates[3]
        assert {targets[1].address, targets[2].address} == {candidates[1].address, candidates[2].address}
        seen_second.add(targets[1].address)
    assert len(seen_second) == 2
    assert len(picker.pick(CycleState(), candidates[:2], [1.0, 0.0])) == 2  # fewer candidates than N


def test_picker_max_num_of_endpoints_is_validated() -> None:
    with pytest.raises(PluginConfigError, match="maxNumOfEndpoints: must be >= 1"):
        MaxScorePicker.create("p", {"maxNumOfEndpoints": 0}, Handle())
    with pytest.raises(PluginConfigError, match="maxNumOfEndpoints: must be an integer"):
        RandomPicker.create("p", {"maxNumOfEndpoints": "2"}, Handle())


def test_random_picker_ignores_scores() -> None:
    candidates = [state(1), state(2)]
    picker = RandomPicker("p", rng=random.Random(1))
    picks = Counter(picker.pick(CycleState(), candidates, [1.0, 0.0])[0].address for _ in range(200))
    assert min(picks.values()) > 60


def test_weighted_random_picker_follows_weights() -> None:
    candidates = [state(1), state(2), state(3)]
    picker = WeightedRandomPicker("p", rng=random.Random(3))
    picks = Counter(picker.pick(CycleState(), candidates, [3.0, 1.0, 0.0])[0].address for _ in range(4000))
    assert candidates[2].address not in picks  # zero weight is never chosen while a positive exists
    share = picks[candidates[0].address] / 4000
    assert 0.70 < share < 0.80  # A-Res with one pick: P = w / Σw = 0.75


def test_weighted_random_picker_all_zero_falls_back_to_uniform() -> None:
    candidates = [state(1), state(2)]
    picker = WeightedRandomPicker("p", rng=random.Random(5))
    picks = Counter(picker.pick(CycleState(), candidates, [0.0, 0.0])[0].address for _ in range(200))
    assert len(picks) == 2
    two = WeightedRandomPicker("p", max_num_of_endpoints=2).pick(CycleState(), candidates, [0.0, 1.0])
    assert two == (candidates[1], candidates[0])  # positives first, then the rest


# -- filters and the saturation detector -------------------------------------------------------


def test_header_based_testing_filter() -> None:
    candidates = [state(1), state(2), state(3)]
    flt = HeaderBasedTestingFilter("h")
    picked = flt.filter(
        request(headers={"test-epp-endpoint-selection": "10.0.0.1, 10.0.0.3:8000,10.0.0.9"}), CycleState(), candidates
    )
    assert picked == [candidates[0], candidates[2]]
    assert flt.filter(request(), CycleState(), candidates) == []
    assert flt.filter(request(headers={"test-epp-endpoint-selection": "10.0.0.2:9"}), CycleState(), candidates) == []


def test_utilization_detector_defaults() -> None:
    detector = UtilizationDetector.create("u", {}, Handle())
    assert (detector.queue_depth_threshold, detector.kv_cache_util_threshold) == (5, 0.8)
    assert (detector.metrics_staleness_threshold, detector.headroom) == (0.2, 0.0)


def test_utilization_detector_saturation_is_mean_of_max_ratios() -> None:
    detector = UtilizationDetector("u")
    # max(5/5, 0.4/0.8) = 1.0 ; max(0/5, 0.4/0.8) = 0.5 ; stale → 1.0 ; never scraped → 1.0
    assert detector.saturation([state(1, waiting=5, kv=0.4), state(2, kv=0.4)]) == pytest.approx(0.75)
    assert detector.saturation([state(1), state(2, age=1.0)]) == pytest.approx(0.5)
    assert detector.saturation([state(1, age=None)]) == 1.0
    assert detector.saturation([]) == 1.0
    assert detector.saturation([state(1, waiting=10)]) == pytest.approx(2.0)


def test_utilization_detector_filter_keeps_fresh_unsaturated_or_all() -> None:
    detector = UtilizationDetector.create("u", {"headroom": 0.2}, Handle())
    ok = state(1, waiting=5, kv=0.9)  # 5 < 6 and 0.9 < 0.96 thanks to the headroom
    full_queue = state(2, waiting=6)
    full_kv = state(3, kv=0.96)
    stale = state(4, age=0.5)
    candidates = [ok, full_queue, full_kv, stale]
    assert detector.filter(request(), CycleState(), candidates) == [ok]
    assert detector.filter(request(), CycleState(), candidates[1:]) == candidates[1:]


def test_utilization_detector_parameters_are_validated() -> None:
    detector = UtilizationDetector.create(
        "u", {"metricsStalenessThreshold": "1.5s", "queueDepthThreshold": 8}, Handle()
    )
    assert detector.metrics_staleness_threshold == 1.5 and detector.queue_depth_threshold == 8
    for parameters, message in [
        ({"queueDepthThreshold": 0}, "queueDepthThreshold: must be >= 1"),
        ({"kvCacheUtilThreshold": 1.5}, "kvCacheUtilThreshold: must be <= 1"),
        ({"kvCacheUtilThreshold": 0}, "kvCacheUtilThreshold: must be > 0"),
        ({"metricsStalenessThreshold": "soon"}, "metricsStalenessThreshold: invalid duration"),
        ({"headroom": -1}, "headroom: must be >= 0"),
        ({"queueDepth": 3}, "queueDepth: unknown parameter"),
    ]:
        with pytest.raises(PluginConfigError, match=message):
            UtilizationDetector.create("u", parameters, Handle())


# -- config-only plugins and parameter parsing -------------------------------------------------


def test_metrics_data_source_parameters() -> None:
    source = MetricsDataSource.create("m", {"scheme": "https", "path": "/prometheus/metrics"}, Handle())
    assert (source.scheme, source.path, source.insecure_skip_verify) == ("https", "/prometheus/metrics", True)
    with pytest.raises(PluginConfigError, match="scheme: must be one of http, https"):
        MetricsDataSource.create("m", {"scheme": "ftp"}, Handle())
    with pytest.raises(PluginConfigError, match="insecureSkipVerify: must be true or false"):
        MetricsDataSource.create("m", {"insecureSkipVerify": "yes"}, Handle())


def test_core_metrics_extractor_parameters() -> None:
    extractor = CoreMetricsExtractor.create("c", {"defaultEngine": "sglang"}, Handle())
    assert extractor.catalog.default_engine == "sglang"
    with pytest.raises(PluginConfigError, match="defaultEngine"):
        CoreMetricsExtractor.create("c", {"defaultEngine": "nope"}, Handle())
    with pytest.raises(PluginConfigError, match="unknown"):
        CoreMetricsExtractor.create("c", {"engines": []}, Handle())


def test_parse_duration() -> None:
    assert parse_duration("200ms") == pytest.approx(0.2)
    assert parse_duration("1m30s") == 90.0
    assert parse_duration("0") == 0.0
    for bad in ("", "5", "ms", "1d"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_parameters_reject_non_mapping() -> None:
    with pytest.raises(PluginConfigError, match="parameters: must be a mapping"):
        Parameters([1, 2])  # type: ignore[arg-type]
