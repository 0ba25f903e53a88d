"""`concurrency-detector`: the reference's saturation detector on the picker's own in-flight
accounting, also usable as a filter."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from picker.datastore.endpoint import EndpointState
from picker.framework.cycle_state import CycleState
from picker.framework.handle import Handle
from picker.framework.parameters import Parameters
from picker.framework.plugin import Filter, SaturationDetector
from picker.framework.request import InferenceRequest

REQUESTS = "requests"
TOKENS = "tokens"


class ConcurrencyDetector(SaturationDetector, Filter):
    """Saturation from requests (or estimated prompt tokens) in flight, as the picker counts them.

    saturation = in flight over all candidates / (candidates × the per-endpoint capacity):
    `maxConcurrency` requests, or `maxTokenConcurrency` tokens with `concurrencyMode: tokens`;
    no candidates at all is 1.0. As a filter it keeps the endpoints below capacity × (1 +
    `headroom`), possibly none, as the reference does.
    """

    plugin_type = "concurrency-detector"

    def __init__(self, name: str, mode: str = REQUESTS, capacity: int = 100, headroom: float = 0.0) -> None:
        super().__init__(name)
        self.mode = mode
        self.capacity = capacity
        self.headroom = headroom

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> ConcurrencyDetector:
        params = Parameters(parameters)
        mode = params.string("concurrencyMode", REQUESTS, choices=(REQUESTS, TOKENS))
        max_requests = params.integer("maxConcurrency", 100, at_least=1)
        max_tokens = params.integer("maxTokenConcurrency", 1_000_000, at_least=1)
        headroom = params.number("headroom", 0.0, at_least=0)
        detector = cls(name, mode, max_tokens if mode == TOKENS else max_requests, headroom)
        detector.parameters = params.finish()
        return detector

    def _load(self, state: EndpointState) -> int:
        return state.in_flight_tokens if self.mode == TOKENS else state.in_flight_requests

    def saturation(self, candidates: Sequence[EndpointState]) -> float:
        if not candidates:
            return 1.0
        return sum(self._load(c) for c in candidates) / (self.capacity * len(candidates))

    def filter(
        self, request: InferenceRequest, cycle_state: CycleState, candidates: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        limit = int(self.capacity * (1.0 + self.headroom))
        return [c for c in candidates if self._load(c) < limit]
