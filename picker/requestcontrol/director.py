"""The director: every request-time hook of one request, in the reference director's order.

    parse (the config's Parser) → flow control (the gate on: wait for room) or admission
    (saturation) → prepare data (async producers, then every producer in dependency order)
    → admitters → schedule (the profiles) → pre-request → response received → response streaming (each
    chunk) and response metadata (what goes back to the proxy) → response complete

The director creates the request's `CycleState` and hands it to every hook; it counts the
request in flight on its primary target and returns a `RoutedRequest`, which the ext_proc
stream feeds with what it sees of the response (through methods) and finishes exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from time import perf_counter
from typing import Any

from picker.config.model_rewrites import ModelRewrites
from picker.config.runtime import Runtime, RuntimeHolder
from picker.datastore.endpoint import Endpoint, EndpointState, join_host_port, split_host_port
from picker.datastore.store import Datastore
from picker.flowcontrol.controller import FlowController
from picker.framework.cycle_state import CycleState
from picker.framework.plugin import Affinity, DynamicMetadata, SchedulingResult, upstream_headers
from picker.framework.request import InferenceRequest, ResponseOutcome, Usage
from picker.request.errors import RequestError
from picker.request.usage import SseUsageScanner, parse_usage
from picker.requestcontrol.hooks import ask_affinity, request_failed, run_admitters, run_isolated, run_isolated_async
from picker.telemetry import metrics, tracing

log = logging.getLogger(__name__)

# The reference bounds all PrepareData work of one request by 400 ms.
PREPARE_TIMEOUT_SECONDS = 0.4
# A non-streaming response body is kept (for its usage) only up to this size.
MAX_RESPONSE_BUFFER = 4 << 20
# What the ResponseMetadata hooks see before (or without) usage: the reference's zero Usage.
NO_USAGE = Usage()


def filter_subset(candidates: list[EndpointState], subset: Sequence[str]) -> list[EndpointState]:
    """Endpoints named by the proxy's subset hint: `ip:port` entries match exactly, bare IPs
    match every port of that IP (the reference matches on IP only)."""
    addresses: set[str] = set()
    ips: set[str] = set()
    for entry in subset:
        try:
            split_host_port(entry)
            addresses.add(entry)
        except ValueError:
            ips.add(entry.strip("[]"))
    return [c for c in candidates if c.address in addresses or c.endpoint.ip in ips]


def least_loaded(candidates: list[EndpointState]) -> EndpointState:
    """Fewest in-flight requests, random among ties."""
    fewest = min(c.in_flight_requests for c in candidates)
    return random.choice([c for c in candidates if c.in_flight_requests == fewest])


def prepare(
    runtime: Runtime,
    request: InferenceRequest,
    candidates: Sequence[EndpointState],
    cycle_state: CycleState,
    timed: bool = False,
) -> None:
    """Run every data producer's `prepare`, in dependency order. As in the reference, a failing
    producer is logged and does not fail the request; its consumers then find no data."""
    run_isolated(runtime.producers, lambda producer: producer.prepare(request, candidates, cycle_state), timed, request)


def routed_fields(request: InferenceRequest, result: SchedulingResult, priority: int, seconds: float) -> dict[str, Any]:
    """The V(4) line's fields: the request, the chosen endpoints, the primary profile's scores
    of the first (each scorer's raw score, and the weighted total) and the decision time
    (parse to pick). No prompt text."""
    fields: dict[str, Any] = {
        "x-request-id": request.request_id,
        "model": request.model,
        "targetModel": request.target_model,
        "objective": request.objective,
        "priority": priority,
        "endpoint": ",".join(t.address for t in result.targets),
        "profile": result.primary_profile,
        "decisionSeconds": round(seconds, 6),
    }
    run = result.profile_results.get(result.primary_profile)
    if run is not None and run.targets:
        chosen = run.targets[0].address
        index = next((i for i, c in enumerate(run.candidates) if c.address == chosen), None)
        fields["candidates"] = len(run.candidates)
        if index is not None:
            fields["scores"] = {scorer: scores[index] for scorer, scores in run.scores.items()}
            fields["totalScore"] = run.totals[index] if index < len(run.totals) else None
    return fields


class RoutedRequest:
    """One routed request, from the pick until its response ends (or the stream dies).

    The ext_proc stream reports the response through `response_headers`, `response_body`,
    `response_trailers` and `finish`; the first end (or `finish`) releases the in-flight slot
    and runs the ResponseComplete hooks, later calls do nothing. `response_body` and
    `response_trailers` return the dynamic metadata the ResponseMetadata hooks report, for the
    stream to set on its answer to that message (None: nothing to set).
    """

    __slots__ = (
        "_metadata",
        "_metadata_usage",
        "_over_cap",
        "_response_buffer",
        "_sse",
        "body",
        "director",
        "done",
        "first_byte_at",
        "request",
        "response_bytes",
        "result",
        "runtime",
        "served",
        "started",
        "status",
        "targets",
        "tokens",
        "trace",
        "usage",
    )

    def __init__(
        self,
        director: Director,
        request: InferenceRequest | None,
        targets: list[str],
        tokens: int,
        runtime: Runtime | None = None,
        result: SchedulingResult | None = None,
        body: bytes = b"",
    ) -> None:
        self.director = director
        self.request = request
        self.runtime = runtime  # the config the request was scheduled with, even after a reload
        self.result = result
        self.targets = targets
        self.tokens = tokens
        self.body = body  # what to forward: the request body, with the model rewritten if it was
        self.started = time.monotonic()
        self.first_byte_at: float | None = None
        self.status = 0
        self.served: str | None = None
        self.usage: Usage | None = None
        self.response_bytes = 0
        self.done = False
        self.trace: tracing.RequestTrace | None = None  # its spans, when sampled (--tracing)
        self._sse: SseUsageScanner | None = None
        self._response_buffer: list[bytes] | None = None
        self._over_cap = False
        self._metadata: dict[str, dict[str, float]] | None = None  # None: not asked yet
        self._metadata_usage: Usage | None = None  # the usage `_metadata` was computed from

    @property
    def destination(self) -> str:
        """The header / metadata value: the ordered fallback list."""
        result = self.result
        if result is None or not result.destination_port:
            return ",".join(self.targets)
        return ",".join(join_host_port(t.endpoint.ip, result.destination_port) for t in result.targets)

    @property
    def upstream_headers(self) -> list[tuple[str, str]]:
        """The request headers this request's plugins set for the model server (an empty value
        removes the header), for the answer that carries the destination."""
        return [] if self.result is None else list(upstream_headers(self.result.cycle_state).items())

    @property
    def streaming(self) -> bool:
        """Whether the client asked for a streamed response."""
        return self.request is not None and self.request.stream

    def response_headers(self, status: int, served: str | None, content_type: str, end_of_stream: bool) -> None:
        """The model server's response headers arrived (`served`: the endpoint Envoy reports)."""
        self.status = status
        self.served = served or self.served
        if "text/event-stream" in content_type:
            self._sse = SseUsageScanner()
        else:
            self._response_buffer = []
        runtime, result, request = self.runtime, self.result, self.request
        if runtime is not None and result is not None and request is not None and runtime.response_received:
            run_isolated(
                runtime.response_received,
                lambda plugin: plugin.response_received(request, result, status),
                result.timed,
                request,
            )
        if end_of_stream:
            self.finish()

    def response_body(
        self, chunk: bytes, end_of_stream: bool, served: str | None = None, first_byte_at: float | None = None
    ) -> DynamicMetadata | None:
        """A chunk of the response body passed; usage is read from it (SSE or whole JSON).
        `first_byte_at`: when the first byte passed (`time.monotonic()`), if the transport
        reports chunks together after the fact. Returns the dynamic metadata to set on the
        answer to this chunk, if any."""
        if self.first_byte_at is None and chunk:
            self.first_byte_at = first_byte_at or time.monotonic()
        self.response_bytes += len(chunk)
        if self.served is None:
            self.served = served
        if self._sse is not None:
            self._sse.feed(chunk)
            if end_of_stream:
                self.usage = self._sse.usage
        elif self._response_buffer is not None and not self._over_cap:
            if self.response_bytes > MAX_RESPONSE_BUFFER:
                self._over_cap = True
                self._response_buffer = None
            else:
                self._response_buffer.append(chunk)
                if end_of_stream:
                    self.usage = self._whole_body_usage()
        runtime, result, request = self.runtime, self.result, self.request
        if runtime is not None and result is not None and request is not None and runtime.response_streaming:
            run_isolated(
                runtime.response_streaming,
                lambda plugin: plugin.response_streaming(request, result, chunk, end_of_stream),
                result.timed,
                request,
            )
        metadata = None
        if self._sse is not None:  # an event stream: asked on every chunk, as the reference does
            metadata = self._response_metadata(self._sse.usage)
        elif end_of_stream:  # any other response: asked once, at its end
            metadata = self._response_metadata(self.usage)
        if end_of_stream:
            self.finish()
        return metadata

    def response_trailers(self) -> DynamicMetadata | None:
        """The response ended with trailers; returns the dynamic metadata to set on the answer."""
        if self._sse is not None:
            self.usage = self._sse.usage
        elif self._response_buffer is not None and not self.done:  # e.g. gRPC: trailers end the body
            self.usage = self._whole_body_usage()
        metadata = None if self.done else self._response_metadata(self.usage)
        self.finish()
        return metadata

    def _whole_body_usage(self) -> Usage | None:
        """The usage of the buffered response body: OpenAI-style JSON, unless the config's
        parser reads its own responses (e.g. gRPC messages)."""
        body = b"".join(self._response_buffer or ())
        parser = self.runtime.parser if self.runtime is not None else None
        if parser is not None and parser.reads_response_usage:
            return parser.response_usage(body)
        return parse_usage(body)

    def _response_metadata(self, usage: Usage | None) -> DynamicMetadata | None:
        """What the ResponseMetadata hooks report for `usage` (zeros when None), merged by
        namespace; asked again only when the usage changed since the last time."""
        runtime, result, request = self.runtime, self.result, self.request
        if runtime is None or result is None or request is None or not runtime.response_metadata:
            return None
        if self._metadata is None or usage is not self._metadata_usage:
            merged: dict[str, dict[str, float]] = {}
            reported_usage = usage or NO_USAGE
            reported = run_isolated(
                runtime.response_metadata,
                lambda plugin: plugin.response_metadata(request, reported_usage),
                result.timed,
                request,
            )
            for metadata in reported:
                for namespace, values in metadata.items():
                    merged.setdefault(namespace, {}).update(values)
            self._metadata, self._metadata_usage = merged, usage
        return self._metadata or None

    def finish(self, error: str | None = None) -> None:
        """Release the in-flight slot and record the outcome; later calls do nothing."""
        if self.done:
            return
        self.done = True
        self.director.complete(self, error)


