"""The messages picker processes exchange (proto/picker/state/v1/state.proto) as values."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from picker.state.v1 import state_pb2


class BadMessageError(ValueError):
    """Bytes that are not a usable v1 StateBatch."""


@dataclass(frozen=True, slots=True)
class IndexInsert:
    """`endpoint` now holds `hashes` in the approximate prefix index named `index`."""

    index: str
    endpoint: str
    hashes: Sequence[int]
    capacity: int | None  # the endpoint's LRU capacity when known (autoTune)
    count_reuse: bool


@dataclass(frozen=True, slots=True)
class EndpointInFlight:
    """Requests (and their prompt tokens) a process has in flight at `endpoint`."""

    endpoint: str
    requests: int
    tokens: int


@dataclass(frozen=True, slots=True)
class InFlightLoad:
    """A process's whole in-flight load (endpoints not listed have none), valid for `expires_ms`
    after its stream entry was written."""

    endpoints: Sequence[EndpointInFlight]
    expires_ms: int


@dataclass(frozen=True, slots=True)
class TtftObservation:
    """One response's lesson for the TTFT model (`TtftModel.observe`'s arguments)."""

    endpoint: str
    ttft_seconds: float
    prompt_tokens: int
    cached_tokens: int
    work_ahead_tokens: float
    remote_prefill: bool = False


@dataclass(frozen=True, slots=True)
class PrefillQueued:
    """A pick queued `tokens` uncached prompt tokens at `endpoint` (`TtftModel.add_backlog`)."""

    endpoint: str
    tokens: float


@dataclass(frozen=True, slots=True)
class StateBatch:
    """One stream entry: a process's updates, numbered per origin."""

    origin: str
    sequence: int
    inserts: Sequence[IndexInsert]
    in_flight: InFlightLoad | None = None  # None: unchanged since the origin's last report
    observations: Sequence[TtftObservation] = ()
    prefills: Sequence[PrefillQueued] = ()


def encode_batch(batch: StateBatch) -> bytes:
    message = state_pb2.StateBatch(origin=batch.origin, sequence=batch.sequence)
    if batch.in_flight is not None:
        load = message.in_flight
        load.SetInParent()  # present even when nothing is in flight: that is the news
        load.expires_ms = batch.in_flight.expires_ms
        for entry in batch.in_flight.endpoints:
            load.endpoints.add(endpoint=entry.endpoint, requests=entry.requests, tokens=entry.tokens)
    for o in batch.observations:
        message.ttft_observations.add(
            endpoint=o.endpoint,
            ttft_seconds=o.ttft_seconds,
            prompt_tokens=o.prompt_tokens,
            cached_tokens=o.cached_tokens,
            work_ahead_tokens=o.work_ahead_tokens,
            remote_prefill=o.remote_prefill,
        )
    for p in batch.prefills:
        message.prefills_queued.add(endpoint=p.endpoint, tokens=p.tokens)
    for insert in batch.inserts:
        message.index_inserts.add(
            index=insert.index,
            endpoint=insert.endpoint,
            block_hashes=insert.hashes,
            capacity=insert.capacity or 0,
            count_reuse=insert.count_reuse,
        )
    return message.SerializeToString()


def decode_batch(data: bytes) -> StateBatch:
    """The batch in `data`; fields a newer version added are ignored. Raises BadMessageError."""
    message = state_pb2.StateBatch()
    try:
        message.ParseFromString(data)
    except DecodeError as error:
        raise BadMessageError(f"not a StateBatch: {error}") from None
    if not message.origin:
        raise BadMessageError("a StateBatch without an origin")
    inserts = []
    for insert in message.index_inserts:
        if not insert.endpoint:
            raise BadMessageError("an IndexInsert without an endpoint")
        inserts.append(
            IndexInsert(
                insert.index,
                insert.endpoint,
                tuple(insert.block_hashes),
                insert.capacity or None,
                insert.count_reuse,
            )
        )
    in_flight = None
    if message.HasField("in_flight"):
        load = message.in_flight
        if any(not e.endpoint for e in load.endpoints):
            raise BadMessageError("an EndpointInFlight without an endpoint")
        in_flight = InFlightLoad(
            tuple(EndpointInFlight(e.endpoint, e.requests, e.tokens) for e in load.endpoints), load.expires_ms
        )
    observations = tuple(
        TtftObservation(
            o.endpoint, o.ttft_seconds, o.prompt_tokens, o.cached_tokens, o.work_ahead_tokens, o.remote_prefill
        )
        for o in message.ttft_observations
    )
    prefills = tuple(PrefillQueued(p.endpoint, p.tokens) for p in message.prefills_queued)
    if any(not o.endpoint for o in observations) or any(not p.endpoint for p in prefills):
        raise BadMessageError("a TTFT update without an endpoint")
    return StateBatch(message.origin, message.sequence, inserts, in_flight, observations, prefills)
