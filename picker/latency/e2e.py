"""A completion-time cost: a request's predicted end-to-end time at each endpoint, and what it
costs the requests already running there.

For endpoint *e* and a request expected to generate *N* output tokens:

    e2e(e)  = ttft(e) + N × tpot(e, b)
    tpot(e, b) = (base + per_seq × b) / (1 − ρ(e))
    harm(e) = weight × (per_seq / (1 − ρ(e)) × overlap(e) + prefill(e) × running(e))

* `ttft(e)`: the TTFT model's prediction (queue wait + prefill of what *e* does not hold,
  `picker.prefix.ttft`); `prefill(e)` its prefill part, `running(e)` the requests running there.
* `base + per_seq × b`: the pool's decode step with *b* sequences in the batch, learnt online
  (`TpotByBatch`).
* `ρ(e)`: the share of *e*'s time its prefills take, which its decodes wait through (they share
  its engine steps): the uncached prompt tokens a second the picker has sent it lately (a sum
  decayed over `PREFILL_WINDOW_S`) over the TTFT model's prefill rate, at most
  `MAX_PREFILL_SHARE`. Prompts sent after this one stall its decode; recent traffic is the
  guess at what will follow.
* The batch over the request's life comes from the picker's *ledger* of its own requests in
  flight at *e*: how many, and their committed decode tokens (each one's expected output, drained
  as *e* generates tokens, `count / tpot` a second). `overlap(e) = min(committed, count × N)` of
  those tokens are generated beside the request's *N*, so its mean batch is `1 + overlap / N`.
* The harm: each overlapped token of another request is `per_seq(e)` slower with this one in the
  batch, and this prompt's prefill stalls each request running there for as long
  (`weight` = the scorer's `harmWeight`).

A pod with a short queue but many long decodes is slow for whoever lands there; this cost sees
that where the TTFT cost does not.

TPOT learning: a streamed response that generated at least two tokens gives a sample,
(duration − TTFT) / (completion tokens − 1), × (1 − ρ over its life: the uncached tokens sent
to its endpoint between its pick and its end, per second, over the prefill rate), against the
mean number of the picker's requests in flight at its endpoint over its life (the ledger's time
integral from pick to end, the request itself included). One least-squares line through the
samples, with exponential forgetting (`FORGET`), for the whole pool (`TpotByBatch` says why not
one per endpoint), times a calibration learnt from how long decodes took against their
prediction (`TpotByBatch.calibrate`). No sample yet: nothing learnt (`TpotByBatch.learnt` is
False).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from picker.framework.request import InferenceRequest

FORGET = 1.0 - 1.0 / 256  # each TPOT sample's weight decays by this per later sample
MIN_BATCH_VARIANCE = 0.25  # sequences²: below it the samples show no slope of their own
PREFILL_WINDOW_S = 10.0  # how long prefill sent to an endpoint counts towards its recent rate
MAX_PREFILL_SHARE = 0.8  # ρ at most: an endpoint does not stop decoding altogether
CALIBRATION_RATE = 0.05  # how far one response moves the decode calibration (in log units)
MAX_CALIBRATION_STEP = math.log(4.0)  # one response's log ratio counts at most this much
MAX_CALIBRATION = math.log(8.0)  # the calibration stays within 1/8..8
OUTPUT_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


@dataclass(slots=True)
class _Line:
    """Weighted sums for a least-squares line tpot = base + per_seq × batch."""

    weight: float = 0.0
    batch: float = 0.0
    tpot: float = 0.0
    batch2: float = 0.0
    batch_tpot: float = 0.0
    samples: int = 0

    def add(self, batch: float, tpot: float) -> None:
        self.weight = self.weight * FORGET + 1.0
        self.batch = self.batch * FORGET + batch
        self.tpot = self.tpot * FORGET + tpot
        self.batch2 = self.batch2 * FORGET + batch * batch
        self.batch_tpot = self.batch_tpot * FORGET + batch * tpot
        self.samples += 1

    def fit(self) -> tuple[float, float, float]:
        """(mean batch, mean TPOT, slope); the slope is 0 where the batches have not varied
        enough to show one, and never negative."""
        mean_batch, mean_tpot = self.batch / self.weight, self.tpot / self.weight
        variance = self.batch2 / self.weight - mean_batch * mean_batch
        slope = 0.0
        if variance >= MIN_BATCH_VARIANCE:
            slope = (self.batch_tpot / self.weight - mean_batch * mean_tpot) / variance
        return mean_batch, mean_tpot, max(0.0, slope)


class TpotCurve(NamedTuple):
    """One endpoint's learnt decode step, prefill stalls aside: `base + per_seq × batch` seconds."""

    base: float
    per_seq: float

    def seconds(self, batch: float) -> float:
        return self.base + self.per_seq * batch


