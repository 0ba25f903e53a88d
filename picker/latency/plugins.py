"""The reference's latency-predictor plugins (listed in `picker.plugins`), with the reference's
types, parameters and rules, predicting with the picker's own models.

* `predicted-latency-producer`: per candidate, predicted TTFT and TPOT (ms) against the
  request's `x-slo-ttft-ms` / `x-slo-tpot-ms`, as `LatencyPrediction`s.
* `latency-scorer`: prefers endpoints by SLO headroom, by tier; without predictions a composite
  of free KV cache, queue and prefix match.
* `prefix-cache-affinity-filter`: keeps the endpoints holding most of the prompt, unless that
  costs more than `maxTTFTPenaltyMs` of predicted TTFT.
* `slo-headroom-tier-filter`: keeps the endpoints predicted within the SLOs, if any.
* `latency-slo-admitter`: denies a sheddable request with SLOs no endpoint can meet.
* `e2e-cost-scorer` (the picker's own): best predicted completion time / the endpoint's,
  decode included (`picker.latency.e2e`).

Difference from the reference: no sidecars. The reference trains XGBoost models in a training
sidecar and asks prediction sidecars over HTTP; here the TTFT is the picker's `TtftModel`
(queue wait + uncached prefill, learnt from every response by the approx-prefix-cache-producer,
which these plugins therefore bring into the config) and the TPOT its `TpotModel` (learnt from
streamed responses). Predictions cost no network call and exist from the first request (from
the models' priors).
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from picker.datastore.endpoint import EndpointState
from picker.framework.cycle_state import CycleState, StateKey
from picker.framework.handle import Handle
from picker.framework.parameters import Parameters
from picker.framework.plugin import (
    Admitter,
    DataProducer,
    Filter,
    PreRequest,
    ResponseComplete,
    SchedulingResult,
    Scorer,
    ScorerCategory,
)
from picker.framework.request import InferenceRequest, ResponseOutcome
from picker.latency.e2e import (
    DecodeLedger,
    E2eEstimate,
    ExpectedOutput,
    InFlight,
    OutputLengths,
    TpotByBatch,
    e2e_scores,
    estimate,
)
from picker.latency.prediction import (
    LATENCY_PREDICTIONS_KEY,
    TPOT_SLO_HEADER,
    TTFT_SLO_HEADER,
    LatencyPrediction,
    predictions,
    prefix_score,
    slo_ms,
)
from picker.latency.tpot import TpotModel
from picker.prefix.plugins import PREFIX_MATCH_KEY, ProducerTtftModel, prompt_and_cached_tokens
from picker.prefix.session import session_name
from picker.prefix.ttft import TtftModel
from picker.telemetry.metrics import E2E_OUTPUT_TOKENS_RATIO, E2E_PREDICTION_RATIO

# The producer's own objects that outlive reloads (Handle.persistent keys, + ":" + its name).
_TPOT_MODEL_KEY = "latency/tpot-model"
_RUNNING_TPOT_SLOS_KEY = "latency/running-tpot-slos"
_PREFILL_ROLE = "prefill"
# The request's (TTFT, TPOT) SLOs in ms, and where its TPOT SLO was counted as running.
_SLOS_KEY = StateKey("predicted-latency-producer/slos", tuple)
_RUNNING_KEY = StateKey("predicted-latency-producer/running", tuple)
# The e2e-cost-scorer's persistent objects (+ ":" + its name), and per request: its expected
# output tokens and session, and what the ledger recorded when it was sent.
_E2E_KEY = "latency/e2e"
_EXPECTED_KEY = StateKey("e2e-cost-scorer/expected", tuple)
_SENT_KEY = StateKey("e2e-cost-scorer/sent", InFlight)
PREDICTED_E2E = "predicted_e2e"  # explain topic: {address: E2eEstimate}
OBSERVED_E2E = "observed_e2e"  # explain topic: {endpoint, seconds, predicted_seconds, completion_tokens, ...}

# {address: {request id: TPOT SLO ms}} of the requests in flight (the reference's per-endpoint queue).
RunningTpotSlos = dict[str, dict[str, float]]


@dataclass(frozen=True, slots=True)
class ProducerSettings:
    """`predicted-latency-producer`'s parameters (see the class)."""

    slo_buffer_factor: float = 1.0
    streaming_mode: bool = False
    endpoint_role_label: str = ""
    predict_in_prepare_data: bool = True


