"""A bounded log of recent scheduling decisions, for `GET /debug/decisions`.

Recording only appends a reference to the (immutable) result to a deque; the dicts are built
when someone reads the log, so an enabled log costs the request path one append.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from picker.framework.plugin import ProfileRunResult, SchedulingResult
from picker.framework.request import InferenceRequest


class DecisionLog:
    """The last `capacity` decisions, oldest dropped first."""

    def __init__(self, capacity: int = 1000) -> None:
        if capacity < 1:
            raise ValueError(f"decision log capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: deque[tuple[float, InferenceRequest, SchedulingResult]] = deque(maxlen=capacity)

    def record(self, request: InferenceRequest, result: SchedulingResult) -> None:
        self._entries.append((time.time(), request, result))

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self, limit: int | None = None) -> list[dict[str, Any]]:
        """The newest `limit` decisions (all if None), newest first, as JSON-ready dicts."""
        selected = list(self._entries)[::-1]
        if limit is not None:
            selected = selected[:limit]
        return [_decision(at, request, result) for at, request, result in selected]


def _decision(at: float, request: InferenceRequest, result: SchedulingResult) -> dict[str, Any]:
    return {
        "time": at,
        "request_id": request.request_id,
        "model": request.model,
        "target_model": request.target_model,
        "primary_profile": result.primary_profile,
        "targets": [t.address for t in result.targets],
        "profiles": {name: _profile(run) for name, run in result.profile_results.items()},
        "explain": _json_ready(result.cycle_state.explained() or {}),
    }


def _json_ready(value: Any) -> Any:
    """Explain values as JSON: named tuples as dicts, mappings element by element."""
    if isinstance(value, tuple) and hasattr(value, "_asdict"):
        return dict(value._asdict())
    if isinstance(value, Mapping):
        return {str(k): _json_ready(v) for k, v in value.items()}
    return value


def _profile(run: ProfileRunResult | None) -> dict[str, Any] | None:
    if run is None:
        return None
    return {
        "weights": dict(run.weights),
        "picks": [t.address for t in run.targets],
        "candidates": [
            {
                "endpoint": candidate.address,
                "scores": {scorer: scores[i] for scorer, scores in run.scores.items()},
                "total": run.totals[i],
                "waiting": candidate.metrics.waiting_queue_size,
                "running": candidate.metrics.running_requests_size,
                "kv_cache_usage": candidate.metrics.kv_cache_usage,
                "in_flight": candidate.in_flight_requests,
            }
            for i, candidate in enumerate(run.candidates)
        ],
    }
