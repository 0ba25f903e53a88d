"""Go-style durations ("200ms", "1m30s", ".5s", "0"), as the reference's flags and config use
them: the one parser behind both `picker serve`'s flags and plugin parameters."""

from __future__ import annotations

import re

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_DURATION_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Seconds in a Go-style duration ("200ms", "1m30s", "0"); ValueError if malformed."""
    text = text.strip()
    if not text:
        raise ValueError('invalid duration ""')
    if text == "0":
        return 0.0
    position, total = 0, 0.0
    while position < len(text):
        match = _DURATION_PART.match(text, position)
        if match is None:
            raise ValueError(f'invalid duration "{text}" (expected e.g. "200ms", "1.5s", "1m")')
        total += float(match.group(1)) * _DURATION_UNIT[match.group(2)]
        position = match.end()
    return total


def format_duration(seconds: float) -> str:
    """The shortest exact Go-style rendering of `seconds` in ms or s."""
    milliseconds = seconds * 1000
    if milliseconds == int(milliseconds) and milliseconds % 1000:
        return f"{int(milliseconds)}ms"
    return f"{seconds:g}s"
