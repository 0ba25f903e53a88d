"""gRPC health (grpc.health.v1) with the reference EPP's semantics.

Without leader election every service name is answered alike (the reference chart probes
`inference-extension`; `liveness`, `readiness`, `""` and the ext_proc service name are the
others): SERVING once the datastore has synced. With leader election, `liveness` is always
SERVING, `readiness`, `""` and the ext_proc service need the pool synced and this replica
leading, and any other name is SERVICE_UNKNOWN.

One addition of the picker: after SIGTERM (`draining`) every name but `liveness` answers
NOT_SERVING, so proxies and Kubernetes stop sending new requests before the server stops.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from picker.telemetry.logging import TRACE

log = logging.getLogger(__name__)

_SERVING = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
_NOT_SERVING = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
_UNKNOWN = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)

LIVENESS = "liveness"
READINESS = "readiness"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# The names that need readiness (and leadership) when leader election is on.
READINESS_SERVICES = frozenset({READINESS, "", EXT_PROC_SERVICE})


class HealthServicer(health_pb2_grpc.HealthServicer):  # type: ignore[misc]  # generated, untyped base
    """Answers Check and List at call time from `synced()` (the datastore has its endpoints),
    `draining()` and, with leader election, `is_leader()` (None: leader election is off)."""

    def __init__(
        self,
        synced: Callable[[], bool],
        draining: Callable[[], bool] = lambda: False,
        is_leader: Callable[[], bool] | None = None,
    ) -> None:
        self.synced = synced
        self.draining = draining
        self.is_leader = is_leader

    def status(self, service: str) -> health_pb2.HealthCheckResponse:
        """The answer for `service`, as Check gives it."""
        synced = self.synced()
        if self.is_leader is None:
            serving = synced if service == LIVENESS else synced and not self.draining()
        elif service == LIVENESS:
            serving = True  # a follower must not be restarted for not leading
        elif service in READINESS_SERVICES:
            serving = synced and self.is_leader() and not self.draining()
        else:
            log.info("gRPC health check for an unknown service %r", service)
            return _UNKNOWN
        if not serving:
            log.info("gRPC health check not serving: service %r, synced %s", service, synced)
            return _NOT_SERVING
        if log.isEnabledFor(TRACE):
            log.log(TRACE, "gRPC health check serving: service %r", service)
        return _SERVING

    async def Check(  # noqa: N802 (gRPC method name)
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        return self.status(request.service)

    async def List(  # noqa: N802 (gRPC method name)
        self, request: health_pb2.HealthListRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthListResponse:
        """As the reference: the ext_proc service, and with leader election the probes' names."""
        services = [EXT_PROC_SERVICE] + ([LIVENESS, READINESS] if self.is_leader is not None else [])
        return health_pb2.HealthListResponse(statuses={name: self.status(name) for name in services})

    async def Watch(  # noqa: N802 (as the reference: unimplemented)
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Watch is not implemented")
