"""Built-in scorers: load from scraped metrics and the picker's own in-flight counts.

Scraped metrics lag (one scrape every 50 ms by default), so back-to-back decisions would
otherwise all see the same queues. The picker knows what it has sent and not seen finish
(`EndpointState.in_flight_requests`); when it is the endpoint's only router that count
lower-bounds running + waiting. The excess, `in_flight − running − waiting` when positive, is
requests the last scrape does not show yet. The queue scorer counts them as queued and the
running-requests scorer as running:

    effective_waiting = waiting + max(0, in_flight − running − waiting) = max(waiting, in_flight − running)
    effective_running = max(running, in_flight − waiting)

With fresh metrics (or other routers sharing the pool) the excess is 0 and the reference
semantics apply unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from picker.datastore.endpoint import EndpointState
from picker.framework.cycle_state import CycleState
from picker.framework.handle import Handle
from picker.framework.parameters import Parameters
from picker.framework.plugin import Scorer, ScorerCategory
from picker.framework.request import InferenceRequest


def min_max_scores(loads: Sequence[float]) -> list[float]:
    """(max − load) / (max − min) per candidate; all equal → 1.0 each (lower load is better)."""
    highest, lowest = max(loads), min(loads)
    if highest == lowest:
        return [1.0] * len(loads)
    span = highest - lowest
    return [(highest - load) / span for load in loads]


class ParameterlessScorer(Scorer):
    """A scorer that takes no parameters (an error names any that are given)."""

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> Scorer:
        Parameters(parameters).finish()
        return cls(name)


class QueueScorer(ParameterlessScorer):
    """`queue-scorer`: min-max normalised waiting queue (effective, see module doc)."""

    plugin_type = "queue-scorer"
    category = ScorerCategory.DISTRIBUTION

    def score(
        self, request: InferenceRequest, cycle_state: CycleState, candidates: Sequence[EndpointState]
    ) -> list[float]:
        return min_max_scores([c.effective_waiting for c in candidates])  # module doc


class RunningRequestsSizeScorer(ParameterlessScorer):
    """`running-requests-size-scorer`: min-max normalised running requests (effective)."""

    plugin_type = "running-requests-size-scorer"
    category = ScorerCategory.DISTRIBUTION

    def score(
        self, request: InferenceRequest, cycle_state: CycleState, candidates: Sequence[EndpointState]
    ) -> list[float]:
        # effective running (module doc)
        return min_max_scores(
            [
                max(c.metrics.running_requests_size, c.in_flight_requests - c.metrics.waiting_queue_size)
                for c in candidates
            ]
        )


class KVCacheUtilizationScorer(ParameterlessScorer):
    """`kv-cache-utilization-scorer`: 1 − KV-cache usage (a fraction)."""

    plugin_type = "kv-cache-utilization-scorer"
    category = ScorerCategory.DISTRIBUTION

    def score(
        self, request: InferenceRequest, cycle_state: CycleState, candidates: Sequence[EndpointState]
    ) -> list[float]:
        return [1.0 - c.metrics.kv_cache_usage for c in candidates]


class LoraAffinityScorer(ParameterlessScorer):
    """`lora-affinity-scorer`: 1.0 adapter running; 0.8 room to load one; 0.6 adapter waiting; else 0."""

    plugin_type = "lora-affinity-scorer"
    category = ScorerCategory.AFFINITY

    def score(
        self, request: InferenceRequest, cycle_state: CycleState, candidates: Sequence[EndpointState]
    ) -> list[float]:
        model = request.target_model
        scores = []
        for candidate in candidates:
            metrics = candidate.metrics
            if model in metrics.active_models:
                scores.append(1.0)
            elif len(metrics.active_models) + len(metrics.waiting_models) < metrics.max_active_models:
                scores.append(0.8)
            elif model in metrics.waiting_models:
                scores.append(0.6)
            else:
                scores.append(0.0)
        return scores


class TokenLoadScorer(Scorer):
    """`token-load-scorer`: 1 − min(1, in-flight tokens / queueThresholdTokens).

    In-flight tokens are the picker's own count (the reference's `inflight-load-producer`).
    """

    plugin_type = "token-load-scorer"
    category = ScorerCategory.DISTRIBUTION

    def __init__(self, name: str, queue_threshold_tokens: float = 4194304) -> None:
        super().__init__(name)
        self.queue_threshold_tokens = queue_threshold_tokens

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> TokenLoadScorer:
        params = Parameters(parameters)
        scorer = cls(name, params.number("queueThresholdTokens", 4194304, above=0))
        scorer.parameters = params.finish()
        return scorer

    def score(
        self, request: InferenceRequest, cycle_state: CycleState, candidates: Sequence[EndpointState]
    ) -> list[float]:
        threshold = self.queue_threshold_tokens
        return [1.0 - min(1.0, c.in_flight_tokens / threshold) for c in candidates]


class LoadAwareScorer(Scorer):
    """`load-aware-scorer` (llm-d): 0.5 for an empty waiting queue, falling linearly to 0 at
    `threshold` (128) waiting requests; the waiting queue is the effective one (module doc).
    As in llm-d, a `threshold` <= 0 means the default."""

    plugin_type = "load-aware-scorer"
    category = ScorerCategory.DISTRIBUTION

    def __init__(self, name: str, threshold: int = 128) -> None:
        super().__init__(name)
        self.threshold = threshold

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> LoadAwareScorer:
        params = Parameters(parameters)
        threshold = params.integer("threshold", 128)
        scorer = cls(name, threshold if threshold > 0 else 128)
        scorer.parameters = params.finish()
        return scorer

    def score(
        self, request: InferenceRequest, cycle_state: CycleState, candidates: Sequence[EndpointState]
    ) -> list[float]:
        threshold = self.threshold
        scores = []
        for c in candidates:
            scores.append(0.5 * (1.0 - min(threshold, c.effective_waiting) / threshold))
        return scores
