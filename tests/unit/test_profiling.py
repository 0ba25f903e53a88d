"""The sampling profiler and stack dump behind `--enable-pprof`, in this process."""

from __future__ import annotations

import asyncio
import threading

from picker.telemetry.profiling import all_stacks, collapsed, sample_stacks


def spin_for_the_profiler(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(100))


def test_sampling_sees_a_busy_thread_in_its_function() -> None:
    stop = threading.Event()
    busy = threading.Thread(target=spin_for_the_profiler, args=(stop,), name="busy-worker")
    busy.start()
    try:
        counts = sample_stacks(0.3, hz=100)
    finally:
        stop.set()
        busy.join()
    text = collapsed(counts)
    lines = text.splitlines()
    assert all(line.rsplit(" ", 1)[1].isdigit() for line in lines)
    busy_samples = sum(n for stack, n in counts.items() if stack.startswith("busy-worker;"))
    assert busy_samples >= 10  # about 30 at 100 Hz for 0.3 s, fewer on a loaded machine
    assert any("spin_for_the_profiler (" in stack for stack in counts if stack.startswith("busy-worker;"))
    assert sum(counts.values()) == sum(int(line.rsplit(" ", 1)[1]) for line in lines)


async def test_all_stacks_lists_threads_and_asyncio_tasks() -> None:
    parked = asyncio.Event()

    async def waiting_for_the_dump() -> None:
        await parked.wait()

    task = asyncio.create_task(waiting_for_the_dump(), name="parked-task")
    await asyncio.sleep(0)  # let it start and park
    try:
        text = all_stacks()
    finally:
        parked.set()
        await task
    assert "[MainThread daemon=False]" in text
    assert "task parked-task [" in text and "in waiting_for_the_dump" in text
    assert "in test_all_stacks_lists_threads_and_asyncio_tasks" in text  # the running task's own stack
