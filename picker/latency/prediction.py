"""What the `predicted-latency-producer` leaves for the latency plugins: one `LatencyPrediction`
per candidate (the reference's LatencyPredictionInfo), and the request's latency SLOs."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from picker.framework.cycle_state import CycleState, StateKey
from picker.prefix.plugins import PREFIX_MATCH_KEY

# The reference's SLO headers, in milliseconds.
TTFT_SLO_HEADER = "x-slo-ttft-ms"
TPOT_SLO_HEADER = "x-slo-tpot-ms"


@dataclass(frozen=True, slots=True)
class LatencyPrediction:
    """One endpoint's predicted latency for one request, in milliseconds, against its SLOs:
    `ttft_headroom_ms` = TTFT SLO − predicted TTFT (valid when positive), likewise for TPOT
    (0 and valid where TPOT does not count); `dispatched` is the requests in flight there."""

    ttft_ms: float
    tpot_ms: float
    ttft_valid: bool
    tpot_valid: bool
    ttft_headroom_ms: float
    tpot_headroom_ms: float
    dispatched: int

    @property
    def valid(self) -> bool:
        """Both within their SLOs."""
        return self.ttft_valid and self.tpot_valid


# {address: LatencyPrediction} for the request's candidates (the reference's endpoint attribute).
LATENCY_PREDICTIONS_KEY = StateKey("LatencyPredictionInfoKey", dict)


def predictions(cycle_state: CycleState) -> Mapping[str, LatencyPrediction]:
    """The request's predictions by endpoint address (empty when no producer made any)."""
    found: Mapping[str, LatencyPrediction] | None = cycle_state.read(LATENCY_PREDICTIONS_KEY)
    return found or {}


def slo_ms(headers: Mapping[str, str], header: str) -> float:
    """An SLO header's milliseconds; absent, not a number or not finite: 0 (no SLO), as the
    reference reads it (it logs a bad value and goes on)."""
    value = headers.get(header)
    if not value:
        return 0.0
    try:
        number = float(value)
    except ValueError:
        return 0.0
    return number if math.isfinite(number) else 0.0


def prefix_score(cycle_state: CycleState, address: str) -> float:
    """The share of the prompt's blocks cached at `address` (0 when unknown), as the reference
    reads its PrefixCacheMatchInfo."""
    match = cycle_state.read(PREFIX_MATCH_KEY)
    return match.score(address) if match is not None else 0.0