class PredictedLatencyProducer(DataProducer, PreRequest, ResponseComplete):
    """`predicted-latency-producer`: each candidate's predicted latency against the request's SLOs.

    Parameters, as the reference's: `sloBufferFactor` (1, > 0: the TPOT SLO is multiplied by
    it), `streamingMode` (false), `endpointRoleLabel` (""), `predictInPrepareData` (true: false
    leaves the plugins below without predictions, the reference's training-only mode);
    `samplingMean` (1000, > 0), `maxDecodeTokenSamplesForPrediction` (0, >= 0) and `contextTTL`
    (5m) are validated and have no effect: they tune how the reference samples tokens for its
    sidecar and how long it keeps per-request state, which here lives with the request.

    Per candidate: TTFT = the TTFT model's prediction for the prompt's uncached tokens there
    (with `streamingMode: false` the reference trains its TTFT model on end-to-end latency; the
    TTFT model learns from the first response byte, which for a non-streamed response is its
    end, so for non-streamed traffic it predicts end-to-end latency too); valid when below the
    TTFT SLO (no SLO header: 0, never valid, headroom −TTFT, as in the reference). With
    `streamingMode: true`, TPOT = the TPOT model's, valid below SLO × sloBufferFactor (lowered
    to the smallest TPOT SLO of the requests running there, × the factor, when that is
    smaller); otherwise, and on endpoints whose `endpointRoleLabel` label is `prefill`, TPOT
    does not count (valid, headroom 0).
    """

    plugin_type = "predicted-latency-producer"
    produces = frozenset({LATENCY_PREDICTIONS_KEY})
    consumes = frozenset({PREFIX_MATCH_KEY})

    def __init__(
        self,
        name: str,
        settings: ProducerSettings,
        ttft: Callable[[], TtftModel],
        tpot: TpotModel,
        running: RunningTpotSlos,
    ) -> None:
        super().__init__(name)
        self.settings = settings
        self._ttft = ttft  # the prefix producer's (`ProducerTtftModel`)
        self.tpot = tpot
        self.running = running

    @property
    def ttft(self) -> TtftModel:
        """The TTFT model this producer predicts with: the prefix producer's."""
        return self._ttft()

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> PredictedLatencyProducer:
        params = Parameters(parameters)
        params.number("samplingMean", 1000.0, above=0)
        params.integer("maxDecodeTokenSamplesForPrediction", 0, at_least=0)
        settings = ProducerSettings(
            slo_buffer_factor=params.number("sloBufferFactor", 1.0, above=0),
            streaming_mode=params.boolean("streamingMode", False),
            endpoint_role_label=params.string("endpointRoleLabel", ""),
            predict_in_prepare_data=params.boolean("predictInPrepareData", True),
        )
        params.duration("contextTTL", 300.0)
        effective = params.finish()
        ttft = ProducerTtftModel(handle)
        tpot_key = f"{_TPOT_MODEL_KEY}:{name}"
        tpot = handle.persistent(tpot_key, TpotModel)
        running: RunningTpotSlos = handle.persistent(f"{_RUNNING_TPOT_SLOS_KEY}:{name}", dict)
        datastore = handle.datastore
        if datastore is not None:
            handle.persistent(
                f"{tpot_key}/listener", lambda: datastore.on_departure(tpot.forget), datastore.remove_listener
            )
        producer = cls(name, settings, ttft, tpot, running)
        producer.parameters = effective
        return producer

    def prepare(self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle_state: CycleState) -> None:
        ttft_slo = slo_ms(request.headers, TTFT_SLO_HEADER)
        tpot_slo = slo_ms(request.headers, TPOT_SLO_HEADER)
        cycle_state[_SLOS_KEY] = (ttft_slo, tpot_slo)
        if not self.settings.predict_in_prepare_data or not candidates:
            return
        prompt_tokens, cached = prompt_and_cached_tokens(request, cycle_state, candidates)
        ttft = self.ttft
        now = ttft.clock()
        cycle_state[LATENCY_PREDICTIONS_KEY] = {
            c.address: self._predict(c, ttft.estimate(c, prompt_tokens, hit, now).seconds, ttft_slo, tpot_slo)
            for c, hit in zip(candidates, cached)
        }

    def _predict(
        self, state: EndpointState, ttft_seconds: float, ttft_slo: float, tpot_slo: float
    ) -> LatencyPrediction:
        settings = self.settings
        ttft = ttft_seconds * 1000.0
        tpot = self.tpot.seconds(state.address) * 1000.0
        tpot_valid, tpot_headroom = True, 0.0
        label = settings.endpoint_role_label
        prefill = bool(label) and state.endpoint.labels.get(label) == _PREFILL_ROLE
        if settings.streaming_mode and not prefill:
            buffered = tpot_slo * settings.slo_buffer_factor
            running = self.running.get(state.address)
            # 0 when a running request has no TPOT SLO: then it lowers nothing, as in the reference.
            smallest = min(running.values()) if running else 0.0
            if smallest > 0:
                buffered = min(buffered, smallest * settings.slo_buffer_factor)
            tpot_valid, tpot_headroom = tpot < buffered, buffered - tpot
        return LatencyPrediction(
            ttft_ms=ttft,
            tpot_ms=tpot,
            ttft_valid=ttft < ttft_slo,
            tpot_valid=tpot_valid,
            ttft_headroom_ms=ttft_slo - ttft,
            tpot_headroom_ms=tpot_headroom,
            dispatched=state.in_flight_requests,
        )

    def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        slos = result.cycle_state.read(_SLOS_KEY)
        if slos is None or not result.targets:
            return
        address = result.targets[0].address
        self.running.setdefault(address, {})[request.request_id] = slos[1]
        result.cycle_state[_RUNNING_KEY] = (address, request.request_id)

    def response_complete(self, request: InferenceRequest, result: SchedulingResult, outcome: ResponseOutcome) -> None:
        dispatched = result.cycle_state.read(_RUNNING_KEY)
        if dispatched is None:
            return
        address, request_id = dispatched
        running = self.running.get(address)
        if running is not None:
            running.pop(request_id, None)
            if not running:
                del self.running[address]
        usage, ttft = outcome.usage, outcome.ttft_seconds
        succeeded = 200 <= outcome.status < 300 and outcome.endpoint in ("", address)
        if request.stream and succeeded and usage is not None and ttft is not None:
            self.tpot.observe(address, outcome.duration_seconds - ttft, usage.completion_tokens)


