"""The ext_proc server: a compiled core speaks the protocol, this side decides.

The core (`native/extproc`, the `picker_extproc_core` module) runs every ext_proc stream on its
own thread: the state machine of each body mode, the answers Envoy gets, TLS and the health
service on the port. It asks this side once per request for the pick (`Director.route`, which
may wait in flow control) and reports what the response teaches (status, the endpoint that
served it, body bytes for usage and TTFT, how it ended) to the request's `RoutedRequest`.
Events cross in batches, one class per kind (`picker_extproc_core.pyi`): the core wakes the loop
through a descriptor only when its queue goes non-empty, and `_drain` handles all that waits.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, assert_never

import picker_extproc_core as core

from picker.request.errors import RequestError
from picker.requestcontrol.director import Director, RoutedRequest
from picker.telemetry import metrics

if TYPE_CHECKING:
    from picker.framework.plugin import DynamicMetadata

log = logging.getLogger(__name__)

# Envoy may send a whole 10 MB body in one message; gRPC's default is 4 MiB.
MAX_RECEIVE_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class ExtProcSettings:
    """Per-server knobs of the ext_proc protocol handling."""

    max_body_bytes: int = 16 << 20
    honour_subset_hint: bool = True
    # How long a stream whose exchange is over waits for the proxy to close it before ending it.
    close_wait_seconds: float = 5.0


@dataclass(frozen=True, slots=True)
class Tls:
    """The port's certificate: PEM key and chain made at start, or a directory holding tls.crt
    and tls.key (a mounted Secret), re-read at a handshake after either changed."""

    key_pem: bytes | None = None
    cert_pem: bytes | None = None
    cert_dir: str | None = None


def _plain(metadata: DynamicMetadata | None) -> dict[str, dict[str, float]] | None:
    """The hooks' metadata as the core takes it (plain dicts)."""
    if metadata is None:
        return None
    return {namespace: dict(values) for namespace, values in metadata.items()}


def _internal_error() -> RequestError:
    return RequestError("Internal", "internal error in the endpoint picker")


def serve_core(
    extproc_core: core.Core,
    drain: Callable[[], None],
    address: str,
    reuse_port: bool,
    tls: Tls | None,
    health_services: Sequence[str],
) -> int:
    """Start `extproc_core` on `address` with the running loop calling `drain` when it has
    events; the bound port (OSError, with nothing left behind, when the address cannot be bound)."""
    loop = asyncio.get_running_loop()
    loop.add_reader(extproc_core.wake_fd(), drain)
    tls = tls or Tls()
    try:
        return extproc_core.serve(
            address,
            reuse_port=reuse_port,
            max_receive_bytes=MAX_RECEIVE_BYTES,
            tls_key=tls.key_pem,
            tls_cert=tls.cert_pem,
            cert_dir=tls.cert_dir,
            health_services=list(health_services),
        )
    except OSError:
        loop.remove_reader(extproc_core.wake_fd())
        raise


