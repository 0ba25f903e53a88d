"""The state-sync schema (proto/picker/state/v1/state.proto): the committed generated code
matches it, and a message from a newer version (fields this one does not know) is applied."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from picker.state.messages import (
    BadMessageError,
    EndpointInFlight,
    IndexInsert,
    InFlightLoad,
    PrefillQueued,
    StateBatch,
    TtftObservation,
    decode_batch,
    encode_batch,
)
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


def _field(number: int, message: bytes) -> bytes:
    """`message` as the length-delimited field `number` of its parent."""
    return _varint((number << 3) | 2) + _varint(len(message)) + message


def test_load_and_ttft_lessons_with_fields_a_newer_version_added_are_applied() -> None:
    endpoint = state_pb2.EndpointInFlight(endpoint="10.0.0.5:8000", requests=3, tokens=900).SerializeToString()
    load = _field(1, endpoint + _unknown_fields(30)) + _varint(2 << 3) + _varint(3000) + _unknown_fields(40)
    observation = state_pb2.TtftObservation(
        endpoint="10.0.0.6:8000", ttft_seconds=0.25, prompt_tokens=800, cached_tokens=512, work_ahead_tokens=64.0
    ).SerializeToString()
    prefill = state_pb2.PrefillQueued(endpoint="10.0.0.6:8000", tokens=288.0).SerializeToString()
    batch = state_pb2.StateBatch(origin="a1", sequence=2).SerializeToString()
    data = (
        batch
        + _field(4, load)
        + _field(5, observation + _unknown_fields(20))
        + _field(6, prefill + _unknown_fields(20))
        + _unknown_fields(60)
    )
    decoded = decode_batch(data)
    assert decoded.in_flight == InFlightLoad((EndpointInFlight("10.0.0.5:8000", 3, 900),), 3000)
    assert list(decoded.observations) == [TtftObservation("10.0.0.6:8000", 0.25, 800, 512, 64.0)]
    assert list(decoded.prefills) == [PrefillQueued("10.0.0.6:8000", 288.0)]


def test_a_batch_of_an_older_version_has_no_load_report() -> None:
    """Version 1's first replicas sent only inserts: the receiver keeps their load as it was."""
    decoded = decode_batch(state_pb2.StateBatch(origin="a1", sequence=1).SerializeToString())
    assert decoded.in_flight is None and not decoded.observations and not decoded.prefills


def test_encode_then_decode_is_the_same_batch() -> None:
    batch = StateBatch("origin", 3, [IndexInsert("i", "10.0.0.5:8000", (5, 6, 7), None, False)])
    assert decode_batch(encode_batch(batch)) == StateBatch(
        "origin", 3, [IndexInsert("i", "10.0.0.5:8000", (5, 6, 7), None, False)]
    )
    full = StateBatch(
        "origin",
        4,
        [],
        InFlightLoad((EndpointInFlight("10.0.0.5:8000", 2, 100), EndpointInFlight("10.0.0.6:8000", 1, 7)), 1500),
        (
            TtftObservation("10.0.0.5:8000", 0.5, 1000, 0, 12.5),
            TtftObservation("10.0.1.5:8000", 0.4, 6000, 0, 0.0, remote_prefill=True),
        ),
        (PrefillQueued("10.0.0.5:8000", 1000.0),),
    )
    assert decode_batch(encode_batch(full)) == full
    # nothing in flight is a report too (the load went to zero), not the absence of one
    idle = StateBatch("origin", 5, [], InFlightLoad((), 1500))
    assert decode_batch(encode_batch(idle)) == idle


@pytest.mark.parametrize(
    "data",
    [
        b"\xff\xff\xff\xff",  # not protobuf
        state_pb2.StateBatch(sequence=1).SerializeToString(),  # no origin
        state_pb2.StateBatch(origin="o", index_inserts=[state_pb2.IndexInsert(index="i")]).SerializeToString(),
        state_pb2.StateBatch(
            origin="o", in_flight=state_pb2.InFlightLoad(endpoints=[state_pb2.EndpointInFlight(requests=1)])
        ).SerializeToString(),
        state_pb2.StateBatch(origin="o", ttft_observations=[state_pb2.TtftObservation()]).SerializeToString(),
    ],
)
def test_garbage_is_a_bad_message(data: bytes) -> None:
    with pytest.raises(BadMessageError):
        decode_batch(data)