class LatencyScorer(Scorer):
    """`latency-scorer`: scores by SLO headroom (the reference's rules and weights).

    Parameters: `ttftWeight` (0.8) and `tpotWeight` (0.2), normalised to sum 1;
    `headroomSelectionStrategy` (`least`: the endpoint with the least spare headroom scores
    highest, packing requests; `most`: the most); `compositeKVWeight`, `compositeQueueWeight`,
    `compositePrefixWeight` (1 each) for the fallback.

    With predictions: the endpoints whose TTFT and TPOT headrooms are both >= 0 are scored (by
    the strategy); if none, the idle ones (nothing dispatched), else the first non-empty of:
    only TPOT negative, only TTFT negative, both; these always by least violation. Within the
    scored tier headrooms are min-max normalised and combined; a score is (1 + int(100 × s)) /
    100; endpoints outside the tier score 0. Without predictions: 100 × (free KV share,
    queue relative to the longest, prefix match), weighted, rounded, / 100.
    Difference: a weight below 0 is an error (the reference takes it as it is).
    """

    plugin_type = "latency-scorer"
    category = ScorerCategory.BALANCE
    consumes = frozenset({PREFIX_MATCH_KEY})

    def __init__(
        self,
        name: str,
        ttft_weight: float = 0.8,
        tpot_weight: float = 0.2,
        strategy: str = "least",
        composite_weights: tuple[float, float, float] = (1.0, 1.0, 1.0),
    ) -> None:
        super().__init__(name)
        self.ttft_weight = ttft_weight
        self.tpot_weight = tpot_weight
        self.strategy = strategy
        self.composite_weights = composite_weights  # KV, queue, prefix

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> LatencyScorer:
        params = Parameters(parameters)
        scorer = cls(
            name,
            ttft_weight=params.number("ttftWeight", 0.8, at_least=0),
            tpot_weight=params.number("tpotWeight", 0.2, at_least=0),
            strategy=params.string("headroomSelectionStrategy", "least", choices=("least", "most")),
            composite_weights=(
                params.number("compositeKVWeight", 1.0, at_least=0),
                params.number("compositeQueueWeight", 1.0, at_least=0),
                params.number("compositePrefixWeight", 1.0, at_least=0),
            ),
        )
        scorer.parameters = params.finish()
        return scorer

    def score(
        self, request: InferenceRequest, cycle_state: CycleState, candidates: Sequence[EndpointState]
    ) -> Sequence[float]:
        found = predictions(cycle_state)
        infos = [found.get(c.address) for c in candidates]
        if all(info is None for info in infos):
            return self._composite(cycle_state, candidates)
        # An endpoint without a prediction counts as headroom 0 on both, as in the reference.
        ttft = [p.ttft_headroom_ms if p is not None else 0.0 for p in infos]
        tpot = [p.tpot_headroom_ms if p is not None else 0.0 for p in infos]
        scores = [0.0] * len(candidates)
        negative = [i for i in range(len(candidates)) if ttft[i] < 0 or tpot[i] < 0]
        positive = [i for i in range(len(candidates)) if ttft[i] >= 0 and tpot[i] >= 0]
        if positive:
            self._score_tier(positive, ttft, tpot, scores, self.strategy)
            return scores
        idle = [i for i in negative if (p := infos[i]) is not None and p.dispatched == 0]
        tpot_only = [i for i in negative if ttft[i] >= 0]
        ttft_only = [i for i in negative if tpot[i] >= 0]
        both = [i for i in negative if ttft[i] < 0 and tpot[i] < 0]
        # Idle endpoints first, then the least violated: these always by least violation.
        self._score_tier(idle or tpot_only or ttft_only or both, ttft, tpot, scores, "least")
        return scores

    def _score_tier(
        self,
        tier: list[int],
        ttft_headroom: list[float],
        tpot_headroom: list[float],
        scores: list[float],
        strategy: str,
    ) -> None:
        total = self.ttft_weight + self.tpot_weight
        alpha, beta = (self.ttft_weight / total, self.tpot_weight / total) if total > 0 else (1.0, 0.0)
        ttft = [abs(ttft_headroom[i]) for i in tier]
        tpot = [abs(tpot_headroom[i]) for i in tier]
        ttft_low, ttft_range = min(ttft), max(ttft) - min(ttft)
        tpot_low, tpot_range = min(tpot), max(tpot) - min(tpot)
        if ttft_range <= _EPS < tpot_range:
            alpha, beta = 0.0, 1.0
        elif tpot_range <= _EPS < ttft_range:
            alpha, beta = 1.0, 0.0
        for i, ttft_h, tpot_h in zip(tier, ttft, tpot):
            n_ttft = (ttft_h - ttft_low) / ttft_range if ttft_range > _EPS else 0.5
            n_tpot = (tpot_h - tpot_low) / tpot_range if tpot_range > _EPS else 0.5
            combined = alpha * n_ttft + beta * n_tpot
            share = combined if strategy == "most" else 1.0 - combined
            scores[i] = (int(share * _WEIGHT_MAX) + 1) / _WEIGHT_MAX

    def _composite(self, cycle_state: CycleState, candidates: Sequence[EndpointState]) -> list[float]:
        kv, queue, prefix = self.composite_weights
        total = kv + queue + prefix
        if total <= 0:
            kv, queue, prefix, total = 1.0, 0.0, 0.0, 1.0
        longest = max((c.metrics.waiting_queue_size for c in candidates), default=0)
        scores = []
        for c in candidates:
            relative_queue = (longest - c.metrics.waiting_queue_size) / longest if longest > 0 else 1.0
            composite = (
                kv * (1.0 - c.metrics.kv_cache_usage)
                + queue * relative_queue
                + prefix * prefix_score(cycle_state, c.address)
            ) / total
            scores.append(math.floor(_WEIGHT_MAX * composite + 0.5) / _WEIGHT_MAX)  # Go's math.Round
        return scores


