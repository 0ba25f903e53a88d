"""`picker sim` with prefill/decode roles, over real HTTP between real sim processes: vLLM's KV
connector protocol (`kv_transfer_params`) in the two steps llm-d's pd-sidecar takes."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq.asyncio

from picker.discovery.static import parse_endpoint_file
from picker.scheduling.labels import ROLE_LABEL
from picker_bench.systems import FleetPod, write_endpoints_file
from picker_sim.engine import answer_text
from tests.sim_fixtures import BlockSetSubscriber, delta, eventually, pod_metrics, start_sim, stop_process

BLOCK = 16
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@contextmanager
def _sim(args: list[str]) -> Iterator[list[str]]:
    """A `picker sim` process with the tiny profile; its pod lines."""
    proc, lines = start_sim(["--base-port", "0", "--profile", "tiny", *args])
    try:
        yield lines
    finally:
        assert stop_process(proc) == 0


@pytest.fixture(scope="module")
def pd_lines() -> Iterator[list[str]]:
    """One process: a prefill pod, then two decode pods, each publishing KV events."""
    with _sim(["--pd", "1:2", "--kv-events-base-port", "0", "--kv-events-replay-base-port", "0"]) as lines:
        yield lines


@pytest.fixture
def pd_pods(pd_lines: list[str]) -> list[FleetPod]:
    return [FleetPod.parse(line) for line in pd_lines]


@pytest.fixture
async def zmq_ctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.term()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def _prompt(tag: int, length: int) -> list[int]:
    return [1000 + 7 * tag + i for i in range(length)]


async def _post(
    http: aiohttp.ClientSession, pod: FleetPod, body: dict[str, Any], path: str = "/v1/completions"
) -> tuple[int, dict[str, Any]]:
    async with http.post(f"http://{pod.address}{path}", json=body) as resp:
        return resp.status, await resp.json()


async def _metrics(http: aiohttp.ClientSession, pod: FleetPod) -> dict[str, float]:
    return await pod_metrics(http, pod.address)


async def _cached(http: aiohttp.ClientSession, pod: FleetPod) -> set[int]:
    async with http.get(f"http://{pod.address}/sim/cache") as resp:
        return set((await resp.json())["block_hashes"])


async def _prefill(http: aiohttp.ClientSession, pod: FleetPod, prompt: list[int]) -> dict[str, Any]:
    """The sidecar's first step: the prompt with max_tokens 1, not streamed, do_remote_decode."""
    body = {"prompt": prompt, "max_tokens": 1, "max_completion_tokens": 1, "stream": False}
    status, answer = await _post(http, pod, {**body, "kv_transfer_params": PREFILL_PARAMS})
    assert status == 200, answer
    params: dict[str, Any] = answer["kv_transfer_params"]
    return params


def test_roles_are_visible_where_routers_read_them(pd_pods: list[FleetPod], tmp_path: Path) -> None:
    assert [p.role for p in pd_pods] == ["prefill", "decode", "decode"]
    endpoints = parse_endpoint_file(write_endpoints_file(pd_pods, tmp_path / "endpoints.yaml").read_text())
    assert [dict(e.labels) for e in endpoints] == [{ROLE_LABEL: r} for r in ("prefill", "decode", "decode")]


async def test_sglang_server_info_and_kv_state_name_the_role(pd_pods: list[FleetPod], http) -> None:
    for pod, mode in zip(pd_pods, ("prefill", "decode", "decode"), strict=True):
        async with http.get(f"http://{pod.address}/server_info") as resp:
            assert (await resp.json())["disaggregation_mode"] == mode
        async with http.get(f"http://{pod.address}/sim/kv") as resp:
            state = await resp.json()
        assert state["role"] == mode and state["engine_id"]


