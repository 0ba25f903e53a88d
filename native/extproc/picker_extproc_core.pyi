"""picker's ext_proc transport core (native/extproc): see native/README.md."""

from typing import TypeAlias, final

@final
class Route:
    """Pick for this body: answer with `Core.route` or `Core.reject`."""

    @property
    def id(self) -> int: ...
    @property
    def body(self) -> bytes:
        """A new bytes object at each read."""
    @property
    def headers(self) -> dict[str, str]:
        """Lower-case names; a new dict at each read."""
    @property
    def subset(self) -> list[str] | None: ...

@final
class RouteWithoutBody:
    """Pick without a body (headers-only requests, STREAMED mode without the early body):
    answer with `Core.route` or `Core.reject`."""

    @property
    def id(self) -> int: ...
    @property
    def subset(self) -> list[str] | None: ...

@final
class Fail:
    """The stream broke the protocol (or a limit): answer with `Core.reject` (its error body)."""

    @property
    def id(self) -> int: ...
    @property
    def code(self) -> str: ...
    @property
    def message(self) -> str: ...

@final
class ResponseHeaders:
    """The response's headers: its status (0 when not digits), the endpoint that served it."""

    @property
    def id(self) -> int: ...
    @property
    def status(self) -> int: ...
    @property
    def served(self) -> str | None: ...
    @property
    def content_type(self) -> str: ...
    @property
    def end_of_stream(self) -> bool: ...

@final
class ResponseBody:
    """Response body bytes since the last such event (chunks coalesced unless `Core.route` asked
    for each); `asks`: answer with `Core.metadata` (the stream's answer to this chunk waits)."""

    @property
    def id(self) -> int: ...
    @property
    def data(self) -> bytes:
        """A new bytes object at each read."""
    @property
    def end_of_stream(self) -> bool: ...
    @property
    def served(self) -> str | None: ...
    @property
    def first_byte_at(self) -> float | None:
        """When the core saw the first body byte, on `time.monotonic()`'s clock."""
    @property
    def asks(self) -> bool: ...

@final
class ResponseTrailers:
    """The response's trailers passed (its end); `asks` as for `ResponseBody`."""

    @property
    def id(self) -> int: ...
    @property
    def asks(self) -> bool: ...

@final
class Closed:
    """The stream ended before its response did: `error` None (the proxy half-closed) or
    "cancelled"."""

    @property
    def id(self) -> int: ...
    @property
    def error(self) -> str | None: ...

@final
class Log:
    """A line for Python's log (`level` as Python's logging levels)."""

    @property
    def level(self) -> int: ...
    @property
    def message(self) -> str: ...

# The events about one stream (`id`), and every event `Core.drain` returns.
StreamEvent: TypeAlias = Route | RouteWithoutBody | Fail | ResponseHeaders | ResponseBody | ResponseTrailers | Closed
Event: TypeAlias = StreamEvent | Log

class Core:
    """One ext_proc server: `serve` starts it on its own thread; the asyncio loop watches
    `wake_fd`, calls `drain` for the events, and answers with `route` / `reject`."""

    def __init__(self, max_body_bytes: int, honour_subset_hint: bool, close_wait_seconds: float) -> None: ...
    def serve(
        self,
        address: str,
        *,
        reuse_port: bool,
        max_receive_bytes: int,
        tls_key: bytes | None = None,
        tls_cert: bytes | None = None,
        cert_dir: str | None = None,
        health_services: list[str] = ...,
    ) -> int: ...
    def wake_fd(self) -> int: ...
    def drain(self) -> list[Event]: ...
    def route(
        self,
        id: int,
        destination: str | None,
        body: bytes | None,
        chunks: bool,
        metadata: bool,
        headers: list[tuple[str, str]] = ...,
    ) -> bool: ...
    def metadata(self, id: int, values: dict[str, dict[str, float]] | None) -> bool: ...
    def reject(self, id: int, status: int, body: bytes) -> bool: ...
    def streams_active(self) -> int: ...
    def enter_graceful_shutdown(self) -> None: ...
    def stop(self, grace: float) -> None: ...

class Scraper:
    """The metrics scraper (src/scrape.rs): every target's page scraped on its own thread; the
    sample lines of the target's families cross only when they changed."""

    def __init__(self, *, interval: float, timeout: float, max_concurrency: int, max_page_bytes: int) -> None: ...
    def add(self, id: int, ip: str, port: int, path: str, families: list[bytes]) -> None:
        """Scrape `http://ip:port{path}` as target `id`, reading the lines of `families`."""
    def remove(self, id: int) -> None: ...
    def drain(
        self,
    ) -> tuple[list[tuple[int, bytes, int, float, float]], list[tuple[int, float, float]], list[tuple[int, str, str]]]:
        """Since the last call: changed `(id, lines, page_bytes, at, took)`, unchanged
        `(id, at, took)` and failed `(id, reason, detail)` scrapes; `at` on `time.monotonic()`'s
        clock, `took` in seconds."""
    def stop(self) -> None: ...

def wanted_lines(page: bytes, families: list[bytes]) -> bytes:
    """The sample lines of `families` in `page`, as `Scraper` picks them."""
