"""The ext_proc stream state machine on its own: any message order, any chunking."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from picker.config.runtime import RuntimeHolder
from picker.datastore.endpoint import Endpoint
from picker.datastore.store import Datastore
from picker.extproc.messages import BODY_CHUNK_BYTES, BUFFERED, FULL_DUPLEX_STREAMED, STREAMED
from picker.extproc.servicer import ExternalProcessor, ExtProcSettings, _Stream
from picker.request.errors import RequestError
from picker.requestcontrol.director import Director

ENDPOINTS = [Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.2", 8000)]


def director() -> Director:
    store = Datastore()
    store.set_endpoints(ENDPOINTS)
    return Director(store, RuntimeHolder(store))


@asynccontextmanager
async def serving(picker: Director, settings: ExtProcSettings) -> AsyncIterator[pb_grpc.ExternalProcessorStub]:
    """A real grpc.aio server with the ext_proc servicer on a free port, and a stub to it."""
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(picker, settings), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield pb_grpc.ExternalProcessorStub(channel)
    finally:
        await channel.close()
        await server.stop(None)


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


async def test_a_body_in_one_byte_chunks_is_routed_once_and_reemitted_whole() -> None:
    d = director()
    stream = _Stream(d, ExtProcSettings())
    payload = json.dumps({"model": "m", "prompt": "p" * 70000}).encode()
    assert (await stream.dispatch(headers())) == []
    for i in range(len(payload) - 1):
        assert (await stream.dispatch(body(payload[i : i + 1], False))) == []
    out = await stream.dispatch(body(payload[-1:], True))
    header_response, *chunks = out
    mutation = {
        h.header.key: h.header.raw_value for h in header_response.request_headers.response.header_mutation.set_headers
    }
    assert mutation["content-length"] == str(len(payload)).encode()
    assert mutation["x-gateway-destination-endpoint"] in {e.address.encode() for e in ENDPOINTS}
    bodies = [c.request_body.response.body_mutation.streamed_response for c in chunks]
    assert b"".join(b.body for b in bodies) == payload
    assert all(len(b.body) <= BODY_CHUNK_BYTES for b in bodies)
    assert [b.end_of_stream for b in bodies] == [False] * (len(bodies) - 1) + [True]
    stream.close(None)
    assert all(d.datastore.in_flight(e.address) == 0 for e in ENDPOINTS)


async def test_trailers_end_the_body_in_duplex_mode() -> None:
    stream = _Stream(director(), ExtProcSettings())
    await stream.dispatch(headers())
    await stream.dispatch(body(json.dumps({"model": "m", "prompt": "x"}).encode(), False))
    out = await stream.dispatch(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    assert out[0].HasField("request_headers")
    assert out[1].request_body.response.body_mutation.streamed_response.end_of_stream is False
    assert out[-1].HasField("request_trailers")


async def test_buffered_mode_answers_headers_then_routes_in_the_body_response() -> None:
    stream = _Stream(director(), ExtProcSettings())
    (first,) = await stream.dispatch(headers(mode=BUFFERED))
    assert first.HasField("request_headers") and not first.request_headers.response.header_mutation.set_headers
    (routed,) = await stream.dispatch(body(json.dumps({"model": "m", "prompt": "x"}).encode(), True))
    assert routed.request_body.response.clear_route_cache
    assert routed.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"].string_value


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


@settings(max_examples=300, deadline=None)
@given(
    mode=st.sampled_from([BUFFERED, STREAMED, FULL_DUPLEX_STREAMED]),
    script=st.lists(
        st.tuples(
            KINDS,
            st.binary(max_size=64)
            | st.sampled_from(
                [b'{"model":"m","prompt":"x"}', b'data: {"usage":{"prompt_tokens":3}}\n\n', b"\xff\xfe", b"{"]
            ),
        ),
        max_size=12,
    ),
)
def test_any_message_order_never_breaks_the_stream_and_always_releases(mode: int, script) -> None:
    d = director()
    stream = _Stream(d, ExtProcSettings(max_body_bytes=256))

    async def play() -> None:
        for kind, data in script:
            try:
                await stream.dispatch(message(kind, data, mode))
            except RequestError as e:
                assert e.status in (400, 413, 503)
                return

    asyncio.run(play())
    stream.close("cancelled")
    assert all(d.datastore.in_flight(e.address) == 0 for e in ENDPOINTS)