async def test_two_step_flow_answers_as_one_pod_would(pd_pods: list[FleetPod], http) -> None:
    prefill, decode = pd_pods[0], pd_pods[1]
    prompt = _prompt(1, 6 * BLOCK + 5)
    before_p, before_d = await _metrics(http, prefill), await _metrics(http, decode)
    cached_before = await _cached(http, decode)

    params = await _prefill(http, prefill, prompt)
    async with http.get(f"http://{prefill.address}/sim/kv") as resp:
        state = await resp.json()
    host, port = prefill.address.rsplit(":", 1)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == state["engine_id"]
    assert (params["remote_host"], params["remote_port"]) == (host, int(port))
    assert len(params["remote_block_ids"]) == 6 and params["remote_block_ids"] in state["pinned_block_ids"]

    body = {"prompt": prompt, "max_tokens": 9, "kv_transfer_params": params}
    status, answer = await _post(http, decode, body)
    assert status == 200, answer
    assert answer["choices"][0]["text"] == answer_text(prompt, 9)
    assert "kv_transfer_params" not in answer
    usage = answer["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (101, 9, 110)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 6 * BLOCK  # received, not computed

    after_d = await _metrics(http, decode)
    # The decode pod computed only the 5 tokens after the last full block; the rest came over.
    assert delta(after_d, before_d, "vllm:prompt_tokens_by_source_total{local_compute}") == 5
    assert delta(after_d, before_d, "vllm:prompt_tokens_by_source_total{external_kv_transfer}") == 6 * BLOCK
    assert delta(after_d, before_d, "vllm:external_prefix_cache_queries_total") == 101
    assert delta(after_d, before_d, "vllm:external_prefix_cache_hits_total") == 6 * BLOCK
    assert delta(after_d, before_d, "vllm:nixl_xfer_time_seconds_count") == 1
    assert delta(after_d, before_d, "vllm:nixl_bytes_transferred_sum") == 6 * BLOCK * 4096  # tiny: 4 KiB/token
    assert delta(after_d, before_d, "vllm:nixl_xfer_time_seconds_sum") > 0
    # The received blocks are in the decode pod's cache now, under the prefill pod's hashes.
    received = await _cached(http, decode) - cached_before
    assert len(received) == 6 and received <= await _cached(http, prefill)
    # Taken: the prefill pod unpinned them and counts no expiry.
    async with http.get(f"http://{prefill.address}/sim/kv") as resp:
        assert params["remote_block_ids"] not in (await resp.json())["pinned_block_ids"]
    after_p = await _metrics(http, prefill)
    assert delta(after_p, before_p, "vllm:prompt_tokens_by_source_total{local_compute}") == 101
    assert delta(after_p, before_p, "vllm:nixl_num_kv_expired_reqs_total") == 0


async def test_decode_pods_kv_events_show_the_received_blocks(pd_lines: list[str], http, zmq_ctx) -> None:
    prefill, decode = FleetPod.parse(pd_lines[0]), FleetPod.parse(pd_lines[1])
    words = pd_lines[1].split()
    replay = words[words.index("replay") + 1]
    assert decode.kv_events_address
    subscriber = BlockSetSubscriber(zmq_ctx, decode.kv_events_address, replay)
    try:
        prompt = _prompt(6, 5 * BLOCK + 7)
        params = await _prefill(http, prefill, prompt)
        status, answer = await _post(http, decode, {"prompt": prompt, "max_tokens": 2, "kv_transfer_params": params})
        assert status == 200 and answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 5 * BLOCK
        blocks = {tuple(prompt[i * BLOCK : (i + 1) * BLOCK]) for i in range(5)}
        # The decode pod computed none of these blocks: only the transfer can have stored them.
        await subscriber.sync_until(lambda: blocks <= {tuple(t) for t in subscriber.tokens.values()})
    finally:
        subscriber.close()


async def test_decode_pod_fetches_only_what_its_own_cache_lacks(pd_pods: list[FleetPod], http) -> None:
    prefill, decode = pd_pods[0], pd_pods[2]
    shared = _prompt(2, 3 * BLOCK)
    warm = {"prompt": [*shared, 1], "max_tokens": 1}
    assert (await _post(http, decode, warm))[0] == 200  # the decode pod holds the first 3 blocks
    prompt = [*shared, *_prompt(3, 4 * BLOCK + 2)]
    before = await _metrics(http, decode)

    params = await _prefill(http, prefill, prompt)
    status, answer = await _post(http, decode, {"prompt": prompt, "max_tokens": 4, "kv_transfer_params": params})
    assert status == 200, answer
    assert answer["choices"][0]["text"] == answer_text(prompt, 4)
    after = await _metrics(http, decode)
    assert delta(after, before, "vllm:prompt_tokens_by_source_total{local_cache_hit}") == 3 * BLOCK
    assert delta(after, before, "vllm:prompt_tokens_by_source_total{external_kv_transfer}") == 4 * BLOCK
    assert delta(after, before, "vllm:prompt_tokens_by_source_total{local_compute}") == 2
    assert delta(after, before, "vllm:nixl_bytes_transferred_sum") == 4 * BLOCK * 4096


async def test_chat_prefill_answer_carries_the_params_and_streamed_decode_works(pd_pods: list[FleetPod], http) -> None:
    prefill, decode = pd_pods[0], pd_pods[1]
    messages = [{"role": "user", "content": " ".join(f"word{i}" for i in range(80))}]
    body = {"messages": messages, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS}
    status, answer = await _post(http, prefill, body, "/v1/chat/completions")
    assert status == 200 and answer["kv_transfer_params"]["remote_block_ids"], answer
    decode_body = {
        "messages": messages,
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "kv_transfer_params": answer["kv_transfer_params"],
    }
    async with http.post(f"http://{decode.address}/v1/chat/completions", json=decode_body) as resp:
        assert resp.status == 200
        text = await resp.text()
    assert text.rstrip().endswith("data: [DONE]")
    assert '"completion_tokens":5' in text and '"cached_tokens":0' not in text


async def test_missing_remote_blocks_fall_back_to_a_local_prefill(pd_pods: list[FleetPod], http) -> None:
    prefill, decode = pd_pods[0], pd_pods[1]
    prompt = _prompt(4, 5 * BLOCK + 3)
    params = await _prefill(http, prefill, prompt)
    gone = {**params, "remote_block_ids": [b + 10_000 for b in params["remote_block_ids"]]}
    before = await _metrics(http, decode)
    status, answer = await _post(http, decode, {"prompt": prompt, "max_tokens": 3, "kv_transfer_params": gone})
    assert status == 200, answer
    assert answer["choices"][0]["text"] == answer_text(prompt, 3)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    after = await _metrics(http, decode)
    assert delta(after, before, "vllm:nixl_num_failed_transfers_total") == 1
    assert delta(after, before, "vllm:prompt_tokens_by_source_total{local_compute}") == len(prompt)
    assert delta(after, before, "vllm:nixl_xfer_time_seconds_count") == 0


async def test_bad_kv_transfer_params_get_a_400_with_an_openai_error(pd_pods: list[FleetPod], http) -> None:
    decode = pd_pods[1]
    good = {
        "do_remote_prefill": True,
        "remote_engine_id": "e",
        "remote_block_ids": [1, 2],
        "remote_host": "127.0.0.1",
        "remote_port": 8000,
    }
    for params, field in (
        ("yes", "kv_transfer_params"),
        ([1], "kv_transfer_params"),
        ({"do_remote_decode": "true"}, "do_remote_decode"),
        ({"do_remote_decode": True, "do_remote_prefill": True}, "both"),
        ({**good, "remote_block_ids": "1,2"}, "remote_block_ids"),
        ({**good, "remote_block_ids": [1, -2]}, "remote_block_ids"),
        ({**good, "remote_port": 70000}, "remote_port"),
        ({**good, "remote_port": "8000"}, "remote_port"),
        ({**good, "remote_host": None}, "remote_host"),
        ({**good, "remote_engine_id": 5}, "remote_engine_id"),
    ):
        status, answer = await _post(http, decode, {"prompt": "hi", "max_tokens": 1, "kv_transfer_params": params})
        assert status == 400, (params, answer)
        assert answer["error"]["type"] == "BadRequestError" and answer["error"]["code"] == 400
        assert field in answer["error"]["message"], answer
    async with http.post(f"http://{pd_pods[0].address}/sim/kv/pull", json={"remote_block_ids": "x"}) as resp:
        assert resp.status == 400 and (await resp.json())["error"]["code"] == 400


async def test_expired_blocks_fall_back_to_a_local_prefill(http) -> None:
    with _sim(["--pd", "1:1", "--kv-transfer-timeout", "0.3"]) as lines:
        prefill, decode = (FleetPod.parse(line) for line in lines)
        prompt = _prompt(5, 4 * BLOCK + 1)
        params = await _prefill(http, prefill, prompt)

        async def expired() -> bool:
            return (await _metrics(http, prefill)).get("vllm:nixl_num_kv_expired_reqs_total") == 1

        await eventually(expired)
        body = {"prompt": prompt, "max_tokens": 2, "kv_transfer_params": params}
        status, answer = await _post(http, decode, body)
        assert status == 200 and answer["choices"][0]["text"] == answer_text(prompt, 2)
        after = await _metrics(http, decode)
        assert after["vllm:nixl_num_failed_transfers_total"] == 1
        assert after["vllm:prompt_tokens_by_source_total{local_compute}"] == len(prompt)


def test_pd_flags_are_checked() -> None:
    for args, text in (
        (["--pd", "2"], "--pd must be P:D"),
        (["--pd", "a:b"], "--pd must be P:D"),
        (["--pd", "1:1", "--role", "decode"], "exclude each other"),
        (["--pd", "1:1", "--pods", "3"], "disagrees"),
        (["--kv-transfer-timeout", "0"], "kv_transfer_timeout must be positive"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "picker.cli", "sim", *args], capture_output=True, text=True, timeout=30
        )
        assert result.returncode != 0, args
        assert text in result.stderr and "Traceback" not in result.stderr, (args, result.stderr)
