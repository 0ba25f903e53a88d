"""The TTFT cost model and its scorer: queue wait against prefill saving, online learning."""

from __future__ import annotations

import pytest

from picker.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState
from picker.framework.cycle_state import CycleState
from picker.framework.handle import Handle
from picker.framework.request import Api, InferenceRequest
from picker.prefix.plugins import (
    PREDICTED_TTFT,
    PREFIX_MATCH_KEY,
    ApproxPrefixCacheProducer,
    PrefixMatch,
    TtftCostScorer,
)
from picker.prefix.prompt_blocks import TOKENS, PromptBlocks
from picker.prefix.ttft import TtftModel, TtftPriors, ttft_scores

CACHED = "10.0.0.1:8000"
IDLE = "10.0.0.2:8000"
REQUEST = InferenceRequest("r", Api.COMPLETIONS, "m", "m", prompt_text="x")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _state(address: str, waiting: int = 0, running: int = 0) -> EndpointState:
    ip, port = address.split(":")
    return EndpointState(
        Endpoint(ip, int(port)),
        EndpointMetrics(waiting_queue_size=waiting, running_requests_size=running, update_time=1.0),
    )


def _cycle(prompt_tokens: int, cached_blocks: int, block: int = 16) -> CycleState:
    blocks = PromptBlocks(TOKENS, tuple(range(prompt_tokens // block)), block, prompt_tokens, 0)
    state = CycleState()
    state[PREFIX_MATCH_KEY] = PrefixMatch(blocks, {CACHED: cached_blocks})
    return state


def _scorer() -> TtftCostScorer:
    handle = Handle()  # as the loader builds a config: the producer whose TTFT model the scorer reads
    handle.add_plugin(ApproxPrefixCacheProducer.create("approx-prefix-cache-producer", {}, handle))
    scorer = TtftCostScorer.create(
        "ttft",
        {
            "prefillTokensPerSecond": 5000,
            "drainTokensPerSecond": 5000,
            "typicalPromptTokens": 512,
        },
        handle,
    )
    assert isinstance(scorer, TtftCostScorer)
    return scorer


def test_cached_pod_wins_while_its_queue_wait_is_below_the_prefill_saving() -> None:
    # 8192-token prompt, 8000 cached at CACHED: saving = 8000 / 5000 = 1.6 s of prefill.
    scorer = _scorer()
    candidates = [
        _state(CACHED, waiting=2),
        _state(IDLE),
    ]  # wait ≈ 2 × 512 / 5000 = 0.2 s
    cycle = _cycle(8192, 500)
    scores = scorer.score(REQUEST, cycle, candidates)
    assert scores[0] == 1.0 and scores[1] < 1.0
    predicted = cycle.explain()[PREDICTED_TTFT]
    assert predicted[CACHED].seconds == pytest.approx(0.01 + 0.2048 + 192 / 5000)
    assert predicted[IDLE].seconds == pytest.approx(0.01 + 8192 / 5000)


def test_idle_pod_wins_once_the_queue_wait_exceeds_the_prefill_saving() -> None:
    scorer = _scorer()
    candidates = [
        _state(CACHED, waiting=20),
        _state(IDLE),
    ]  # wait ≈ 20 × 512 / 5000 = 2.05 s > 1.6 s
    scores = scorer.score(REQUEST, _cycle(8192, 500), candidates)
    assert scores[1] == 1.0 and scores[0] < 1.0
    assert 0.0 < scores[0] < 1.0


def test_interference_sends_a_miss_to_a_quiet_endpoint_and_keeps_a_hit_at_its_busy_holder() -> None:
    # 2,048-token prompt: 2,000 tokens cached at CACHED, which runs 10 requests; IDLE runs 1.
    # TTFT alone prefers CACHED for both. A miss elsewhere would stall CACHED's 10 requests for its
    # whole prefill: with the stall counted, the miss (nothing cached anywhere) goes to IDLE.
    model = TtftModel(TtftPriors(prefill_tokens_per_second=5000.0, overhead_seconds=0.0))
    busy, quiet = _state(CACHED, running=10), _state(IDLE, running=1)
    hit = [model.estimate(busy, 2048, 2000, None, 1.0), model.estimate(quiet, 2048, 0, None, 1.0)]
    assert ttft_scores(hit)[0] == 1.0  # 48 tokens stall 10 requests less than 2,048 stall one
    miss = [model.estimate(busy, 2048, 0, None, 1.0), model.estimate(quiet, 2048, 0, None, 1.0)]
    assert miss[0].seconds == miss[1].seconds  # the same TTFT...
    assert miss[0].interference_seconds == pytest.approx(10 * 2048 / 5000)  # ...but 10 stalled requests
    assert ttft_scores(miss)[1] == 1.0 and ttft_scores(miss)[0] < 0.2
    assert model.estimate(busy, 2048, 0).interference_seconds == 0.0  # off unless weighted


def test_scores_are_best_over_predicted_in_unit_range() -> None:
    model = TtftModel(TtftPriors(overhead_seconds=0.0))
    estimates = [model.estimate(_state(a), tokens, 0) for a, tokens in ((CACHED, 1000), (IDLE, 4000))]
    assert ttft_scores(estimates) == [1.0, pytest.approx(0.25)]


def test_the_pickers_own_backlog_counts_until_it_drains() -> None:
    clock = Clock()
    model = TtftModel(TtftPriors(drain_tokens_per_second=1000.0, typical_prompt_tokens=100.0), clock)
    state = _state(CACHED, waiting=1)
    assert model.work_ahead(state) == 100.0  # the scrape's queue
    model.add_backlog(CACHED, 3000)
    assert model.work_ahead(state) == 3000.0  # requests the scrape does not show yet
    clock.now += 2.0
    assert model.work_ahead(state) == pytest.approx(1000.0)
    clock.now += 5.0
    assert model.work_ahead(state) == 100.0


def test_prefill_and_drain_rates_are_learnt_from_observed_ttft() -> None:
    model = TtftModel(
        TtftPriors(
            prefill_tokens_per_second=5000.0,
            drain_tokens_per_second=5000.0,
            overhead_seconds=0.01,
        )
    )
    true_prefill, true_drain = 8000.0, 2000.0  # decoding alongside slows the queue down
    for i in range(60):  # idle endpoint: TTFT is overhead + prefill of the uncached tokens
        prompt, cached = 1000 + 37 * (i % 7), 200
        model.observe(CACHED, 0.01 + (prompt - cached) / true_prefill, prompt, cached, 0.0)
    assert model.rates(CACHED).prefill_tokens_per_second == pytest.approx(true_prefill, rel=0.02)
    for i in range(60):  # queued endpoint: 20k tokens ahead dominate
        ahead, prompt = 20000.0 + 500 * (i % 5), 300
        model.observe(CACHED, 0.01 + ahead / true_drain + prompt / true_prefill, prompt, 0, ahead)
    rates = model.rates(CACHED)
    assert rates.drain_tokens_per_second == pytest.approx(true_drain, rel=0.05)
    assert rates.prefill_tokens_per_second == pytest.approx(true_prefill, rel=0.02)
    assert rates.prefill_samples == 60 and rates.drain_samples == 60


def test_short_prompts_teach_the_overhead_and_not_the_prefill_rate() -> None:
    # Mooncake's 20-40 token turns come back after one engine step (~100 ms here) whatever the
    # prefill rate; taken as prefill samples they taught a few hundred tokens a second.
    model = TtftModel(TtftPriors(prefill_tokens_per_second=5000.0, overhead_seconds=0.01))
    true_prefill, step = 40000.0, 0.1
    for i in range(200):
        prompt = 30 + i % 10 if i % 2 else 8000 + 100 * (i % 7)
        model.observe(CACHED, step + prompt / true_prefill, prompt, 0, 0.0)
    assert model.overhead_seconds == pytest.approx(step, rel=0.1)
    assert model.prefill_rate(CACHED) == pytest.approx(true_prefill, rel=0.1)


def test_outliers_move_a_rate_by_a_bounded_step() -> None:
    model = TtftModel(TtftPriors(prefill_tokens_per_second=5000.0, ewma_alpha=1.0))
    model.observe(CACHED, 1e-3 + 0.01, 10000, 0, 0.0)  # an impossible 10M tokens/s
    assert model.rates(CACHED).prefill_tokens_per_second == pytest.approx(20000.0)


def test_a_poor_prior_is_forgotten_within_a_few_samples() -> None:
    # Prior 5000 tokens/s, true 40000: the first samples average (weight 1/n), each step
    # bounded by x4, so a handful of responses suffice instead of dozens at the EWMA weight.
    model = TtftModel(TtftPriors(prefill_tokens_per_second=5000.0, overhead_seconds=0.0, ewma_alpha=0.2))
    for _ in range(6):
        model.observe(CACHED, 8000 / 40000.0, 8000, 0, 0.0)
    assert model.prefill_rate(CACHED) == pytest.approx(40000.0, rel=0.1)  # a fixed 0.2 weight: ~27000


def test_endpoints_without_samples_use_the_pools_learnt_rate() -> None:
    # Learning each endpoint alone feeds back on itself: the one that learnt a fast rate first
    # would look cheapest forever while the others keep the slow prior. Samples teach the pool.
    model = TtftModel(TtftPriors(prefill_tokens_per_second=5000.0, overhead_seconds=0.0))
    for _ in range(20):
        model.observe(CACHED, 4000 / 20000.0, 4000, 0, 0.0)
    assert model.prefill_rate(IDLE) == pytest.approx(20000.0, rel=0.05)
    assert model.rates(IDLE).prefill_samples == 0
    cold, learnt = (model.estimate(_state(a), 4000, 0) for a in (IDLE, CACHED))
    assert cold.prefill_seconds == pytest.approx(learnt.prefill_seconds, rel=0.05)


def test_an_endpoints_own_rate_wins_as_its_samples_accumulate() -> None:
    model = TtftModel(TtftPriors(prefill_tokens_per_second=10000.0, overhead_seconds=0.0))
    for _ in range(200):  # the pool: most samples from fast endpoints
        model.observe(IDLE, 4000 / 10000.0, 4000, 0, 0.0)
    slow = "10.0.0.3:8000"
    for _ in range(100):  # one endpoint is half as fast
        model.observe(slow, 4000 / 5000.0, 4000, 0, 0.0)
    assert model.rates(slow).prefill_tokens_per_second == pytest.approx(5000.0, rel=0.02)
    assert 5000.0 < model.prefill_rate(slow) < 6000.0  # 100 own samples against 16 of shrinkage
    assert model.prefill_rate(IDLE) > 9000.0


def test_an_overestimated_queue_raises_the_drain_rate_until_predictions_match() -> None:
    # The queue and prefill shares of a TTFT are not observed apart; scaling the drain rate by
    # predicted / observed converges on the true rate even from queue-and-prefill mixes.
    model = TtftModel(
        TtftPriors(prefill_tokens_per_second=8000.0, drain_tokens_per_second=1000.0, overhead_seconds=0.0)
    )
    model.observe(IDLE, 0.5, 4000, 0, 0.0)  # pins the prefill rate: 8000 tokens/s
    true_drain = 6000.0
    for i in range(80):
        ahead, prompt = 3000.0 + 400 * (i % 6), 2000
        model.observe(CACHED, ahead / true_drain + prompt / 8000.0, prompt, 0, ahead)
    assert model.drain_rate(CACHED) == pytest.approx(true_drain, rel=0.05)
    estimate = model.estimate(_state(CACHED, waiting=0), 2000, 0)
    assert estimate.prefill_seconds == pytest.approx(2000 / 8000.0, rel=0.05)


def test_the_drain_rate_never_exceeds_the_prefill_rate() -> None:
    # A queue cannot drain faster than the engine prefills; an overestimate would empty the
    # backlog at once and let requests herd onto whichever endpoint the last scrape showed idle.
    model = TtftModel(TtftPriors(prefill_tokens_per_second=4000.0, drain_tokens_per_second=50000.0))
    assert model.drain_rate(CACHED) == 4000.0


def test_in_flight_requests_beyond_the_scraped_running_ones_count_as_waiting() -> None:
    model = TtftModel(TtftPriors(typical_prompt_tokens=1000.0))
    ip, port = CACHED.split(":")
    state = EndpointState(
        Endpoint(ip, int(port)),
        EndpointMetrics(waiting_queue_size=1, running_requests_size=4, update_time=1.0),
        in_flight_requests=9,  # picked since the scrape: 5 more than it shows running
    )
    assert model.work_ahead(state) == 5000.0
