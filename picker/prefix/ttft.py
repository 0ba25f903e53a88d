"""A time-to-first-token cost model: queue wait plus prefill of the tokens not cached.

For endpoint *e* and a prompt of *P* tokens of which *C* are cached there:

    ttft(e) = overhead + work_ahead(e) / drain_rate(e) + (P − C) / prefill_rate(e)

`work_ahead(e)` is the prefill work queued in front of the request, in tokens: the larger of
the waiting requests times the endpoint's typical uncached prompt (waiting = the scrape's count,
or the picker's in-flight requests beyond the scraped running ones, whichever is larger), and
the picker's own *backlog*, a fluid queue that grows by each request's uncached tokens at pick
time and drains at `drain_rate` (so requests the last scrape does not show yet still count,
without double counting them once it does). The drain rate never exceeds the prefill rate.

The mission is the lowest total completion time, not this request's alone: a long prefill on an
endpoint stalls every request already running there for about as long (they share its engine
steps). With `interference_weight` > 0 the score adds that stall, weight × uncached prefill time ×
requests running there, so a cache miss goes to a quiet endpoint rather than a busy one, while
a hit (little prefill) still joins its busy holder.

Rates are learnt from observed TTFTs (`ResponseOutcome.ttft_seconds` and usage prompt/cached
tokens) with an EWMA, starting from priors. A sample updates the prefill rate when the queue was
negligible at pick time (its TTFT is nearly all prefill); otherwise the drain rate, scaled by
predicted / observed TTFT (the queue and prefill shares are not observed apart). The overhead is
learnt too, for the pool: an unqueued request whose predicted prefill is shorter than the
overhead teaches it (its TTFT is the step it waited for, the network, the proxy), and no prefill
rate. Taken as prefill samples, such short prompts (Mooncake's 20-40 token turns answered in
one 100 ms step) taught rates of a few hundred tokens a second, the backlog then drained a
hundred times too slowly, and the endpoints with long prompts on it looked busy for a minute.
The estimate keeps the prior overhead: it is the same for every endpoint, and a larger one only
flattens the scores (best / predicted), which the scorer weights were tuned with. Each sample
moves a rate by at most ×4 (a stall or a burst must not swing it wildly); the first samples are
averaged (EWMA weight 1/n until it reaches `ewma_alpha`), so a poor prior is soon forgotten.

Every sample teaches both its endpoint and the pool (an InferencePool's servers usually share
hardware). An endpoint's rate is its own estimate shrunk towards the pool's, weighted by its
sample count (`n / (n + POOL_SHRINK_SAMPLES)`). Learning each endpoint alone feeds back on
itself: the endpoint that happened to learn a fast rate first looks cheapest, gets the traffic
and the samples, while the others keep their slow prior and stay idle.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from picker.datastore.endpoint import EndpointState

MIN_SAMPLE_TOKENS = 32  # smaller prefills are dominated by noise
SAMPLE_CLAMP = 4.0
POOL_SHRINK_SAMPLES = 16.0  # an endpoint's own samples count half once it has this many


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


class TtftEstimate(NamedTuple):
    """One endpoint's predicted TTFT (`seconds`), its parts, and the stall it would impose on the
    requests running there (`interference_seconds`, already weighted). A named tuple rather than
    a frozen dataclass: one is built per candidate per request, and it builds 3× faster."""

    seconds: float
    queue_seconds: float
    prefill_seconds: float
    overhead_seconds: float
    work_ahead_tokens: float
    uncached_tokens: int
    interference_seconds: float = 0.0

    @property
    def cost_seconds(self) -> float:
        """What the scorer minimises: the predicted TTFT plus the stall imposed on others."""
        return self.seconds + self.interference_seconds


class TtftModel:
    """Per-endpoint TTFT prediction and online learning."""

    def __init__(self, priors: TtftPriors | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.priors = priors or TtftPriors()
        self.clock = clock
        self._rates: dict[str, EndpointRates] = {}
        self.pool = self._new_rates()
        self.overhead_seconds = self.priors.overhead_seconds  # learnt for the pool
        self.overhead_samples = 0

    def _new_rates(self) -> EndpointRates:
        p = self.priors
        return EndpointRates(p.prefill_tokens_per_second, p.drain_tokens_per_second, p.typical_prompt_tokens)

    def set_priors(self, priors: TtftPriors) -> None:
        """New priors apply to endpoints with no samples yet (learnt rates are kept)."""
        self.priors = priors
        if not self.overhead_samples:
            self.overhead_seconds = priors.overhead_seconds
        for rates in (self.pool, *self._rates.values()):
            if not rates.prefill_samples:
                rates.prefill_tokens_per_second = priors.prefill_tokens_per_second
            if not rates.drain_samples:
                rates.drain_tokens_per_second = priors.drain_tokens_per_second

    def rates(self, endpoint: str) -> EndpointRates:
        """What `endpoint` alone has learnt (plus its backlog); see `prefill_rate`/`drain_rate`."""
        rates = self._rates.get(endpoint)
        if rates is None:
            rates = self._rates[endpoint] = self._new_rates()
        return rates

    def speeds(self, rates: EndpointRates) -> tuple[float, float]:
        """(prefill, drain) tokens/s for one endpoint's `rates`: each its own estimate shrunk
        towards the pool's, and the drain rate never above the prefill rate (decoding alongside
        only slows the queue down; an overestimate would drain the backlog at once and let every
        request herd onto the endpoint the last scrape showed idle)."""
        pool = self.pool
        prefill = shrunk(rates.prefill_tokens_per_second, rates.prefill_samples, pool.prefill_tokens_per_second)
        drain = shrunk(rates.drain_tokens_per_second, rates.drain_samples, pool.drain_tokens_per_second)
        return prefill, min(drain, prefill)

    def prefill_rate(self, endpoint: str) -> float:
        """Prefill tokens/s at `endpoint` (see `speeds`)."""
        return self.speeds(self.rates(endpoint))[0]

    def drain_rate(self, endpoint: str) -> float:
        """Queued prefill tokens/s `endpoint` works off (see `speeds`)."""
        return self.speeds(self.rates(endpoint))[1]

    def forget(self, endpoints: Iterable[str]) -> None:
        for endpoint in endpoints:
            self._rates.pop(endpoint, None)

    def backlog(self, endpoint: str, now: float | None = None) -> float:
        """The picker's own prefill backlog at `endpoint` (tokens), drained up to now."""
        rates = self.rates(endpoint)
        return _drain(rates, self.speeds(rates)[1], self.clock() if now is None else now)

    def work_ahead(self, state: EndpointState, now: float | None = None) -> float:
        """Prefill tokens queued in front of a new request at `state`'s endpoint.

        The waiting count is the scrape's, or the picker's own in-flight requests beyond the
        scraped running ones when that is larger (the scrape lags behind a burst of picks).
        """
        rates = self.rates(state.address)
        return _work_ahead(state, rates, self.speeds(rates)[1], self.clock() if now is None else now)

    def estimate(
        self,
        state: EndpointState,
        prompt_tokens: int,
        cached_tokens: int,
        now: float | None = None,
        interference_weight: float = 0.0,
    ) -> TtftEstimate:
        """The predicted TTFT at `state`'s endpoint of a prompt with `cached_tokens` cached there
        (`now`: the request's clock reading, read once for all candidates)."""
        rates = self.rates(state.address)
        prefill_rate, drain_rate = self.speeds(rates)
        ahead = _work_ahead(state, rates, drain_rate, self.clock() if now is None else now)
        uncached = max(0, prompt_tokens - cached_tokens)
        queue = ahead / drain_rate
        prefill = uncached / prefill_rate
        overhead = self.priors.overhead_seconds
        interference = 0.0
        if interference_weight > 0.0:
            metrics = state.metrics
            running = max(metrics.running_requests_size, state.in_flight_requests - metrics.waiting_queue_size)
            interference = interference_weight * prefill * running
        return TtftEstimate(overhead + queue + prefill, queue, prefill, overhead, ahead, uncached, interference)

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
        remote_prefill: bool = False,
    ) -> None:
        """Learn from one request's observed TTFT (work ahead as estimated at pick time).

        `remote_prefill`: the TTFT is a prefill pod's share of a disaggregated request's (P/D),
        which teaches its rates but not the overhead: that share is the client's TTFT less a
        predicted transfer and second hop, and a prefill pod's queue is the least observed (no
        request is in flight there), so a short prompt's sample would carry its queue wait."""
        rates = self.rates(endpoint)
        uncached = max(0, prompt_tokens - cached_tokens)
        if prompt_tokens > 0:
            rates.typical_prompt_tokens += self.priors.ewma_alpha * (uncached - rates.typical_prompt_tokens)
        queue_part = work_ahead_tokens / self.drain_rate(endpoint)
        prefill_part = uncached / self.prefill_rate(endpoint)
        if work_ahead_tokens < MIN_SAMPLE_TOKENS and prefill_part < self.overhead_seconds:
            if remote_prefill:
                return
            self.overhead_seconds = self._ewma(
                self.overhead_seconds, max(ttft_seconds - prefill_part, 0.0), self.overhead_samples
            )
            self.overhead_samples += 1
            return
        residual = ttft_seconds - self.overhead_seconds
        if residual <= 0.0:
            return
        if uncached >= MIN_SAMPLE_TOKENS and queue_part <= 0.1 * prefill_part:
            sample = uncached / max(residual - queue_part, 1e-6)
            for learner in (rates, self.pool):
                learner.prefill_tokens_per_second = self._ewma(
                    learner.prefill_tokens_per_second, sample, learner.prefill_samples
                )
                learner.prefill_samples += 1
        elif work_ahead_tokens >= MIN_SAMPLE_TOKENS:
            # The queue share of the TTFT is not observed apart from the prefill: scale the drain
            # rate by predicted / observed. Overestimating the queue then raises the drain rate,
            # which drains the backlog faster (and vice versa), so the model corrects itself.
            sample = self.drain_rate(endpoint) * (queue_part + prefill_part) / residual
            for learner in (rates, self.pool):
                learner.drain_tokens_per_second = self._ewma(
                    learner.drain_tokens_per_second, sample, learner.drain_samples
                )
                learner.drain_samples += 1

    def _ewma(self, current: float, sample: float, samples: int) -> float:
        """One EWMA step, weight 1/(n+1) for the first samples (a running mean), then `ewma_alpha`."""
        alpha = max(self.priors.ewma_alpha, 1.0 / (samples + 1))
        sample = min(max(sample, current / SAMPLE_CLAMP), current * SAMPLE_CLAMP)
        return current + alpha * (sample - current)


def _drain(rates: EndpointRates, drain_rate: float, now: float) -> float:
    """`rates`' backlog drained at `drain_rate` up to `now`."""
    if rates.backlog_tokens > 0.0:
        rates.backlog_tokens = max(0.0, rates.backlog_tokens - (now - rates.backlog_time) * drain_rate)
    rates.backlog_time = now
    return rates.backlog_tokens


def _work_ahead(state: EndpointState, rates: EndpointRates, drain_rate: float, now: float) -> float:
    return max(state.effective_waiting * rates.typical_prompt_tokens, _drain(rates, drain_rate, now))


def shrunk(own: float, samples: int, pool: float) -> float:
    """An endpoint's estimate `own` from `samples` samples, shrunk towards the pool's."""
    weight = samples / (samples + POOL_SHRINK_SAMPLES)
    return weight * own + (1.0 - weight) * pool


def ttft_scores(estimates: list[TtftEstimate]) -> list[float]:
    """best / predicted cost per endpoint: 1.0 for the cheapest, in (0, 1] for the rest."""
    seconds = [e.cost_seconds for e in estimates]
    best = min(seconds, default=0.0)
    return [best / s if s > 0 else 1.0 for s in seconds]
