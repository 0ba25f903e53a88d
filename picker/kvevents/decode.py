"""Decoding of vLLM KV-cache event messages into typed values.

A publisher sends three ZMQ frames per message: the topic, an 8-byte big-endian sequence
number and a msgpack `EventBatch`. The batch is a positional array `[ts, events, dp_rank]`
(a map is accepted too). Each event is either a positional array tagged by its first element
(`["BlockStored", hashes, parent, ...]`, vLLM before PR #42892) or a tagged map
(`{"type": "BlockStored", ...}` with None-valued fields omitted, vLLM 0.26+). The value
classes below mirror the wire structs of vLLM's `kv_events.py`, field for field.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

_U64 = (1 << 64) - 1


class EventDecodeError(ValueError):
    """A KV-event message that does not follow vLLM's wire format."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks the engine added to its cache (one hash per full block of `token_ids`)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None  # one entry per block (LoRA name, cache_salt, mm ids)
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks the engine evicted from one medium."""

    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine reset its whole prefix cache."""


@dataclass(frozen=True, slots=True)
class UnknownEvent:
    """An event type this decoder does not know (a newer engine); carried so it can be counted."""

    type: str


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | UnknownEvent


@dataclass(frozen=True, slots=True)
class EventBatch:
    """The events of one message, in the order the engine produced them."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


@dataclass(frozen=True, slots=True)
class EventMessage:
    """One decoded ZMQ message."""

    topic: str
    seq: int
    batch: EventBatch


# Field order of the positional encoding (after the tag), as in vLLM's structs.
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
_STORED_REQUIRED = 4
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_REMOVED_REQUIRED = 1


def decode_seq(frame: bytes) -> int:
    """The signed 8-byte big-endian sequence number (-1 is the replay end marker)."""
    if len(frame) != 8:
        raise EventDecodeError(f"sequence frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def decode_message(frames: Sequence[bytes]) -> EventMessage:
    """Decode `[topic, seq, payload]` as received from a SUB socket."""
    if len(frames) != 3:
        raise EventDecodeError(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    topic, seq, payload = frames
    try:
        topic_text = bytes(topic).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise EventDecodeError("topic is not UTF-8") from exc
    return EventMessage(topic_text, decode_seq(seq), decode_batch(payload))


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one msgpack `EventBatch` (also the payload of a replayed message)."""
    try:
        # Arrays as tuples: the events keep them as they come, without a copy.
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise EventDecodeError(f"payload is not valid msgpack: {exc}") from exc
    if isinstance(raw, (list, tuple)):
        if len(raw) < 2:
            raise EventDecodeError("event batch array needs at least [ts, events]")
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        if "ts" not in raw or "events" not in raw:
            raise EventDecodeError("event batch map needs 'ts' and 'events'")
        ts, events, rank = raw["ts"], raw["events"], raw.get("data_parallel_rank")
    else:
        raise EventDecodeError(f"event batch must be an array or a map, got {type(raw).__name__}")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise EventDecodeError("batch ts must be a number")
    if not isinstance(events, (list, tuple)):
        raise EventDecodeError("batch events must be an array")
    return EventBatch(
        float(ts), tuple(_event(e, i) for i, e in enumerate(events)), _opt_int(rank, "data_parallel_rank")
    )


def _event(raw: Any, index: int) -> KVEvent:
    if isinstance(raw, (list, tuple)):
        if not raw or not isinstance(raw[0], str):
            raise EventDecodeError(f"event {index}: positional event must start with its type name")
        tag, values = raw[0], raw[1:]
        if tag == "BlockStored":
            return _block_stored(_positional(values, _STORED_FIELDS, _STORED_REQUIRED, tag, index), index)
        if tag == "BlockRemoved":
            return _block_removed(_positional(values, _REMOVED_FIELDS, _REMOVED_REQUIRED, tag, index), index)
    elif isinstance(raw, dict):
        kind = raw.get("type")
        if not isinstance(kind, str):
            raise EventDecodeError(f"event {index}: map event needs a string 'type'")
        tag = kind
        if tag == "BlockStored":
            return _block_stored(raw, index)
        if tag == "BlockRemoved":
            return _block_removed(raw, index)
    else:
        raise EventDecodeError(f"event {index}: must be an array or a map, got {type(raw).__name__}")
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return UnknownEvent(tag)


