"""The director: from a parsed request to a pick, and from a finished response to accounting.

Per request it selects the candidates (the subset hint, else every endpoint), asks the
scheduler for an ordered list of endpoints, counts the request in flight on the primary one,
and hands back a `RoutedRequest` that the response path completes exactly once.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Sequence

from picker.datastore.endpoint import EndpointState, split_host_port
from picker.datastore.store import Datastore
from picker.request.errors import RequestError
from picker.request.model import InferenceRequest, ResponseOutcome, Usage
from picker.telemetry import metrics

log = logging.getLogger(__name__)


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
        "director", "request", "targets", "tokens", "started", "first_byte_at", "status",
        "served", "usage", "response_bytes", "done",
    )

    def __init__(self, director: "Director", request: InferenceRequest | None, targets: list[str], tokens: int) -> None:
        self.director = director
        self.request = request
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


class Director:
    """Routes parsed requests over the datastore's endpoints."""

    def __init__(self, datastore: Datastore) -> None:
        self.datastore = datastore

    def candidates(self, subset: Sequence[str] | None) -> list[EndpointState]:
        candidates = self.datastore.snapshot()
        if subset is not None:
            candidates = filter_subset(candidates, subset)
            if not candidates:
                raise RequestError("ServiceUnavailable", "no endpoint in the subset hint is in the pool")
        elif not candidates:
            raise RequestError("ServiceUnavailable", "no ready endpoints in the pool")
        return candidates

    def route(self, request: InferenceRequest | None, subset: Sequence[str] | None) -> RoutedRequest:
        """Pick endpoints for `request` (None for a request without a body)."""
        candidates = self.candidates(subset)
        started = time.perf_counter()
        targets = [least_loaded(candidates).address]
        metrics.SCHEDULER_E2E.observe(time.perf_counter() - started)
        tokens = request.estimated_prompt_tokens() if request is not None else 0
        primary = targets[0]
        self.datastore.acquire(primary, tokens)
        metrics.ROUTED_TOTAL.labels(primary).inc()
        metrics.IN_FLIGHT.labels(primary).set(self.datastore.in_flight(primary))
        if request is not None:
            labels = (request.model, request.target_model)
            metrics.REQUEST_TOTAL.labels(*labels, "0").inc()
            metrics.REQUEST_SIZES.labels(*labels).observe(request.size_bytes)
            metrics.RUNNING_REQUESTS.labels(request.model).inc()
        return RoutedRequest(self, request, targets, tokens)

    def complete(self, routed: RoutedRequest, error: str | None) -> None:
        primary = routed.targets[0]
        self.datastore.release(primary, routed.tokens)
        metrics.IN_FLIGHT.labels(primary).set(self.datastore.in_flight(primary))
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
        labels = (request.model, request.target_model)
        metrics.RUNNING_REQUESTS.labels(request.model).dec()
        metrics.REQUEST_DURATION.labels(*labels).observe(outcome.duration_seconds)
        metrics.RESPONSE_SIZES.labels(*labels).observe(routed.response_bytes)
        if outcome.ttft_seconds is not None:
            metrics.TTFT.labels(*labels).observe(outcome.ttft_seconds)
        if error is not None:
            metrics.REQUEST_ERROR_TOTAL.labels(*labels, error).inc()
        elif outcome.status and outcome.status != 200:
            metrics.REQUEST_ERROR_TOTAL.labels(*labels, "ModelServerError").inc()
        if outcome.usage is not None:
            metrics.INPUT_TOKENS.labels(*labels).observe(outcome.usage.prompt_tokens)
            metrics.OUTPUT_TOKENS.labels(*labels).observe(outcome.usage.completion_tokens)
            metrics.CACHED_TOKENS.labels(*labels).observe(outcome.usage.cached_tokens)
