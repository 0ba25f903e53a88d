"""The ext_proc stream state machine: any message order, any chunking.

The compiled core (native/extproc) serves on a real socket; a grpc.aio client stands in for
Envoy (no Envoy here: the point is the protocol handling, in this process).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from picker.config.runtime import RuntimeHolder
from picker.datastore.endpoint import Endpoint
from picker.datastore.store import Datastore
from picker.extproc.server import ExtProcServer, ExtProcSettings
from picker.framework.registry import Registration
from picker.framework.request import Usage
from picker.plugins import REGISTRY
from picker.request.parser import OpenAIParser
from picker.requestcontrol.director import Director, RoutedRequest
from tests.sim_fixtures import eventually

ENDPOINTS = [Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.2", 8000)]
STREAMED, BUFFERED, FULL_DUPLEX_STREAMED = (
    ProcessingMode.STREAMED,
    ProcessingMode.BUFFERED,
    ProcessingMode.FULL_DUPLEX_STREAMED,
)
# Envoy's reference limit for one streamed body message (gie-epp.md §1.2): re-emitted bodies
# come in chunks of at most this.
BODY_CHUNK_BYTES = 62000


def director() -> Director:
    store = Datastore()
    store.set_endpoints(ENDPOINTS)
    return Director(store, RuntimeHolder(store))


def headers(
    path: str = "/v1/completions",
    eos: bool = False,
    mode: int = FULL_DUPLEX_STREAMED,
    extra: dict[str, str] | None = None,
) -> pb.ProcessingRequest:
    pairs = {":path": path, ":method": "POST", "content-type": "application/json", **(extra or {})}
    req = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
            ),
            end_of_stream=eos,
        )
    )
    req.protocol_config.request_body_mode = mode
    req.protocol_config.response_body_mode = FULL_DUPLEX_STREAMED
    return req


def body(chunk: bytes, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=chunk, end_of_stream=eos))


# A short wait for the proxy's close: the stand-in closes only when a test says so.
SHORT_CLOSE_WAIT = ExtProcSettings(close_wait_seconds=0.5)


@contextlib.asynccontextmanager
async def serving(
    d: Director, settings_: ExtProcSettings = SHORT_CLOSE_WAIT
) -> AsyncIterator[pb_grpc.ExternalProcessorStub]:
    """The picker's ext_proc server on a free port, and a client stub for it."""
    server = ExtProcServer(d, settings_)
    port = server.start("127.0.0.1:0")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield pb_grpc.ExternalProcessorStub(channel)
    finally:
        await channel.close()
        await server.stop(0)


async def exchange(
    stub: pb_grpc.ExternalProcessorStub, messages: Sequence[pb.ProcessingRequest], answers: int
) -> tuple[grpc.aio.StreamStreamCall, list[pb.ProcessingResponse]]:
    """Send `messages`, then read `answers` answers; the stream stays open."""
    call = stub.Process()
    for message in messages:
        await call.write(message)
    return call, [await asyncio.wait_for(call.read(), 10) for _ in range(answers)]


async def released(d: Director) -> None:
    """Wait until no request is in flight on any endpoint (the picker released them all)."""

    async def check() -> bool:
        return all(d.datastore.in_flight(e.address) == 0 for e in ENDPOINTS)

    await eventually(check, deadline_s=5)


def one_byte_pieces_at_the_edges(payload: bytes, edges: tuple[int, ...], span: int, large: int) -> list[bytes]:
    """`payload` cut into single bytes for `span` bytes before and after each offset in
    `edges`, and into pieces of at most `large` bytes elsewhere."""
    single = {i for edge in edges for i in range(max(0, edge - span), min(len(payload), edge + span))}
    pieces: list[bytes] = []
    start = 0
    while start < len(payload):
        end = start + 1 if start in single else start + large
        end = min([end, len(payload), *(i for i in single if i > start)])
        pieces.append(payload[start:end])
        start = end
    return pieces