def _positional(values: Sequence[Any], names: tuple[str, ...], required: int, tag: str, index: int) -> dict[str, Any]:
    if len(values) < required:
        raise EventDecodeError(f"event {index}: {tag} needs at least {required} fields, got {len(values)}")
    return dict(zip(names, values))


def _block_stored(f: dict[str, Any], index: int) -> BlockStored:
    for name in ("block_hashes", "token_ids", "block_size"):  # a nil parent may be omitted from a map
        if name not in f:
            raise EventDecodeError(f"event {index}: BlockStored lacks '{name}'")
    hashes = _hashes(f["block_hashes"], index)
    parent = f.get("parent_block_hash")
    tokens = f["token_ids"]
    if not isinstance(tokens, (list, tuple)):
        raise EventDecodeError(f"event {index}: token_ids must be an array")
    try:
        array("I", tokens)  # validates every id as a uint32 in one C pass
    except (TypeError, OverflowError) as exc:
        raise EventDecodeError(f"event {index}: token_ids must be uint32 integers") from exc
    block_size = f["block_size"]
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise EventDecodeError(f"event {index}: block_size must be a positive integer")
    extra = f.get("extra_keys")
    if extra is not None and not isinstance(extra, (list, tuple)):
        raise EventDecodeError(f"event {index}: extra_keys must be an array")
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else _hash(parent, index),
        token_ids=tuple(tokens),
        block_size=block_size,
        lora_id=_opt_int(f.get("lora_id"), "lora_id"),
        medium=_opt_str(f.get("medium"), "medium"),
        lora_name=_opt_str(f.get("lora_name"), "lora_name"),
        extra_keys=None if extra is None else _frozen(extra),
        group_idx=_opt_int(f.get("group_idx"), "group_idx"),
        kv_cache_spec_kind=_opt_str(f.get("kv_cache_spec_kind"), "kv_cache_spec_kind"),
        kv_cache_spec_sliding_window=_opt_int(f.get("kv_cache_spec_sliding_window"), "kv_cache_spec_sliding_window"),
    )


def _block_removed(f: dict[str, Any], index: int) -> BlockRemoved:
    if "block_hashes" not in f:
        raise EventDecodeError(f"event {index}: BlockRemoved lacks 'block_hashes'")
    return BlockRemoved(
        block_hashes=_hashes(f["block_hashes"], index),
        medium=_opt_str(f.get("medium"), "medium"),
        group_idx=_opt_int(f.get("group_idx"), "group_idx"),
    )


def _hashes(raw: Any, index: int) -> tuple[int, ...]:
    if not isinstance(raw, (list, tuple)):
        raise EventDecodeError(f"event {index}: block_hashes must be an array")
    hashes = tuple(raw)
    if set(map(type, hashes)) == {int}:
        try:
            array("Q", hashes)  # every hash already a uint64 (the common case), checked in C
            return hashes
        except OverflowError:
            pass  # negative or wider ints: masked one by one
    return tuple(_hash(h, index) for h in hashes)


def _hash(raw: Any, index: int) -> int:
    """An engine block hash as a uint64: ints masked, digests as their last 8 bytes big-endian."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw & _U64
    if isinstance(raw, (bytes, bytearray)):
        if not raw:
            raise EventDecodeError(f"event {index}: empty block hash")
        return int.from_bytes(raw[-8:], "big")
    raise EventDecodeError(f"event {index}: block hash must be an integer or bytes, got {type(raw).__name__}")


def _frozen(value: Any) -> Any:
    """Arrays as tuples, all the way down, so a decoded event is immutable and hashable."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _frozen(v)) for k, v in value.items())
    return value


def _opt_int(raw: Any, name: str) -> int | None:
    if raw is None or (isinstance(raw, int) and not isinstance(raw, bool)):
        return raw
    raise EventDecodeError(f"{name} must be an integer or nil, got {type(raw).__name__}")


def _opt_str(raw: Any, name: str) -> str | None:
    if raw is None or isinstance(raw, str):
        return raw
    raise EventDecodeError(f"{name} must be a string or nil, got {type(raw).__name__}")
