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
class StateBatch:
    """One stream entry: a process's updates, numbered per origin."""

    origin: str
    sequence: int
    inserts: Sequence[IndexInsert]


def encode_batch(batch: StateBatch) -> bytes:
    message = state_pb2.StateBatch(origin=batch.origin, sequence=batch.sequence)
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
    return StateBatch(message.origin, message.sequence, inserts)