_WEIGHT_MAX = 100
_EPS = 1e-9


class PrefixCacheAffinityFilter(Filter):
    """`prefix-cache-affinity-filter`: keeps the "sticky" endpoints, those holding at least
    `affinityThreshold` (0.80, <= 1; <= 0 turns the filter off) of the prompt's blocks, unless
    the best sticky endpoint's predicted TTFT exceeds the best other's by more than
    `maxTTFTPenaltyMs` (5000, >= 0; 0: never); with probability `explorationProbability` (0.01,
    in [0, 1]) it keeps everyone, so other endpoints keep being tried. No sticky endpoint, or
    one candidate: everyone is kept. As the reference's.
    """

    plugin_type = "prefix-cache-affinity-filter"
    consumes = frozenset({PREFIX_MATCH_KEY})

    def __init__(
        self,
        name: str,
        affinity_threshold: float = 0.8,
        exploration_probability: float = 0.01,
        max_ttft_penalty_ms: float = 5000.0,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(name)
        self.affinity_threshold = affinity_threshold
        self.exploration_probability = exploration_probability
        self.max_ttft_penalty_ms = max_ttft_penalty_ms
        self._random = rng or random.Random()

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> PrefixCacheAffinityFilter:
        params = Parameters(parameters)
        plugin = cls(
            name,
            affinity_threshold=params.number("affinityThreshold", 0.8, at_most=1),
            exploration_probability=params.number("explorationProbability", 0.01, at_least=0, at_most=1),
            max_ttft_penalty_ms=params.number("maxTTFTPenaltyMs", 5000.0, at_least=0),
        )
        plugin.parameters = params.finish()
        return plugin

    def filter(
        self, request: InferenceRequest, cycle_state: CycleState, candidates: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        if len(candidates) <= 1 or self.affinity_threshold <= 0:
            return candidates
        if self._random.random() < self.exploration_probability:
            return candidates
        sticky = [c for c in candidates if prefix_score(cycle_state, c.address) >= self.affinity_threshold]
        if not sticky:
            return candidates
        others = [c for c in candidates if c not in sticky]
        if self.max_ttft_penalty_ms > 0 and others:
            found = predictions(cycle_state)
            penalty = _best_ttft(sticky, found) - _best_ttft(others, found)
            if penalty > self.max_ttft_penalty_ms:
                return candidates
        return sticky


def _best_ttft(candidates: Sequence[EndpointState], found: Mapping[str, LatencyPrediction]) -> float:
    """The lowest predicted TTFT among `candidates` (the largest float when none has one)."""
    return min((p.ttft_ms for c in candidates if (p := found.get(c.address)) is not None), default=sys.float_info.max)


class SloHeadroomTierFilter(Filter):
    """`slo-headroom-tier-filter`: keeps the endpoints predicted within both SLOs (headrooms
    >= 0) when there are some, except with probability `epsilonExploreNeg` (0.01, in [0, 1])
    it keeps the others instead (endpoints without a prediction count as others); no
    prediction at all, or one candidate: everyone. As the reference's."""

    plugin_type = "slo-headroom-tier-filter"

    def __init__(self, name: str, epsilon_explore_neg: float = 0.01, rng: random.Random | None = None) -> None:
        super().__init__(name)
        self.epsilon_explore_neg = epsilon_explore_neg
        self._random = rng or random.Random()

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> SloHeadroomTierFilter:
        params = Parameters(parameters)
        plugin = cls(name, params.number("epsilonExploreNeg", 0.01, at_least=0, at_most=1))
        plugin.parameters = params.finish()
        return plugin

    def filter(
        self, request: InferenceRequest, cycle_state: CycleState, candidates: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        if len(candidates) <= 1:
            return candidates
        found = predictions(cycle_state)
        positive: list[EndpointState] = []
        negative: list[EndpointState] = []
        for c in candidates:
            p = found.get(c.address)
            within = p is not None and p.ttft_headroom_ms >= 0 and p.tpot_headroom_ms >= 0
            (positive if within else negative).append(c)
        if not any(c.address in found for c in candidates):
            return candidates
        if positive and negative:
            return negative if self._random.random() < self.epsilon_explore_neg else positive
        return positive or negative


class LatencySloAdmitter(Admitter):
    """`latency-slo-admitter` (no parameters): denies a sheddable request (priority < 0) that
    has an SLO header when no candidate is predicted within its SLOs, none is idle (no running
    requests) and none is cold (KV cache under 2% used). Requests without predictions pass.
    As the reference's (which denies with 500, "request cannot be admitted")."""

    plugin_type = "latency-slo-admitter"

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> LatencySloAdmitter:
        Parameters(parameters).finish()
        return cls(name)

    def admit(
        self, request: InferenceRequest, priority: int, candidates: Sequence[EndpointState], cycle_state: CycleState
    ) -> str | None:
        if priority >= 0:
            return None
        if slo_ms(request.headers, TTFT_SLO_HEADER) <= 0 and slo_ms(request.headers, TPOT_SLO_HEADER) <= 0:
            return None
        found = predictions(cycle_state)
        if not any(c.address in found for c in candidates):
            return None
        for c in candidates:
            p = found.get(c.address)
            if (p is not None and p.valid) or c.metrics.running_requests_size == 0 or c.metrics.kv_cache_usage < 0.02:
                return None
        return "no valid endpoint available to serve the request"


@dataclass(frozen=True, slots=True)
class E2eSettings:
    """`e2e-cost-scorer`'s parameters (see the class)."""

    harm_weight: float = 1.0
    scale_seconds: float = 1.0
    default_output_tokens: int = 256
    max_output_tokens: int = 4096
    session_fields: tuple[str, ...] = ("prompt_cache_key", "user")
    session_header: str | None = None


class E2eCostScorer(Scorer, PreRequest, ResponseComplete):
    """`e2e-cost-scorer`: the predicted completion time, decode included, plus the harm to the
    requests already running at the endpoint (`picker.latency.e2e`); scores by the seconds an
    endpoint costs beyond the cheapest (`e2e_scores`).

    Until a streamed response has taught the TPOT model anything it scores every endpoint 1
    (the TTFT cost then decides alone). Its TTFT part is the prefix producer's TTFT model, which
    the scorer therefore brings into the config. It learns from every response it routed: the
    endpoint's decode step against its batch (prefill stalls taken out), and the output lengths
    of the request's model and session.

    Parameters: `harmWeight` (1, >= 0): how much the slowdown of the requests already running
    counts (0: the request's own completion time only); `scaleSeconds` (1, > 0): the extra
    cost that halves an endpoint's score, so the scorer's weight is worth a second of
    completion time against the other scorers' points; `defaultOutputTokens` (256): the
    expected output before any response has been seen; `maxOutputTokens` (4096): the cap on
    every expectation, `max_tokens` included; `sessionFields` (["prompt_cache_key", "user"])
    and `sessionHeader` (none): where a request names its session, as for
    `session-affinity-scorer`; `sessionCapacity` (100000): sessions whose output lengths are
    remembered. Each endpoint's prediction goes to the decision's explain map
    (`predicted_e2e`), the observed completion time after the response (`observed_e2e`).
    """

    plugin_type = "e2e-cost-scorer"
    category = ScorerCategory.BALANCE
    consumes = frozenset({PREFIX_MATCH_KEY})

    def __init__(
        self,
        name: str,
        settings: E2eSettings,
        ttft: Callable[[], TtftModel],
        ledger: DecodeLedger,
        lengths: OutputLengths,
    ) -> None:
        super().__init__(name)
        self.settings = settings
        self._ttft = ttft  # the prefix producer's (`ProducerTtftModel`)
        self.ledger = ledger
        self.tpot = ledger.tpot
        self.lengths = lengths

    @property
    def ttft(self) -> TtftModel:
        """The TTFT model this scorer predicts with: the prefix producer's."""
        return self._ttft()

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> E2eCostScorer:
        params = Parameters(parameters)
        defaults = E2eSettings()
        settings = E2eSettings(
            harm_weight=params.number("harmWeight", defaults.harm_weight, at_least=0),
            scale_seconds=params.number("scaleSeconds", defaults.scale_seconds, above=0),
            default_output_tokens=params.integer("defaultOutputTokens", defaults.default_output_tokens, at_least=1),
            max_output_tokens=params.integer("maxOutputTokens", defaults.max_output_tokens, at_least=1),
            session_fields=params.strings("sessionFields", defaults.session_fields),
            session_header=params.string("sessionHeader", "").lower() or None,
        )
        capacity = params.integer("sessionCapacity", 100_000, at_least=1)
        effective = params.finish()
        key = f"{_E2E_KEY}:{name}"
        ledger = handle.persistent(f"{key}/ledger", lambda: DecodeLedger(TpotByBatch()))
        lengths = handle.persistent(f"{key}/lengths:{capacity}", lambda: OutputLengths(capacity))
        datastore = handle.datastore
        if datastore is not None:
            handle.persistent(
                f"{key}/listener", lambda: datastore.on_departure(ledger.forget), datastore.remove_listener
            )
        scorer = cls(name, settings, ProducerTtftModel(handle), ledger, lengths)
        scorer.parameters = effective
        return scorer

    def expected(self, request: InferenceRequest, cycle_state: CycleState) -> tuple[ExpectedOutput, str | None]:
        """The request's expected output and session name, worked out once per request."""
        found: tuple[ExpectedOutput, str | None] | None = cycle_state.read(_EXPECTED_KEY)
        if found is None:
            settings = self.settings
            session = session_name(request, settings.session_fields, settings.session_header)
            tokens = self.lengths.expected(request, session, settings.default_output_tokens, settings.max_output_tokens)
            found = cycle_state[_EXPECTED_KEY] = (tokens, session)
        return found

    def score(
        self, request: InferenceRequest, cycle_state: CycleState, candidates: Sequence[EndpointState]
    ) -> Sequence[float]:
        tpot = self.tpot
        if not tpot.learnt:
            return [1.0] * len(candidates)
        tokens = self.expected(request, cycle_state)[0].tokens
        prompt_tokens, cached = prompt_and_cached_tokens(request, cycle_state, candidates)
        ttft, ledger, weight = self.ttft, self.ledger, self.settings.harm_weight
        ttft_now, now = ttft.clock(), ledger.clock()
        curve = tpot.curve()
        estimates: list[E2eEstimate] = []
        for state, hit in zip(candidates, cached):
            # Interference weight 1: the prefill's stall summed over the requests running there.
            first = ttft.estimate(state, prompt_tokens, hit, ttft_now, 1.0)
            load = ledger.load(state.address, now)
            prefill_rate = ttft.prefill_rate(state.address)
            estimates.append(
                estimate(curve, load, prefill_rate, tokens, first.seconds, first.interference_seconds, weight)
            )
        predicted: dict[str, E2eEstimate] = cycle_state.explain().setdefault(PREDICTED_E2E, {})
        predicted.update((c.address, e) for c, e in zip(candidates, estimates))
        return e2e_scores(estimates, self.settings.scale_seconds)

    def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        if not result.targets:
            return
        target = result.targets[0]
        tokens = self.expected(request, result.cycle_state)[0].tokens
        prompt_tokens, (cached,) = prompt_and_cached_tokens(request, result.cycle_state, [target])
        result.cycle_state[_SENT_KEY] = self.ledger.sent(target.address, tokens, max(0, prompt_tokens - cached))

    def response_complete(self, request: InferenceRequest, result: SchedulingResult, outcome: ResponseOutcome) -> None:
        sent = result.cycle_state.read(_SENT_KEY)
        if sent is None:
            return
        usage = outcome.usage
        served = 200 <= outcome.status < 300 and outcome.endpoint in ("", sent.address)
        completion = usage.completion_tokens if served and usage is not None else None
        life = self.ledger.ended(sent, completion)
        if completion is None:
            return
        expected, session = self.expected(request, result.cycle_state)
        self.lengths.observe(request, session, completion)
        E2E_OUTPUT_TOKENS_RATIO.labels(request.target_model, expected.source).observe(completion / expected.tokens)
        ttft = outcome.ttft_seconds
        if request.stream and ttft is not None:
            share = life.prefill_tokens_per_second / self.ttft.prefill_rate(sent.address)
            self.tpot.observe(life.mean_batch, share, outcome.duration_seconds - ttft, completion)
        explain = result.cycle_state.explain()
        predicted = explain.get(PREDICTED_E2E, {}).get(sent.address)
        if request.stream and ttft is not None and predicted is not None and completion > 1:
            # Per token, so an answer longer or shorter than expected does not pass for a slow decode.
            self.tpot.calibrate(outcome.duration_seconds - ttft, predicted.tpot_seconds * (completion - 1))
        if predicted is not None and predicted.seconds > 0.0:
            ratio = E2E_PREDICTION_RATIO.labels
            ratio(request.target_model, "total").observe(outcome.duration_seconds / predicted.seconds)
            if ttft is not None and predicted.ttft_seconds > 0.0 and predicted.decode_seconds > 0.0:
                ratio(request.target_model, "ttft").observe(ttft / predicted.ttft_seconds)
                ratio(request.target_model, "decode").observe(
                    (outcome.duration_seconds - ttft) / predicted.decode_seconds
                )
        explain[OBSERVED_E2E] = {
            "endpoint": sent.address,
            "seconds": outcome.duration_seconds,
            "predicted_seconds": None if predicted is None else predicted.seconds,
            "completion_tokens": completion,
            "expected_tokens": sent.expected_tokens,
            "mean_batch": life.mean_batch,
        }
