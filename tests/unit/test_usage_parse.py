"""Usage parsing from whole JSON responses and from SSE streams fed in arbitrary chunks."""

from __future__ import annotations

import tracemalloc
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from picker.framework.request import Usage
from picker.request.usage import SseUsageScanner, parse_usage, usage_from_json

CHAT_USAGE = {
    "prompt_tokens": 12,
    "completion_tokens": 5,
    "total_tokens": 17,
    "prompt_tokens_details": {"cached_tokens": 8},
}


@pytest.mark.parametrize(
    ("body", "usage"),
    [
        ({"object": "chat.completion", "usage": CHAT_USAGE}, Usage(12, 5, 8, 17)),
        ({"object": "text_completion", "usage": {"prompt_tokens": 3, "completion_tokens": 4}}, Usage(3, 4, 0)),
        (
            {"usage": {"prompt_tokens": 3, "completion_tokens": 4, "prompt_token_details": {"cached_tokens": 2}}},
            Usage(3, 4, 2),
        ),
        (
            {"usage": {"prompt_tokens": 3, "completion_tokens": 4, "prompt_tokens_details": None}},
            Usage(3, 4, 0),
        ),
        ({"usage": {"prompt_tokens": 9}}, Usage(9, 0, 0)),
        (
            {
                "object": "response",
                "usage": {"input_tokens": 20, "output_tokens": 7, "input_tokens_details": {"cached_tokens": 16}},
            },
            Usage(20, 7, 16),
        ),
        (
            {
                "type": "response.completed",
                "response": {"object": "response", "usage": {"input_tokens": 2, "output_tokens": 1}},
            },
            Usage(2, 1, 0),
        ),
        ({"usage": None}, None),
        ({"usage": {}}, None),
        ({"usage": {"total_tokens": 5}}, None),  # no prompt or completion count: not usage
        ({"usage": {"prompt_tokens": 2, "total_tokens": 5}}, Usage(2, 0, 0, 5)),
        ({"usage": {"prompt_tokens": "12", "completion_tokens": True}}, None),
        ({"usage": {"prompt_tokens": -1, "completion_tokens": 2}}, Usage(0, 2, 0)),
        ({"usage": [1, 2]}, None),
        ({"response": "done"}, None),
        ({"choices": []}, None),
        ([{"usage": CHAT_USAGE}], None),
        ("usage", None),
    ],
)
def test_parse_usage_of_whole_responses(body: Any, usage: Usage | None) -> None:
    assert parse_usage(orjson.dumps(body)) == usage
    assert usage_from_json(body) == usage


@pytest.mark.parametrize("body", [b"", b"not json", b'{"usage": {"prompt_tokens": 1', b"\xff\xfe", b"[" * 5000])
def test_parse_usage_of_garbage_is_none(body: bytes) -> None:
    assert parse_usage(body) is None


def chunk_event(usage: dict[str, Any] | None) -> bytes:
    chunk = {"id": "c", "object": "chat.completion.chunk", "choices": [{"delta": {"content": "hi"}}], "usage": usage}
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def test_scanner_keeps_the_last_usage_object_and_ignores_null_usage() -> None:
    scanner = SseUsageScanner()
    scanner.feed(chunk_event(None))
    assert scanner.usage is None
    scanner.feed(chunk_event({"prompt_tokens": 1, "completion_tokens": 1}))
    scanner.feed(chunk_event(None))
    scanner.feed(chunk_event(CHAT_USAGE))
    scanner.feed(chunk_event(None) + b"data: [DONE]\n\n")
    assert scanner.usage == Usage(12, 5, 8, 17)


def test_scanner_handles_crlf_split_lines_and_many_events_per_chunk() -> None:
    stream = (
        b'event: message\r\ndata: not json but has "usage": {\r\n\r\n'
        + chunk_event(None).replace(b"\n", b"\r\n")
        + b'data:{"usage":{"prompt_tokens":7,"completion_tokens":2}}\r\n\r\n'
        + b"data: [DONE]\r\n\r\n"
    )
    scanner = SseUsageScanner()
    for start in range(0, len(stream), 3):
        scanner.feed(stream[start : start + 3])
    assert scanner.usage == Usage(7, 2, 0)


