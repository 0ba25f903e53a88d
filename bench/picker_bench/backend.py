"""A minimal, fast HTTP/1.1 keep-alive backend for measuring the gateway's own overhead.

It reads each request (Content-Length or chunked, as Envoy sends re-emitted bodies) and answers
a fixed small JSON, so that what a benchmark measures is Envoy and the picker, not the backend.
A request with `"stream":true` is answered as vLLM streams: `max_tokens` SSE events, one word
each and written one at a time `CHUNK_INTERVAL` apart (so each reaches the gateway on its own),
then a usage event and `[DONE]`. With `--metrics`, a `GET /metrics` is answered with a static
vLLM /metrics page (`picker_bench.metric_pages.vllm_page`), so pickers have real pages to scrape.
"""

from __future__ import annotations

import asyncio
import re
import socket
from typing import Any

import orjson

_ANSWER = b'{"id":"x","object":"text_completion","choices":[{"index":0,"text":"ok"}]}'
_RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
    + str(len(_ANSWER)).encode()
    + b"\r\n\r\n"
    + _ANSWER
)

_STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
_STREAM_MARK = re.compile(rb'"stream"\s*:\s*true')
_MAX_TOKENS = re.compile(rb'"max_tokens"\s*:\s*(\d+)')
CHUNK_INTERVAL = 0.001  # seconds between SSE events: the gateway reads each one separately


def sse_answer(words: int) -> list[bytes]:
    """An answer of `words` words as a chat completion stream, one word per event, with a usage
    event before `[DONE]` (vLLM's `stream_options.include_usage`)."""
    events: list[dict[str, Any]] = [
        {"choices": [{"index": 0, "delta": {"content": f" word{i % 50}"}}]} for i in range(words)
    ]
    events.append({"choices": [], "usage": {"prompt_tokens": 2000, "completion_tokens": words}})
    return [b"data: " + orjson.dumps(e) + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


def _http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class _Connection(asyncio.Protocol):
    # The whole answer to GET /metrics (None: answered like any other request).
    metrics_response: bytes | None = None

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        # Streamed answers on one connection go out in order, each after the one before.
        self.streaming: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            consumed = self._complete_request()
            if consumed == 0:
                return
            request = bytes(self.buffer[:consumed])
            del self.buffer[:consumed]
            assert self.transport is not None
            if self.metrics_response is not None and request.startswith(b"GET /metrics"):
                self.transport.write(self.metrics_response)
            elif _STREAM_MARK.search(request):
                tokens = _MAX_TOKENS.search(request)
                self.streaming = asyncio.ensure_future(
                    self._stream(self.streaming, sse_answer(int(tokens.group(1)) if tokens else 16))
                )
            elif self.streaming is None or self.streaming.done():
                self.transport.write(_RESPONSE)
            else:
                self.streaming = asyncio.ensure_future(self._stream(self.streaming, None))

    async def _stream(self, before: asyncio.Task[None] | None, events: list[bytes] | None) -> None:
        """After `before`, write `events` as a chunked SSE answer, one event at a time (or the
        fixed JSON answer when None)."""
        if before is not None:
            await before
        assert self.transport is not None
        if events is None:
            self.transport.write(_RESPONSE)
            return
        self.transport.write(_STREAM_HEAD)
        for event in events:
            if self.transport.is_closing():
                return
            self.transport.write(_http_chunk(event))
            await asyncio.sleep(CHUNK_INTERVAL)
        self.transport.write(b"0\r\n\r\n")

    def _complete_request(self) -> int:
        """Length of the first complete request in the buffer, or 0."""
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return 0
        head = bytes(self.buffer[:end]).lower()
        start = end + 4
        if b"transfer-encoding: chunked" in head:
            pos = start
            while True:
                line_end = self.buffer.find(b"\r\n", pos)
                if line_end < 0:
                    return 0
                size = int(bytes(self.buffer[pos:line_end]).split(b";")[0], 16)
                pos = line_end + 2 + size + 2
                if pos > len(self.buffer):
                    return 0
                if size == 0:
                    return pos
        marker = head.find(b"content-length:")
        length = 0
        if marker >= 0:
            length = int(head[marker + 15 : head.find(b"\r\n", marker) if head.find(b"\r\n", marker) > 0 else None])
        return start + length if len(self.buffer) >= start + length else 0


async def serve(host: str, port: int) -> asyncio.AbstractServer:
    loop = asyncio.get_running_loop()
    return await loop.create_server(_Connection, host, port)


def main(argv: list[str]) -> int:
    """`python -m picker_bench.backend [--metrics] HOST PORT [PORT ...]`: serve on every port until killed."""
    import uvloop

    if argv[:1] == ["--metrics"]:
        from picker_bench.metric_pages import vllm_page

        page = vllm_page()
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: %d\r\n\r\n"
        _Connection.metrics_response = head % len(page) + page
        argv = argv[1:]

    async def run() -> None:
        servers = [await serve(argv[0], int(port)) for port in argv[1:]]
        print("ready", flush=True)
        await asyncio.gather(*(server.serve_forever() for server in servers))

    uvloop.run(run())
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
