"""`--metrics-endpoint-auth`: who may read the metrics port, asked of the Kubernetes API server as
the reference EPP does (controller-runtime's WithAuthenticationAndAuthorization filter).

A request's bearer token is reviewed with a TokenReview (authentication; no token or a rejected
one: 401), then its user with a SubjectAccessReview for the non-resource URL: the request's path,
its lower-case HTTP method as the verb (`get` on `/metrics`; 403 when not allowed). The picker's
ServiceAccount needs `create` on tokenreviews and subjectaccessreviews; a scraper needs
`nonResourceURLs: [/metrics], verbs: [get]`.

Results are cached as the reference caches them (token reviews 1 min; allowed 5 min, denied
30 s) and concurrent reviews of the same question share one call, so a scrape costs no API call
once cached. The API calls run in worker threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from kubernetes import client

from picker.discovery.kube_errors import KUBE_API_ERRORS
from picker.telemetry.http import AccessDecision

log = logging.getLogger(__name__)

TOKEN_TTL = 60.0
ALLOWED_TTL = 300.0
DENIED_TTL = 30.0
REVIEW_TIMEOUT = 10.0  # seconds per API call, the reference's TokenAccessReviewTimeout
_MAX_ENTRIES = 4096  # beyond this, expired entries are dropped before adding one

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class ReviewedUser:
    """The user a token authenticates as, as a TokenReview reports it."""

    username: str
    uid: str
    groups: tuple[str, ...]
    extra: tuple[tuple[str, tuple[str, ...]], ...]


@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool
    reason: str


class ReviewCache(Generic[K, V]):
    """Answers kept for a time that depends on the answer; one review in flight per key."""

    def __init__(self, ttl: Callable[[V], float]) -> None:
        self._ttl = ttl
        self._entries: dict[K, tuple[float, V]] = {}
        self._in_flight: dict[K, asyncio.Future[V]] = {}

    async def get(self, key: K, review: Callable[[], Awaitable[V]]) -> V:
        """The cached answer for `key`, else `review()`'s (a failure is raised, not cached)."""
        entry = self._entries.get(key)
        if entry is not None and entry[0] > time.monotonic():
            return entry[1]
        pending = self._in_flight.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[V] = asyncio.get_running_loop().create_future()
        self._in_flight[key] = future
        try:
            value = await review()
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Exception as exc:
            future.set_exception(exc)
            future.exception()  # retrieved here, so no "never retrieved" warning without waiters
            raise
        finally:
            del self._in_flight[key]
        future.set_result(value)
        self._store(key, value)
        return value

    def _store(self, key: K, value: V) -> None:
        now = time.monotonic()
        if len(self._entries) >= _MAX_ENTRIES:
            self._entries = {k: e for k, e in self._entries.items() if e[0] > now}
        self._entries[key] = (now + self._ttl(value), value)


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, else None."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class KubeAccessReviewer:
    """Reviews metrics-port requests with TokenReview and SubjectAccessReview (see module doc)."""

    def __init__(self, api: client.ApiClient) -> None:
        self._api = api
        self._users: ReviewCache[str, ReviewedUser | None] = ReviewCache(lambda _: TOKEN_TTL)
        self._verdicts: ReviewCache[tuple[ReviewedUser, str, str], Verdict] = ReviewCache(
            lambda verdict: ALLOWED_TTL if verdict.allowed else DENIED_TTL
        )

    # The generated API classes are built at the first review, in its thread: importing their
    # modules at start would delay SERVING by a tenth of a second of CPU.
    @functools.cached_property
    def _authentication(self) -> client.AuthenticationV1Api:
        return client.AuthenticationV1Api(self._api)

    @functools.cached_property
    def _authorization(self) -> client.AuthorizationV1Api:
        return client.AuthorizationV1Api(self._api)

    async def decide(self, authorization: str | None, verb: str, path: str) -> AccessDecision:
        token = bearer_token(authorization)
        if token is None:
            log.debug("metrics endpoint: no bearer token for %s %s", verb, path)
            return AccessDecision(401, "Unauthorized")
        digest = hashlib.sha256(token.encode()).hexdigest()  # the token itself is not kept
        try:
            user = await self._users.get(digest, lambda: asyncio.to_thread(self._token_review, token))
        except KUBE_API_ERRORS as exc:
            log.error("metrics endpoint: authentication failed: %s", exc)
            return AccessDecision(500, "Authentication failed")
        if user is None:
            log.debug("metrics endpoint: token not authenticated for %s %s", verb, path)
            return AccessDecision(401, "Unauthorized")
        try:
            verdict = await self._verdicts.get(
                (user, verb, path), lambda: asyncio.to_thread(self._access_review, user, verb, path)
            )
        except KUBE_API_ERRORS as exc:
            log.error("metrics endpoint: authorization for user %s failed: %s", user.username, exc)
            return AccessDecision(500, f"Authorization for user {user.username} failed")
        if not verdict.allowed:
            log.debug("metrics endpoint: %s denied %s %s: %s", user.username, verb, path, verdict.reason)
            return AccessDecision(403, f"Authorization denied for user {user.username}")
        return AccessDecision(200)

    def _token_review(self, token: str) -> ReviewedUser | None:
        review = client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token))
        status = self._authentication.create_token_review(review, _request_timeout=REVIEW_TIMEOUT).status
        if status is None or not status.authenticated or status.user is None:
            return None
        user = status.user
        return ReviewedUser(
            username=user.username or "",
            uid=user.uid or "",
            groups=tuple(user.groups or ()),
            extra=tuple(sorted((key, tuple(values)) for key, values in (user.extra or {}).items())),
        )

    def _access_review(self, user: ReviewedUser, verb: str, path: str) -> Verdict:
        spec = client.V1SubjectAccessReviewSpec(
            user=user.username,
            uid=user.uid or None,
            groups=list(user.groups),
            extra={key: list(values) for key, values in user.extra} or None,
            non_resource_attributes=client.V1NonResourceAttributes(path=path, verb=verb),
        )
        review = client.V1SubjectAccessReview(spec=spec)
        status = self._authorization.create_subject_access_review(review, _request_timeout=REVIEW_TIMEOUT).status
        allowed = status is not None and bool(status.allowed) and not status.denied
        return Verdict(allowed, (status.reason or "") if status is not None else "")
