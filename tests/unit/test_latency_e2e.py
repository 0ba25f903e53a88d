"""The completion-time cost (`e2e-cost-scorer`, `picker.latency.e2e`): TPOT learnt per pod
against its batch from what responses report, the output length expected from `max_tokens` or
history, and routing that sees decode work the TTFT cost does not."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY

from picker.config.loader import parse_text
from picker.config.runtime import RuntimeHolder
from picker.config.schema import ConfigError
from picker.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState
from picker.datastore.store import Datastore
from picker.framework.cycle_state import CycleState
from picker.framework.plugin import ProfileRunResult, SchedulingResult
from picker.framework.request import Api, InferenceRequest, ResponseOutcome, Usage
from picker.latency.e2e import DecodeLedger, E2eEstimate, TpotByBatch, e2e_scores
from picker.latency.plugins import OBSERVED_E2E, PREDICTED_E2E, E2eCostScorer
from picker.prefix.plugins import TtftCostScorer
from picker.requestcontrol.director import prepare

ENDPOINTS = [Endpoint(f"10.0.0.{i}", 8000, name=f"pod-{i}") for i in (1, 2, 3)]
FIRST, SECOND, THIRD = (e.address for e in ENDPOINTS)


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def config(**parameters: Any) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
            "kind": "EndpointPickerConfig",
            "plugins": [
                {"type": "e2e-cost-scorer", "parameters": parameters},
                {"type": "ttft-cost-scorer"},
                {"type": "max-score-picker"},
            ],
        }
    )


def setup(*metrics: EndpointMetrics, **parameters: Any) -> tuple[Any, Datastore, E2eCostScorer, Clock]:
    """A runtime with an `e2e-cost-scorer` over three endpoints, its ledger on a test clock."""
    datastore = Datastore()
    datastore.set_endpoints(ENDPOINTS)
    for endpoint, scraped in zip(ENDPOINTS, metrics):
        datastore.set_metrics(endpoint.address, scraped)
    runtime = RuntimeHolder(datastore).build(parse_text(config(**parameters)))
    scorer = runtime.plugins["e2e-cost-scorer"]
    assert isinstance(scorer, E2eCostScorer)
    clock = Clock()
    scorer.ledger.clock = clock
    return runtime, datastore, scorer, clock


def request(
    body: Mapping[str, Any] | None = None, stream: bool = True, request_id: str = "r", prompt: str = "word " * 100
) -> InferenceRequest:
    return InferenceRequest(
        request_id, Api.COMPLETIONS, "m", "m", stream=stream, prompt_text=prompt, body=dict(body or {})
    )


def state_of(datastore: Datastore, address: str) -> EndpointState:
    return next(s for s in datastore.snapshot() if s.address == address)


def send(scorer: E2eCostScorer, datastore: Datastore, address: str, req: InferenceRequest) -> SchedulingResult:
    """`req` was picked for `address`."""
    result = SchedulingResult({"default": ProfileRunResult((state_of(datastore, address),))}, "default", CycleState())
    scorer.pre_request(req, result)
    return result


def answer(
    scorer: E2eCostScorer,
    req: InferenceRequest,
    result: SchedulingResult,
    address: str,
    tokens: int,
    tpot: float,
    ttft: float = 0.05,
) -> None:
    """The response ends: `tokens` tokens, `tpot` seconds apart after the first at `ttft`."""
    scorer.response_complete(
        req, result, ResponseOutcome(address, 200, ttft, ttft + tpot * (tokens - 1), Usage(100, tokens))
    )


def teach(scorer: E2eCostScorer, datastore: Datastore, clock: Clock, address: str, batch: int, tpot: float) -> None:
    """`batch` requests of 101 tokens run together at `address`, `tpot` seconds a token (their
    prompts are empty: no prefill stalls the others)."""
    pending = [(req, send(scorer, datastore, address, req)) for req in (request(prompt="") for _ in range(batch))]
    clock.now += 0.05 + 100 * tpot
    for req, result in pending:
        answer(scorer, req, result, address, 101, tpot)


def score(runtime: Any, datastore: Datastore, scorer: E2eCostScorer, req: InferenceRequest) -> dict[str, float]:
    cycle_state = CycleState()
    candidates = datastore.snapshot()
    prepare(runtime, req, candidates, cycle_state)
    scores = scorer.score(req, cycle_state, candidates)
    return {c.address: s for c, s in zip(candidates, scores)}


def predicted(runtime: Any, datastore: Datastore, scorer: E2eCostScorer, req: InferenceRequest) -> dict[str, Any]:
    cycle_state = CycleState()
    candidates = datastore.snapshot()
    prepare(runtime, req, candidates, cycle_state)
    scorer.score(req, cycle_state, candidates)
    found: dict[str, Any] = cycle_state.explain()[PREDICTED_E2E]
    return found


def test_nothing_learnt_scores_every_endpoint_alike() -> None:
    busy = EndpointMetrics(waiting_queue_size=5, running_requests_size=20)
    runtime, datastore, scorer, _ = setup(EndpointMetrics(), busy, EndpointMetrics())
    for _ in range(4):  # long decodes committed at the second endpoint, none answered yet
        send(scorer, datastore, SECOND, request({"max_tokens": 2000}))
    assert not scorer.tpot.learnt
    assert set(score(runtime, datastore, scorer, request({"max_tokens": 1000})).values()) == {1.0}


def test_tpot_is_learnt_against_the_batch_and_many_running_decodes_predict_a_longer_completion() -> None:
    runtime, datastore, scorer, clock = setup()
    teach(scorer, datastore, clock, FIRST, batch=1, tpot=0.010)
    teach(scorer, datastore, clock, FIRST, batch=8, tpot=0.024)
    teach(scorer, datastore, clock, FIRST, batch=1, tpot=0.010)
    teach(scorer, datastore, clock, FIRST, batch=8, tpot=0.024)
    curve = scorer.tpot.curve()
    assert curve.per_seq == pytest.approx(0.002, rel=0.05)  # 14 ms more over 7 more sequences
    assert curve.seconds(1) == pytest.approx(0.010, rel=0.05)
    # A non-streamed response (its first byte is its end) and a failed one teach nothing.
    unstreamed = request(stream=False)
    answer(scorer, unstreamed, send(scorer, datastore, FIRST, unstreamed), FIRST, 101, 0.5)
    failed = request()
    scorer.response_complete(failed, send(scorer, datastore, FIRST, failed), ResponseOutcome(FIRST, 500, 0.05, 9.0))
    assert scorer.tpot.curve() == curve

    for _ in range(6):
        send(scorer, datastore, SECOND, request({"max_tokens": 1000}))
    found = predicted(runtime, datastore, scorer, request({"max_tokens": 500}))
    busy, idle = found[SECOND], found[THIRD]
    assert busy.mean_batch == pytest.approx(7.0)  # six others decode beside all of its 500 tokens
    assert idle.mean_batch == pytest.approx(1.0)
    assert busy.seconds > idle.seconds + 400 * (busy.tpot_seconds - idle.tpot_seconds)
    assert busy.harm_seconds > 0.0 == idle.harm_seconds  # the six would decode slower beside it


def test_decodes_that_take_half_their_prediction_calibrate_the_line_down() -> None:
    tpot = TpotByBatch()
    tpot.observe(1.0, 0.0, 0.99, 100)  # 10 ms a token
    assert tpot.curve().seconds(1.0) == pytest.approx(0.010)
    for _ in range(200):  # decodes really take 5 ms a token, against the line's prediction as it is then
        tpot.calibrate(0.005 * 99, tpot.curve().seconds(1.0) * 99)
    assert tpot.curve().seconds(1.0) == pytest.approx(0.005, rel=0.1)
    assert tpot.calibration == pytest.approx(0.5, rel=0.1)
    for _ in range(1000):  # one wild response at a time moves it a bounded step; never past 1/8..8
        tpot.calibrate(1000.0, 0.001)
    assert tpot.calibration == pytest.approx(8.0)
    tpot.calibrate(0.0, 1.0)  # nothing measured: nothing learnt
    assert tpot.calibration == pytest.approx(8.0)


def test_an_endpoint_that_answered_slowly_is_not_predicted_slower_at_the_same_load() -> None:
    # The pool's servers are alike: slow samples at one endpoint are its load's or noise, and a
    # line of its own would keep traffic off it (and its line slow) for good.
    runtime, datastore, scorer, clock = setup()
    for _ in range(20):
        teach(scorer, datastore, clock, FIRST, batch=1, tpot=0.020)
        teach(scorer, datastore, clock, SECOND, batch=1, tpot=0.010)
    found = predicted(runtime, datastore, scorer, request({"max_tokens": 500}))
    assert found[FIRST].tpot_seconds == found[SECOND].tpot_seconds == found[THIRD].tpot_seconds
    assert set(score(runtime, datastore, scorer, request({"max_tokens": 500})).values()) == {1.0}


def test_scores_weigh_the_seconds_an_endpoint_costs_beyond_the_cheapest_not_their_ratio() -> None:
    def costs(*seconds: float) -> list[E2eEstimate]:
        return [E2eEstimate(s, 0.0, s, 0.0, 1.0, 0.0, 100, 0.0) for s in seconds]

    near_zero = e2e_scores(costs(0.010, 0.050), 1.0)
    long_decodes = e2e_scores(costs(10.0, 10.04), 1.0)
    assert near_zero == pytest.approx([1.0, 1 / 1.04])
    assert long_decodes == pytest.approx(near_zero)
    assert e2e_scores(costs(2.0, 3.0, 2.5), 1.0) == pytest.approx([1.0, 0.5, 1 / 1.5])
    assert e2e_scores(costs(2.0, 3.0), 0.5) == pytest.approx([1.0, 1 / 3])


def test_a_long_answer_avoids_a_short_queue_whose_batch_is_full_of_long_decodes() -> None:
    decoding = EndpointMetrics(running_requests_size=6)
    queued = EndpointMetrics(waiting_queue_size=2)
    runtime, datastore, scorer, clock = setup(EndpointMetrics(), decoding, queued, harmWeight=0)
    teach(scorer, datastore, clock, FIRST, batch=1, tpot=0.010)
    teach(scorer, datastore, clock, FIRST, batch=8, tpot=0.024)
    for _ in range(6):
        send(scorer, datastore, SECOND, request({"max_tokens": 2000}))
    long_answer, short_answer = request({"max_tokens": 1000}), request({"max_tokens": 2})

    # The TTFT cost alone prefers the decoding pod (no queue) for either.
    ttft_scorer = runtime.plugins["ttft-cost-scorer"]
    assert isinstance(ttft_scorer, TtftCostScorer)
    cycle_state = CycleState()
    prepare(runtime, long_answer, datastore.snapshot(), cycle_state)
    ttft_scores = dict(
        zip(
            (s.address for s in datastore.snapshot()), ttft_scorer.score(long_answer, cycle_state, datastore.snapshot())
        )
    )
    assert ttft_scores[SECOND] > ttft_scores[THIRD]

    long_scores = score(runtime, datastore, scorer, long_answer)
    assert long_scores[THIRD] > long_scores[SECOND]
    short_scores = score(runtime, datastore, scorer, short_answer)
    assert short_scores[SECOND] > short_scores[THIRD]


def test_committed_decode_drains_as_the_pod_generates_and_the_mean_batch_is_over_the_requests_life() -> None:
    clock = Clock()
    tpot = TpotByBatch()
    tpot.observe(1.0, 0.0, 0.99, 100)  # 10 ms a token
    ledger = DecodeLedger(tpot, clock)
    first = ledger.sent(FIRST, 100, 0)
    clock.now += 0.5
    second = ledger.sent(FIRST, 100, 0)
    load = ledger.load(FIRST, clock.now)
    assert load.requests == 2 and load.committed_tokens == pytest.approx(150.0)  # 50 of the first's generated
    clock.now += 0.5
    assert ledger.ended(first, 100).mean_batch == pytest.approx(1.5)  # alone for half its life, in two for half
    load = ledger.load(FIRST, clock.now)
    assert load.requests == 1 and load.committed_tokens == pytest.approx(50.0)
    clock.now += 0.5
    assert ledger.ended(second, 60).mean_batch == pytest.approx(1.5)  # in two for half its life, then alone
    load = ledger.load(FIRST, clock.now)
    assert (load.requests, load.committed_tokens) == (0, 0.0)


def test_prefill_sent_to_a_pod_stalls_its_predicted_decode_and_is_taken_out_of_what_is_learnt() -> None:
    runtime, datastore, scorer, clock = setup()
    prefill_rate = scorer.ttft.prefill_rate(FIRST)  # the TTFT model's prior, the same everywhere
    # One request's decode step is 10 ms, and prefill sent to its pod after it takes a share of
    # the pod's time over its 1 s life: it observes 10 ms / (1 - share) a token.
    req = request()
    result = send(scorer, datastore, FIRST, req)
    arrivals = [request(request_id=f"p{i}") for i in range(4)]
    for arrival in arrivals:
        send(scorer, datastore, FIRST, arrival)
    clock.now += 1.0
    share = 4 * arrivals[0].estimated_prompt_tokens() / prefill_rate
    assert share > 0.05
    answer(scorer, req, result, FIRST, 101, 0.010 / (1 - share), ttft=0.0)
    assert scorer.tpot.curve().seconds(1.0) == pytest.approx(0.010)
    # 20,000 uncached tokens just sent to the second pod: its decodes will wait through them.
    for i in range(8):
        send(
            scorer, datastore, SECOND, InferenceRequest(f"big{i}", Api.COMPLETIONS, "m", "m", prompt_text="w" * 10_000)
        )
    found = predicted(runtime, datastore, scorer, request({"max_tokens": 200}))
    assert found[SECOND].prefill_share > 0.2 and found[THIRD].prefill_share == 0.0
    assert found[SECOND].tpot_seconds == pytest.approx(found[THIRD].tpot_seconds / (1 - found[SECOND].prefill_share))


def test_max_tokens_is_the_expected_output_else_the_sessions_else_the_models() -> None:
    runtime, datastore, scorer, clock = setup(defaultOutputTokens=100, maxOutputTokens=3000)

    def expected(body: Mapping[str, Any]) -> int:
        return scorer.expected(request(body), CycleState())[0].tokens

    assert expected({"max_tokens": 700}) == 700
    assert expected({"max_completion_tokens": 90}) == 90
    assert expected({"max_tokens": 100_000}) == 3000  # capped
    assert expected({}) == expected({"max_tokens": 0}) == 100  # nothing known: the default
    for tokens in (400, 400):
        req = request({"prompt_cache_key": "chat-1"})
        answer(scorer, req, send(scorer, datastore, FIRST, req), FIRST, tokens, 0.01)
    req = request({"user": "someone"})
    answer(scorer, req, send(scorer, datastore, FIRST, req), FIRST, 40, 0.01)
    assert expected({"prompt_cache_key": "chat-1"}) == 400  # the session's answers
    assert expected({}) == 280  # the model's: 400, 400, then 40 at weight 1/3
    assert expected({"prompt_cache_key": "chat-1", "max_tokens": 5}) == 5  # the request's own limit first

    # The ledger commits what was expected, and the prediction decodes that many tokens.
    teach(scorer, datastore, clock, FIRST, batch=1, tpot=0.010)
    found = predicted(runtime, datastore, scorer, request({"max_tokens": 700}))
    assert {e.expected_tokens for e in found.values()} == {700}
    assert found[FIRST].decode_seconds == pytest.approx(700 * found[FIRST].tpot_seconds)


def test_the_observed_completion_is_explained_beside_the_prediction() -> None:
    runtime, datastore, scorer, clock = setup()
    teach(scorer, datastore, clock, FIRST, batch=1, tpot=0.010)
    req = request({"max_tokens": 50})
    cycle_state = CycleState()
    prepare(runtime, req, datastore.snapshot(), cycle_state)
    scorer.score(req, cycle_state, datastore.snapshot())
    result = SchedulingResult({"default": ProfileRunResult((state_of(datastore, FIRST),))}, "default", cycle_state)
    scorer.pre_request(req, result)
    ratio = {"model_name": req.target_model, "part": "total"}
    by_limit = {"model_name": req.target_model, "source": "max_tokens"}
    before = [
        REGISTRY.get_sample_value(f"{name}_count", labels) or 0.0
        for name, labels in (("picker_e2e_prediction_ratio", ratio), ("picker_e2e_output_tokens_ratio", by_limit))
    ]
    exact = REGISTRY.get_sample_value("picker_e2e_output_tokens_ratio_bucket", {**by_limit, "le": "1.0"}) or 0.0
    answer(scorer, req, result, FIRST, 50, 0.01)
    observed = cycle_state.explain()[OBSERVED_E2E]
    assert observed["endpoint"] == FIRST and observed["expected_tokens"] == 50 and observed["completion_tokens"] == 50
    assert observed["seconds"] == pytest.approx(0.05 + 49 * 0.01)
    assert observed["predicted_seconds"] == cycle_state.explain()[PREDICTED_E2E][FIRST].seconds
    # How good the predictions were, as metrics: observed over predicted, answer over expectation.
    after = [
        REGISTRY.get_sample_value(f"{name}_count", labels)
        for name, labels in (("picker_e2e_prediction_ratio", ratio), ("picker_e2e_output_tokens_ratio", by_limit))
    ]
    assert after == [b + 1 for b in before]
    assert REGISTRY.get_sample_value("picker_e2e_output_tokens_ratio_bucket", {**by_limit, "le": "1.0"}) == exact + 1


@pytest.mark.parametrize(
    "parameters",
    [
        {"harmWeight": -1},
        {"scaleSeconds": 0},
        {"maxOutputTokens": 0},
        {"defaultOutputTokens": "many"},
        {"sessionFields": "user"},
        {"x": 1},
    ],
)
def test_bad_parameters_are_refused(parameters: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        RuntimeHolder(Datastore()).build(parse_text(config(**parameters)))
