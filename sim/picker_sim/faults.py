"""Faults a simulated pod can inject, switchable at start (CLI flags) or at run time (admin API)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

FORCE_ERROR_HEADER = "x-sim-force-error"


@dataclass(slots=True)
class Faults:
    """The pod's current faults; mutable so the admin API can flip them."""

    error_rate: float = 0.0  # fraction of inference requests answered with `error_status`
    error_status: int = 500
    metrics_delay: float = 0.0  # real seconds added to every /metrics answer
    metrics_garbage: bool = False  # /metrics answers text that is not Prometheus format
    hang: bool = False  # every non-admin request waits until the fault is cleared
    drop_kv_events: float = 0.0  # fraction of KV event batches not sent (still replayable)

    def update(self, changes: dict[str, Any]) -> None:
        """Apply a partial update from JSON; ValueError names a bad field or value."""
        known = {f.name: f for f in fields(self)}
        staged: dict[str, Any] = {}
        for key, value in changes.items():
            if key not in known:
                raise ValueError(f"unknown fault {key!r}; known: {', '.join(known)}")
            kind = type(getattr(self, key))
            if kind is bool:
                if not isinstance(value, bool):
                    raise ValueError(f"fault {key!r} must be true or false")
            elif kind is int:
                if not isinstance(value, int) or isinstance(value, bool) or not 100 <= value <= 599:
                    raise ValueError(f"fault {key!r} must be an HTTP status code")
            else:
                if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                    raise ValueError(f"fault {key!r} must be a non-negative number")
                if key in ("error_rate", "drop_kv_events") and value > 1:
                    raise ValueError(f"fault {key!r} is a fraction in [0, 1]")
                value = float(value)
            staged[key] = value
        for key, value in staged.items():
            setattr(self, key, value)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