class ExtProcServer:
    """`envoy.service.ext_proc.v3.ExternalProcessor` on one port, routing with `director`."""

    def __init__(self, director: Director, settings: ExtProcSettings = ExtProcSettings()) -> None:
        self.director = director
        self.settings = settings
        self._core = core.Core(settings.max_body_bytes, settings.honour_subset_hint, settings.close_wait_seconds)
        self._routed: dict[int, RoutedRequest] = {}  # stream id → its request, until the response ends
        self._routing: dict[int, asyncio.Task[None]] = {}  # stream id → its pick in progress
        self._loop: asyncio.AbstractEventLoop | None = None
        self.port = 0

    def start(
        self,
        address: str,
        *,
        reuse_port: bool = False,
        tls: Tls | None = None,
        health_services: Sequence[str] = (),
    ) -> int:
        """Serve on `address` (`host:port`, port 0 picks one); the bound port. Raises OSError
        when the address cannot be bound. `health_services`: names the standard gRPC health
        service reports SERVING on this port (none: no health service here)."""
        self._loop = asyncio.get_running_loop()
        self.port = serve_core(self._core, self._drain, address, reuse_port, tls, health_services)
        return self.port

    def streams_active(self) -> int:
        """How many ext_proc streams are open now."""
        return self._core.streams_active()

    def enter_graceful_shutdown(self) -> None:
        """The port's health service reports NOT_SERVING from now on."""
        self._core.enter_graceful_shutdown()

    async def stop(self, grace: float | None) -> None:
        """Stop accepting streams, give open ones `grace` seconds, then end them all."""
        await asyncio.to_thread(self._core.stop, grace or 0.0)
        self._drain()  # what the streams reported as they ended
        if self._loop is not None:
            self._loop.remove_reader(self._core.wake_fd())
        for task in self._routing.values():
            task.cancel()
        for routed in self._routed.values():
            routed.finish("cancelled")
        self._routing.clear()
        self._routed.clear()

    # -- events from the core ----------------------------------------------------------------

    def _drain(self) -> None:
        for event in self._core.drain():
            if isinstance(event, core.Log):
                log.log(event.level, "%s", event.message)
                continue
            try:
                self._handle(event)
            except Exception as error:
                if isinstance(event, core.ResponseHeaders | core.ResponseBody | core.ResponseTrailers):
                    self._response_failed(event, error)
                else:
                    self._failed(event.id, error)

    def _handle(self, event: core.StreamEvent) -> None:
        match event:
            case core.Route():
                routing = self._route(event.id, event.body, event.headers, event.subset)
                self._routing[event.id] = asyncio.create_task(routing)
            case core.ResponseBody():
                metadata = None
                if (routed := self._reported(event.id)) is not None:
                    metadata = routed.response_body(event.data, event.end_of_stream, event.served, event.first_byte_at)
                    self._forget_at_end(event.id, event.end_of_stream)
                if event.asks:  # the answer to this chunk waits for what the response-metadata hooks report
                    self._core.metadata(event.id, _plain(metadata))
            case core.ResponseHeaders():
                if (routed := self._reported(event.id)) is not None:
                    routed.response_headers(event.status, event.served, event.content_type, event.end_of_stream)
                    self._forget_at_end(event.id, event.end_of_stream)
            case core.ResponseTrailers():
                metadata = None
                if (routed := self._reported(event.id)) is not None:
                    metadata = routed.response_trailers()
                    self._forget_at_end(event.id, True)
                if event.asks:
                    self._core.metadata(event.id, _plain(metadata))
            case core.Closed():
                task = self._routing.pop(event.id, None)
                if task is not None:
                    task.cancel()  # the client is gone: leave the flow-control queue
                unfinished = self._routed.pop(event.id, None)
                if unfinished is not None:
                    unfinished.finish(event.error)
            case core.RouteWithoutBody():
                self._answer(event.id, self.director.route_without_body(event.subset), None)
            case core.Fail():
                self._fail(event.id, RequestError(event.code, event.message))
            case _:
                assert_never(event)

    def _reported(self, stream: int) -> RoutedRequest | None:
        """The request a response event is about (None once a failure ended it: the response
        still passes, nothing more is reported)."""
        return self._routed.get(stream)

    def _forget_at_end(self, stream: int, end: bool) -> None:
        """The response ended and was reported whole: the request is no longer this stream's.
        (Forgotten only after the report, so a report that fails still finds it to finish.)"""
        if end:
            self._routed.pop(stream, None)

    async def _route(self, stream: int, body: bytes, headers: Mapping[str, str], subset: list[str] | None) -> None:
        try:
            routed = await self.director.route(body, headers, subset)
        except Exception as error:
            self._failed(stream, error)
        else:
            self._answer(stream, routed, body)
        finally:
            self._routing.pop(stream, None)  # already gone when the stream closed (cancelled)

    def _answer(self, stream: int, routed: RoutedRequest, body: bytes | None) -> None:
        self._routed[stream] = routed
        runtime = routed.runtime
        # Response-streaming hooks read each chunk as it passes; otherwise chunks come coalesced.
        chunks = runtime is not None and bool(runtime.response_streaming)
        # Response-metadata hooks set dynamic metadata on the answers to response messages.
        metadata = runtime is not None and bool(runtime.response_metadata)
        replaced = None if routed.body is body or body is None else routed.body
        self._core.route(stream, routed.destination, replaced, chunks, metadata, routed.upstream_headers)

    def _failed(self, stream: int, error: Exception) -> None:
        """The one failure policy of every director call: a RequestError is answered as the
        reference answers it (its status and OpenAI-style body); anything else is a bug, which
        must cost this request only (never the stream's peers or the process): logged, and
        answered as an internal error."""
        if not isinstance(error, RequestError):
            log.error("ext_proc stream failed", exc_info=error)
            error = _internal_error()
        self._fail(stream, error)

    def _response_failed(
        self, event: core.ResponseHeaders | core.ResponseBody | core.ResponseTrailers, error: Exception
    ) -> None:
        """A bug while reading the response (e.g. a parser's usage reader): the response already
        under way passes untouched, its request ends with Internal (its in-flight slot released)
        and nothing more of it is reported; an answer the core waits for is given."""
        log.error("reading the response of ext_proc stream %d failed", event.id, exc_info=error)
        metrics.STREAM_ERRORS.labels("Internal").inc()
        routed = self._routed.pop(event.id, None)
        if routed is not None:
            routed.finish("Internal")
        if not isinstance(event, core.ResponseHeaders) and event.asks:
            self._core.metadata(event.id, None)

    def _fail(self, stream: int, error: RequestError) -> None:
        """Answer the client with `error`; the request, if routed, ends with its code."""
        metrics.STREAM_ERRORS.labels(error.code).inc()
        routed = self._routed.pop(stream, None)
        if routed is not None:
            routed.finish(error.code)
        self._core.reject(stream, error.status, error.body())
