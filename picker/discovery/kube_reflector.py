"""List-then-watch one kind of Kubernetes object in a thread, keeping a local copy.

The official client blocks, so each `KubeReflector` runs its list and watch calls in its own
daemon thread and hands every new full copy of the objects to the event loop through
`loop.call_soon_threadsafe`. It behaves like client-go's reflector:

- the first delivery is the complete list; later ones follow each watch event;
- a dropped watch (timeout, API-server restart, network error) resumes from the last
  resourceVersion, so the local copy survives the outage unchanged;
- 410 Gone (the resourceVersion was compacted away) triggers a relist, delivered whole, so
  objects that still exist are never dropped in between;
- a missing resource type (404, e.g. a CRD that is not installed) is retried slowly and quietly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import threading
from collections.abc import Callable, Iterator
from typing import Any

import urllib3
from kubernetes.client.exceptions import ApiException
from kubernetes.watch import watch as kube_watch

log = logging.getLogger(__name__)

# The client ships py.typed but leaves this helper unannotated: it yields the response's lines,
# decoded as UTF-8.
_iter_resp_lines: Callable[[urllib3.BaseHTTPResponse], Iterator[str]] = kube_watch.iter_resp_lines

Objects = dict[str, dict[str, Any]]
# Calls one list or watch endpoint with the given query arguments; returns the unread response.
ListCall = Callable[..., urllib3.BaseHTTPResponse]

_RETRY_MIN = 0.1
_RETRY_MAX = 2.0
_MISSING_RESOURCE_RETRY = 30.0
# Server-side watch timeout, randomised like client-go's so watches do not all renew at once.
_WATCH_TIMEOUT = (240, 360)
_CONNECT_TIMEOUT = 5.0


class _RelistNeededError(Exception):
    """The watch's resourceVersion is gone: list again."""


def object_key(metadata: dict[str, Any], *, across_namespaces: bool) -> str:
    """An object's key in a reflector's copy: its name, or `namespace/name` for a watch across
    namespaces (where names repeat)."""
    name = str(metadata["name"])
    return f"{metadata.get('namespace', '')}/{name}" if across_namespaces else name


class KubeReflector:
    """Keeps `{name: object}` for one list call (`{namespace/name: object}` with
    `across_namespaces`) and delivers copies to `on_change` on the loop."""

    def __init__(
        self,
        name: str,
        list_call: ListCall,
        on_change: Callable[[Objects], None],
        loop: asyncio.AbstractEventLoop,
        *,
        across_namespaces: bool = False,
    ) -> None:
        self.name = name
        self._across_namespaces = across_namespaces
        self._list_call = list_call
        self._on_change = on_change
        self._loop = loop
        self._objects: Objects = {}
        self._resource_version: str | None = None
        self._stopped = threading.Event()
        self._response: urllib3.BaseHTTPResponse | None = None
        self._thread = threading.Thread(target=self._run, name=f"kube-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end and interrupt a blocked watch read; does not wait."""
        self._stopped.set()
        response = self._response
        if response is not None:
            # The connection may already be gone, in which case there is nothing to interrupt.
            with contextlib.suppress(Exception):
                response.shutdown()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        delay = _RETRY_MIN
        while not self._stopped.is_set():
            try:
                if self._resource_version is None:
                    self._list()
                self._watch()
                delay = _RETRY_MIN
            except _RelistNeededError:
                self._resource_version = None
            except ApiException as exc:
                if exc.status == 410:
                    self._resource_version = None
                    continue
                if exc.status == 404:
                    log.info("%s: resource not served (404); retrying in %.0f s", self.name, _MISSING_RESOURCE_RETRY)
                    self._stopped.wait(_MISSING_RESOURCE_RETRY)
                    continue
                log.warning("%s: API error %s %s; retrying", self.name, exc.status, exc.reason)
                delay = self._backoff(delay)
            except Exception as exc:  # connection refused/reset, timeouts, TLS: keep the copy, retry
                if self._stopped.is_set():
                    break
                log.warning("%s: watch interrupted (%s); retrying", self.name, type(exc).__name__)
                delay = self._backoff(delay)
            finally:
                self._response = None

    def _backoff(self, delay: float) -> float:
        self._stopped.wait(delay * random.uniform(0.8, 1.2))
        return min(delay * 2, _RETRY_MAX)

    def _list(self) -> None:
        response = self._list_call(_request_timeout=(_CONNECT_TIMEOUT, 60.0))
        try:
            body = json.loads(response.data)
        finally:
            response.release_conn()
        objects: Objects = {}
        for item in body.get("items") or ():
            objects[object_key(item["metadata"], across_namespaces=self._across_namespaces)] = item
        self._objects = objects
        self._resource_version = body["metadata"]["resourceVersion"]
        self._deliver()

    def _watch(self) -> None:
        timeout = random.randint(*_WATCH_TIMEOUT)
        response = self._list_call(
            watch=True,
            resource_version=self._resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=timeout,
            _request_timeout=(_CONNECT_TIMEOUT, timeout + 30.0),
        )
        self._response = response
        if self._stopped.is_set():  # stop() raced with the connect
            return
        try:
            for line in _iter_resp_lines(response):
                if self._stopped.is_set():
                    return
                if line:
                    self._apply(json.loads(line))
        finally:
            response.release_conn()

    def _apply(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        obj: dict[str, Any] = event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _RelistNeededError()
            raise ApiException(status=obj.get("code"), reason=obj.get("message"))
        metadata: dict[str, Any] = obj.get("metadata") or {}
        self._resource_version = metadata.get("resourceVersion", self._resource_version)
        if kind == "BOOKMARK":
            return
        if kind == "DELETED":
            if metadata.get("name") is not None:  # a nameless object was never stored
                self._objects.pop(object_key(metadata, across_namespaces=self._across_namespaces), None)
        elif kind in ("ADDED", "MODIFIED"):
            self._objects[object_key(metadata, across_namespaces=self._across_namespaces)] = obj
        else:
            return
        self._deliver()

    def _deliver(self) -> None:
        snapshot = dict(self._objects)
        try:
            self._loop.call_soon_threadsafe(self._on_change, snapshot)
        except RuntimeError:  # the loop closed under us: the picker is shutting down
            self._stopped.set()
