"""A live one-line progress bar on stderr (a plain line every few seconds when not a terminal)."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import TextIO

from picker_bench.loadgen import Progress

WIDTH = 28


def render(label: str, progress: Progress, elapsed_s: float) -> str:
    """One progress line: bar, done/total, in flight, errors, elapsed time."""
    fraction = min(1.0, progress.done / progress.total) if progress.total else 1.0
    filled = int(fraction * WIDTH)
    bar = "#" * filled + "-" * (WIDTH - filled)
    return (
        f"{label:<24} [{bar}] {progress.done:>5}/{progress.total:<5} "
        f"in flight {progress.in_flight:>3}  errors {progress.errors:>3}  {elapsed_s:6.1f}s"
    )


async def show(label: str, progress: Progress, stream: TextIO = sys.stderr, interval_s: float = 0.5) -> None:
    """Redraw until cancelled; the caller cancels it when the run ends (a final line stays)."""
    tty = stream.isatty()
    start = time.monotonic()
    last_plain = 0.0
    try:
        while True:
            elapsed = time.monotonic() - start
            if tty:
                stream.write("\r" + render(label, progress, elapsed))
                stream.flush()
            elif elapsed - last_plain >= 10:
                last_plain = elapsed
                stream.write(render(label, progress, elapsed) + "\n")
                stream.flush()
            await asyncio.sleep(interval_s)
    finally:
        stream.write(("\r" if tty else "") + render(label, progress, time.monotonic() - start) + "\n")
        stream.flush()