class _ModelSeries:
    """The per-model metric children a request touches, looked up once per model pair."""

    __slots__ = ("cached", "duration", "input", "labels", "output", "response_sizes", "running", "sizes", "ttft")

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
    """Routes requests over the datastore's endpoints with the installed config.

    `tenant_header` names the request header that scopes prefix state by tenant;
    `staleness_threshold` the age after which an endpoint's scraped metrics count as stale
    (None: never; while nothing scrapes, every endpoint's metrics soon are, and all stay
    candidates); `tracer` (`--tracing` with an exporter) traces sampled requests; `pool_name`
    labels the flow-control metrics.
    """

    def __init__(
        self,
        datastore: Datastore,
        runtimes: RuntimeHolder,
        staleness_threshold: float | None = None,
        tenant_header: str | None = None,
        tracer: tracing.Tracing | None = None,
        pool_name: str = "",
    ) -> None:
        self.datastore = datastore
        self.tracer = tracer
        self.runtimes = runtimes
        self._staleness_threshold = staleness_threshold
        self.tenant_header = tenant_header
        self._series: dict[tuple[str, str], _ModelSeries] = {}
        self._endpoint_series: dict[str, tuple[Any, Any]] = {}  # address → (routed counter, in-flight gauge)
        self._rewrite_series: dict[tuple[str, str, str], Any] = {}  # (resource, model, target) → counter
        datastore.add_listener(self._forget_endpoints)
        self.flow_control = FlowController(
            lambda: self.runtimes.current.flow_control,
            self._pool_saturation,
            pool_name,
            self._endpoint_has_room,
            datastore.completion_rate,
            self._pool_room,
        )
        datastore.add_load_listener(self.flow_control.wake)  # completions, metrics, endpoints

    def _pool_saturation(self) -> float:
        """The whole pool's saturation by the config's detector, as flow control gates on it."""
        return self.runtimes.current.saturation_detector.saturation(self.datastore.snapshot())

    def _endpoint_has_room(self, address: str) -> bool:
        """Whether one endpoint is below the flow-control usage limit by the config's detector
        (an endpoint no longer in the pool: yes, nothing is gained by waiting for it)."""
        states = self.datastore.snapshot((address,))
        return not states or self._below_limit(states)

    def _pool_room(self) -> dict[str, bool]:
        """Whether each of the pool's endpoints is below the flow-control usage limit."""
        return {state.address: self._below_limit([state]) for state in self.datastore.snapshot()}

    def _below_limit(self, states: list[EndpointState]) -> bool:
        runtime = self.runtimes.current
        limit = runtime.flow_control.usage_limit if runtime.flow_control is not None else 1.0
        return runtime.saturation_detector.saturation(states) < limit

    def _forget_endpoints(self, old: Mapping[str, Endpoint], new: Mapping[str, Endpoint]) -> None:
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
        return self._fresh_if_any(candidates, whole_pool=subset is None)

    def _fresh_if_any(self, candidates: list[EndpointState], whole_pool: bool) -> list[EndpointState]:
        """The candidates with fresh metrics, or all of them when none is fresh.

        A pod whose scrapes fail (dead, hung, serving garbage) keeps its last metrics, or none,
        and would look idle to the scorers: a dead pod still listed would draw traffic. When
        nothing is fresh (no scraping configured, or the whole pool unreachable) every
        candidate stays, so routing never stops for want of metrics.
        """
        if self._staleness_threshold is None:
            return candidates
        now = time.monotonic()
        # as a rule every candidate is fresh: the pool's oldest scrape says so without a pass
        if whole_pool:
            oldest = self.datastore.oldest_update_time()
        else:
            oldest = min(map(self.datastore.scraped_at, (c.address for c in candidates)))
        if oldest > 0 and now - oldest <= self._staleness_threshold:
            return candidates
        fresh = [c for c in candidates if c.metrics_age(now) <= self._staleness_threshold]
        return fresh or candidates

    def route_without_body(self, subset: Sequence[str] | None) -> RoutedRequest:
        """Pick for a request that has no body to schedule on (e.g. GET /v1/models)."""
        primary = least_loaded(self.candidates(subset)).address
        self._count(primary, 0)
        return RoutedRequest(self, None, [primary], 0)

    async def route(self, body: bytes, headers: Mapping[str, str], subset: Sequence[str] | None) -> RoutedRequest:
        """Parse, admit, prepare, schedule and count one request; raises RequestError (400,
        429, 500, 503) when it cannot be routed. `headers` have lower-case names."""
        trace = self.tracer.start(headers) if self.tracer is not None else None
        if trace is None:
            return await self._route(body, headers, subset, None)
        token = tracing.activate(trace)  # the plugin timers below record into it
        try:
            routed = await self._route(body, headers, subset, trace)
        except BaseException as error:
            trace.failed(error)
            raise
        finally:
            tracing.deactivate(token)
        routed.trace = trace
        return routed

    async def _route(
        self, body: bytes, headers: Mapping[str, str], subset: Sequence[str] | None, trace: tracing.RequestTrace | None
    ) -> RoutedRequest:
        """`_parse_and_route`, with the failure policy's last word: a plugin's exception other
        than a `RequestError` fails the request with 500 (`hooks.request_failed`)."""
        request_id = headers.get("x-request-id") or str(uuid.uuid4())
        try:
            return await self._parse_and_route(body, headers, request_id, subset, trace)
        except RequestError:
            raise
        except Exception:
            raise request_failed(request_id) from None

    async def _parse_and_route(
        self,
        body: bytes,
        headers: Mapping[str, str],
        request_id: str,
        subset: Sequence[str] | None,
        trace: tracing.RequestTrace | None,
    ) -> RoutedRequest:
        # V(4): one line per routed request; below it nothing is measured for the line.
        log_request = log.isEnabledFor(logging.DEBUG)
        started = perf_counter() if log_request else 0.0
        runtime, objectives = self.runtimes.current, self.runtimes.objectives
        request = runtime.parser.parse(body, headers, request_id, self.tenant_header)
        rewrites = self.runtimes.model_rewrites
        if rewrites and request.model:  # a parser that reads no model (gRPC, passthrough) gets none
            request = self._rewrite_model(rewrites, request)
        priority = objectives.priority(request)
        if trace is not None:
            trace.parsed(request, priority)
        # -- flow control (the `flowControl` gate): hold the request until the pool has room;
        # it is scheduled after dispatch, on that moment's endpoints and metrics (late binding).
        flow_control = runtime.flow_control
        if flow_control is not None:
            # The prompt is hashed (tokenized off the loop) before it waits, so the queue knows
            # where its prefix is cached; its scheduling reuses that work.
            cycle_state = CycleState()
            candidates = self._candidates_or_none(subset)
            prepared_async = False
            if candidates and runtime.async_producers:
                await self._prepare_async(runtime, request, candidates, cycle_state)
                prepared_async = True
            affinity = self._affinity_lookup(runtime, request, subset, cycle_state)
            async with self.flow_control.dispatched(flow_control, request, priority, affinity) as waited:
                # Nothing awaited since the candidates were read (no preparation off the loop, no
                # wait in the queue): they are the pool as it is now, so scheduling reuses them.
                current = candidates if candidates and not (waited or prepared_async) else None
                return await self._schedule(
                    runtime,
                    request,
                    priority,
                    body,
                    subset,
                    started,
                    log_request,
                    trace,
                    cycle_state if candidates else None,
                    current,
                )
        # -- end of flow control
        return await self._schedule(runtime, request, priority, body, subset, started, log_request, trace)

    def _rewrite_model(self, rewrites: ModelRewrites, request: InferenceRequest) -> InferenceRequest:
        """The request with the target model its InferenceModelRewrite rule chose (over the
        rewrite header, as in the reference), so scorers, LoRA affinity, the prefix scope and
        the forwarded body all see it; unchanged when no rule applies."""
        rule = rewrites.rule_for(request.model)
        target = None if rule is None else rule.choose(request.request_id)
        if rule is None or target is None:
            return request
        key = (rule.resource, request.model, target)
        counter = self._rewrite_series.get(key)
        if counter is None:
            counter = self._rewrite_series[key] = metrics.MODEL_REWRITE_DECISIONS.labels(*key)
        counter.inc()
        return request.with_target_model(target)

    def _candidates_or_none(self, subset: Sequence[str] | None) -> list[EndpointState] | None:
        try:
            return self.candidates(subset)
        except RequestError:
            return None

    def _affinity_lookup(
        self, runtime: Runtime, request: InferenceRequest, subset: Sequence[str] | None, cycle_state: CycleState
    ) -> Callable[[], Affinity | None] | None:
        """Where the request's prefix is cached, asked at dispatch time (None: no producer knows)."""
        source = runtime.affinity_source
        if source is None:
            return None

        def lookup() -> Affinity | None:
            candidates = self._candidates_or_none(subset)
            return ask_affinity(source, request, candidates, cycle_state) if candidates else None

        return lookup

    async def _schedule(
        self,
        runtime: Runtime,
        request: InferenceRequest,
        priority: int,
        body: bytes,
        subset: Sequence[str] | None,
        started: float,
        log_request: bool,
        trace: tracing.RequestTrace | None,
        prepared: CycleState | None = None,
        candidates: list[EndpointState] | None = None,
    ) -> RoutedRequest:
        """Admit, prepare, schedule and count a parsed request of InferenceObjective `priority`
        (`prepared`: its CycleState after
        the async preparation, done before it waited in flow control; `candidates`: the
        endpoints as they are now, when already read)."""
        if candidates is None:
            candidates = self.candidates(subset)
        self._admit(runtime, request, priority, candidates)
        timed = runtime.scheduler.next_cycle_timed() or trace is not None  # a traced request times its plugins
        cycle_state = prepared
        if cycle_state is None:
            cycle_state = CycleState()
            await self._prepare_async(runtime, request, candidates, cycle_state)
        prepare(runtime, request, candidates, cycle_state, timed)
        if runtime.admitters:
            run_admitters(
                runtime.admitters,
                lambda admitter: admitter.admit(request, priority, candidates, cycle_state),
                timed,
                request,
            )
        result = runtime.scheduler.schedule(request, candidates, cycle_state, timed)
        run_isolated(runtime.pre_request, lambda plugin: plugin.pre_request(request, result), timed, request)
        targets = [t.address for t in result.targets]
        if trace is not None:
            trace.routed(result, targets)
        tokens = request.estimated_prompt_tokens()
        self._count(targets[0], tokens)
        series = self._model_series(request)
        metrics.REQUEST_TOTAL.labels(*series.labels, str(priority)).inc()
        series.sizes.observe(request.size_bytes)
        series.running.inc()
        forwarded = body if request.target_model == request.model else runtime.parser.rewrite_model(request)
        if log_request:
            log.debug("request routed", extra=routed_fields(request, result, priority, perf_counter() - started))
        return RoutedRequest(self, request, targets, tokens, runtime, result, forwarded)

    def _admit(
        self, runtime: Runtime, request: InferenceRequest, priority: int, candidates: Sequence[EndpointState]
    ) -> None:
        """The reference's legacy admission: shed a sheddable request (priority < 0) with
        ResourceExhausted (429) when the candidates are saturated; others always pass. Under
        flow control nothing is shed here: the request waited for room."""
        if runtime.flow_control is not None:
            return
        if priority < 0 and runtime.saturation_detector.saturation(candidates) >= 1.0:
            raise RequestError("ResourceExhausted", "the pool is saturated and the request is sheddable")

    async def _prepare_async(
        self,
        runtime: Runtime,
        request: InferenceRequest,
        candidates: Sequence[EndpointState],
        cycle_state: CycleState,
    ) -> None:
        """Await the producers' async preparation, bounded by 400 ms in total; a timeout or a
        producer's failure is logged and `prepare` then works without it."""
        if not runtime.async_producers:
            return
        try:
            async with asyncio.timeout(PREPARE_TIMEOUT_SECONDS):
                await run_isolated_async(
                    runtime.async_producers,
                    lambda producer: producer.prepare_async(request, candidates, cycle_state),
                    request,
                )
        except TimeoutError:
            log.warning("async data preparation for request %s timed out", request.request_id)

    def _endpoint_metrics(self, address: str) -> tuple[Any, Any]:
        series = self._endpoint_series.get(address)
        if series is None:
            series = self._endpoint_series[address] = (
                metrics.ROUTED_TOTAL.labels(address),
                metrics.IN_FLIGHT.labels(address),
            )
        return series

    def _count(self, primary: str, tokens: int) -> None:
        self.datastore.acquire(primary, tokens)
        routed, in_flight = self._endpoint_metrics(primary)
        routed.inc()
        in_flight.set(self.datastore.in_flight(primary))

    def complete(self, routed: RoutedRequest, error: str | None) -> None:
        """The response ended (or the stream died): release, run ResponseComplete, record."""
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
        runtime, result, trace = routed.runtime, routed.result, routed.trace
        token = tracing.activate(trace) if trace is not None else None
        if runtime is not None and result is not None:
            run_isolated(
                runtime.response_complete,
                lambda plugin: plugin.response_complete(request, result, outcome),
                result.timed,
                request,
            )
        if trace is not None and token is not None:
            tracing.deactivate(token)
            trace.finished(outcome)
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
