"""Leader election on a coordination.k8s.io/v1 Lease (`--ha-enable-leader-election`), as the
reference EPP's controller-runtime manager does it: the Lease
`epp-<namespace>-<pool>.gateway-api-inference-extension.sigs.k8s.io` in the pool's namespace,
15 s lease duration, 10 s renew deadline, 2 s retry period, released on a clean stop.

A candidate takes the Lease when it is free or when its record has not changed for the lease
duration as this process observed it (client-go's rule: local observation times, so clock skew
between replicas does not matter). The leader renews every retry period; if no renewal succeeds
within the renew deadline it stops leading (and stops being ready) before anyone else may take
over, then competes again as a candidate.

One deviation from the reference: there a lost Lease ends the process (the pod restarts); here it
only ends leadership, keeping the warm state (endpoints, prefix indexes) for the next term.

Every API call runs in a worker thread (`asyncio.to_thread`); nothing here touches the request
path, which reads `is_leader` only.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import re
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from kubernetes import client

from picker.discovery.kube_errors import KUBE_API_ERRORS

log = logging.getLogger(__name__)

LEASE_SUFFIX = "gateway-api-inference-extension.sigs.k8s.io"
_JITTER = 1.2  # candidates retry after retry_period × [1, 1.2), as client-go's wait.JitterUntil
# The reference's name for an endpoint-selector deployment: the pod name minus its two hashes.
_DEPLOYMENT_OF_POD = re.compile(r"^(.+)-[a-z0-9]+-[a-z0-9]+$")


class LeaseConfigError(ValueError):
    """Leader election cannot be set up as asked (no pool to name its Lease after)."""


@dataclass(frozen=True, slots=True)
class LeaseTiming:
    """controller-runtime's leader election defaults, in seconds (the reference sets none)."""

    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """What a Lease's spec says, compared between reads to see whether its holder still renews."""

    holder: str
    duration_seconds: int
    acquire_time: datetime | None
    renew_time: datetime | None
    transitions: int


def lease_record(spec: client.V1LeaseSpec | None) -> LeaseRecord:
    if spec is None:
        return LeaseRecord("", 0, None, None, 0)
    return LeaseRecord(
        holder=spec.holder_identity or "",
        duration_seconds=spec.lease_duration_seconds or 0,
        acquire_time=spec.acquire_time,
        renew_time=spec.renew_time,
        transitions=spec.lease_transitions or 0,
    )


def lease_name(namespace: str, pool_name: str) -> str:
    """The reference's Lease name: unique per EPP deployment."""
    return f"epp-{namespace}-{pool_name}.{LEASE_SUFFIX}"


def elected_name(pool_name: str | None, pod_name: str | None) -> str:
    """What the Lease is named after, as the reference: the pool, or for an endpoint selector
    (no pool) the Deployment, read from $POD_NAME."""
    if pool_name:
        return pool_name
    if not pod_name:
        raise LeaseConfigError(
            "--ha-enable-leader-election: with --endpoint-selector the Lease is named after the "
            "Deployment, read from $POD_NAME, which is not set"
        )
    match = _DEPLOYMENT_OF_POD.match(pod_name)
    if match is None:
        raise LeaseConfigError(
            f"--ha-enable-leader-election: cannot read a Deployment name from $POD_NAME {pod_name!r}"
        )
    return match.group(1)


def candidate_identity() -> str:
    """controller-runtime's identity: the host name and a UUID, unique per process."""
    return f"{socket.gethostname()}_{uuid.uuid4()}"


