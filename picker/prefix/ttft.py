"""A time-to-first-token cost model: queue wait plus prefill of the tokens not cached.

For endpoint *e* and a prompt of *P* tokens of which *C* are cached there:

    ttft(e) = overhead + work_ahead(e) / drain_rate(e) + (P − C) / prefill_rate(e)

`work_ahead(e)` is the prefill work queued in front of the request, in tokens: the larger of
the scraped waiting queue times the endpoint's typical uncached prompt, and the picker's own
*backlog*, a fluid queue that grows by each request's uncached tokens at pick time and drains
at `drain_rate` (so requests the last scrape does not show yet still count, without double
counting them once it does).

Rates are learnt per endpoint from observed TTFTs (`ResponseOutcome.ttft_seconds` and usage
prompt/cached tokens) with an EWMA, starting from priors. A sample updates the prefill rate
when the queue was negligible at pick time (its TTFT is nearly all prefill) and the drain rate
when the queue dominated; mixed samples only feed the typical prompt size. Each sample moves a
rate by at most ×4 (a stall or a burst must not swing it wildly).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from picker.datastore.endpoint import EndpointState

MIN_SAMPLE_TOKENS = 32  # smaller prefills are dominated by noise
SAMPLE_CLAMP = 4.0


@dataclass(frozen=True, slots=True)
class TtftPriors:
    """Starting values (and the fixed per-request overhead) of the model."""

    prefill_tokens_per_second: float = 5000.0
    drain_tokens_per_second: float = 5000.0
    overhead_seconds: float = 0.01
    typical_prompt_tokens: float = 512.0
    ewma_alpha: float = 0.2


@dataclass(slots=True)
class EndpointRates:
    """What the model has learnt about one endpoint, plus its picker-side backlog."""

    prefill_tokens_per_second: float
    drain_tokens_per_second: float
    typical_prompt_tokens: float
    backlog_tokens: float = 0.0
    backlog_time: float = 0.0
    prefill_samples: int = 0
    drain_samples: int = 0


@dataclass(frozen=True, slots=True)
class TtftEstimate:
    """One endpoint's predicted TTFT and its parts."""

    queue_seconds: float
    prefill_seconds: float
    overhead_seconds: float
    work_ahead_tokens: float
    uncached_tokens: int

    @property
    def seconds(self) -> float:
        return self.overhead_seconds + self.queue_seconds + self.prefill_seconds


class TtftModel:
    """Per-endpoint TTFT prediction and online learning."""

    def __init__(self, priors: TtftPriors | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.priors = priors or TtftPriors()
        self._clock = clock
        self._rates: dict[str, EndpointRates] = {}

    def set_priors(self, priors: TtftPriors) -> None:
        """New priors apply to endpoints with no samples yet (learnt rates are kept)."""
        self.priors = priors
        for rates in self._rates.values():
            if not rates.prefill_samples:
                rates.prefill_tokens_per_second = priors.prefill_tokens_per_second
            if not rates.drain_samples:
                rates.drain_tokens_per_second = priors.drain_tokens_per_second

    def rates(self, endpoint: str) -> EndpointRates:
        rates = self._rates.get(endpoint)
        if rates is None:
            p = self.priors
            rates = self._rates[endpoint] = EndpointRates(
                p.prefill_tokens_per_second,
                p.drain_tokens_per_second,
                p.typical_prompt_tokens,
            )
        return rates

    def forget(self, endpoints: Iterable[str]) -> None:
        for endpoint in endpoints:
            self._rates.pop(endpoint, None)

    def backlog(self, endpoint: str, now: float | None = None) -> float:
        """The picker's own prefill backlog at `endpoint` (tokens), drained up to now."""
        rates = self.rates(endpoint)
        now = self._clock() if now is None else now
        if rates.backlog_tokens > 0.0:
            drained = (now - rates.backlog_time) * rates.drain_tokens_per_second
            rates.backlog_tokens = max(0.0, rates.backlog_tokens - drained)
        rates.backlog_time = now
        return rates.backlog_tokens

    def work_ahead(self, state: EndpointState, now: float | None = None) -> float:
        """Prefill tokens queued in front of a new request at `state`'s endpoint."""
        rates = self.rates(state.address)
        scraped = state.metrics.waiting_queue_size * rates.typical_prompt_tokens
        return max(scraped, self.backlog(state.address, now))

    def estimate(
        self,
        state: EndpointState,
        prompt_tokens: int,
        cached_tokens: int,
        now: float | None = None,
    ) -> TtftEstimate:
        rates = self.rates(state.address)
        ahead = self.work_ahead(state, now)
        uncached = max(0, prompt_tokens - cached_tokens)
        return TtftEstimate(
            ahead / rates.drain_tokens_per_second,
            uncached / rates.prefill_tokens_per_second,
            self.priors.overhead_seconds,
            ahead,
            uncached,
        )

    def add_backlog(self, endpoint: str, tokens: float, now: float | None = None) -> None:
        """A request with `tokens` uncached prompt tokens was sent to `endpoint`."""
        self.backlog(endpoint, now)
        self.rates(endpoint).backlog_tokens += max(0.0, tokens)

    def observe(
        self,
        endpoint: str,
        ttft_seconds: float,
        prompt_tokens: int,
        cached_tokens: int,
        work_ahead_tokens: float,
    ) -> None:
        """Learn from one request's observed TTFT (work ahead as estimated at pick time)."""
        rates = self.rates(endpoint)
        alpha = self.priors.ewma_alpha
        uncached = max(0, prompt_tokens - cached_tokens)
        if prompt_tokens > 0:
            rates.typical_prompt_tokens += alpha * (uncached - rates.typical_prompt_tokens)
        residual = ttft_seconds - self.priors.overhead_seconds
        if residual <= 0.0:
            return
        queue_part = work_ahead_tokens / rates.drain_tokens_per_second
        prefill_part = uncached / rates.prefill_tokens_per_second
        if uncached >= MIN_SAMPLE_TOKENS and queue_part <= 0.1 * prefill_part:
            sample = uncached / max(residual - queue_part, 1e-6)
            rates.prefill_tokens_per_second = _ewma(rates.prefill_tokens_per_second, sample, alpha)
            rates.prefill_samples += 1
        elif work_ahead_tokens >= MIN_SAMPLE_TOKENS and queue_part >= prefill_part:
            sample = work_ahead_tokens / max(residual - prefill_part, 1e-6)
            rates.drain_tokens_per_second = _ewma(rates.drain_tokens_per_second, sample, alpha)
            rates.drain_samples += 1


def _ewma(current: float, sample: float, alpha: float) -> float:
    sample = min(max(sample, current / SAMPLE_CLAMP), current * SAMPLE_CLAMP)
    return current + alpha * (sample - current)


def ttft_scores(estimates: list[TtftEstimate]) -> list[float]:
    """best / predicted per endpoint: 1.0 for the fastest, in (0, 1] for the rest."""
    seconds = [e.seconds for e in estimates]
    best = min(seconds, default=0.0)
    return [best / s if s > 0 else 1.0 for s in seconds]
