"""The ext_proc servicer: one bidirectional stream per HTTP request, answered in order.

Request path: keep the headers; accumulate the body to end_of_stream; hand it to the director
(`picker.requestcontrol`), which parses and picks; answer with the destination header +
`envoy.lb` metadata (in the headers response for duplex and streamed modes, in the body
response for BUFFERED), then re-emit the body in duplex mode. Response path: pass everything
through and report what passes to the request's `RoutedRequest`, which the stream finishes
when it ends for any reason; the dynamic metadata it returns is set on the answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from picker.extproc import messages
from picker.extproc.messages import BUFFERED, BUFFERED_PARTIAL, FULL_DUPLEX_STREAMED, STREAMED
from picker.request.errors import RequestError
from picker.requestcontrol.director import Director, RoutedRequest
from picker.telemetry import metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ExtProcSettings:
    """Per-server knobs of the ext_proc protocol handling."""

    max_body_bytes: int = 16 << 20
    honour_subset_hint: bool = True
    # How long a stream whose exchange is over waits for the proxy to close it before ending it.
    close_wait_seconds: float = 5.0


def _out_of_order(what: str) -> RequestError:
    return RequestError("BadRequest", f"ext_proc protocol violation: {what}")


class _Stream:
    """The state of one ext_proc stream (one HTTP request)."""

    __slots__ = (
        "body",
        "body_size",
        "chunks",
        "director",
        "headers",
        "request_ended",
        "request_mode",
        "response_ended",
        "response_mode",
        "routed",
        "send_body_early",
        "settings",
        "subset",
    )

    def __init__(self, director: Director, settings: ExtProcSettings) -> None:
        self.director = director
        self.settings = settings
        self.request_mode = BUFFERED
        self.response_mode = 0
        self.send_body_early = False
        self.headers: dict[str, str] = {}
        self.subset: list[str] | None = None
        self.body: list[bytes] = []
        self.body_size = 0
        self.chunks = 0
        self.routed: RoutedRequest | None = None
        self.request_ended = False
        self.response_ended = False

    @property
    def exchange_ended(self) -> bool:
        """Envoy has sent the last message of both directions: nothing more will come."""
        return self.request_ended and self.response_ended

    # -- request path -----------------------------------------------------------------------

    def on_request_headers(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if self.headers:
            raise _out_of_order("request headers arrived twice")
        if req.HasField("protocol_config"):
            config = req.protocol_config
            self.request_mode = config.request_body_mode or BUFFERED
            self.response_mode = config.response_body_mode
            self.send_body_early = config.send_body_without_waiting_for_header_response
        self.headers = messages.header_map(req.request_headers.headers)
        self.request_ended = req.request_headers.end_of_stream
        if self.settings.honour_subset_hint:
            self.subset = messages.subset_hint(req)
        if req.request_headers.end_of_stream or (self.request_mode == STREAMED and not self.send_body_early):
            # No body, or STREAMED mode where Envoy forwards the headers before any body arrives:
            # the pick cannot wait for the body.
            self.routed = self.director.route_without_body(self.subset)
            return [messages.route_in_headers(self.routed.destination, None, self._removed_headers())]
        if self.request_mode in (BUFFERED, BUFFERED_PARTIAL):
            return [messages.continue_request_headers()]
        return []  # duplex, or STREAMED with the body sent early: answered once the body is seen

    async def on_request_body(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self.request_ended = req.request_body.end_of_stream
        if self.routed is not None:  # routed on headers (STREAMED without the early body)
            return [messages.continue_request_body()]
        if not self.headers:
            raise _out_of_order("request body before request headers")
        chunk = req.request_body.body
        self.chunks += 1
        self.body_size += len(chunk)
        if self.body_size > self.settings.max_body_bytes:
            raise RequestError(
                "PayloadTooLarge", f"request body exceeds the limit of {self.settings.max_body_bytes} bytes"
            )
        if chunk:
            self.body.append(chunk)
        if not req.request_body.end_of_stream and self.request_mode != BUFFERED_PARTIAL:
            return []
        return await self._route_body(trailers_follow=False)

    async def on_request_trailers(self) -> list[pb.ProcessingResponse]:
        if not self.headers:
            raise _out_of_order("request trailers before request headers")
        self.request_ended = True
        if self.routed is None:  # trailers end the body in duplex mode
            return await self._route_body(trailers_follow=True) + [messages.continue_request_trailers()]
        return [messages.continue_request_trailers()]

    async def _route_body(self, trailers_follow: bool) -> list[pb.ProcessingResponse]:
        body = b"".join(self.body)
        self.body = []
        routed = self.routed = await self.director.route(body, self.headers, self.subset)
        destination = routed.destination
        removed = self._removed_headers()
        out_body = routed.body
        if self.request_mode in (BUFFERED, BUFFERED_PARTIAL):
            return [messages.route_in_body(destination, removed, None if out_body is body else out_body)]
        responses = [messages.route_in_headers(destination, len(out_body), removed)]
        if self.request_mode == FULL_DUPLEX_STREAMED:
            responses.extend(messages.streamed_request_body(out_body, end_of_stream=not trailers_follow))
        else:  # STREAMED, body sent early: each chunk Envoy sent gets its (empty) answer
            responses.extend(messages.continue_request_body() for _ in range(self.chunks))
        return responses

    def _removed_headers(self) -> list[str]:
        return [h for h in self.headers if h in messages.SYSTEM_OWNED_HEADERS and h != "content-length"]

    # -- response path ----------------------------------------------------------------------

    def on_response_headers(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self.response_ended = req.response_headers.end_of_stream
        routed = self.routed
        if routed is not None:
            headers = messages.header_map(req.response_headers.headers)
            status = headers.get(":status", "0")
            routed.response_headers(
                int(status) if status.isdigit() else 0,
                messages.served_endpoint(req) or headers.get(messages.SERVED_KEY),
                headers.get("content-type", ""),
                req.response_headers.end_of_stream,
            )
        return [messages.continue_response_headers()]

    def on_response_body(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        chunk = req.response_body.body
        end = self.response_ended = req.response_body.end_of_stream
        routed = self.routed
        metadata = None  # what the response-metadata plugins report back to the proxy
        if routed is not None:
            served = None if routed.served is not None else messages.served_endpoint(req)
            metadata = routed.response_body(chunk, end, served)
        if self.response_mode == FULL_DUPLEX_STREAMED:
            return [messages.streamed_response_body(chunk, end, metadata)]
        return [messages.continue_response_body(metadata)]

    def on_response_trailers(self) -> list[pb.ProcessingResponse]:
        self.response_ended = True
        metadata = self.routed.response_trailers() if self.routed is not None else None
        return [messages.continue_response_trailers(metadata)]

    async def dispatch(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """The answers to one message from Envoy, in order (possibly none yet)."""
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            return self.on_request_headers(req)
        if kind == "request_body":
            return await self.on_request_body(req)
        if kind == "request_trailers":
            return await self.on_request_trailers()
        if kind == "response_headers":
            return self.on_response_headers(req)
        if kind == "response_body":
            return self.on_response_body(req)
        if kind == "response_trailers":
            return self.on_response_trailers()
        return []

    def close(self, error: str | None) -> None:
        """The stream ended: a request still in flight is released now."""
        if self.routed is not None:
            self.routed.finish(error)


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]  # generated, untyped base
    """`envoy.service.ext_proc.v3.ExternalProcessor`: answers each message in protocol order."""

    def __init__(self, director: Director, settings: ExtProcSettings = ExtProcSettings()) -> None:
        self.director = director
        self.settings = settings

    async def _await_close(self, stream: _Stream, error: str | None) -> None:
        """Finish the request now, then wait, without a gRPC operation pending, for the proxy
        to close the stream.

        Envoy resets each ext_proc stream once its exchange is over. grpc.aio leaks the native
        `grpc_op` array (~100 bytes) of a batch pending at a reset or failing on it
        (grpc/grpc#43360): a receive for the next message, or the final status sent just after
        the reset. Idle here, the reset only cancels this task; a proxy that never closes the
        stream gets the status after `close_wait_seconds`.
        """
        stream.close(error)  # in-flight released and outcome recorded without waiting
        await asyncio.sleep(self.settings.close_wait_seconds)

    async def Process(  # noqa: N802 (gRPC method name)
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        stream = _Stream(self.director, self.settings)
        metrics.STREAMS_ACTIVE.inc()
        error: str | None = "cancelled"
        try:
            async for req in request_iterator:
                try:
                    responses = await stream.dispatch(req)
                except RequestError as e:
                    # The answer ends the HTTP exchange; Envoy closes this stream after it.
                    error = e.code
                    metrics.STREAM_ERRORS.labels(e.code).inc()
                    yield messages.immediate(e.status, e.body())
                    await self._await_close(stream, error)
                    return
                except Exception:
                    # A bug must cost one request, never the stream's peers or the process.
                    log.exception("ext_proc stream failed")
                    error = "Internal"
                    metrics.STREAM_ERRORS.labels(error).inc()
                    yield messages.immediate(
                        500, RequestError("Internal", "internal error in the endpoint picker").body()
                    )
                    await self._await_close(stream, error)
                    return
                for response in responses:
                    yield response
                if stream.exchange_ended:
                    error = None
                    await self._await_close(stream, error)
                    break
            error = None
        finally:
            stream.close(error)
            metrics.STREAMS_ACTIVE.dec()
