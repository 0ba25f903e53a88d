"""The simulator's HTTP API, served by a real in-process fleet and exercised over real sockets."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from picker.prefix.builtin_tokenizer import encode, render_chat
from picker_sim import Fleet, FleetConfig
from tests.sim_fixtures import eventually

LONG_PROMPT = " ".join(f"word{i}" for i in range(600))  # 600 tokens


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    fleet = Fleet(
        FleetConfig(
            pods=2,
            profile="llama3-8b-h100",
            time_scale=1.0,
            num_gpu_blocks=400,
            max_loras=1,
            lora_modules=("support-adapter",),
        )
    )
    await fleet.start()
    try:
        yield fleet
    finally:
        await fleet.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def _sse(resp: aiohttp.ClientResponse) -> tuple[list[dict], bool]:
    """(chunks, saw [DONE])."""
    chunks = []
    done = False
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line:
            continue
        assert line.startswith("data: ")
        data = line[len("data: ") :]
        if data == "[DONE]":
            done = True
            continue
        chunks.append(orjson.loads(data))
    return chunks, done


async def test_completion_reports_cached_whole_blocks(fleet: Fleet, http) -> None:
    """The cached tokens come back in the usage; that they cost no prefill time is the engine's
    test (test_sim_engine, in virtual time)."""
    url = fleet.pods[0].url + "/v1/completions"
    body = {
        "model": "sim-model",
        "prompt": LONG_PROMPT,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
        "some_unknown_field": {"x": 1},
    }
    usages = []
    for _ in range(2):
        async with http.post(url, json=body) as resp:
            assert resp.status == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            chunks, done = await _sse(resp)
        assert done
        usages.append(chunks[-1]["usage"])
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]).split()[:4]
    assert usages[0]["prompt_tokens"] == 600 and usages[0]["completion_tokens"] == 4
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] == 592  # 37 whole blocks of 16


async def test_non_streaming_completion_and_chat(fleet: Fleet, http) -> None:
    pod = fleet.pods[1]
    async with http.post(pod.url + "/v1/completions", json={"prompt": "hello there", "max_tokens": 3}) as resp:
        assert resp.status == 200
        assert resp.headers["x-inference-pod"] == "sim-1"
        assert resp.headers["x-inference-address"] == pod.address
        data = await resp.json()
    assert data["object"] == "text_completion" and data["choices"][0]["finish_reason"] == "length"
    assert len(data["choices"][0]["text"].split()) == 3
    assert data["usage"] == {
        "prompt_tokens": 2,
        "total_tokens": 5,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
    async with http.post(
        pod.url + "/v1/chat/completions", json={"model": "sim-model", "messages": messages, "max_completion_tokens": 2}
    ) as resp:
        chat = await resp.json()
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["usage"]["prompt_tokens"] == len(encode(render_chat(messages)))


async def test_without_ignore_eos_the_model_ends_its_answer_at_min_tokens(fleet: Fleet, http) -> None:
    # How a bench client lets answers run their natural length without announcing it in max_tokens.
    url = fleet.pods[0].url + "/v1/completions"
    cases = [
        ({"min_tokens": 7}, 7),  # no limit given: the natural length
        ({"min_tokens": 7, "max_tokens": 5}, 5),  # cut at the limit
        ({"min_tokens": 7, "max_tokens": 9}, 7),
        ({"min_tokens": 7, "max_tokens": 9, "ignore_eos": True}, 9),  # ignore_eos runs to the limit
        ({"min_tokens": 0, "max_tokens": 4}, 4),  # vLLM's default min_tokens: no natural length
    ]
    for fields, tokens in cases:
        async with http.post(url, json={"prompt": "hello there", **fields}) as resp:
            assert resp.status == 200, fields
            assert (await resp.json())["usage"]["completion_tokens"] == tokens, fields


async def test_streaming_chat_ends_with_done_and_no_usage_unless_asked(fleet: Fleet, http) -> None:
    body = {"messages": [{"role": "user", "content": "stream please"}], "max_tokens": 5, "stream": True}
    async with http.post(fleet.pods[0].url + "/v1/chat/completions", json=body) as resp:
        chunks, done = await _sse(resp)
    assert done
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = [c["choices"][0]["delta"].get("content") for c in chunks[1:-1]]
    assert len(content) == 5 and all(content)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks)


async def test_a_chat_stream_opens_with_its_first_token_as_vllm_does(fleet: Fleet, http) -> None:
    # vLLM sends the role chunk with the first engine output: a router measuring TTFT to the
    # first body byte must see the prefill, not the response headers' round trip.
    pod = fleet.pods[0]
    body = {"messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 200, "stream": True}
    async with http.post(pod.url + "/v1/chat/completions", json=body) as resp:
        first = orjson.loads((await resp.content.readline()).decode()[len("data: ") :])
        assert first["choices"][0]["delta"]["role"] == "assistant"
        (running,) = pod.engine.running  # still decoding its 200 tokens
        assert running.num_output >= 1  # the prefill was done before the first byte went out
        chunks, done = await _sse(resp)
    assert done and chunks[0]["choices"][0]["delta"]["content"]


async def test_tokenize_render_models_and_probes(fleet: Fleet, http) -> None:
    base = fleet.pods[0].url
    async with http.post(base + "/tokenize", json={"model": "sim-model", "prompt": "Hi, you!"}) as resp:
        tok = await resp.json()
    assert tok == {
        "count": 4,
        "max_model_len": 32768,
        "tokens": encode("Hi, you!"),
        "token_strs": ["Hi", ",", "you", "!"],
    }
    messages = [{"role": "user", "content": "Hi"}]
    async with http.post(base + "/tokenize", json={"messages": messages}) as resp:
        assert (await resp.json())["tokens"] == encode(render_chat(messages))
    # render answers vLLM's GenerateRequest shape (what vllm-router's cache-aware mode reads)
    async with http.post(base + "/v1/completions/render", json={"model": "sim-model", "prompt": "a b"}) as resp:
        assert (await resp.json())[0]["token_ids"] == encode("a b")
    async with http.post(base + "/v1/chat/completions/render", json={"messages": messages}) as resp:
        rendered = await resp.json()
    assert rendered["token_ids"] == encode(render_chat(messages)) and rendered["model"] == "sim-model"
    async with http.get(base + "/v1/models") as resp:
        ids = [m["id"] for m in (await resp.json())["data"]]
    assert ids == ["sim-model", "support-adapter"]
    for path in ("/health", "/server_info", "/model_info", "/get_server_info", "/get_model_info"):
        async with http.get(base + path) as resp:
            assert resp.status == 200, path
            assert resp.headers["x-inference-pod"] == "sim-0"


async def test_bad_requests_get_clear_errors(fleet: Fleet, http) -> None:
    url = fleet.pods[0].url
    cases = [
        ("/v1/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/completions", b"[1, 2]", 400, "JSON object"),
        ("/v1/completions", orjson.dumps({"model": "nope", "prompt": "x"}), 404, "does not exist"),
        ("/v1/completions", orjson.dumps({"prompt": {"a": 1}}), 400, "prompt must be"),
        ("/v1/completions", orjson.dumps({"prompt": "x", "max_tokens": -1}), 400, "max_tokens"),
        ("/v1/completions", orjson.dumps({"prompt": "x", "min_tokens": "3"}), 400, "min_tokens"),
        ("/v1/completions", orjson.dumps({"prompt": "x " * 40000}), 400, "maximum context length"),
        ("/v1/chat/completions", orjson.dumps({"messages": []}), 400, "messages"),
    ]
    for path, data, status, text in cases:
        async with http.post(url + path, data=data) as resp:
            assert resp.status == status, (path, data[:40])
            err = (await resp.json())["error"]
            assert text in err["message"] and err["code"] == status


async def test_lora_adapters_load_on_demand(fleet: Fleet, http) -> None:
    pod = fleet.pods[0]
    for model in ("sim-model-lora-x", "support-adapter"):
        async with http.post(
            pod.url + "/v1/completions", json={"model": model, "prompt": LONG_PROMPT[:200], "max_tokens": 1}
        ) as resp:
            assert resp.status == 200
            assert (await resp.json())["model"] == model
    assert list(pod.engine.loaded_loras) == ["support-adapter"]  # max_loras=1: x was swapped out
    async with http.get(pod.url + "/metrics") as resp:
        page = await resp.text()
    assert 'vllm:lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""}' in page


async def test_metrics_page_parses_with_vllm_names(fleet: Fleet, http) -> None:
    pod = fleet.pods[0]
    async with http.post(pod.url + "/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 3}) as resp:
        assert resp.status == 200
    async with http.get(pod.url + "/metrics") as resp:
        assert resp.status == 200
        families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert families[name].type == "gauge"
    for name in (
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:request_success",
        "vllm:num_preemptions",
    ):
        assert families[name].type == "counter", name
        assert all(s.name == name + "_total" for s in families[name].samples)
    for name in (
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
    ):
        assert families[name].type == "histogram", name
    config = families["vllm:cache_config_info"].samples[0].labels
    assert config["block_size"] == "16" and config["num_gpu_blocks"] == "400"
    queries = families["vllm:prefix_cache_queries"].samples[0]
    assert queries.value == 600 and queries.labels == {"engine": "0", "model_name": "sim-model"}
    ttft = {
        s.labels.get("le"): s.value
        for s in families["vllm:time_to_first_token_seconds"].samples
        if s.name.endswith("_bucket")
    }
    assert ttft["0.001"] == 0 and ttft["+Inf"] == 1
    assert families["vllm:generation_tokens"].samples[0].value == 3


async def test_fault_admin_api(fleet: Fleet, http) -> None:
    url = fleet.pods[0].url
    body = {"prompt": "x", "max_tokens": 1}
    async with http.post(url + "/v1/completions", json=body, headers={"x-sim-force-error": "429"}) as resp:
        assert resp.status == 429
        assert resp.headers["x-inference-pod"] == "sim-0"
    async with http.post(url + "/sim/fault", json={"error_rate": 1.0, "error_status": 503}) as resp:
        assert (await resp.json())["error_rate"] == 1.0
    async with http.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 503
    async with http.post(url + "/sim/fault", json={"error_rate": 2}) as resp:
        assert resp.status == 400 and "fraction" in (await resp.json())["error"]["message"]
    async with http.post(url + "/sim/fault", json={"bogus": 1}) as resp:
        assert resp.status == 400 and "unknown fault" in (await resp.json())["error"]["message"]
    async with http.post(url + "/sim/fault", json={"error_rate": 0, "metrics_garbage": True}) as resp:
        assert resp.status == 200
    async with http.get(url + "/metrics") as resp:
        with pytest.raises(ValueError):
            list(text_string_to_metric_families(await resp.text()))
    async with http.post(url + "/sim/fault", json={"metrics_garbage": False, "metrics_delay": 0.3}) as resp:
        assert resp.status == 200
    with pytest.raises(TimeoutError):  # a scrape slower than the scraper's timeout
        async with http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=0.1)):
            pass
    async with http.post(url + "/sim/fault", json={"metrics_delay": 0, "hang": True}) as resp:
        assert resp.status == 200
    with pytest.raises(TimeoutError):
        async with http.get(url + "/health", timeout=aiohttp.ClientTimeout(total=0.3)):
            pass
    async with http.post(url + "/sim/fault", json={"hang": False}) as resp:
        assert resp.status == 200
    async with http.get(url + "/health") as resp:
        assert resp.status == 200


async def test_crash_clears_cache_and_pod_comes_back(fleet: Fleet, http) -> None:
    pod = fleet.pods[0]
    async with http.post(pod.url + "/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 1}) as resp:
        assert resp.status == 200
    assert pod.engine.cache.refs
    async with http.post(pod.url + "/sim/crash", json={"down_seconds": 0.3}) as resp:
        assert resp.status == 200

    async def is_down() -> bool:
        return not pod.engine.cache.refs

    await eventually(is_down)

    async def is_up() -> bool:
        try:
            async with http.get(pod.url + "/health", timeout=aiohttp.ClientTimeout(total=1)) as r:
                return r.status == 200
        except aiohttp.ClientError:
            return False

    await eventually(is_up)
    async with http.post(pod.url + "/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 1}) as resp:
        assert (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_eviction_under_pressure_through_http(http) -> None:
    fleet = Fleet(FleetConfig(pods=1, profile="tiny", time_scale=20, num_gpu_blocks=50))
    await fleet.start()
    try:
        url = fleet.pods[0].url + "/v1/completions"
        prompts = [" ".join(f"p{j}w{i}" for i in range(320)) for j in range(3)]  # 20 blocks each
        for prompt in prompts:
            async with http.post(url, json={"prompt": prompt, "max_tokens": 1}) as resp:
                assert resp.status == 200
        # the first prompt's blocks were evicted to make room for the third
        async with http.post(url, json={"prompt": prompts[0], "max_tokens": 1}) as resp:
            assert (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"] < 320 - 16
        async with http.post(url, json={"prompt": prompts[0], "max_tokens": 1}) as resp:
            assert (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 304
    finally:
        await fleet.stop()


async def test_client_leaving_mid_stream_frees_seat_and_blocks(fleet: Fleet) -> None:
    pod = fleet.pods[0]
    body = {"prompt": LONG_PROMPT, "max_tokens": 2000, "stream": True}
    async with aiohttp.ClientSession() as http, http.post(pod.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        await resp.content.readline()  # the first token arrived; now hang up

    async def released() -> bool:
        return not pod.engine.running and pod.engine.cache.available == pod.engine.cache.num_blocks

    await eventually(released)
    assert pod.engine.stats.success.get("length", 0) == 0  # it was aborted, not finished
