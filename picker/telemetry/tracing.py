"""OpenTelemetry traces (`--tracing`): a span per request and per plugin, exported over OTLP gRPC.

Spans, as the reference EPP names them:
- `gateway.request` (SERVER): from the director's `route` until the response ends; attributes
  `request_id`, `model`, `target_model`, `objective`, `endpoint` (the chosen one),
  `http.response.status_code`; an error status when the request fails.
- `gateway.request_orchestration` (SERVER, its child): parse to pick; `target_model` and
  `request_prio` as the reference's, plus `profile` and `candidates`.
- one span per plugin call (`<extension point> <plugin name>`, attributes `plugin.type`,
  `plugin.name`, `plugin.extension_point`): producers, filters, scorers, picker, profile
  handler and pre-request hooks under the orchestration span, response-complete hooks under
  the request span. They are recorded after the fact from the `perf_counter` readings the
  plugin-duration histogram already takes (`scheduling.scheduler.PluginTimer`).

Configured by the standard variables, read once at start (the reference's defaults where it
sets them): `OTEL_TRACES_EXPORTER` (`otlp` or `none`), `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` /
`OTEL_EXPORTER_OTLP_ENDPOINT` (the reference's default `http://localhost:4317`; `http://`
means plaintext), `OTEL_SERVICE_NAME` (default `gateway-api-inference-extension/epp`),
`OTEL_TRACES_SAMPLER` / `_ARG` (default `parentbased_traceidratio` at 0.1, as the reference),
`OTEL_RESOURCE_ATTRIBUTES`, `OTEL_SDK_DISABLED`, and the exporter's own `OTEL_EXPORTER_OTLP_*`
(headers, certificates, timeout, compression). A W3C `traceparent` on the request makes its
spans children of the caller's; the parent-based samplers then follow the caller's decision.

Export is batched (the SDK's BatchSpanProcessor thread): the request path only creates spans.
The OpenTelemetry SDK is imported only when tracing starts; with tracing off the request path
pays one `is None` check.
"""

from __future__ import annotations

import importlib.metadata
import logging
import time
from collections.abc import Mapping
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import Sampler
    from opentelemetry.trace import Span, Tracer

    from picker.framework.plugin import SchedulingResult
    from picker.framework.request import InferenceRequest, ResponseOutcome

log = logging.getLogger(__name__)

# The reference's names (pkg/common/observability/tracing, pkg/epp/handlers, requestcontrol).
DEFAULT_SERVICE_NAME = "gateway-api-inference-extension/epp"
DEFAULT_ENDPOINT = "http://localhost:4317"
DEFAULT_SAMPLER = "parentbased_traceidratio"
DEFAULT_SAMPLER_ARG = 0.1
REQUEST_TRACER = "gateway-api-inference-extension/epp/extproc"
ORCHESTRATION_TRACER = "gateway-api-inference-extension"
REQUEST_SPAN = "gateway.request"
ORCHESTRATION_SPAN = "gateway.request_orchestration"

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)


class TracingError(ValueError):
    """An OTEL_* variable the picker cannot honour; the message names it."""


@dataclass(frozen=True, slots=True)
class TracingSettings:
    """Where and what to export: the OTLP gRPC endpoint, the service name, the sampler by its
    standard name and its ratio (for the ratio samplers)."""

    endpoint: str
    service_name: str
    sampler: str
    ratio: float


