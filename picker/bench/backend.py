"""A minimal, fast HTTP/1.1 keep-alive backend for measuring the gateway's own overhead.

It reads each request (Content-Length or chunked, as Envoy sends re-emitted bodies) and answers
a fixed small JSON, so that what a benchmark measures is Envoy and the picker, not the backend.
"""

from __future__ import annotations

import asyncio
import socket

_ANSWER = b'{"id":"x","object":"text_completion","choices":[{"index":0,"text":"ok"}]}'
_RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
    + str(len(_ANSWER)).encode()
    + b"\r\n\r\n"
    + _ANSWER
)


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

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
            del self.buffer[:consumed]
            assert self.transport is not None
            self.transport.write(_RESPONSE)

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
    """`python -m picker.bench.backend HOST PORT`: serve until killed."""
    import uvloop

    async def run() -> None:
        server = await serve(argv[0], int(argv[1]))
        print("ready", flush=True)
        await server.serve_forever()

    uvloop.run(run())
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
