"""The body-based router's ext_proc server, on the picker's compiled ext_proc core.

The core runs the protocol (BUFFERED and FULL_DUPLEX_STREAMED alike: it reads the mode Envoy
sends) and asks once per request with the whole body; this side parses the JSON body, runs the
request plugins and answers with their headers only (`Core.route` with no destination): the
core then sets them, clears the route cache so the Gateway's routes see them, leaves every other
header (the EPP downstream needs its own) and passes the response through without reporting it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from typing import Any, assert_never

import picker_extproc_core as core

from picker.bbr import metrics
from picker.bbr.plugins import RequestPlugin
from picker.extproc.server import ExtProcSettings, Tls, serve_core
from picker.request.errors import RequestError, bad_request

log = logging.getLogger(__name__)


def _refuse_constant(name: str) -> float:
    raise ValueError(f"invalid character {name[0]!r} looking for beginning of value")


def _finite(text: str) -> float:
    number = float(text)
    if number in (float("inf"), float("-inf")):
        raise ValueError(f"cannot unmarshal number {text} into Go value of type float64")
    return number


def parse_body(body: bytes) -> dict[str, Any]:
    """The body as Go's `encoding/json` decodes it into a map: an object (or null: empty), every
    number a float64, NaN and Infinity refused, invalid UTF-8 replaced. RequestError otherwise."""
    try:
        parsed = json.loads(
            body.decode("utf-8", "replace"),
            parse_int=_finite,
            parse_float=_finite,
            parse_constant=_refuse_constant,
        )
    except ValueError as error:
        raise bad_request(f"failed to parse request body: {error}") from None
    if parsed is None:
        return {}
    if not isinstance(parsed, dict):
        raise bad_request(f"failed to parse request body: cannot unmarshal {type(parsed).__name__} into an object")
    return parsed


class BbrServer:
    """`envoy.service.ext_proc.v3.ExternalProcessor` on one port, setting routing headers."""

    def __init__(self, plugins: Sequence[RequestPlugin], settings: ExtProcSettings | None = None) -> None:
        settings = settings or ExtProcSettings()
        self.plugins = tuple(plugins)
        self._core = core.Core(settings.max_body_bytes, False, settings.close_wait_seconds)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.port = 0

    def start(self, address: str, *, tls: Tls | None = None, health_services: Sequence[str] = ()) -> int:
        """Serve on `address` (`host:port`, port 0 picks one); the bound port (OSError if the
        address cannot be bound)."""
        self._loop = asyncio.get_running_loop()
        self.port = serve_core(self._core, self._drain, address, False, tls, health_services)
        return self.port

    async def stop(self, grace: float) -> None:
        """Stop accepting streams, give open ones `grace` seconds, then end them all."""
        await asyncio.to_thread(self._core.stop, grace)
        if self._loop is not None:
            self._loop.remove_reader(self._core.wake_fd())

    def headers_for(self, body: bytes) -> list[tuple[str, str]]:
        """The headers the plugins set for `body` (RequestError for a body that is not JSON)."""
        parsed = parse_body(body)
        headers: dict[str, str] = {}
        for plugin in self.plugins:
            plugin.process(parsed, headers)
        metrics.SUCCESS.inc()
        return list(headers.items())

    def _drain(self) -> None:
        for event in self._core.drain():
            match event:
                case core.Log():
                    log.log(event.level, "%s", event.message)
                case core.Route():
                    try:
                        headers = self.headers_for(event.body)
                    except RequestError as error:
                        self._core.reject(event.id, error.status, error.body())
                    else:
                        self._core.route(event.id, None, None, False, False, headers)
                case core.RouteWithoutBody():
                    self._core.route(event.id, None, None, False, False)
                case core.Fail():
                    failure = RequestError(event.code, event.message)
                    self._core.reject(event.id, failure.status, failure.body())
                case core.Closed() | core.ResponseHeaders() | core.ResponseBody() | core.ResponseTrailers():
                    pass  # a header-only answer hears nothing of the response; a stream gone early
                case _:
                    assert_never(event)