def test_scanner_reads_responses_completed_events() -> None:
    created = {"type": "response.created", "response": {"id": "r", "usage": None}}
    completed = {
        "type": "response.completed",
        "response": {
            "id": "r",
            "usage": {"input_tokens": 30, "output_tokens": 9, "input_tokens_details": {"cached_tokens": 24}},
        },
    }
    scanner = SseUsageScanner()
    scanner.feed(b"event: response.created\ndata: " + orjson.dumps(created) + b"\n\n")
    scanner.feed(b"event: response.completed\ndata: " + orjson.dumps(completed) + b"\n\n")
    assert scanner.usage == Usage(30, 9, 24)


def test_scanner_ignores_usage_outside_data_lines_and_in_an_unfinished_line() -> None:
    scanner = SseUsageScanner()
    scanner.feed(b'event: {"usage":{"prompt_tokens":1,"completion_tokens":1}}\n')
    scanner.feed(b': {"usage":{"prompt_tokens":1,"completion_tokens":1}}\n')
    scanner.feed(b'data: {"usage":{"prompt_tokens":2,"completion_tokens":2}}')
    assert scanner.usage is None
    scanner.feed(b"\n")
    assert scanner.usage == Usage(2, 2, 0)


def test_scanner_drops_a_line_over_the_cap_and_recovers() -> None:
    long_line = b'data: {"usage":{"prompt_tokens":1,"completion_tokens":1},"pad":"' + b"x" * 200 + b'"}\n'
    short_line = b'data: {"usage":{"prompt_tokens":5,"completion_tokens":6}}\n'
    for chunk_size in (1, 7, 64, len(long_line), 10_000):
        scanner = SseUsageScanner(max_line_bytes=100)
        stream = long_line + short_line + long_line
        for start in range(0, len(stream), chunk_size):
            scanner.feed(stream[start : start + chunk_size])
        assert scanner.usage == Usage(5, 6, 0), chunk_size


def test_scanner_memory_stays_bounded_on_an_endless_line() -> None:
    scanner = SseUsageScanner(max_line_bytes=1 << 20)
    chunk = b"data: " + b"u" * (64 * 1024)
    tracemalloc.start()
    try:
        for _ in range(160):  # 10 MiB without a newline
            scanner.feed(chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 << 20
    scanner.feed(b'\ndata: {"usage":{"prompt_tokens":1,"completion_tokens":2}}\n')
    assert scanner.usage == Usage(1, 2, 0)


EVENT_LINES = st.sampled_from(
    [
        b'data: {"usage":{"prompt_tokens":1,"completion_tokens":1}}',
        b'data:{"usage": {"prompt_tokens":2,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":1}}}',
        b'data: {"choices":[],"usage":null}',
        b'data: {"type":"response.completed","response":{"usage":{"input_tokens":4,"output_tokens":5}}}',
        b'data: {"usage":{"prompt_tokens":6,"completion_tokens":7},"pad":"' + b"p" * 80 + b'"}',
        b'data: {"usage":{"prompt_tokens":8,"comp',
        b"data: [DONE]",
        b"event: message",
        b": keep-alive",
        b"",
    ]
) | st.binary(max_size=40).filter(lambda line: b"\n" not in line)


def expected_usage(lines: list[bytes], max_line_bytes: int) -> Usage | None:
    """The oracle: the last complete data line that decodes to usage, within the cap."""
    found = None
    for line in lines:
        if line.startswith(b"data:") and len(line) <= max_line_bytes:
            try:
                usage = usage_from_json(orjson.loads(line[5:]))
            except orjson.JSONDecodeError:
                continue
            found = usage or found
    return found


@settings(max_examples=300, deadline=None)
@given(
    lines=st.lists(EVENT_LINES, max_size=12),
    crlf=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=30),
    max_line_bytes=st.sampled_from([64, 100, 1 << 20]),
    trailing=st.binary(max_size=30).filter(lambda tail: b"\n" not in tail),
)
def test_scanner_result_does_not_depend_on_chunking(
    lines: list[bytes], crlf: bool, cuts: list[int], max_line_bytes: int, trailing: bytes
) -> None:
    ending = b"\r\n" if crlf else b"\n"
    stream = b"".join(line + ending for line in lines) + trailing
    whole = SseUsageScanner(max_line_bytes)
    whole.feed(stream)
    chunked = SseUsageScanner(max_line_bytes)
    bounds = sorted({0, len(stream), *(cut for cut in cuts if cut < len(stream))})
    for start, end in zip(bounds, bounds[1:]):
        chunked.feed(stream[start:end])
    # The oracle sees the line as the scanner measures it: everything before the "\n".
    measured = [line + (b"\r" if crlf else b"") for line in lines]
    assert whole.usage == chunked.usage == expected_usage(measured, max_line_bytes)
