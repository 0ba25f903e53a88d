"""Hot reload with a real file and the real watch task, while requests keep being scheduled."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from picker.config.runtime import RuntimeHolder
from picker.config.schema import ConfigError
from picker.telemetry.metrics import CONFIG_RELOADS
from tests.routing import Router, completion
from tests.unit.test_scheduling_plugins import state

HEADER = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
BY_KV = HEADER + "plugins: [{type: kv-cache-utilization-scorer}]\n"  # picks the low-KV endpoint
BY_QUEUE = HEADER + "plugins: [{type: queue-scorer}]\n"  # picks the short-queue endpoint
INVALID = HEADER + "plugins: [{type: no-such-scorer}]\n"

LOW_KV = state(1, kv=0.1, waiting=9)
SHORT_QUEUE = state(2, kv=0.9, waiting=0)


def reloads(result: str) -> float:
    return CONFIG_RELOADS.labels(result)._value.get()


# A deadline, not a bound under test: while the loop schedules back to back, the watch's file
# read in a worker thread waits for the GIL (0.5-1.5 s a poll seen here).
async def until(condition: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def swap_configmap(directory: Path, text: str, generation: int) -> None:
    """Update like a kubelet does: write a new data dir, then atomically repoint `..data`;
    the new file keeps the old modification time, so only its content tells the change."""
    data_dir = directory / f"..gen{generation}"
    data_dir.mkdir()
    (data_dir / "config.yaml").write_text(text)
    os.utime(data_dir / "config.yaml", (1_000_000, 1_000_000))
    (directory / "..data_tmp").symlink_to(data_dir.name)
    os.replace(directory / "..data_tmp", directory / "..data")


async def test_watch_swaps_valid_configs_and_keeps_the_old_one_on_errors(tmp_path: Path) -> None:
    (tmp_path / "..data").symlink_to("..gen0")
    (tmp_path / "..gen0").mkdir()
    (tmp_path / "..gen0" / "config.yaml").write_text(BY_KV)
    os.utime(tmp_path / "..gen0" / "config.yaml", (1_000_000, 1_000_000))
    (tmp_path / "config.yaml").symlink_to("..data/config.yaml")
    path = tmp_path / "config.yaml"

    router = Router()
    router.set_endpoints({LOW_KV.address: LOW_KV.metrics, SHORT_QUEUE.address: SHORT_QUEUE.metrics})
    holder = router.runtimes
    holder.load_file(path)
    last_pick: list[str] = []
    failures: list[BaseException] = []
    decisions = 0

    async def keep_scheduling() -> None:
        nonlocal decisions
        while True:
            try:
                result = await router.pick(completion("hi"))
                last_pick[:] = [result.targets[0].address]
                decisions += 1
            except Exception as error:  # recorded: the test asserts there were none
                failures.append(error)
            await asyncio.sleep(0)

    loop_task = asyncio.create_task(keep_scheduling())
    watch_task = asyncio.create_task(holder.watch(path, interval=0.1))
    try:
        await until(lambda: last_pick == [LOW_KV.address])
        steps = [
            (BY_QUEUE, SHORT_QUEUE),
            (INVALID, SHORT_QUEUE),
            (BY_KV, LOW_KV),
            (INVALID, LOW_KV),
            (BY_QUEUE, SHORT_QUEUE),
        ]
        for generation, (text, expected) in enumerate(steps, start=1):
            successes, errors = reloads("success"), reloads("failure")
            swap_configmap(tmp_path, text, generation)
            if text is INVALID:
                await until(lambda: reloads("failure") == errors + 1)
                seen = decisions
                await until(lambda: decisions >= seen + 50)
            else:
                await until(lambda: reloads("success") == successes + 1)
            await until(lambda: last_pick == [expected.address])
        assert failures == []
        assert decisions > 100
    finally:
        loop_task.cancel()
        watch_task.cancel()
        await asyncio.gather(loop_task, watch_task, return_exceptions=True)


def test_load_file_rejects_invalid_and_keeps_the_current_runtime(tmp_path: Path) -> None:
    holder = RuntimeHolder()
    path = tmp_path / "config.yaml"
    path.write_text(BY_QUEUE)
    first = holder.load_file(path)
    path.write_text(INVALID)
    with pytest.raises(ConfigError, match='unknown plugin type "no-such-scorer"'):
        holder.load_file(path)
    assert holder.current is first
    with pytest.raises(ConfigError, match="cannot read"):
        holder.load_file(tmp_path / "missing.yaml")
