"""The state-sync schema (proto/picker/state/v1/state.proto): the committed generated code
matches it, and a message from a newer version (fields this one does not know) is applied."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from picker.state.messages import BadMessageError, IndexInsert, StateBatch, decode_batch, encode_batch
from picker.state.v1 import state_pb2

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("picker/state/v1/state_pb2.py", "picker/state/v1/state_pb2.pyi")


def test_the_committed_generated_code_matches_the_schema(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run([str(ROOT / "tools/generate-proto.sh"), str(tmp_path)], check=True, env=env, timeout=60)
    for name in GENERATED:
        assert (tmp_path / name).read_text() == (ROOT / name).read_text(), (
            f"{name} no longer matches proto/: run tools/generate-proto.sh and commit the result"
        )


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _unknown_fields(number: int) -> bytes:
    """A varint field and a length-delimited one numbered from `number`: what a newer picker
    could add."""
    text = b"from a newer picker"
    return _varint(number << 3) + _varint(12345) + _varint(((number + 1) << 3) | 2) + _varint(len(text)) + text


def test_a_batch_with_fields_a_newer_version_added_is_applied() -> None:
    newer_insert = state_pb2.IndexInsert(
        index="approx", endpoint="10.0.0.5:8000", block_hashes=[1, 2**64 - 1], capacity=7, count_reuse=True
    ).SerializeToString() + _unknown_fields(40)
    batch = state_pb2.StateBatch(origin="a1", sequence=9).SerializeToString()
    # The insert as a length-delimited field 3 of the batch, then unknown fields of the batch.
    data = batch + _varint((3 << 3) | 2) + _varint(len(newer_insert)) + newer_insert + _unknown_fields(50)
    decoded = decode_batch(data)
    assert decoded.origin == "a1" and decoded.sequence == 9
    assert list(decoded.inserts) == [IndexInsert("approx", "10.0.0.5:8000", (1, 2**64 - 1), 7, True)]
    # protobuf keeps the unknown fields: a message re-sent by an older picker loses nothing
    message = state_pb2.StateBatch()
    message.ParseFromString(data)
    assert message.SerializeToString() == data


def test_encode_then_decode_is_the_same_batch() -> None:
    batch = StateBatch("origin", 3, [IndexInsert("i", "10.0.0.5:8000", (5, 6, 7), None, False)])
    assert decode_batch(encode_batch(batch)) == StateBatch(
        "origin", 3, [IndexInsert("i", "10.0.0.5:8000", (5, 6, 7), None, False)]
    )


@pytest.mark.parametrize(
    "data",
    [
        b"\xff\xff\xff\xff",  # not protobuf
        state_pb2.StateBatch(sequence=1).SerializeToString(),  # no origin
        state_pb2.StateBatch(origin="o", index_inserts=[state_pb2.IndexInsert(index="i")]).SerializeToString(),
    ],
)
def test_garbage_is_a_bad_message(data: bytes) -> None:
    with pytest.raises(BadMessageError):
        decode_batch(data)
