"""How the ext_proc RPC ends, over a real grpc.aio server and channel.

A grpc.aio client stands in for Envoy (no Envoy here: the point is the RPC's end, measured in
this process). Envoy resets each ext_proc stream once its HTTP exchange is over; grpc.aio leaks
a native `grpc_op` array per RPC whose final status meets that reset (grpc/grpc#43360), which
was picker's RSS growth of ~100-140 bytes per request (BENCHMARKS.md). Once Envoy has sent the
last message of both directions, the picker waits for that reset with no gRPC operation pending,
and ends the RPC itself if it does not come.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import json
from collections.abc import AsyncIterator

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from picker.extproc.servicer import ExtProcSettings
from picker.requestcontrol.director import Director
from tests.unit.test_extproc_stream import ENDPOINTS, body, director, headers, serving

BODY = json.dumps({"model": "m", "prompt": "hello"}).encode()


def response_headers() -> pb.ProcessingRequest:
    status = base_pb2.HeaderValue(key=":status", raw_value=b"200")
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[status])))


def response_body(eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=b'{"choices": []}', end_of_stream=eos))


@pytest.fixture
def picker_director() -> Director:
    return director()


@pytest.fixture
async def stub(picker_director: Director) -> AsyncIterator[pb_grpc.ExternalProcessorStub]:
    # A short wait for the proxy's close: the stand-in below closes only when a test says so.
    async with serving(picker_director, ExtProcSettings(close_wait_seconds=0.5)) as stub:
        yield stub


async def exchange(stub: pb_grpc.ExternalProcessorStub) -> grpc.aio.StreamStreamCall:
    """One duplex HTTP exchange as Envoy sends it, every answer read, the stream left open."""
    call = stub.Process()
    await call.write(headers())
    await call.write(body(BODY, True))
    await call.read()  # the routing headers response
    await call.read()  # the re-emitted body
    await call.write(response_headers())
    await call.read()
    await call.write(response_body(False))
    await call.read()
    await call.write(response_body(True))
    await call.read()
    return call


async def test_the_picker_ends_the_rpc_once_envoy_sent_its_last_message(
    stub: pb_grpc.ExternalProcessorStub, picker_director: Director
) -> None:
    call = await exchange(stub)
    # The request is over for the picker at once, not when the RPC ends.
    assert not call.done()
    assert all(picker_director.datastore.in_flight(e.address) == 0 for e in ENDPOINTS)
    # Neither a half-close nor a reset from the stand-in: the picker alone ends the RPC.
    assert await asyncio.wait_for(call.code(), timeout=10) == grpc.StatusCode.OK


async def test_the_rpc_stays_open_while_the_response_is_still_coming(stub: pb_grpc.ExternalProcessorStub) -> None:
    call = stub.Process()
    await call.write(headers())
    await call.write(body(BODY, True))
    await call.read()
    await call.read()
    await call.write(response_headers())
    await call.read()
    await call.write(response_body(True))  # answered: the RPC was still open
    answer = await call.read()
    assert answer.response_body.response.body_mutation.streamed_response.end_of_stream


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def native_heap_in_use() -> int:
    """Bytes glibc's malloc has handed out and not had back (grpc's C core allocates there)."""
    gc.collect()
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    return int(libc.mallinfo2().uordblks)


async def test_exchanges_that_envoy_resets_at_the_end_leave_no_native_memory_behind(
    stub: pb_grpc.ExternalProcessorStub,
) -> None:
    async def one() -> None:
        call = await exchange(stub)
        call.cancel()  # what Envoy does once it has the last answer: RST_STREAM
        await call.code()

    for _ in range(200):  # warm-up: grpc's and the picker's caches reach their size
        await one()
    before = native_heap_in_use()
    streams = 1500
    for _ in range(streams):
        await one()
    growth = (native_heap_in_use() - before) / streams
    # Before the fix: ~96 bytes per exchange, one leaked grpc_op array each; after it 26-35, which
    # this process's stand-in client and its cancel account for as well (they share the heap).
    assert growth < 60, f"{growth:.1f} bytes of native heap per exchange"
