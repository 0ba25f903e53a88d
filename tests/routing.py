"""Routing in tests through the production path: a `Director` over a `Datastore` and a
`RuntimeHolder`, given request bodies and headers as the ext_proc stream gives them
(parse, admission, async and sync preparation, admitters, scheduling, pre-request hooks)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import orjson

from picker.config.runtime import RuntimeHolder
from picker.datastore.endpoint import Endpoint, EndpointMetrics, split_host_port
from picker.datastore.store import Datastore
from picker.framework.plugin import SchedulingResult
from picker.requestcontrol.director import Director, RoutedRequest

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def completion(prompt: str | Sequence[int], model: str = "m", **fields: Any) -> bytes:
    """A /v1/completions body (`prompt`: text or token ids)."""
    return orjson.dumps({"model": model, "prompt": prompt if isinstance(prompt, str) else list(prompt), **fields})


def chat(messages: Sequence[Mapping[str, str]], model: str = "m", **fields: Any) -> bytes:
    """A /v1/chat/completions body."""
    return orjson.dumps({"model": model, "messages": list(messages), **fields})


class Router:
    """A director over `datastore` (a new one by default) with `runtimes` (by default a holder
    of the default config on that datastore)."""

    def __init__(
        self, datastore: Datastore | None = None, runtimes: RuntimeHolder | None = None, **director: Any
    ) -> None:
        self.datastore = datastore if datastore is not None else Datastore()
        self.runtimes = runtimes if runtimes is not None else RuntimeHolder(self.datastore)
        self.director = Director(self.datastore, self.runtimes, **director)

    def set_endpoints(self, metrics: Mapping[str, EndpointMetrics] | Iterable[str]) -> None:
        """The pool is these `ip:port` addresses (with their metrics, when a mapping)."""
        addresses = list(metrics)
        self.datastore.set_endpoints(Endpoint(*split_host_port(address)) for address in addresses)
        if isinstance(metrics, Mapping):
            for address, values in metrics.items():
                self.datastore.set_metrics(address, values)

    async def route(
        self,
        body: bytes,
        request_id: str = "r1",
        path: str = COMPLETIONS,
        headers: Mapping[str, str] | None = None,
        subset: Sequence[str] | None = None,
    ) -> RoutedRequest:
        """Route one request as the ext_proc stream does; the caller finishes it."""
        all_headers = {":path": path, "x-request-id": request_id, **(headers or {})}
        return await self.director.route(body, all_headers, subset)

    async def pick(self, body: bytes, request_id: str = "r1", **route: Any) -> SchedulingResult:
        """Route one request (`route`: `route`'s other arguments), end it at once (its response
        not seen) and return its scheduling result."""
        routed = await self.route(body, request_id, **route)
        routed.finish()
        assert routed.result is not None
        return routed.result