def tracing_settings(environ: Mapping[str, str], requested: bool) -> TracingSettings | None:
    """The settings from the OTEL_* variables, or None when nothing is to be exported.

    Spans are exported when `OTEL_TRACES_EXPORTER=otlp` or an OTLP endpoint variable is set;
    `requested` (`--tracing=true` given explicitly) exports to the reference's default endpoint
    without either, as the reference does. `OTEL_TRACES_EXPORTER=none` or `OTEL_SDK_DISABLED=true`
    turn it off. Raises TracingError for a value the picker cannot honour.
    """
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return None
    if exporter not in ("", "otlp"):
        raise TracingError(
            f"OTEL_TRACES_EXPORTER={exporter!r}: the picker exports traces with 'otlp' (gRPC) only, or 'none' "
            "(no 'console': stdout carries the structured log)"
        )
    endpoint = next((environ[name] for name in ENDPOINT_VARIABLES if environ.get(name)), None)
    if endpoint is None and not exporter and not requested:
        return None
    sampler = environ.get("OTEL_TRACES_SAMPLER", DEFAULT_SAMPLER).strip().lower()
    if sampler not in SAMPLERS:
        raise TracingError(f"OTEL_TRACES_SAMPLER={sampler!r}: expected one of {', '.join(SAMPLERS)}")
    ratio = DEFAULT_SAMPLER_ARG
    if "traceidratio" in sampler and environ.get("OTEL_TRACES_SAMPLER_ARG"):
        text = environ["OTEL_TRACES_SAMPLER_ARG"]
        try:
            ratio = float(text)
        except ValueError:
            ratio = -1.0
        if not 0.0 <= ratio <= 1.0:
            raise TracingError(f"OTEL_TRACES_SAMPLER_ARG={text!r}: expected a ratio between 0 and 1")
    return TracingSettings(
        endpoint=endpoint or DEFAULT_ENDPOINT,
        service_name=environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME,
        sampler=sampler,
        ratio=ratio,
    )


def _sampler(settings: TracingSettings) -> Sampler:
    from opentelemetry.sdk.trace import sampling

    root: Sampler
    base = settings.sampler.removeprefix("parentbased_")
    if base == "always_on":
        root = sampling.ALWAYS_ON
    elif base == "always_off":
        root = sampling.ALWAYS_OFF
    else:
        root = sampling.TraceIdRatioBased(settings.ratio)
    return sampling.ParentBased(root) if settings.sampler.startswith("parentbased_") else root


# The sampled request whose plugin calls become spans: set by the director around the calls.
_active: ContextVar[RequestTrace | None] = ContextVar("picker_request_trace", default=None)


def active() -> RequestTrace | None:
    """The request being traced in this context, if any (read only for timed plugin calls)."""
    return _active.get()


def activate(trace: RequestTrace) -> Token[RequestTrace | None]:
    """Make `trace` receive the plugin spans of this context until `deactivate`."""
    return _active.set(trace)


def deactivate(token: Token[RequestTrace | None]) -> None:
    _active.reset(token)


class Tracing:
    """The tracer provider (batched OTLP gRPC export) and the request spans it starts."""

    def __init__(self, settings: TracingSettings) -> None:
        from opentelemetry import propagate, trace
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self.settings = settings
        resource = Resource.create(
            {"service.name": settings.service_name, "service.version": importlib.metadata.version("picker")}
        )
        self.provider: TracerProvider = TracerProvider(sampler=_sampler(settings), resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.endpoint)))
        self._request_tracer = self.provider.get_tracer(REQUEST_TRACER, importlib.metadata.version("picker"))
        self._orchestration_tracer = self.provider.get_tracer(ORCHESTRATION_TRACER)
        self._extract = propagate.extract  # W3C trace context + baggage, the SDK's default propagators
        self._server = trace.SpanKind.SERVER

    def start(self, headers: Mapping[str, str]) -> RequestTrace | None:
        """The spans of a new request (child of the caller's `traceparent`, if any), or None
        when the sampler drops it: unsampled requests record nothing more."""
        parent = self._extract(headers) if "traceparent" in headers else None
        span = self._request_tracer.start_span(
            REQUEST_SPAN, context=parent, kind=self._server, attributes={"request_id": headers.get("x-request-id", "")}
        )
        if not span.is_recording():
            return None
        return RequestTrace(self._orchestration_tracer, self._request_tracer, span, self._server)

    async def shutdown(self) -> None:
        """Export what is buffered and stop the export thread (off the event loop)."""
        import asyncio

        await asyncio.to_thread(self.provider.shutdown)


