"""Encoding of KV events in vLLM's wire format: the inverse of `decode`.

For publishers written in Python (tests, tools): `encode_message(topic, seq, batch, encoding)`
gives the three ZMQ frames a vLLM publisher would send. `encoding` chooses how events are
written: "positional" (tagged arrays, trailing None fields dropped) or "map" (tagged maps,
None fields omitted). The batch itself is always the positional `[ts, events, dp_rank]`.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Literal

import msgpack

from picker.kvevents.decode import EventBatch, KVEvent, UnknownEvent

Encoding = Literal["positional", "map"]
ENCODINGS: tuple[Encoding, ...] = ("positional", "map")


def encode_event(event: KVEvent, encoding: Encoding = "positional") -> Any:
    """One event as msgpack-ready data."""
    if isinstance(event, UnknownEvent):
        tag, values = event.type, []
    else:
        tag = type(event).__name__
        values = [(f.name, _wire(getattr(event, f.name))) for f in fields(event)]
    if encoding == "map":
        out: dict[str, Any] = {"type": tag}
        out.update((name, value) for name, value in values if value is not None)
        return out
    if encoding != "positional":
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
    positional = [value for _, value in values]
    while positional and positional[-1] is None:
        positional.pop()
    return [tag, *positional]


def encode_batch(batch: EventBatch, encoding: Encoding = "positional") -> bytes:
    """The msgpack payload of one batch."""
    events = [encode_event(e, encoding) for e in batch.events]
    return msgpack.packb([batch.ts, events, batch.data_parallel_rank], use_bin_type=True)


def encode_seq(seq: int) -> bytes:
    """A sequence number frame (8 bytes, big-endian, signed so -1 ends a replay)."""
    return seq.to_bytes(8, "big", signed=True)


def encode_message(topic: str, seq: int, batch: EventBatch, encoding: Encoding = "positional") -> list[bytes]:
    """The three frames of one published message."""
    return [topic.encode(), encode_seq(seq), encode_batch(batch, encoding)]


def _wire(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