async def test_a_body_in_one_byte_chunks_is_routed_once_and_reemitted_whole() -> None:
    """One-byte messages where the body starts, where it fills a re-emitted chunk and where it
    ends (some 700 messages): what one byte at a time can break, without 70,000 round trips
    for the bytes between, which come in 1 KB messages."""
    d = director()
    payload = json.dumps({"model": "m", "prompt": "p" * 70000}).encode()
    pieces = one_byte_pieces_at_the_edges(payload, (0, BODY_CHUNK_BYTES, len(payload)), 175, 1000)
    assert b"".join(pieces) == payload and sum(len(p) == 1 for p in pieces) == 700
    messages = [headers()] + [body(piece, i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    async with serving(d) as stub:
        count = -(-len(payload) // BODY_CHUNK_BYTES)
        # Nothing is answered before the body's end: the first answer is the routing one.
        call, (header_response, *chunks) = await exchange(stub, messages, 1 + count)
        mutation = {
            h.header.key: h.header.raw_value
            for h in header_response.request_headers.response.header_mutation.set_headers
        }
        assert mutation["content-length"] == str(len(payload)).encode()
        assert mutation["x-gateway-destination-endpoint"] in {e.address.encode() for e in ENDPOINTS}
        bodies = [c.request_body.response.body_mutation.streamed_response for c in chunks]
        assert b"".join(b.body for b in bodies) == payload
        assert all(len(b.body) <= BODY_CHUNK_BYTES for b in bodies)
        assert [b.end_of_stream for b in bodies] == [False] * (len(bodies) - 1) + [True]
        await call.done_writing()  # the proxy closes its side: the request ends with the stream
        await released(d)


async def test_trailers_end_the_body_in_duplex_mode() -> None:
    messages = [
        headers(),
        body(json.dumps({"model": "m", "prompt": "x"}).encode(), False),
        pb.ProcessingRequest(request_trailers=pb.HttpTrailers()),
    ]
    async with serving(director()) as stub:
        _, out = await exchange(stub, messages, 3)
    assert out[0].HasField("request_headers")
    assert out[1].request_body.response.body_mutation.streamed_response.end_of_stream is False
    assert out[-1].HasField("request_trailers")


async def test_buffered_mode_answers_headers_then_routes_in_the_body_response() -> None:
    messages = [headers(mode=BUFFERED), body(json.dumps({"model": "m", "prompt": "x"}).encode(), True)]
    async with serving(director()) as stub:
        _, (first, routed) = await exchange(stub, messages, 2)
    assert first.HasField("request_headers") and not first.request_headers.response.header_mutation.set_headers
    assert routed.request_body.response.clear_route_cache
    assert routed.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"].string_value


def response_headers(content_type: str) -> pb.ProcessingRequest:
    pairs = {":status": "200", "content-type": content_type}
    headers = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=headers)))


async def test_a_streamed_answer_passes_chunk_by_chunk_and_reports_usage_and_first_byte() -> None:
    d = director()
    finished: list[tuple[RoutedRequest, str | None]] = []
    release = d.complete

    def complete(routed: RoutedRequest, error: str | None) -> None:
        finished.append((routed, error))
        release(routed, error)

    d.complete = complete
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    events = [
        b'data: {"choices":[{"text":"a"}]}\n\n',
        b'data: {"choices":[{"text":"b"}]',  # an event split across chunks
        b"}\n\n",
        b'data: {"choices":[],"usage":' + json.dumps(usage).encode() + b"}\n\n",
        b"data: [DONE]\n\n",
    ]
    async with serving(d) as stub:
        call, _ = await exchange(stub, [headers(), body(json.dumps({"model": "m", "prompt": "x"}).encode(), True)], 2)
        await call.write(response_headers("text/event-stream"))
        await call.read()
        first_sent = time.monotonic()
        for i, event in enumerate(events):
            end = i == len(events) - 1
            last_sent = time.monotonic()
            await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=event, end_of_stream=end)))
            passed = (await call.read()).response_body.response.body_mutation.streamed_response
            assert (passed.body, passed.end_of_stream) == (event, end)

        async def reported() -> bool:
            return bool(finished)

        await eventually(reported, deadline_s=5)
    ((routed, error),) = finished
    assert error is None and routed.status == 200
    assert routed.usage is not None and (routed.usage.prompt_tokens, routed.usage.completion_tokens) == (3, 2)
    assert routed.response_bytes == sum(map(len, events))
    # The chunks reach Python together at the end; TTFT still runs from when the core saw the first.
    assert routed.first_byte_at is not None and first_sent <= routed.first_byte_at < last_sent


class UsageReaderThatFails(OpenAIParser):
    """OpenAI parsing, and a whole-body usage reader that raises (a bug on the response side)."""

    plugin_type = "test-usage-reader-that-fails"
    reads_response_usage = True

    def response_usage(self, body: bytes) -> Usage | None:
        raise RuntimeError("usage reader fails on purpose")


