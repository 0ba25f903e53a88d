"""`utilization-detector`: the default saturation detector, also usable as a filter."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from picker.datastore.endpoint import EndpointState
from picker.framework.cycle_state import CycleState
from picker.framework.handle import Handle
from picker.framework.parameters import Parameters
from picker.framework.plugin import Filter, SaturationDetector
from picker.framework.request import InferenceRequest


class UtilizationDetector(SaturationDetector, Filter):
    """Saturation from scraped queue depth and KV-cache usage against thresholds.

    saturation = mean over candidates of max(waiting / queueDepthThreshold,
    kv_usage / kvCacheUtilThreshold); a candidate whose metrics are older than
    `metricsStalenessThreshold` (or never scraped) counts 1.0; no candidates at all is 1.0.

    As a filter it keeps fresh endpoints under both thresholds × (1 + headroom), or every
    candidate if none qualifies.
    """

    plugin_type = "utilization-detector"

    def __init__(
        self,
        name: str,
        queue_depth_threshold: int = 5,
        kv_cache_util_threshold: float = 0.8,
        metrics_staleness_threshold: float = 0.2,
        headroom: float = 0.0,
    ) -> None:
        super().__init__(name)
        self.queue_depth_threshold = queue_depth_threshold
        self.kv_cache_util_threshold = kv_cache_util_threshold
        self.metrics_staleness_threshold = metrics_staleness_threshold
        self.headroom = headroom

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> UtilizationDetector:
        params = Parameters(parameters)
        detector = cls(
            name,
            queue_depth_threshold=params.integer("queueDepthThreshold", 5, at_least=1),
            kv_cache_util_threshold=params.number("kvCacheUtilThreshold", 0.8, above=0, at_most=1),
            metrics_staleness_threshold=params.duration("metricsStalenessThreshold", 0.2),
            headroom=params.number("headroom", 0.0, at_least=0),
        )
        detector.parameters = params.finish()
        return detector

    def saturation(self, candidates: Sequence[EndpointState]) -> float:
        if not candidates:
            return 1.0
        now = time.monotonic()
        stale_after = self.metrics_staleness_threshold
        queue_limit, kv_limit = self.queue_depth_threshold, self.kv_cache_util_threshold
        total = 0.0
        for candidate in candidates:
            if candidate.metrics_age(now) > stale_after:
                total += 1.0
                continue
            metrics = candidate.metrics
            total += max(metrics.waiting_queue_size / queue_limit, metrics.kv_cache_usage / kv_limit)
        return total / len(candidates)

    def filter(
        self, request: InferenceRequest, cycle_state: CycleState, candidates: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        now = time.monotonic()
        stale_after = self.metrics_staleness_threshold
        queue_limit = self.queue_depth_threshold * (1.0 + self.headroom)
        kv_limit = self.kv_cache_util_threshold * (1.0 + self.headroom)
        kept = [
            c
            for c in candidates
            if c.metrics_age(now) <= stale_after
            and c.metrics.waiting_queue_size < queue_limit
            and c.metrics.kv_cache_usage < kv_limit
        ]
        return kept or candidates
