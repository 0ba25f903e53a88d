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


async def _until(condition, deadline_s: float = 5.0) -> None:
    end = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < end, "condition not met before the deadline"
        await asyncio.sleep(0.005)  # poll interval, not a fixed wait


async def test_kv_producer_pins_its_blocks_until_a_consumer_takes_them() -> None:
    producer, consumer = Engine(FAST), Engine(FAST)
    producer.start()
    consumer.start()
    try:
        prompt = list(range(100, 130))  # 7 full blocks of 4, and 2 tokens
        done = await _run(producer, prompt, 1, kv_producer=True)
        assert len(done.pinned_block_ids) == 7
        assert producer.cache.available == FAST.num_gpu_blocks - 7  # pinned: not evictable
        hashes = producer.take_pinned(done.pinned_block_ids)
        assert hashes == done.hashes[:7] and producer.take_pinned(done.pinned_block_ids) is None
        assert producer.cache.available == FAST.num_gpu_blocks

        req = await _run(consumer, prompt, 3, remote_hashes=hashes)
        assert (req.num_external, req.num_cached, req.num_output) == (28, 28, 3)
        assert consumer.stats.external_hits == 28 and consumer.stats.kv_transfer_time.count == 1
        assert set(hashes) <= set(consumer.cache.refs)  # received blocks are cached here now
    finally:
        await producer.stop()
        await consumer.stop()


async def test_a_request_aborted_while_its_kv_arrives_frees_every_block() -> None:
    slow_link = dataclasses.replace(get_profile("tiny"), kv_transfer_bandwidth=1.0)
    producer, engine = Engine(FAST), Engine(dataclasses.replace(FAST, profile=slow_link, time_scale=1.0))
    producer.start()
    engine.start()
    try:
        prompt = list(range(200, 230))
        remote = producer.take_pinned((await _run(producer, prompt, 1, kv_producer=True)).pinned_block_ids)
        await _run(engine, prompt[:9], 1)  # the first 2 blocks are cached here
        req = engine.submit(prompt, 3, remote_hashes=remote)
        await _until(lambda: req in engine.receiving)
        assert engine.cache.private == 5  # blocks for the 5 remote ones, beyond the 2 local hits
        engine.abort(req)
        assert req.finish_reason == "abort" and not engine.receiving
        assert engine.cache.private == 0 and engine.cache.available == FAST.num_gpu_blocks
    finally:
        await producer.stop()
        await engine.stop()


async def test_pinned_blocks_expire_and_a_reset_forgets_them() -> None:
    engine = Engine(dataclasses.replace(FAST, kv_transfer_timeout=0.05, time_scale=1.0))
    engine.start()
    try:
        done = await _run(engine, list(range(300, 320)), 1, kv_producer=True)
        await _until(lambda: not engine.pinned)
        assert engine.stats.kv_expired_reqs == 1 and engine.take_pinned(done.pinned_block_ids) is None
        assert engine.cache.available == FAST.num_gpu_blocks
        await _run(engine, list(range(400, 420)), 1, kv_producer=True)
        engine.reset_cache()
        assert not engine.pinned and engine.cache.available == FAST.num_gpu_blocks
    finally:
        await engine.stop()
