"""Time per output token, learnt per endpoint from streamed responses.

A sample is (end − first byte) / (completion tokens − 1) of a streamed response that generated
at least two tokens: the mean time between its tokens. Each sample moves its endpoint's and the
pool's running means (EWMA, weight 1/n for the first samples, then `EWMA_ALPHA`); an endpoint's
prediction is its own mean shrunk towards the pool's (`picker.prefix.ttft.shrunk`), so an
endpoint with few samples reads as the pool. No sample anywhere yet: no prediction (0).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from picker.prefix.ttft import shrunk

EWMA_ALPHA = 0.2


@dataclass(slots=True)
class _Mean:
    seconds: float = 0.0
    samples: int = 0

    def add(self, sample: float) -> None:
        self.samples += 1
        self.seconds += max(EWMA_ALPHA, 1.0 / self.samples) * (sample - self.seconds)


class TpotModel:
    """Per-endpoint mean time per output token (seconds), shrunk towards the pool's."""

    def __init__(self) -> None:
        self._endpoints: dict[str, _Mean] = {}
        self._pool = _Mean()

    def observe(self, endpoint: str, decode_seconds: float, completion_tokens: int) -> None:
        """Learn from one streamed response: `decode_seconds` from its first byte to its end."""
        if completion_tokens < 2 or decode_seconds <= 0.0:
            return
        sample = decode_seconds / (completion_tokens - 1)
        self._endpoints.setdefault(endpoint, _Mean()).add(sample)
        self._pool.add(sample)

    def seconds(self, endpoint: str) -> float:
        """The predicted time per output token at `endpoint` (0: nothing learnt yet)."""
        own = self._endpoints.get(endpoint)
        if own is None:
            return self._pool.seconds
        return shrunk(own.seconds, own.samples, self._pool.seconds)

    def forget(self, endpoints: Iterable[str]) -> None:
        for endpoint in endpoints:
            self._endpoints.pop(endpoint, None)