class LeaderElector:
    """Competes for one Lease until stopped; `is_leader` says whether this process leads now."""

    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        name: str,
        identity: str | None = None,
        timing: LeaseTiming = LeaseTiming(),
    ) -> None:
        self.namespace = namespace
        self.name = name
        self.identity = identity or candidate_identity()
        self.timing = timing
        self._api = api
        self._leading = False
        self._observed: LeaseRecord | None = None
        self._observed_at = 0.0  # monotonic time the observed record last changed
        self._task: asyncio.Task[None] | None = None

    # Built at the first attempt, in its thread: importing the generated API's module on the
    # event loop would hold the start (and this replica's readiness) for a tenth of a second.
    @functools.cached_property
    def _leases(self) -> client.CoordinationV1Api:
        return client.CoordinationV1Api(self._api)

    def is_leader(self) -> bool:
        return self._leading

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="leader-election")
        log.info("leader election: competing for Lease %s/%s as %s", self.namespace, self.name, self.identity)

    async def stop(self) -> None:
        """Stop competing; a leader releases the Lease so a standby takes over at once (the
        reference's LeaderElectionReleaseOnCancel)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._leading:
            self._leading = False
            try:
                await asyncio.to_thread(self._release)
            except KUBE_API_ERRORS as exc:
                log.warning("leader election: could not release the Lease: %s", exc)

    async def _run(self) -> None:
        last_renewal = 0.0
        while True:
            if self._leading:
                # A renewal must land before the renew deadline, whatever the API server does.
                remaining = last_renewal + self.timing.renew_deadline - time.monotonic()
                renewed = remaining > 0 and await self._attempt(timeout=remaining)
                if renewed:
                    last_renewal = time.monotonic()
                elif time.monotonic() - last_renewal >= self.timing.renew_deadline:
                    self._leading = False
                    log.warning("leader election: lost the Lease (not renewed for %.0fs)", self.timing.renew_deadline)
                    continue  # at once a candidate: the Lease may still hold this identity
                await asyncio.sleep(self.timing.retry_period)
            else:
                if await self._attempt(timeout=self.timing.renew_deadline):
                    last_renewal = time.monotonic()
                    self._leading = True
                    log.info(
                        "leader election: this instance is now the leader (Lease %s/%s)", self.namespace, self.name
                    )
                    continue
                await asyncio.sleep(self.timing.retry_period * random.uniform(1.0, _JITTER))

    async def _attempt(self, timeout: float) -> bool:
        """One try to acquire or renew, bounded by `timeout` seconds; failures count as no."""
        try:
            return await asyncio.wait_for(asyncio.to_thread(self._try_acquire_or_renew, timeout), timeout)
        except TimeoutError:
            log.warning("leader election: the API server did not answer within %.1fs", timeout)
        except KUBE_API_ERRORS as exc:
            log.warning("leader election: %s", exc)
        return False

    def _try_acquire_or_renew(self, timeout: float) -> bool:
        """client-go's tryAcquireOrRenew, blocking (a worker thread runs it)."""
        now = datetime.now(UTC)
        try:
            lease = self._leases.read_namespaced_lease(self.name, self.namespace, _request_timeout=timeout)
        except client.ApiException as exc:
            if exc.status != 404:
                raise
            body = client.V1Lease(
                metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace),
                spec=self._spec(now, now, 0),
            )
            return self._write(
                lambda: self._leases.create_namespaced_lease(self.namespace, body, _request_timeout=timeout)
            )
        record = lease_record(lease.spec)
        if record != self._observed:
            self._observed, self._observed_at = record, time.monotonic()
        held_by_other = record.holder not in ("", self.identity)
        if held_by_other and time.monotonic() < self._observed_at + record.duration_seconds:
            return False
        if record.holder == self.identity:
            lease.spec = self._spec(record.acquire_time or now, now, record.transitions)
        else:
            lease.spec = self._spec(now, now, record.transitions + 1)
        # The read's resourceVersion makes this a compare-and-swap: a rival's write wins with 409.
        return self._write(
            lambda: self._leases.replace_namespaced_lease(self.name, self.namespace, lease, _request_timeout=timeout)
        )

    def _write(self, write: Callable[[], client.V1Lease]) -> bool:
        try:
            written = write()
        except client.ApiException as exc:
            if exc.status == 409:  # another candidate wrote first
                return False
            raise
        self._observed = lease_record(written.spec)
        self._observed_at = time.monotonic()
        return True

    def _spec(self, acquired: datetime, renewed: datetime, transitions: int) -> client.V1LeaseSpec:
        return client.V1LeaseSpec(
            holder_identity=self.identity,
            lease_duration_seconds=int(self.timing.lease_duration),
            acquire_time=acquired,
            renew_time=renewed,
            lease_transitions=transitions,
        )

    def _release(self) -> None:
        """client-go's release: no holder, a one-second duration; transitions kept."""
        timeout = self.timing.retry_period
        lease = self._leases.read_namespaced_lease(self.name, self.namespace, _request_timeout=timeout)
        record = lease_record(lease.spec)
        if record.holder != self.identity:
            return
        now = datetime.now(UTC)
        lease.spec = client.V1LeaseSpec(
            lease_duration_seconds=1, acquire_time=now, renew_time=now, lease_transitions=record.transitions
        )
        self._leases.replace_namespaced_lease(self.name, self.namespace, lease, _request_timeout=timeout)
        log.info("leader election: released Lease %s/%s", self.namespace, self.name)
