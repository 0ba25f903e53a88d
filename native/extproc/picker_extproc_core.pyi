"""picker's ext_proc transport core (native/extproc): see native/README.md."""

from typing import Any, Final

ROUTE: Final[int]
ROUTE_WITHOUT_BODY: Final[int]
FAIL: Final[int]
RESPONSE_HEADERS: Final[int]
RESPONSE_BODY: Final[int]
RESPONSE_TRAILERS: Final[int]
CLOSED: Final[int]
LOG: Final[int]

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
    def drain(self) -> list[tuple[Any, ...]]: ...
    def route(self, id: int, destination: str, body: bytes | None, chunks: bool, metadata: bool) -> bool: ...
    def metadata(self, id: int, values: dict[str, dict[str, float]] | None) -> bool: ...
    def reject(self, id: int, status: int, body: bytes) -> bool: ...
    def streams_active(self) -> int: ...
    def enter_graceful_shutdown(self) -> None: ...
    def stop(self, grace: float) -> None: ...