class TpotByBatch:
    """The pool's decode step (time per output token without prefill stalls) as a function of
    the batch (see the module docstring).

    One line for the pool, not one per endpoint: an InferencePool's servers run the same model
    on the same hardware, so what makes one endpoint's decode slower than another's is its load,
    which the batch and the prefill share already carry. A line per endpoint only learnt noise,
    and fed on it: an endpoint that happened to show slow samples looked slower, lost traffic and
    kept its slow line, and the one that looked fast took the traffic (a run on the
    `conversation` workload had 237 of 483 requests on one of four pods, the piled pod's answers
    the slowest)."""

    def __init__(self) -> None:
        self._line = _Line()
        self._log_scale = 0.0  # the calibration: log of what decodes took over what was predicted
        self._curve: TpotCurve | None = None  # fitted once per sample, read per candidate

    @property
    def learnt(self) -> bool:
        """Whether any sample has been seen."""
        return self._line.samples > 0

    def observe(self, mean_batch: float, prefill_share: float, decode_seconds: float, completion_tokens: int) -> None:
        """Learn from one streamed response: `decode_seconds` from its first byte to its end,
        with `mean_batch` of the picker's requests in flight at its endpoint over its life, which
        spent `prefill_share` of its time on prefills."""
        if completion_tokens < 2 or decode_seconds <= 0.0:
            return
        sample = decode_seconds / (completion_tokens - 1) * (1.0 - min(prefill_share, MAX_PREFILL_SHARE))
        self._line.add(max(1.0, mean_batch), sample)
        self._curve = None

    @property
    def calibration(self) -> float:
        """The factor the fitted line is multiplied by (1: none)."""
        return math.exp(self._log_scale)

    def calibrate(self, observed_seconds: float, predicted_seconds: float) -> None:
        """Learn from one response's decode: `observed_seconds` from its first token to its end
        against the `predicted_seconds` its endpoint was chosen on.

        The line is fitted to samples with the prefill stall taken out, and a prediction puts the
        stall back from the prefill share expected over the request's life. Both shares are
        estimates, and the stall is convex in them (1 / (1 − ρ)), so the noise does not cancel:
        on the Mooncake trace the decode took half its prediction for the median request. The
        calibration moves the line towards what decodes really take (a stochastic step on the
        log ratio, converging where the median ratio is 1), so the scorer's seconds are seconds."""
        if observed_seconds <= 0.0 or predicted_seconds <= 0.0:
            return
        step = max(-MAX_CALIBRATION_STEP, min(MAX_CALIBRATION_STEP, math.log(observed_seconds / predicted_seconds)))
        self._log_scale = max(-MAX_CALIBRATION, min(MAX_CALIBRATION, self._log_scale + CALIBRATION_RATE * step))
        self._curve = None

    def curve(self) -> TpotCurve:
        """The calibrated decode step line (all zero while nothing is learnt)."""
        curve = self._curve
        if curve is None:
            curve = self._curve = self._fit()
        return curve

    def _fit(self) -> TpotCurve:
        line = self._line
        if not line.samples:
            return TpotCurve(0.0, 0.0)
        batch, tpot, slope = line.fit()
        scale = self.calibration
        return TpotCurve(max(0.0, tpot - slope * batch) * scale, slope * scale)


@dataclass(slots=True)
class _Ledger:
    """The picker's own requests in flight at one endpoint."""

    requests: int = 0
    committed_tokens: float = 0.0  # expected output tokens not generated yet
    load_integral: float = 0.0  # ∫ requests dt: the mean batch between two readings
    prefill_sent: float = 0.0  # uncached prompt tokens sent, ever
    prefill_recent: float = 0.0  # ... decayed over PREFILL_WINDOW_S: / PREFILL_WINDOW_S = the rate
    time: float = 0.0


class PodLoad(NamedTuple):
    """The ledger's view of one endpoint: the picker's requests in flight there, the decode
    tokens they are still expected to generate, and the uncached prompt tokens a second it has
    been sent lately."""

    requests: int
    committed_tokens: float
    prefill_tokens_per_second: float


class Life(NamedTuple):
    """What a request's endpoint did over its life: the mean number of the picker's requests in
    flight there (itself included) and the uncached prompt tokens a second sent there after it."""

    mean_batch: float
    prefill_tokens_per_second: float


