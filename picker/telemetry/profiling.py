"""`--enable-pprof`: Go pprof's two most used handlers, made for Python, on the metrics port.

- `GET /debug/pprof/profile?seconds=N` (default 30, at most 300): a wall-clock sampling profile
  of every thread, taken by a thread that reads `sys._current_frames()` 100 times a second (Go's
  CPU profile rate), as collapsed stacks (`outer;inner;leaf count` per line, the format of
  flamegraph.pl, speedscope and inferno). Sampling rather than cProfile: cProfile hooks every
  call of only the thread it runs in (the event loop would run 2-3x slower while profiled, and
  other threads are missed); sampling costs the process about 1% and sees every thread. It is
  wall-clock: an idle event loop shows as its selector wait (`select`/`poll`/`run_once`).
  One profile at a time (409 otherwise).
- `GET /debug/pprof/goroutine`: the current stack of every thread and every asyncio task.
- `GET /debug/pprof/`: the index.

Nothing runs until a handler is asked: no cost while idle.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback
from collections import Counter
from types import FrameType

from aiohttp import web

SAMPLE_HZ = 100
DEFAULT_SECONDS = 30
MAX_SECONDS = 300
NO_FRAMES = "  (no frames: not started or done)\n"
INDEX = """/debug/pprof/

profile?seconds=N  wall-clock sampling profile of all threads for N seconds (default 30),
                   as collapsed stacks ("outer;inner;leaf count"; flamegraph.pl, speedscope)
goroutine          current stacks of all threads and asyncio tasks
"""


def _frame_name(frame: FrameType) -> str:
    code = frame.f_code
    return f"{code.co_qualname} ({code.co_filename}:{frame.f_lineno})"


def _stack(frame: FrameType | None) -> str:
    names: list[str] = []
    while frame is not None:
        names.append(_frame_name(frame))
        frame = frame.f_back
    names.reverse()
    return ";".join(names)


def sample_stacks(seconds: float, hz: int = SAMPLE_HZ) -> Counter[str]:
    """Sample every other thread's stack `hz` times a second for `seconds` (blocking: run it in
    a thread of its own); returns each collapsed stack, prefixed with its thread's name, and
    how many samples saw it."""
    me = threading.get_ident()
    counts: Counter[str] = Counter()
    interval = 1.0 / hz
    deadline = time.monotonic() + seconds
    next_sample = time.monotonic()
    while next_sample < deadline:
        names = {thread.ident: thread.name for thread in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if ident != me:
                counts[f"{names.get(ident, ident)};{_stack(frame)}"] += 1
        next_sample += interval
        time.sleep(max(0.0, next_sample - time.monotonic()))
    return counts


def collapsed(counts: Counter[str]) -> str:
    """The collapsed-stack text, most sampled first."""
    return "".join(f"{stack} {count}\n" for stack, count in counts.most_common())


def all_stacks() -> str:
    """Every thread's stack, then every asyncio task's of the running loop (call from it)."""
    names = {thread.ident: thread for thread in threading.enumerate()}
    parts: list[str] = []
    for ident, frame in sys._current_frames().items():
        thread = names.get(ident)
        label = f"{thread.name} daemon={thread.daemon}" if thread is not None else "unknown"
        parts.append(f"thread {ident} [{label}]:\n{''.join(traceback.format_stack(frame))}")
    tasks = sorted(asyncio.all_tasks(), key=lambda task: task.get_name())
    for task in tasks:
        frames = task.get_stack()
        stack = "".join(traceback.format_list(traceback.StackSummary.extract((f, f.f_lineno) for f in frames)))
        parts.append(f"task {task.get_name()} [{task.get_coro()!r}]:\n{stack or NO_FRAMES}")
    header = f"{len(names)} threads, {len(tasks)} asyncio tasks\n\n"
    return header + "\n".join(parts)


def add_profiling_routes(app: web.Application) -> None:
    """Serve the handlers above on `app` (the metrics server's)."""
    busy = asyncio.Lock()

    async def index(_: web.Request) -> web.Response:
        return web.Response(text=INDEX)

    async def profile(request: web.Request) -> web.Response:
        text = request.query.get("seconds", str(DEFAULT_SECONDS))
        try:
            seconds = float(text)
        except ValueError:
            seconds = 0.0
        if not 0 < seconds <= MAX_SECONDS:
            raise web.HTTPBadRequest(text=f"seconds: expected a number in (0, {MAX_SECONDS}], got {text!r}\n")
        if busy.locked():
            raise web.HTTPConflict(text="a profile is already being taken\n")
        async with busy:
            counts = await asyncio.to_thread(sample_stacks, seconds)
        return web.Response(text=collapsed(counts))

    async def goroutine(_: web.Request) -> web.Response:
        return web.Response(text=all_stacks())

    app.router.add_get("/debug/pprof/", index)
    app.router.add_get("/debug/pprof/profile", profile)
    app.router.add_get("/debug/pprof/goroutine", goroutine)
