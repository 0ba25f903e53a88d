"""Decoding vLLM KV-event messages: both event encodings, hash forms, and malformed input."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from picker.kvevents.decode import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    UnknownEvent,
    decode_batch,
    decode_message,
)
from tests.kv_event_encoder import ENCODINGS, encode_batch, encode_message

U64 = (1 << 64) - 1


def _frames(payload: object, seq: int = 7, topic: bytes = b"kv@10.0.0.1:8000@m") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), msgpack.packb(payload, use_bin_type=True)]


def test_positional_events_with_trailing_fields_omitted() -> None:
    message = decode_message(
        _frames(
            [
                1.5,
                [
                    ["BlockStored", [11, 12], None, [1, 2, 3, 4], 2, None, "GPU"],
                    ["BlockStored", [13], 12, [5, 6], 2, None, "CPU", "adapter", [["salt"]], 1],
                    ["BlockRemoved", [11], "GPU"],
                    ["BlockRemoved", [12]],
                    ["AllBlocksCleared"],
                ],
                3,
            ]
        )
    )
    assert (message.topic, message.seq) == ("kv@10.0.0.1:8000@m", 7)
    assert hash(message.batch)  # immutable all the way down
    assert message.batch == EventBatch(
        1.5,
        (
            BlockStored((11, 12), None, (1, 2, 3, 4), 2, None, "GPU"),
            BlockStored((13,), 12, (5, 6), 2, None, "CPU", "adapter", (("salt",),), 1),
            BlockRemoved((11,), "GPU"),
            BlockRemoved((12,)),
            AllBlocksCleared(),
        ),
        3,
    )


def test_map_events_and_map_batch() -> None:
    batch = decode_batch(
        msgpack.packb(
            {
                "ts": 2,
                "events": [
                    {
                        "type": "BlockStored",
                        "block_hashes": [1],
                        "parent_block_hash": None,
                        "token_ids": [9, 9],
                        "block_size": 2,
                        "medium": "GPU",
                        "lora_name": "a",
                        "kv_cache_spec_kind": "full_attention",
                    },
                    {"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU", "group_idx": 0},
                    {"type": "AllBlocksCleared"},
                ],
            }
        )
    )
    assert batch.ts == 2.0 and batch.data_parallel_rank is None
    stored, removed, cleared = batch.events
    assert stored == BlockStored(
        (1,), None, (9, 9), 2, medium="GPU", lora_name="a", kv_cache_spec_kind="full_attention"
    )
    assert removed == BlockRemoved((1,), "CPU", 0)
    assert cleared == AllBlocksCleared()


def test_byte_hashes_take_the_last_eight_bytes_big_endian() -> None:
    digest = bytes(range(32))
    parent = b"\x00" * 24 + (5).to_bytes(8, "big")
    batch = decode_batch(msgpack.packb([0.0, [["BlockStored", [digest], parent, [1], 1]]], use_bin_type=True))
    (event,) = batch.events
    assert event.block_hashes == (int.from_bytes(digest[-8:], "big"),)
    assert event.parent_block_hash == 5


def test_int_hashes_are_read_as_uint64() -> None:
    batch = decode_batch(msgpack.packb([0.0, [["BlockRemoved", [-1, U64, 3]]]]))
    assert batch.events[0].block_hashes == (U64, U64, 3)


def test_unknown_event_types_are_kept_as_unknown() -> None:
    batch = decode_batch(msgpack.packb([0.0, [["BlockPinned", [1]], {"type": "Future", "x": 1}]]))
    assert batch.events == (UnknownEvent("BlockPinned"), UnknownEvent("Future"))


@pytest.mark.parametrize(
    "payload, message",
    [
        (b"\xc1", "not valid msgpack"),
        (msgpack.packb(5), "array or a map"),
        (msgpack.packb([1.0]), "at least"),
        (msgpack.packb({"ts": 1}), "'ts' and 'events'"),
        (msgpack.packb(["x", []]), "ts must be a number"),
        (msgpack.packb([1.0, {"a": 1}]), "events must be an array"),
        (msgpack.packb([1.0, [7]]), "array or a map"),
        (msgpack.packb([1.0, [[]]]), "start with its type name"),
        (msgpack.packb([1.0, [{"block_hashes": []}]]), "string 'type'"),
        (msgpack.packb([1.0, [["BlockStored", [1], None, [1]]]]), "at least 4 fields"),
        (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "block_size": 1}]]), "token_ids"),
        (msgpack.packb([1.0, [["BlockStored", [1], None, [1, -2], 1]]]), "uint32"),
        (msgpack.packb([1.0, [["BlockStored", [1], None, [1, "a"], 1]]]), "uint32"),
        (msgpack.packb([1.0, [["BlockStored", [1], None, [1], 0]]]), "block_size"),
        (msgpack.packb([1.0, [["BlockStored", [1], None, [1], True]]]), "block_size"),
        (msgpack.packb([1.0, [["BlockStored", [1.5], None, [1], 1]]]), "integer or bytes"),
        (msgpack.packb([1.0, [["BlockStored", [b""], None, [1], 1]]]), "empty block hash"),
        (msgpack.packb([1.0, [["BlockStored", 3, None, [1], 1]]]), "block_hashes must be an array"),
        (msgpack.packb([1.0, [["BlockStored", [1], None, [1], 1, None, 5]]]), "medium"),
        (msgpack.packb([1.0, [["BlockRemoved"]]]), "at least 1 fields"),
        (msgpack.packb([1.0, [], "rank"]), "data_parallel_rank"),
    ],
)
def test_malformed_batches_raise_a_clear_error(payload: bytes, message: str) -> None:
    with pytest.raises(EventDecodeError, match=message):
        decode_batch(payload)


def test_malformed_frames_raise_a_clear_error() -> None:
    with pytest.raises(EventDecodeError, match="3 frames"):
        decode_message([b"kv@", b"\x00" * 8])
    with pytest.raises(EventDecodeError, match="8 bytes"):
        decode_message([b"kv@", b"\x00", msgpack.packb([0.0, []])])
    with pytest.raises(EventDecodeError, match="UTF-8"):
        decode_message([b"\xff", b"\x00" * 8, msgpack.packb([0.0, []])])


_hashes = st.lists(st.integers(0, U64), max_size=4).map(tuple)
_medium = st.sampled_from([None, "GPU", "CPU"])
_events = st.one_of(
    st.builds(
        BlockStored,
        block_hashes=_hashes,
        parent_block_hash=st.none() | st.integers(0, U64),
        token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=8).map(tuple),
        block_size=st.integers(1, 64),
        lora_id=st.none() | st.integers(0, 9),
        medium=_medium,
        lora_name=st.none() | st.text(max_size=5),
        extra_keys=st.none() | st.lists(st.none() | st.text(max_size=3), max_size=2).map(tuple),
        group_idx=st.none() | st.integers(0, 3),
        kv_cache_spec_kind=st.none() | st.sampled_from(["full_attention", "sliding_window"]),
        kv_cache_spec_sliding_window=st.none() | st.integers(1, 4096),
    ),
    st.builds(BlockRemoved, block_hashes=_hashes, medium=_medium, group_idx=st.none() | st.integers(0, 3)),
    st.just(AllBlocksCleared()),
)


@settings(max_examples=150, deadline=None)
@given(
    events=st.lists(_events, max_size=5),
    rank=st.none() | st.integers(0, 7),
    encoding=st.sampled_from(ENCODINGS),
    seq=st.integers(0, 2**63 - 1),
)
def test_encode_then_decode_round_trips(events: list, rank: int | None, encoding: str, seq: int) -> None:
    batch = EventBatch(12.25, tuple(events), rank)
    message = decode_message(encode_message("kv@p@m", seq, batch, encoding))  # type: ignore[arg-type]
    assert (message.topic, message.seq, message.batch) == ("kv@p@m", seq, batch)
    assert decode_batch(encode_batch(batch, encoding)) == batch  # type: ignore[arg-type]


_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=12)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type"]),
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=30,
)


@settings(max_examples=150, deadline=None)
@given(value=_msgpack_values)
def test_arbitrary_msgpack_never_raises_anything_but_decode_errors(value: object) -> None:
    try:
        decode_batch(msgpack.packb(value, use_bin_type=True))
    except EventDecodeError:
        pass


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=64))
def test_arbitrary_bytes_never_raise_anything_but_decode_errors(data: bytes) -> None:
    try:
        decode_batch(data)
    except EventDecodeError:
        pass


def test_fields_of_newer_versions_are_tolerated() -> None:
    """vLLM keeps appending fields (e.g. `locality`); positional extras and unknown keys are ignored."""
    batch = decode_batch(
        msgpack.packb(
            [
                0.0,
                [
                    [
                        "BlockStored",
                        [1],
                        None,
                        [7],
                        1,
                        None,
                        "GPU",
                        None,
                        None,
                        0,
                        "full_attention",
                        None,
                        "LOCAL",
                        "x",
                    ],
                    {"type": "BlockRemoved", "block_hashes": [1], "locality": "REMOTE"},
                ],
            ]
        )
    )
    assert batch.events == (
        BlockStored((1,), None, (7,), 1, medium="GPU", group_idx=0, kv_cache_spec_kind="full_attention"),
        BlockRemoved((1,)),
    )
