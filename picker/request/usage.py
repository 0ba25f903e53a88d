"""Token usage from model-server responses: whole JSON bodies and Server-Sent Event streams.

Chat/completions objects report `prompt_tokens`/`completion_tokens`; Responses objects report
`input_tokens`/`output_tokens`, inside `response` for a `response.completed` event. Garbage in
gives `None`, never an exception: usage is telemetry, not something to fail a request over.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from picker.framework.request import Usage

DEFAULT_MAX_LINE_BYTES = 1 << 20

# A data line worth decoding holds a usage *object*; vLLM streams `"usage": null` in every
# chunk until the last, and Responses events carry `"usage": null` until completion.
_USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')
_DATA_PREFIX = b"data:"


def parse_usage(body: bytes) -> Usage | None:
    """Usage from a whole (non-streamed) JSON response body, or None if it has none."""
    try:
        return usage_from_json(orjson.loads(body))
    except orjson.JSONDecodeError:
        return None


def usage_from_json(value: Any) -> Usage | None:
    """Usage from a decoded response object (`usage`, else `response.usage`), or None."""
    if not isinstance(value, dict):
        return None
    usage = value.get("usage")
    if not isinstance(usage, dict):
        response = value.get("response")
        usage = response.get("usage") if isinstance(response, dict) else None
        if not isinstance(usage, dict):
            return None
    prompt = _count(usage, "prompt_tokens", "input_tokens")
    completion = _count(usage, "completion_tokens", "output_tokens")
    if prompt is None and completion is None:
        return None
    cached = None
    # `prompt_token_details` is the misspelling the reference EPP reads; accept both.
    for name in ("prompt_tokens_details", "prompt_token_details", "input_tokens_details"):
        details = usage.get(name)
        if isinstance(details, dict) and (cached := _count(details, "cached_tokens")) is not None:
            break
    return Usage(
        prompt_tokens=prompt or 0,
        completion_tokens=completion or 0,
        cached_tokens=cached or 0,
        total_tokens=_count(usage, "total_tokens") or 0,
    )


def _count(source: dict[str, Any], *names: str) -> int | None:
    """The first of `names` holding a non-negative integer count."""
    for name in names:
        value = source.get(name)
        if type(value) is int and value >= 0:
            return value
    return None


class SseUsageScanner:
    """Tracks the last usage object seen in an SSE stream fed in chunks of any size.

    Memory is bounded: only the unfinished last line is kept, and a line longer than
    `max_line_bytes` is dropped whole (however it was chunked). Lines end at LF or CRLF.
    """

    __slots__ = ("_discarding", "_max_line_bytes", "_pending", "_usage")

    def __init__(self, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> None:
        self._max_line_bytes = max_line_bytes
        self._pending = bytearray()
        self._discarding = False  # inside a line that already exceeded the cap
        self._usage: Usage | None = None

    @property
    def usage(self) -> Usage | None:
        """The last usage seen so far, or None."""
        return self._usage

    def feed(self, chunk: bytes) -> None:
        """Consume the next piece of the stream."""
        end = chunk.find(b"\n")
        if end < 0:
            self._append_partial(chunk)
            return
        if self._discarding:
            self._discarding = False
        elif self._pending:
            self._pending += chunk[:end]
            self._scan_line(self._pending)
            self._pending.clear()
        else:
            self._scan_line(chunk[:end])
        last = chunk.rfind(b"\n")
        if last > end:
            self._scan_lines(chunk[end + 1 : last])
        self._append_partial(chunk[last + 1 :])

    def _append_partial(self, piece: bytes) -> None:
        if self._discarding:
            return
        if len(self._pending) + len(piece) > self._max_line_bytes:
            self._pending.clear()
            self._discarding = True
            return
        self._pending += piece

    def _scan_lines(self, block: bytes) -> None:
        """Scan complete lines, decoding only the lines holding a usage object."""
        if _USAGE_OBJECT.search(block) is None:
            return
        for line in block.split(b"\n"):
            self._scan_line(line)

    def _scan_line(self, line: bytes | bytearray) -> None:
        if len(line) > self._max_line_bytes or not line.startswith(_DATA_PREFIX):
            return
        if _USAGE_OBJECT.search(line) is None:
            return
        try:
            usage = usage_from_json(orjson.loads(line[len(_DATA_PREFIX) :]))
        except orjson.JSONDecodeError:
            return
        if usage is not None:
            self._usage = usage
