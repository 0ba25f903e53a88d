"""The engine's scheduler: prefix hits, seats, chunked prefill, preemption, LoRA slots."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from picker_sim.engine import Engine, EngineConfig, EngineError
from picker_sim.profiles import Profile, get_profile

FAST = EngineConfig(
    profile=get_profile("tiny"),
    num_gpu_blocks=64,
    block_size=4,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    max_loras=1,
    max_model_len=1024,
    time_scale=50.0,
)
REAL_TIME = dataclasses.replace(FAST, time_scale=1.0)  # 1 ms steps: slow enough to observe the queue


async def _run(engine: Engine, *args, **kwargs):
    req = engine.submit(*args, **kwargs)
    while req.finish_reason is None:
        await req.wait()
    return req


async def test_repeated_prefix_hits_whole_blocks_only() -> None:
    engine = Engine(FAST)
    engine.start()
    try:
        first = await _run(engine, list(range(30)), 3)
        second = await _run(engine, list(range(30)), 3)
        third = await _run(engine, list(range(10)) + [500] * 20, 3)
        assert first.num_cached == 0
        # 30 prompt tokens = 7 full blocks of 4; the last token is always recomputed, as in vLLM
        assert second.num_cached == 28
        assert third.num_cached == 8  # shared prefix 10 tokens -> 2 whole blocks
        assert engine.stats.prefix_queries == 90 and engine.stats.prefix_hits == 36
        assert (first.finish_reason, first.num_output) == ("length", 3)
    finally:
        await engine.stop()


class VirtualTime:
    """A clock that a step's sleep moves forward at once: an engine's timing, without waiting."""

    def __init__(self) -> None:
        self.now = 1000.0

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


async def test_only_uncached_tokens_cost_prefill_time() -> None:
    slow_prefill = Profile("t", 0.001, 0.0005, 0.0, 0.0, 0.0, 512, 4, 4096, 4096, 1e9)
    virtual = VirtualTime()
    engine = Engine(
        EngineConfig(profile=slow_prefill, num_gpu_blocks=512, block_size=16, time_scale=1.0),
        virtual.clock,
        virtual.sleep,
    )
    engine.start()
    try:
        prompt = list(range(1000, 1400))  # 400 tokens -> 200 ms of prefill when uncached
        cold = await _run(engine, prompt, 1)
        warm = await _run(engine, prompt, 1)
        assert (cold.num_cached, warm.num_cached) == (0, 384)  # 24 whole blocks of 16
        # The first token comes at the end of the step that prefilled what was not cached.
        assert cold.first_token_at - cold.arrival == pytest.approx(slow_prefill.step_time(400, 0, 0))
        assert warm.first_token_at - warm.arrival == pytest.approx(slow_prefill.step_time(16, 0, 0))
    finally:
        await engine.stop()


async def test_requests_wait_for_seats() -> None:
    engine = Engine(REAL_TIME)
    engine.start()
    try:
        reqs = [engine.submit([7, i, 9], 50) for i in range(6)]
        end = time.monotonic() + 5
        while not engine.running and time.monotonic() < end:
            await asyncio.sleep(0.001)  # poll interval
        assert len(engine.running) == 4 and len(engine.waiting) == 2
        for req in reqs:
            while req.finish_reason is None:
                await req.wait()
        assert all(r.num_output == 50 for r in reqs)
        assert engine.cache.available == engine.cache.num_blocks
    finally:
        await engine.stop()


async def test_chunked_prefill_respects_the_token_budget() -> None:
    engine = Engine(FAST)
    budgets = []
    original = engine._schedule

    def spy():
        result = original()
        budgets.append(result[1] + result[2])
        return result

    engine._schedule = spy
    engine.start()
    try:
        await _run(engine, list(range(200)), 2)
        assert max(budgets) <= FAST.max_num_batched_tokens
        assert budgets[:3] == [64, 64, 64]  # a 200-token prompt takes 4 prefill steps
    finally:
        await engine.stop()


async def test_preemption_when_kv_runs_out_mid_decode() -> None:
    cfg = EngineConfig(
        profile=get_profile("tiny"),
        num_gpu_blocks=8,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        time_scale=50.0,
    )
    engine = Engine(cfg)
    engine.start()
    try:
        # each needs 4 + 16 = 20 tokens -> 5 blocks at the end; both fit at the start (2 blocks each)
        a = engine.submit([1, 2, 3, 4, 5, 6, 7], 13)
        b = engine.submit([11, 12, 13, 14, 15, 16, 17], 13)
        for req in (a, b):
            while req.finish_reason is None:
                await req.wait()
        assert engine.stats.num_preemptions >= 1
        assert a.num_output == b.num_output == 13
        assert engine.cache.available == 8
    finally:
        await engine.stop()


async def test_lora_slots_limit_concurrent_adapters() -> None:
    engine = Engine(REAL_TIME)  # max_loras = 1
    engine.start()
    try:
        a = engine.submit([1, 2, 3], 50, lora="m-lora-a")
        b = engine.submit([1, 2, 3], 50, lora="m-lora-b")
        end = time.monotonic() + 5
        while not engine.running and time.monotonic() < end:
            await asyncio.sleep(0.001)  # poll interval
        assert [r.lora for r in engine.running] == ["m-lora-a"] and list(engine.waiting) == [b]
        for req in (a, b):
            while req.finish_reason is None:
                await req.wait()
        assert list(engine.loaded_loras) == ["m-lora-b"]
    finally:
        await engine.stop()


def test_requests_that_can_never_fit_are_rejected() -> None:
    engine = Engine(FAST)
    with pytest.raises(EngineError, match="maximum context length"):
        engine.submit(list(range(1000)), 100)
    with pytest.raises(EngineError, match="KV blocks"):
        Engine(EngineConfig(profile=get_profile("tiny"), num_gpu_blocks=2, block_size=4)).submit(list(range(8)), 4)
    with pytest.raises(EngineError, match="empty"):
        engine.submit([], 4)