class InFlight(NamedTuple):
    """What the ledger recorded when a request was sent: the response settles it."""

    address: str
    expected_tokens: int
    load_integral: float
    prefill_sent: float
    time: float


class DecodeLedger:
    """Per endpoint: the picker's requests in flight there, their committed decode tokens
    (drained at the rate the endpoint's decode step generates them, prefill stalls aside: under
    heavy prefill the drain runs a little fast) and the prefill sent there (see the module
    docstring)."""

    def __init__(self, tpot: TpotByBatch, clock: Callable[[], float] = time.monotonic) -> None:
        self.tpot = tpot
        self.clock = clock
        self._ledgers: dict[str, _Ledger] = {}

    def _advanced(self, address: str, now: float) -> _Ledger:
        ledger = self._ledgers.get(address)
        if ledger is None:
            ledger = self._ledgers[address] = _Ledger(time=now)
        elapsed = now - ledger.time
        if elapsed > 0.0 and ledger.prefill_recent:
            ledger.prefill_recent *= math.exp(-elapsed / PREFILL_WINDOW_S)
        if elapsed > 0.0 and ledger.requests:
            ledger.load_integral += ledger.requests * elapsed
            tpot = self.tpot.curve().seconds(ledger.requests)
            if tpot > 0.0:
                ledger.committed_tokens = max(0.0, ledger.committed_tokens - elapsed * ledger.requests / tpot)
        ledger.time = max(ledger.time, now)
        return ledger

    def load(self, address: str, now: float) -> PodLoad:
        """`address`'s load as of `now`."""
        ledger = self._advanced(address, now)
        return PodLoad(ledger.requests, ledger.committed_tokens, ledger.prefill_recent / PREFILL_WINDOW_S)

    def sent(self, address: str, expected_tokens: int, uncached_tokens: int) -> InFlight:
        """A request expected to generate `expected_tokens`, with `uncached_tokens` of its prompt
        to prefill, was sent to `address`."""
        now = self.clock()
        ledger = self._advanced(address, now)
        ledger.requests += 1
        ledger.committed_tokens += expected_tokens
        ledger.prefill_sent += uncached_tokens
        ledger.prefill_recent += uncached_tokens
        # Its own prefill comes before its first token: only what is sent after it stalls it.
        return InFlight(address, expected_tokens, ledger.load_integral, ledger.prefill_sent, now)

    def ended(self, sent: InFlight, completion_tokens: int | None) -> Life:
        """The request `sent` ended after `completion_tokens` (None: unknown): what its endpoint
        did over its life."""
        now = self.clock()
        ledger = self._advanced(sent.address, now)
        ledger.requests = max(0, ledger.requests - 1)
        # The drain took its generated tokens from the total; what it was expected to generate
        # beyond them is no longer committed (or, when it ran longer, the drain took too much).
        generated = sent.expected_tokens if completion_tokens is None else completion_tokens
        ledger.committed_tokens = max(0.0, ledger.committed_tokens - (sent.expected_tokens - generated))
        if not ledger.requests:
            ledger.committed_tokens = 0.0
        elapsed = now - sent.time
        if elapsed <= 0.0:
            return Life(float(ledger.requests + 1), 0.0)
        return Life(
            (ledger.load_integral - sent.load_integral) / elapsed, (ledger.prefill_sent - sent.prefill_sent) / elapsed
        )

    def forget(self, endpoints: Iterable[str]) -> None:
        for endpoint in endpoints:
            self._ledgers.pop(endpoint, None)


@dataclass(slots=True)
class _MeanTokens:
    tokens: float = 0.0
    samples: int = 0

    def add(self, sample: float, alpha: float) -> None:
        self.samples += 1
        self.tokens += max(alpha, 1.0 / self.samples) * (sample - self.tokens)


class ExpectedOutput(NamedTuple):
    """A request's expected output tokens and where the figure came from: `max_tokens` (the
    request's own limit), `session` or `model` (their answers so far) or `default`."""

    tokens: int
    source: str


