"""What makes a picker process one of `--workers`: where its health and metrics answer its parent."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerRole:
    """One worker's private addresses: unix sockets in the parent's run directory."""

    index: int
    health_address: str  # gRPC address of its health service: `unix:/path`
    metrics_socket: str  # path of the unix socket its metrics app listens on
