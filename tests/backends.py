"""Small real HTTP model-server stand-ins for the integration tests.

Each listens on its own 127.0.0.x address and says who it is: the `x-backend` header and the
`backend` field of a JSON answer, which also echoes the request body's length and SHA-256 and the
`model` it named (as `received_model`: a key no model-name rewrite of the response touches).
A request with `"stream": true` gets an SSE stream ending in a usage chunk and `[DONE]`.

Run: python -m tests.backends ADDRESS [ADDRESS ...]   (prints `ready` once all listen)
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import sys

from aiohttp import web

SSE_CHUNKS = 5


def usage_for(body: bytes) -> dict:
    prompt = max(1, len(body) // 4)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": SSE_CHUNKS,
        "total_tokens": prompt + SSE_CHUNKS,
        "prompt_tokens_details": {"cached_tokens": prompt // 2},
    }


def make_app(address: str) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {"x-backend": address}
        try:
            payload = json.loads(body) if body else {}
        except ValueError:
            payload = {}
        if isinstance(payload, dict) and payload.get("stream") is True:
            response = web.StreamResponse(headers={**headers, "content-type": "text/event-stream"})
            await response.prepare(request)
            for i in range(SSE_CHUNKS):
                chunk = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": f"t{i} "}]}
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            final = {"id": "x", "object": "text_completion", "choices": [], "usage": usage_for(body)}
            await response.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
            await response.write_eof()
            return response
        answer = {
            "backend": address,
            "method": request.method,
            "path": request.path,
            "body_len": len(body),
            "body_sha256": hashlib.sha256(body).hexdigest(),
            "received_model": payload.get("model") if isinstance(payload, dict) else None,
            "headers": {k.lower(): v for k, v in request.headers.items()},
            "object": "text_completion",
            "usage": usage_for(body),
        }
        return web.json_response(answer, headers=headers)

    app = web.Application(client_max_size=64 << 20)
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


async def serve(addresses: list[str]) -> None:
    runners = []
    for address in addresses:
        host, port = address.rsplit(":", 1)
        runner = web.AppRunner(make_app(address), access_log=None)
        await runner.setup()
        sock = socket.create_server((host, int(port)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await web.SockSite(runner, sock).start()
        runners.append(runner)
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1:]))