class RequestTrace:
    """The spans of one sampled request: `gateway.request`, its orchestration child, and the
    plugin spans under whichever of them is open (see `routed`)."""

    __slots__ = ("_clock_offset_ns", "_orchestration", "_plugin_parent", "_plugin_tracer", "request_span")

    def __init__(self, orchestration_tracer: Tracer, plugin_tracer: Tracer, request_span: Span, kind: Any) -> None:
        from opentelemetry import trace

        self.request_span = request_span
        self._plugin_tracer = plugin_tracer
        self._orchestration = orchestration_tracer.start_span(
            ORCHESTRATION_SPAN, context=trace.set_span_in_context(request_span), kind=kind
        )
        self._plugin_parent: Context = trace.set_span_in_context(self._orchestration)
        # perf_counter readings (what the plugin timers take) to Unix nanoseconds.
        self._clock_offset_ns = time.time_ns() - time.perf_counter_ns()

    def parsed(self, request: InferenceRequest, priority: int) -> None:
        """The request is parsed: what it asks for."""
        self.request_span.set_attributes(
            {
                "request_id": request.request_id,
                "model": request.model,
                "target_model": request.target_model,
                "objective": request.objective or "",
            }
        )
        self._orchestration.set_attributes({"target_model": request.target_model, "request_prio": priority})

    def plugin(self, extension_point: str, plugin_type: str, name: str, started: float, ended: float) -> None:
        """A plugin call, from its `perf_counter` readings."""
        span = self._plugin_tracer.start_span(
            f"{extension_point} {name}",
            context=self._plugin_parent,
            start_time=int(started * 1e9) + self._clock_offset_ns,
            attributes={"plugin.extension_point": extension_point, "plugin.type": plugin_type, "plugin.name": name},
        )
        span.end(end_time=int(ended * 1e9) + self._clock_offset_ns)

    def routed(self, result: SchedulingResult, targets: list[str]) -> None:
        """The pick is made: the orchestration span ends; later plugin spans (response hooks)
        hang under the request span."""
        from opentelemetry import trace

        primary = result.profile_results.get(result.primary_profile)
        self._orchestration.set_attributes(
            {"profile": result.primary_profile, "candidates": len(primary.candidates) if primary else 0}
        )
        self._orchestration.end()
        self.request_span.set_attribute("endpoint", targets[0])
        if len(targets) > 1:
            self.request_span.set_attribute("fallback_endpoints", ",".join(targets[1:]))
        self._plugin_parent = trace.set_span_in_context(self.request_span)

    def failed(self, error: BaseException) -> None:
        """The request could not be routed: both spans end with the error."""
        from opentelemetry.trace import Status, StatusCode

        for span in (self._orchestration, self.request_span):
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, str(error)))
            span.end()

    def finished(self, outcome: ResponseOutcome) -> None:
        """The response ended (or the stream died): the request span ends."""
        from opentelemetry.trace import Status, StatusCode

        span = self.request_span
        if outcome.status:
            span.set_attribute("http.response.status_code", outcome.status)
        if outcome.endpoint:
            span.set_attribute("served_endpoint", outcome.endpoint)
        if outcome.error is not None:
            span.set_status(Status(StatusCode.ERROR, outcome.error))
        elif outcome.status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        span.end()


def start_tracing(environ: Mapping[str, str], enabled: bool, requested: bool) -> Tracing | None:
    """`--tracing`: the tracer when enabled and an exporter is configured (see
    `tracing_settings`), else None; logs which. Raises TracingError for bad variables."""
    if not enabled:
        return None
    settings = tracing_settings(environ, requested)
    if settings is None:
        log.info("tracing: no OTLP endpoint configured (OTEL_EXPORTER_OTLP_ENDPOINT), no spans are exported")
        return None
    log.info(
        "tracing: exporting spans over OTLP gRPC",
        extra={
            "endpoint": settings.endpoint,
            "serviceName": settings.service_name,
            "sampler": settings.sampler,
            "samplerArg": settings.ratio,
        },
    )
    return Tracing(settings)
