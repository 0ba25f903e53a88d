"""The generated text of a response: whole JSON bodies and Server-Sent Event streams.

A chat client sends the answer back as the start of the conversation's next turn, so what the
engine generated is, token for token, the next prompt's continuation; the picker reads it to
learn where that continuation is cached. Garbage in gives None, never an exception.
"""

from __future__ import annotations

from typing import Any

import orjson

_DATA = b"data:"


def completion_text(body: bytes) -> str | None:
    """The first choice's text (`message.content`, `delta.content` or `text`) of a response
    body, or of an SSE stream's `data:` events joined; None when there is none."""
    stripped = body.lstrip()
    if not stripped.startswith(_DATA):
        try:
            return _choice_text(orjson.loads(body), "message")
        except orjson.JSONDecodeError:
            return None
    # One parse for the whole stream (its events as one JSON array): a parse per event costs
    # several times more, and a chat answer is hundreds of events.
    payloads = [
        payload
        for line in stripped.split(b"\n")
        if line.startswith(_DATA) and (payload := line[len(_DATA) :].strip()) and payload != b"[DONE]"
    ]
    try:
        events = orjson.loads(b"[" + b",".join(payloads) + b"]")
    except orjson.JSONDecodeError:
        return None
    parts = [text for event in events if (text := _choice_text(event, "delta"))]
    return "".join(parts) if parts else None


def _choice_text(value: Any, field: str) -> str | None:
    if not isinstance(value, dict):
        return None
    choices = value.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    message = choice.get(field)
    text = message.get("content") if isinstance(message, dict) else choice.get("text")
    return text if isinstance(text, str) else None
