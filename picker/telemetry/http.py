"""The metrics port: Prometheus `/metrics`, the config in force at `/config`, and
`/debug/decisions` when enabled."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest


def metrics_app(
    decisions: Callable[[], list[dict[str, Any]]] | None = None,
    config: Callable[[], dict[str, Any]] | None = None,
) -> web.Application:
    """An aiohttp app serving metrics; `decisions` (if given) backs GET /debug/decisions and
    `config` (if given) GET /config."""

    async def serve_metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", serve_metrics)
    if config is not None:
        describe = config

        async def serve_config(_: web.Request) -> web.Response:
            return web.json_response(describe())

        app.router.add_get("/config", serve_config)
    if decisions is not None:

        async def serve_decisions(_: web.Request) -> web.Response:
            return web.json_response({"decisions": decisions()})

        app.router.add_get("/debug/decisions", serve_decisions)
    return app


async def start_metrics_server(app: web.Application, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
