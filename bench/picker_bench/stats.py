"""Numbers for one system's run: latency percentiles, throughput, hit ratio, load spread."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from picker_bench.attribution import Attribution
from picker_bench.loadgen import RequestResult


def percentile(values: Sequence[float], q: float) -> float | None:
    """The `q`-th percentile (0-100) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True, slots=True)
class DecisionTime:
    """The picker's scheduling time per request, from its Prometheus histogram."""

    count: int
    mean_s: float
    p50_s: float | None  # upper bound of the bucket holding the median
    p99_s: float | None


@dataclass(frozen=True, slots=True)
class TenantResult:
    """The requests of one tenant (fairness id) with one objective (priority)."""

    tenant: str
    objective: str | None
    sent: int
    served: int
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    e2e_p50_s: float | None
    e2e_p90_s: float | None
    goodput_tokens_per_s: float  # output tokens of its served requests per second of the whole run
    rejected: int  # 429: no room in the flow-control queue, or shed
    expired: int  # 503: past the flow-control TTL, or no endpoint
    other_errors: int  # anything else, unfinished requests included


@dataclass(frozen=True, slots=True)
class SystemResult:
    """One system's measures; `results.json` carries these under the system's name."""

    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p90_s: float | None
    e2e_p99_s: float | None
    output_tokens_per_s: float
    hit_ratio: float
    requests: int
    errors: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    wall_s: float
    pods: dict[str, dict[str, int]] = field(default_factory=dict)  # pod -> requests, prompt_tokens
    hotspot: float | None = None  # pods x the busiest pod's share of requests (1.0 = even)
    decision_time: DecisionTime | None = None
    error_kinds: dict[str, int] = field(default_factory=dict)
    ttfts_s: tuple[float, ...] = ()  # every successful request's TTFT, for the CDF plot
    attribution: Attribution | None = None  # where the prompt tokens' cache hits went
    tenants: tuple[TenantResult, ...] = ()  # per tenant and objective, for workloads that name them
    # Output tokens of the requests answered by the last arrival, per second from the first
    # arrival to the last: the rate while load arrives. `output_tokens_per_s` divides by the
    # whole run, which ends when the last answer comes, so a system that sheds its backlog (a
    # flow-control TTL) ends sooner than one that serves it until the drain timeout, and its
    # quieter start weighs more; this rate compares them over the same window.
    arrival_window_tokens_per_s: float = 0.0
    # Over the same window, the requests decoding per pod on average (`pods_decoding`).
    arrival_window_pods_decoding: float = 0.0
    # Time per output token after the first (`time_per_output_token`): what prefills sharing a
    # decoding pod's steps stall, and what P/D disaggregation is for.
    tpot_p50_s: float | None = None
    tpot_p90_s: float | None = None
    tpot_p99_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON form (without the raw TTFT list, which goes to its own file)."""
        out = asdict(self)
        out.pop("ttfts_s")
        return out


def summarize(
    results: Sequence[RequestResult], num_pods: int, decision_time: DecisionTime | None = None
) -> SystemResult:
    """Aggregate one run's request results."""
    ok = [r for r in results if r.error is None]
    failed = [r for r in results if r.error is not None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2es = [r.e2e_s for r in ok if r.e2e_s is not None]
    tpots = [t for r in ok if (t := time_per_output_token(r)) is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    start = min((r.due_s for r in results), default=0.0)
    end = max((r.due_s + r.e2e_s for r in ok if r.e2e_s is not None), default=start)
    wall = end - start
    last_arrival = max((r.due_s for r in results), default=0.0)
    arrived = sum(r.output_tokens for r in ok if r.e2e_s is not None and r.due_s + r.e2e_s <= last_arrival)
    pods: dict[str, dict[str, int]] = {}
    for r in ok:
        if r.pod is not None:
            entry = pods.setdefault(r.pod, {"requests": 0, "prompt_tokens": 0})
            entry["requests"] += 1
            entry["prompt_tokens"] += r.prompt_tokens
    attributed = sum(p["requests"] for p in pods.values())
    hotspot = num_pods * max(p["requests"] for p in pods.values()) / attributed if attributed else None
    kinds = Counter(_error_kind(r.error) for r in failed if r.error is not None)
    return SystemResult(
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
        ttft_p99_s=percentile(ttfts, 99),
        e2e_p50_s=percentile(e2es, 50),
        e2e_p90_s=percentile(e2es, 90),
        e2e_p99_s=percentile(e2es, 99),
        output_tokens_per_s=output / wall if wall > 0 else 0.0,
        hit_ratio=cached / prompt if prompt else 0.0,
        requests=len(ok),
        errors=len(failed),
        prompt_tokens=prompt,
        cached_tokens=cached,
        output_tokens=output,
        wall_s=wall,
        pods=dict(sorted(pods.items())),
        hotspot=hotspot,
        decision_time=decision_time,
        error_kinds=dict(kinds),
        ttfts_s=tuple(sorted(ttfts)),
        tenants=per_tenant(results, wall),
        arrival_window_tokens_per_s=arrived / (last_arrival - start) if last_arrival > start else 0.0,
        arrival_window_pods_decoding=pods_decoding(results, num_pods, start, last_arrival),
        tpot_p50_s=percentile(tpots, 50),
        tpot_p90_s=percentile(tpots, 90),
        tpot_p99_s=percentile(tpots, 99),
    )


def time_per_output_token(r: RequestResult) -> float | None:
    """Seconds per output token after the first, as the client saw them (vLLM's benchmark
    definition: (E2E - TTFT) / (output tokens - 1)); None for an answer of fewer than 2 tokens."""
    if r.ttft_s is None or r.e2e_s is None or r.output_tokens < 2:
        return None
    return (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)


def pods_decoding(results: Sequence[RequestResult], num_pods: int, start: float, end: float) -> float:
    """Requests decoding per pod, on average over [start, end]: a served request counts from its
    first token to its last as the client saw them. Under overload it is a pod's batch when the
    pods are kept busy; below it, they ran short of work (e.g. a flow-control detector that
    holds requests until a pod has a free seat, so the seat idles until the next one arrives)."""
    if num_pods <= 0 or end <= start:
        return 0.0
    busy = 0.0
    for r in results:
        if r.error is None and r.ttft_s is not None and r.e2e_s is not None:
            busy += max(0.0, min(end, r.due_s + r.e2e_s) - max(start, r.due_s + r.ttft_s))
    return busy / num_pods / (end - start)


def per_tenant(results: Sequence[RequestResult], wall_s: float) -> tuple[TenantResult, ...]:
    """The results of each (tenant, objective), sorted by name; none for requests without a
    tenant. Goodput divides by the whole run's `wall_s`, so the tenants' goodputs add up."""
    groups: dict[tuple[str, str | None], list[RequestResult]] = {}
    for r in results:
        if r.tenant is not None:
            groups.setdefault((r.tenant, r.objective), []).append(r)
    out = []
    for (tenant, objective), group in sorted(groups.items(), key=lambda item: (item[0][0], item[0][1] or "")):
        ok = [r for r in group if r.error is None]
        kinds = Counter(_error_kind(r.error) for r in group if r.error is not None)
        ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
        e2es = [r.e2e_s for r in ok if r.e2e_s is not None]
        output = sum(r.output_tokens for r in ok)
        rejected, expired = kinds.pop("HTTP 429", 0), kinds.pop("HTTP 503", 0)
        out.append(
            TenantResult(
                tenant,
                objective,
                sent=len(group),
                served=len(ok),
                ttft_p50_s=percentile(ttfts, 50),
                ttft_p90_s=percentile(ttfts, 90),
                e2e_p50_s=percentile(e2es, 50),
                e2e_p90_s=percentile(e2es, 90),
                goodput_tokens_per_s=output / wall_s if wall_s > 0 else 0.0,
                rejected=rejected,
                expired=expired,
                other_errors=sum(kinds.values()),
            )
        )
    return tuple(out)


def _error_kind(error: str) -> str:
    return error.split(":", 1)[0]


def histogram_decision_time(metrics_text: str, name: str) -> DecisionTime | None:
    """Read histogram `name` (all label sets summed) from Prometheus text; None if absent."""
    buckets: dict[float, float] = {}
    total = count = 0.0
    for line in metrics_text.splitlines():
        if not line.startswith(name):
            continue
        key, _, value = line.rpartition(" ")
        try:
            number = float(value)
        except ValueError:
            continue
        if key.startswith(name + "_bucket"):
            le = key.split('le="', 1)[1].split('"', 1)[0]
            bound = math.inf if le == "+Inf" else float(le)
            buckets[bound] = buckets.get(bound, 0.0) + number
        elif key.startswith(name + "_sum"):
            total += number
        elif key.startswith(name + "_count"):
            count += number
    if not count:
        return None
    ordered = sorted(buckets.items())

    def quantile(q: float) -> float | None:
        for bound, cumulative in ordered:
            if cumulative >= q * count:
                return None if math.isinf(bound) else bound
        return None

    return DecisionTime(int(count), total / count, quantile(0.5), quantile(0.99))
