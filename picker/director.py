"""The director: from a parsed request to a pick, and from a finished response to accounting.

Per request it selects the candidates (the subset hint, else every endpoint), asks the
scheduler for an ordered list of endpoints, counts the request in flight on the primary one,
and hands back a `RoutedRequest` that the response path completes exactly once.
"""

from __future__ import annotations

import random
import time
from typing import Sequence

from picker.config.runtime import Runtime, RuntimeHolder
from picker.datastore.endpoint import EndpointState, split_host_port
from picker.datastore.store import Datastore
from picker.request.errors import RequestError
from picker.request.model import InferenceRequest, ResponseOutcome, Usage
from picker.scheduling.framework import SchedulingResult
from picker.telemetry import metrics



def filter_subset(candidates: list[EndpointState], subset: Sequence[str]) -> list[EndpointState]:
    """Endpoints named by the proxy's subset hint: `ip:port` entries match exactly, bare IPs
    match every port of that IP (the reference matches on IP only)."""
    addresses: set[str] = set()
    ips: set[str] = set()
    for entry in subset:
        try:
            ip, _ = split_host_port(entry)
            addresses.add(entry)
        except ValueError:
            ips.add(entry.strip("[]"))
    return [c for c in candidates if c.address in addresses or c.endpoint.ip in ips]


def least_loaded(candidates: list[EndpointState]) -> EndpointState:
    """Fewest in-flight requests, random among ties."""
    fewest = min(c.in_flight_requests for c in candidates)
    return random.choice([c for c in candidates if c.in_flight_requests == fewest])


class RoutedRequest:
    """One routed request, from the pick until its response ends (or the stream dies)."""

    __slots__ = (
        "director", "request", "runtime", "result", "targets", "tokens", "started", "first_byte_at",
        "status", "served", "usage", "response_bytes", "done",
    )

    def __init__(
        self,
        director: "Director",
        request: InferenceRequest | None,
        targets: list[str],
        tokens: int,
        runtime: Runtime | None = None,
        result: SchedulingResult | None = None,
    ) -> None:
        self.director = director
        self.request = request
        self.runtime = runtime  # the config the request was scheduled with, even after a reload
        self.result = result
        self.targets = targets
        self.tokens = tokens
        self.started = time.monotonic()
        self.first_byte_at: float | None = None
        self.status = 0
        self.served: str | None = None
        self.usage: Usage | None = None
        self.response_bytes = 0
        self.done = False

    @property
    def destination(self) -> str:
        """The header / metadata value: the ordered fallback list."""
        return ",".join(self.targets)

    def response_body(self, size: int) -> None:
        if self.first_byte_at is None and size > 0:
            self.first_byte_at = time.monotonic()
        self.response_bytes += size

    def finish(self, error: str | None = None) -> None:
        """Release the in-flight slot and record the outcome; later calls do nothing."""
        if self.done:
            return
        self.done = True
        self.director.complete(self, error)


class _ModelSeries:
    """The per-model metric children a request touches, looked up once per model pair."""

    __slots__ = ("running", "sizes", "duration", "response_sizes", "ttft", "input", "output", "cached", "labels")

    def __init__(self, model: str, target: str) -> None:
        labels = (model, target)
        self.labels = labels
        self.running = metrics.RUNNING_REQUESTS.labels(model)
        self.sizes = metrics.REQUEST_SIZES.labels(*labels)
        self.duration = metrics.REQUEST_DURATION.labels(*labels)
        self.response_sizes = metrics.RESPONSE_SIZES.labels(*labels)
        self.ttft = metrics.TTFT.labels(*labels)
        self.input = metrics.INPUT_TOKENS.labels(*labels)
        self.output = metrics.OUTPUT_TOKENS.labels(*labels)
        self.cached = metrics.CACHED_TOKENS.labels(*labels)


