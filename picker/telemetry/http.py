"""The metrics port: Prometheus `/metrics`, the config in force at `/config`, and
`/debug/decisions` when enabled; with `--metrics-endpoint-auth`, every path answers only
callers the access reviewer lets through (401 without a valid token, 403 without the right)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest


@dataclass(frozen=True, slots=True)
class AccessDecision:
    """What to answer a request: `status` 200 lets it through; otherwise the HTTP error
    status (401, 403, or 500 when the review itself failed) and its text."""

    status: int
    reason: str = ""

    @property
    def allowed(self) -> bool:
        return self.status == 200


class AccessReviewer(Protocol):
    """Decides whether a request's `Authorization` header may `verb` the `path`."""

    async def decide(self, authorization: str | None, verb: str, path: str) -> AccessDecision: ...


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _access_middleware(reviewer: AccessReviewer) -> Any:
    @web.middleware
    async def check_access(request: web.Request, handler: Handler) -> web.StreamResponse:
        # The verb as Kubernetes spells it for non-resource URLs: the lower-case HTTP method.
        decision = await reviewer.decide(request.headers.get("Authorization"), request.method.lower(), request.path)
        if not decision.allowed:
            return web.Response(status=decision.status, text=decision.reason + "\n")
        return await handler(request)

    return check_access


def metrics_app(
    decisions: Callable[[], list[dict[str, Any]]] | None = None,
    config: Callable[[], dict[str, Any]] | None = None,
    reviewer: AccessReviewer | None = None,
    exposition: Callable[[web.Request], Awaitable[bytes]] | None = None,
) -> web.Application:
    """An aiohttp app serving metrics; `decisions` (if given) backs GET /debug/decisions,
    `config` (if given) GET /config, and `reviewer` (if given) guards every path.
    `exposition` (if given) makes the /metrics page instead of this process's registry."""

    async def serve_metrics(request: web.Request) -> web.Response:
        body = await exposition(request) if exposition is not None else generate_latest()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application(middlewares=[_access_middleware(reviewer)] if reviewer is not None else [])
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


async def start_metrics_socket(app: web.Application, path: str) -> web.AppRunner:
    """The metrics app on a unix socket: a worker's, read by its parent (`picker serve --workers`)."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.UnixSite(runner, path).start()
    return runner