async def test_a_failure_reading_the_response_lets_it_pass_and_releases_its_request(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    kind = UsageReaderThatFails.plugin_type
    create = lambda name, parameters, handle: UsageReaderThatFails(name)  # noqa: E731
    monkeypatch.setitem(REGISTRY.registrations, kind, Registration(kind, create))
    d = director()
    d.runtimes.load_text(
        "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
        f"plugins: [{{type: queue-scorer}}, {{name: usage, type: {kind}}}]\nparser: {{pluginRef: usage}}\n"
    )
    answer = b'{"choices":[{"text":"a"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
    async with serving(d) as stub:
        call, _ = await exchange(stub, [headers(), body(json.dumps({"model": "m", "prompt": "x"}).encode(), True)], 2)
        await call.write(response_headers("application/json"))
        await call.read()
        await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=answer, end_of_stream=True)))
        passed = (await call.read()).response_body.response.body_mutation.streamed_response
        assert (passed.body, passed.end_of_stream) == (answer, True)  # passed untouched, not rejected
        await released(d)  # and its in-flight slot is not leaked
    assert any("usage reader fails on purpose" in str(r.exc_info and r.exc_info[1]) for r in caplog.records)


KINDS = st.sampled_from(["rh", "rh_eos", "rb", "rb_eos", "rt", "sh", "sb", "sb_eos", "st", "junk"])


def message(kind: str, data: bytes, mode: int) -> pb.ProcessingRequest:
    if kind in ("rh", "rh_eos"):
        return headers(eos=kind == "rh_eos", mode=mode)
    if kind in ("rb", "rb_eos"):
        return body(data, kind == "rb_eos")
    if kind == "rt":
        return pb.ProcessingRequest(request_trailers=pb.HttpTrailers())
    if kind == "sh":
        return pb.ProcessingRequest(
            response_headers=pb.HttpHeaders(
                headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")])
            )
        )
    if kind in ("sb", "sb_eos"):
        return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=kind == "sb_eos"))
    if kind == "st":
        return pb.ProcessingRequest(response_trailers=pb.HttpTrailers())
    return pb.ProcessingRequest()


async def play_script(
    d: Director,
    scripts: list[tuple[int, list[tuple[str, bytes]]]],
    end: Callable[[grpc.aio.StreamStreamCall], Awaitable[None]],
) -> None:
    """Play each script on its own stream of one server; every answer is read until the RPC
    ends (the stand-in ends its side with `end`). After an immediate response the picker ends
    the RPC itself, so the stand-in's later writes may fail: that is the RPC's end too."""
    async with serving(d, ExtProcSettings(max_body_bytes=256, close_wait_seconds=0.02)) as stub:
        for mode, script in scripts:
            call = stub.Process()
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                for kind, data in script:
                    await call.write(message(kind, data, mode))
                await end(call)
            answers = []
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
                async for answer in call:
                    answers.append(answer)
            for answer in answers:
                if answer.HasField("immediate_response"):
                    assert answer.immediate_response.status.code in (400, 413, 503)
        await released(d)


SCRIPTS = st.lists(
    st.tuples(
        st.sampled_from([BUFFERED, STREAMED, FULL_DUPLEX_STREAMED]),
        st.lists(
            st.tuples(
                KINDS,
                st.binary(max_size=64)
                | st.sampled_from(
                    [b'{"model":"m","prompt":"x"}', b'data: {"usage":{"prompt_tokens":3}}\n\n', b"\xff\xfe", b"{"]
                ),
            ),
            max_size=12,
        ),
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=40, deadline=None)
@given(scripts=SCRIPTS)
def test_any_message_order_never_breaks_the_stream_and_always_releases(scripts) -> None:
    # The proxy half-closes after its last message: the picker ends the RPC.
    d = director()
    asyncio.run(play_script(d, scripts, lambda call: call.done_writing()))


@settings(max_examples=40, deadline=None)
@given(scripts=SCRIPTS)
def test_any_message_order_then_a_reset_always_releases(scripts) -> None:
    # The proxy resets the stream after its last message (the client went away).
    d = director()

    async def reset(call: grpc.aio.StreamStreamCall) -> None:
        call.cancel()

    asyncio.run(play_script(d, scripts, reset))