class Director:
    """Routes parsed requests over the datastore's endpoints with the active scheduler config."""

    def __init__(self, datastore: Datastore, runtimes: RuntimeHolder, staleness_threshold: float | None = None) -> None:
        self.datastore = datastore
        self.runtimes = runtimes
        # Seconds after which an endpoint's scraped metrics count as stale; None: never.
        self.staleness_threshold = staleness_threshold
        self._series: dict[tuple[str, str], _ModelSeries] = {}
        self._endpoint_series: dict[str, tuple] = {}  # address → (routed counter, in-flight gauge)
        datastore.add_listener(self._forget_endpoints)

    def _forget_endpoints(self, old: dict, new: dict) -> None:
        """Drop the metric series of endpoints that left, so churn does not grow them forever."""
        for address in old.keys() - new.keys():
            if self._endpoint_series.pop(address, None) is not None:
                metrics.ROUTED_TOTAL.remove(address)
                metrics.IN_FLIGHT.remove(address)

    def _model_series(self, request: InferenceRequest) -> _ModelSeries:
        key = (request.model, request.target_model)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = _ModelSeries(*key)
        return series

    def candidates(self, subset: Sequence[str] | None) -> list[EndpointState]:
        candidates = self.datastore.snapshot()
        if subset is not None:
            candidates = filter_subset(candidates, subset)
            if not candidates:
                raise RequestError("ServiceUnavailable", "no endpoint in the subset hint is in the pool")
        elif not candidates:
            raise RequestError("ServiceUnavailable", "no ready endpoints in the pool")
        return self._fresh_if_any(candidates)

    def _fresh_if_any(self, candidates: list[EndpointState]) -> list[EndpointState]:
        """The candidates with fresh metrics, or all of them when none is fresh.

        A pod whose scrapes fail (dead, hung, serving garbage) keeps its last metrics, or none,
        and would look idle to the scorers: a dead pod still listed would draw traffic. When
        nothing is fresh (no scraping configured, or the whole pool unreachable) every
        candidate stays, so routing never stops for want of metrics.
        """
        if self.staleness_threshold is None:
            return candidates
        now = time.monotonic()
        fresh = [c for c in candidates if c.metrics_age(now) <= self.staleness_threshold]
        return fresh or candidates

    def route_without_body(self, subset: Sequence[str] | None) -> RoutedRequest:
        """Pick for a request that has no body to schedule on (e.g. GET /v1/models)."""
        primary = least_loaded(self.candidates(subset)).address
        self._count(primary, 0)
        return RoutedRequest(self, None, [primary], 0)

    async def route(self, request: InferenceRequest, subset: Sequence[str] | None) -> RoutedRequest:
        """Admit, schedule and count `request`; raises RequestError (429, 503) when it cannot."""
        candidates = self.candidates(subset)
        runtime = self.runtimes.current
        runtime.admit(request, candidates)
        await runtime.prepare_async(request, candidates)
        result = runtime.scheduler.schedule(request, candidates)
        runtime.pre_request(request, result)
        targets = [t.address for t in result.targets]
        tokens = request.estimated_prompt_tokens()
        self._count(targets[0], tokens)
        series = self._model_series(request)
        metrics.REQUEST_TOTAL.labels(*series.labels, str(runtime.priority(request))).inc()
        series.sizes.observe(request.size_bytes)
        series.running.inc()
        return RoutedRequest(self, request, targets, tokens, runtime, result)

    def _endpoint_metrics(self, address: str) -> tuple:
        series = self._endpoint_series.get(address)
        if series is None:
            series = self._endpoint_series[address] = (
                metrics.ROUTED_TOTAL.labels(address), metrics.IN_FLIGHT.labels(address)
            )
        return series

    def _count(self, primary: str, tokens: int) -> None:
        self.datastore.acquire(primary, tokens)
        routed, in_flight = self._endpoint_metrics(primary)
        routed.inc()
        in_flight.set(self.datastore.in_flight(primary))

    def complete(self, routed: RoutedRequest, error: str | None) -> None:
        primary = routed.targets[0]
        self.datastore.release(primary, routed.tokens)
        self._endpoint_metrics(primary)[1].set(self.datastore.in_flight(primary))
        request = routed.request
        if request is None:
            return
        now = time.monotonic()
        outcome = ResponseOutcome(
            endpoint=routed.served or primary,
            status=routed.status,
            ttft_seconds=None if routed.first_byte_at is None else routed.first_byte_at - routed.started,
            duration_seconds=now - routed.started,
            usage=routed.usage,
            error=error,
        )
        if routed.runtime is not None and routed.result is not None:
            routed.runtime.response_complete(request, routed.result, outcome)
        series = self._model_series(request)
        series.running.dec()
        series.duration.observe(outcome.duration_seconds)
        series.response_sizes.observe(routed.response_bytes)
        if outcome.ttft_seconds is not None:
            series.ttft.observe(outcome.ttft_seconds)
        if error is not None:
            metrics.REQUEST_ERROR_TOTAL.labels(*series.labels, error).inc()
        elif outcome.status and outcome.status != 200:
            metrics.REQUEST_ERROR_TOTAL.labels(*series.labels, "ModelServerError").inc()
        if outcome.usage is not None:
            series.input.observe(outcome.usage.prompt_tokens)
            series.output.observe(outcome.usage.completion_tokens)
            series.cached.observe(outcome.usage.cached_tokens)
