"""The bench load generator against a real HTTP server that records what it was sent."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time

import orjson
import pytest
from aiohttp import web

from picker.prefix.builtin_tokenizer import encode, render_chat
from picker_bench import workloads as w
from picker_bench.bound import infinite_cache_hit_ratio
from picker_bench.loadgen import UNFINISHED, LoadOptions, Progress, run_load

FIRST_TOKEN_DELAY = 0.15


class RecordingServer:
    """An OpenAI-style streaming server: a role-only chunk, a pause, content, then usage."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.headers: list[dict[str, str]] = []
        self.arrivals: list[float] = []
        self.hang = False
        self.release = asyncio.Event()  # set at teardown so hanging handlers end

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        self.arrivals.append(time.monotonic())
        if "fail" in json.dumps(body):
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if self.hang:
            await self.release.wait()
        prompt_tokens = len(encode(body["prompt"])) if "prompt" in body else len(encode(render_chat(body["messages"])))
        resp = web.StreamResponse(
            headers={"content-type": "text/event-stream", "x-inference-pod": f"pod-{len(self.bodies) % 2}"}
        )
        await resp.prepare(request)
        chat = "messages" in body
        await resp.write(
            b"data: "
            + orjson.dumps({"choices": [{"delta": {"role": "assistant"}} if chat else {"text": ""}]})
            + b"\n\n"
        )
        await asyncio.sleep(FIRST_TOKEN_DELAY)  # the simulated model's time to first token
        answer = body.get("max_tokens") or body["min_tokens"]  # announced, or the model's natural end
        for _ in range(answer):
            choice = {"delta": {"content": " tok"}} if chat else {"text": " tok"}
            await resp.write(b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\n")
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": answer,
            "prompt_tokens_details": {"cached_tokens": prompt_tokens // 2},
        }
        await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\ndata: [DONE]\n\n")
        return resp


@pytest.fixture
async def server():
    rec = RecordingServer()
    app = web.Application()
    app.router.add_post("/v1/completions", rec.handle)
    app.router.add_post("/v1/chat/completions", rec.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield rec, f"http://127.0.0.1:{port}"
    rec.release.set()
    await runner.cleanup()


async def test_streaming_measures_ttft_usage_and_pod(server) -> None:
    rec, url = server
    spec = w.SharedPrefixSpec(groups=2, prompts_per_group=3, system_prompt_len=40, question_len=5, output_len=4)
    sessions = w.shared_prefix(spec, rate=40.0, duration_s=0.5, seed=1)
    progress = Progress(len(sessions))
    results = await run_load(sessions, LoadOptions(url, "m"), progress)
    assert len(results) == len(sessions) == progress.done and progress.errors == 0
    for r in results:
        assert r.error is None
        assert FIRST_TOKEN_DELAY <= r.ttft_s < r.e2e_s  # the first token came after the server's pause
        assert r.prompt_tokens == len(
            encode(render_chat([{"role": "system", "content": "x " * 40}, {"role": "user", "content": "y " * 5}]))
        )
        assert r.cached_tokens == r.prompt_tokens // 2 and r.output_tokens == 4
        assert r.pod in ("pod-0", "pod-1")
    sent = rec.bodies[0]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True} and sent["model"] == "m"


async def test_arrivals_are_open_loop(server) -> None:
    """Each request goes at its arrival time, not after the answer before it: with the server
    answering nothing, all four still reach it; once it answers, all four complete."""
    rec, url = server
    rec.hang = True
    sessions = [w.Session(0.3 * i, (w.Prompt(1, hash_ids=(i,), input_length=10),)) for i in range(4)]
    load = asyncio.create_task(run_load(sessions, LoadOptions(url, "m")))
    async with asyncio.timeout(10):
        while len(rec.arrivals) < 4:
            await asyncio.sleep(0.01)
    rec.release.set()
    results = await load
    assert [r.error for r in results] == [None] * 4
    assert sorted(r.due_s for r in results) == pytest.approx([0.0, 0.3, 0.6, 0.9])  # as scheduled


async def test_multi_turn_turns_follow_each_other(server) -> None:
    _, url = server
    spec = w.MultiTurnSpec(sessions=2, turns=3, system_prompt_len=10, question_len=3, answer_len=2, think_time_s=0.0)
    sessions = w.multi_turn(spec, rate=50.0, duration_s=10.0, seed=2)
    results = await run_load(sessions, LoadOptions(url, "m"))
    assert len(results) == 6 and all(r.error is None for r in results)
    for s in range(2):
        turns = sorted((r for r in results if r.session == s), key=lambda r: r.turn)
        for a, b in itertools.pairwise(turns):
            assert b.due_s >= a.due_s + a.e2e_s - 0.01  # a later turn waits for the earlier answer


async def test_session_keys_reach_the_server_in_the_body(server) -> None:
    rec, url = server
    spec = w.ConversationSpec(
        applications=2, system_prompt_len=8, user_len=4, answer_len=3, one_off_len=12, think_scale=0.005
    )
    sessions = w.conversation(spec, rate=40.0, duration_s=1.0, seed=4)
    key_of = {p.messages: p.session_key for p in w.all_prompts(sessions)}
    assert None in key_of.values() and len(set(key_of.values())) > 2  # one-offs and several conversations
    results = await run_load(sessions, LoadOptions(url, "m"))
    assert len(results) == len(key_of) and all(r.error is None for r in results)
    for body in rec.bodies:
        sent = tuple((m["role"], m["content"]) for m in body["messages"])
        assert body.get("prompt_cache_key") == key_of[sent]


async def test_unannounced_answer_lengths_go_as_min_tokens_only(server) -> None:
    rec, url = server
    sessions = [
        w.Session(0.0, (w.Prompt(5, messages=(("user", "hi"),)), w.Prompt(3, messages=(("user", "yo"),))), (0.0,))
    ]
    results = await run_load(sessions, LoadOptions(url, "m", announce_lengths=False))
    assert [r.output_tokens for r in results] == [5, 3]
    assert [(b.get("max_tokens"), b.get("ignore_eos"), b["min_tokens"]) for b in rec.bodies] == [
        (None, None, 5),
        (None, None, 3),
    ]


async def test_tenants_and_objectives_reach_the_server_in_headers(server) -> None:
    rec, url = server
    spec = w.MultiTenantSpec(tenants=2, system_prompt_len=8, question_len=4, output_len=2, burst_rate=20.0)
    sessions = w.multi_tenant(spec, rate=20.0, duration_s=1.0, seed=1)
    sent = {p.messages: (p.tenant, p.objective) for p in w.all_prompts(sessions)}
    results = await run_load(sessions, LoadOptions(url, "m"))
    assert len(results) == len(sent) and all(r.error is None for r in results)
    assert {(r.tenant, r.objective) for r in results} == set(sent.values())
    for body, headers in zip(rec.bodies, rec.headers, strict=True):
        prompt = tuple((m["role"], m["content"]) for m in body["messages"])
        assert (headers["x-gateway-inference-fairness-id"], headers["x-gateway-inference-objective"]) == sent[prompt]


async def test_errors_and_unfinished_requests_are_counted(server) -> None:
    rec, url = server
    failing = w.Session(
        0.0, (w.Prompt(2, messages=(("user", "fail"),)), w.Prompt(2, messages=(("user", "never sent"),))), (0.0,)
    )
    results = await run_load([failing], LoadOptions(url, "m"))
    assert len(results) == 1 and results[0].error.startswith("HTTP 500")  # the conversation stops there
    rec.hang = True
    results = await run_load(
        [w.Session(0.0, (w.Prompt(2, messages=(("user", "hi"),)),))], LoadOptions(url, "m", drain_timeout_s=0.3)
    )
    assert [r.error for r in results] == [UNFINISHED]


async def test_replayed_trace_keeps_its_prefix_sharing_on_the_wire(server) -> None:
    rec, url = server
    rng = random.Random(1)
    rows, next_id = [], 10
    for c in range(6):
        ids = [c % 2]
        for _ in range(3):
            ids = ids + [next_id]
            next_id += 1
            rows.append(w.TraceRecord(rng.uniform(0, 300), 512 * (len(ids) - 1) + rng.randint(1, 512), 1, tuple(ids)))
    sessions = w.trace_replay(rows, speed=1.0, duration_s=10.0, seed=3)
    results = await run_load(sessions, LoadOptions(url, "m"))
    assert len(results) == len(rows) and all(r.error is None for r in results)
    expected = infinite_cache_hit_ratio((p.token_ids() for p in w.all_prompts(sessions)), 16)
    on_the_wire = infinite_cache_hit_ratio((encode(b["prompt"]) for b in rec.bodies), 16)
    assert on_the_wire == pytest.approx(expected) and expected > 0.3
