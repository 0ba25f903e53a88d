"""gRPC health (grpc.health.v1) with the reference EPP's service names."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

_SERVING = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
_NOT_SERVING = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
_UNKNOWN = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)

# Services that follow readiness; `liveness` is always SERVING while the process answers.
READINESS_SERVICES = frozenset({"readiness", "envoy.service.ext_proc.v3.ExternalProcessor", ""})


class HealthServicer(health_pb2_grpc.HealthServicer):  # type: ignore[misc]  # generated, untyped base
    """Answers Check from `ready()`, evaluated at call time (e.g. the datastore has synced)."""

    def __init__(self, ready: Callable[[], bool]) -> None:
        self.ready = ready

    async def Check(  # noqa: N802 (gRPC method name)
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        if request.service == "liveness":
            return _SERVING
        if request.service in READINESS_SERVICES:
            return _SERVING if self.ready() else _NOT_SERVING
        return _UNKNOWN

    async def Watch(  # noqa: N802 (as the reference: unimplemented)
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Watch is not implemented")
