"""KV-cache events over real ZMQ sockets: a subscriber reproduces each pod's cached blocks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import msgpack
import pytest
import zmq.asyncio

from picker.kvevents.vllm_hash import DEFAULT_SEED, SHA256_CBOR, VllmBlockHasher, external
from picker.prefix.builtin_tokenizer import encode
from picker_sim import Fleet, FleetConfig
from picker_sim.kvcache import block_hashes
from tests.sim_fixtures import BlockSetSubscriber, eventually


@pytest.fixture
async def zmq_ctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.term()


async def _start(fmt: str, **overrides) -> Fleet:
    cfg = dict(
        pods=2,
        profile="tiny",
        time_scale=20,
        num_gpu_blocks=40,
        kv_events_base_port=0,
        kv_replay_base_port=0,
        kv_events_format=fmt,
    )
    cfg.update(overrides)
    fleet = Fleet(FleetConfig(**cfg))
    await fleet.start()
    return fleet


async def _load(http: aiohttp.ClientSession, url: str, prompts: list[str], lora: str | None = None) -> None:
    async def one(prompt: str) -> None:
        body = {"prompt": prompt, "max_tokens": 20, "model": lora or "sim-model"}
        async with http.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()

    await asyncio.gather(*(one(p) for p in prompts))


def _prompts(n: int, shared: int, tag: str) -> list[str]:
    system = " ".join(f"sys{i}" for i in range(shared))
    return [f"{system} " + " ".join(f"{tag}{j}q{i}" for i in range(40 + 7 * j)) for j in range(n)]


STORED_MAP = ("type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
# Per encoding: the batch's layout, then BlockStored's and BlockRemoved's (field counts with the
# tag for arrays, keys in order for maps), as vLLM's msgspec structs encode them.
LAYOUTS = {
    "array": (3, 7, 3),
    "positional": (3, 8, 3),
    "map": (("ts", "events", "data_parallel_rank"), STORED_MAP, ("type", "block_hashes", "medium")),
}


@pytest.mark.parametrize("fmt", list(LAYOUTS))
async def test_subscriber_reproduces_cached_blocks_under_eviction(fmt: str, zmq_ctx) -> None:
    fleet = await _start(fmt, max_loras=1)
    subs = [BlockSetSubscriber(zmq_ctx, p.kv_events_endpoint, p.kv_replay_endpoint) for p in fleet.pods]
    try:
        async with aiohttp.ClientSession() as http:
            for round_ in range(3):  # 40 blocks per pod: later rounds evict earlier ones
                for i, pod in enumerate(fleet.pods):
                    await _load(
                        http,
                        pod.url,
                        _prompts(4, 48, f"r{round_}p{i}"),
                        lora="sim-model-lora-a" if round_ == 1 else None,
                    )
        for pod, sub in zip(fleet.pods, subs, strict=True):
            await sub.sync_until(lambda sub=sub, pod=pod: sub.blocks == set(pod.engine.cache.refs))
            assert sub.topics == {f"kv@{pod.host}@sim-model".encode()}  # vLLM's, as llm-d reads it
            assert sub.removed > 0  # the cache was under pressure
            batch, stored, removed = LAYOUTS[fmt]
            assert sub.batch_layouts == {batch}
            assert sub.event_layouts == {("BlockStored", stored), ("BlockRemoved", removed)}
        assert any(pod.engine.stats.prefix_hits for pod in fleet.pods)  # shared system prompt hit
        # Block hashes are vLLM's sha256_cbor chain from NONE_HASH = sha256_cbor("vllm-none-hash")
        sub, pod = subs[0], fleet.pods[0]
        prompt_ids = encode(_prompts(1, 48, "r2p0")[0])
        first = external(VllmBlockHasher(SHA256_CBOR, DEFAULT_SEED).digests(prompt_ids, 16)[0])
        assert first in sub.blocks and sub.tokens[first] == prompt_ids[:16]
    finally:
        for sub in subs:
            sub.close()
        await fleet.stop()


async def test_replay_recovers_dropped_batches_and_crash_clears(zmq_ctx) -> None:
    fleet = await _start("map", pods=1)
    pod = fleet.pods[0]
    sub = BlockSetSubscriber(zmq_ctx, pod.kv_events_endpoint, pod.kv_replay_endpoint)
    try:
        async with aiohttp.ClientSession() as http:
            await _load(http, pod.url, _prompts(2, 32, "a"))
            await sub.sync_until(lambda: sub.blocks == set(pod.engine.cache.refs))
            pod.faults.drop_kv_events = 1.0  # batches vanish on the wire but stay replayable
            await _load(http, pod.url, _prompts(2, 32, "b"))
            seq = sub.next_seq
            while await sub.pump(0.05):  # live duplicates of batches already replayed, if any
                pass
            assert sub.next_seq == seq and sub.blocks != set(pod.engine.cache.refs)
            pod.faults.drop_kv_events = 0.0
            replays = sub.replays
            await _load(http, pod.url, _prompts(1, 8, "c"))  # the next batch reveals the gap
            await sub.sync_until(lambda: sub.blocks == set(pod.engine.cache.refs))
            assert sub.replays > replays
            await pod.crash()
            await sub.sync_until(lambda: sub.clears == 1 and not sub.blocks)
            await pod.restart()
            await _load(http, pod.url, _prompts(1, 32, "d"))
            await sub.sync_until(lambda: sub.blocks == set(pod.engine.cache.refs) and bool(sub.blocks))
    finally:
        sub.close()
        await fleet.stop()


async def test_hashes_are_deterministic_across_restarts(zmq_ctx) -> None:
    seen = []
    for _ in range(2):
        fleet = await _start("positional", pods=1)
        pod = fleet.pods[0]
        try:
            async with aiohttp.ClientSession() as http:
                await _load(http, pod.url, _prompts(2, 32, "same"))
            seen.append(set(pod.engine.cache.refs))
        finally:
            await fleet.stop()
    assert seen[0] == seen[1] and seen[0]


@pytest.mark.parametrize(("algorithm", "seed"), [("sha256", "42"), ("builtin", DEFAULT_SEED)])
async def test_pods_connect_to_a_binding_subscriber(algorithm: str, seed: str, zmq_ctx) -> None:
    """vLLM's endpoint without '*': every pod connects (llm-d's subscriber binds and tells the
    pods apart by topic, one IP per pod), with the block hash and seed chosen."""
    sub = zmq_ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    fleet = await _start(
        "array",
        host="127.0.0.6",
        distinct_hosts=True,
        kv_events_base_port=None,
        kv_replay_base_port=None,
        kv_events_connect=f"tcp://127.0.0.1:{port}",
        block_hash=algorithm,
        hash_seed=seed,
    )
    try:
        assert all(pod.kv_events_endpoint is None for pod in fleet.pods)  # nothing bound
        hasher = None if algorithm == "builtin" else VllmBlockHasher(algorithm, seed)
        stored: dict[bytes, set[int]] = {}
        expected: list[list[int]] = []  # per prompt sent
        async with aiohttp.ClientSession() as http:

            async def both_pods_seen() -> bool:
                # A connecting PUB drops what it sends before the connection is up (vLLM's too):
                # a prompt sharing no block with the ones before, until each pod's events arrive.
                prompt = " ".join(f"c{len(expected)}w{i}" for i in range(60))
                prompt_ids = encode(prompt)
                if hasher is None:
                    expected.append(block_hashes(prompt_ids, 16))
                else:
                    expected.append([external(d) for d in hasher.digests(prompt_ids, 16)])
                for pod in fleet.pods:
                    await _load(http, pod.url, [prompt])
                while await sub.poll(100):
                    topic, _seq, payload = await sub.recv_multipart()
                    for event in msgpack.unpackb(payload)[1]:
                        if event[0] == "BlockStored":
                            stored.setdefault(topic, set()).update(event[1])
                return len(stored) == 2 and all(any(set(e) <= h for e in expected) for h in stored.values())

            await eventually(both_pods_seen)
        assert set(stored) == {b"kv@127.0.0.6@sim-model", b"kv@127.0.0.7@sim-model"}
    finally:
        sub.close(0)
        await fleet.stop()