class OutputLengths:
    """How many tokens a request is expected to generate.

    The estimate, in order:

    1. the request's own limit (`max_tokens`, `max_completion_tokens` or `max_output_tokens`,
       a positive integer): exact for clients that ask for the length they need, an
       overstatement for those that set a generous limit and stop early;
    2. else the running mean of the completion tokens its session (tenant, model and the
       session's name, `picker.prefix.session.session_name`) has generated, once the session has been answered;
    3. else the running mean of its model's (per tenant and model);
    4. else the scorer's default.

    Every estimate is at most the scorer's cap. The running means are EWMAs over every successful
    response's `usage.completion_tokens` (weight 1/n for the first samples, then `alpha`);
    sessions are kept up to `capacity`, least recently answered forgotten first.
    """

    def __init__(self, capacity: int = 100_000, alpha: float = 0.2) -> None:
        self.capacity = capacity
        self.alpha = alpha
        self._models: dict[tuple[str | None, str], _MeanTokens] = {}
        self._sessions: OrderedDict[tuple[str | None, str, str], _MeanTokens] = OrderedDict()

    def expected(
        self, request: InferenceRequest, session: str | None, default_tokens: int, cap_tokens: int
    ) -> ExpectedOutput:
        """The expected output tokens of `request`, of the session named `session` (if any)."""
        body = request.body
        for name in OUTPUT_LIMIT_FIELDS:
            limit = body.get(name)
            if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
                return ExpectedOutput(min(limit, cap_tokens), "max_tokens")
        if session is not None:
            mean = self._sessions.get((request.tenant, request.target_model, session))
            if mean is not None:
                return ExpectedOutput(max(1, min(round(mean.tokens), cap_tokens)), "session")
        mean = self._models.get((request.tenant, request.target_model))
        if mean is not None:
            return ExpectedOutput(max(1, min(round(mean.tokens), cap_tokens)), "model")
        return ExpectedOutput(max(1, min(default_tokens, cap_tokens)), "default")

    def observe(self, request: InferenceRequest, session: str | None, completion_tokens: int) -> None:
        """Learn from one successful response's completion tokens."""
        model_key = (request.tenant, request.target_model)
        self._models.setdefault(model_key, _MeanTokens()).add(completion_tokens, self.alpha)
        if session is None:
            return
        sessions = self._sessions
        key = (request.tenant, request.target_model, session)
        mean = sessions.get(key)
        if mean is None:
            mean = sessions[key] = _MeanTokens()
            if len(sessions) > self.capacity:
                sessions.popitem(last=False)
        else:
            sessions.move_to_end(key)
        mean.add(completion_tokens, self.alpha)


class E2eEstimate(NamedTuple):
    """One endpoint's predicted completion time for one request (seconds) and its parts, and the
    harm it would do the requests running there (already weighted). A named tuple: one is built
    per candidate per request."""

    seconds: float
    ttft_seconds: float
    decode_seconds: float
    tpot_seconds: float
    mean_batch: float
    prefill_share: float
    expected_tokens: int
    harm_seconds: float

    @property
    def cost_seconds(self) -> float:
        """What the scorer minimises: the predicted completion time plus the harm to others."""
        return self.seconds + self.harm_seconds


def estimate(
    curve: TpotCurve,
    load: PodLoad,
    prefill_tokens_per_second: float,
    expected_tokens: int,
    ttft_seconds: float,
    prefill_stall_seconds: float,
    harm_weight: float,
) -> E2eEstimate:
    """The prediction at one endpoint (`load`: the ledger's there; `prefill_tokens_per_second`:
    its prefill rate; `prefill_stall_seconds`: the prefill's stall summed over the requests
    running there)."""
    overlap = min(load.committed_tokens, load.requests * expected_tokens)
    mean_batch = 1.0 + overlap / expected_tokens
    stalled = 1.0 - min(load.prefill_tokens_per_second / prefill_tokens_per_second, MAX_PREFILL_SHARE)
    tpot = curve.seconds(mean_batch) / stalled
    decode = expected_tokens * tpot
    harm = harm_weight * (curve.per_seq / stalled * overlap + prefill_stall_seconds)
    return E2eEstimate(
        ttft_seconds + decode, ttft_seconds, decode, tpot, mean_batch, 1.0 - stalled, expected_tokens, harm
    )


def e2e_scores(estimates: Sequence[E2eEstimate], scale_seconds: float) -> list[float]:
    """1 / (1 + (cost − cheapest) / `scale_seconds`) per endpoint: 1.0 for the cheapest, half
    for one `scale_seconds` dearer.

    Absolute seconds, not a ratio: every request's seconds count alike towards the completion
    time the picker minimises, so 10 ms against 50 ms must weigh no more than 1.00 s against
    1.04 s. A ratio (cheapest / cost) made a few milliseconds decisive whenever the cheapest was
    near zero, and the scorer's weight then swamped the prefix and load scorers beside it."""
    costs = [e.cost_seconds for e in estimates]
    low = min(costs, default=0.0)
    return [1.0 / (1.0 + (cost - low) / scale_seconds) for cost in costs]
