"""The picker routes real Envoy traffic, in both body modes, with the EPP protocol."""

from __future__ import annotations

import asyncio
import hashlib
import json
import urllib.request

import aiohttp
import pytest

from tests.stack import Stack

pytestmark = pytest.mark.asyncio(loop_scope="module")


def completion(prompt: str = "hello", **extra: object) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, **extra}).encode()


async def post(session: aiohttp.ClientSession, url: str, body: bytes, **headers: str) -> tuple[int, dict, bytes]:
    async with session.post(url, data=body, headers={"content-type": "application/json", **headers}) as r:
        return r.status, dict(r.headers), await r.read()


def metric(stack: Stack, name: str) -> float:
    """Sum of every sample of `name` on the picker's /metrics page."""
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.picker.metrics_port}/metrics", timeout=5) as r:
        total = 0.0
        for line in r.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
        return total


async def test_requests_land_where_the_picker_said(stack: Stack) -> None:
    url = stack.envoy.url + "/v1/completions"
    seen = set()
    async with aiohttp.ClientSession() as session:
        for i in range(12):
            status, headers, body = await post(session, url, completion(f"prompt {i}"))
            assert status == 200, body
            answer = json.loads(body)
            # The backend that answered is the one named in the header the picker set.
            assert answer["headers"]["x-gateway-destination-endpoint"] == answer["backend"]
            assert headers["x-backend"] == answer["backend"]
            seen.add(answer["backend"])
    assert seen <= set(stack.backends)
    assert len(seen) >= 2  # the least-loaded pick spreads sequential requests


async def test_a_one_mebibyte_body_arrives_byte_for_byte(stack: Stack) -> None:
    body = completion("x" * (1 << 20))
    async with aiohttp.ClientSession() as session:
        status, _, answer = await post(session, stack.envoy.url + "/v1/completions", body)
    assert status == 200
    answer = json.loads(answer)
    assert answer["body_len"] == len(body)
    assert answer["body_sha256"] == hashlib.sha256(body).hexdigest()


async def test_headers_only_request_is_picked_at_once(stack: Stack) -> None:
    async with aiohttp.ClientSession() as session, session.get(stack.envoy.url + "/v1/models") as r:
        assert r.status == 200
        answer = await r.json()
    assert answer["backend"] in stack.backends
    assert answer["headers"]["x-gateway-destination-endpoint"] == answer["backend"]


async def test_streamed_sse_passes_through_intact_and_usage_is_counted(stack: Stack) -> None:
    before = metric(stack, "inference_objective_input_tokens_count")
    body = completion("stream me", stream=True)
    async with aiohttp.ClientSession() as session:
        status, headers, raw = await post(session, stack.envoy.url + "/v1/completions", body)
    assert status == 200
    assert headers["Content-Type"].startswith("text/event-stream")
    events = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["text"] for e in events[:5]] == [f"t{i} " for i in range(5)]
    usage = json.loads(events[-2])["usage"]
    if stack.mode == "buffered":
        return  # the minimal config sends no response phases, so the picker sees no usage
    await _until(lambda: metric(stack, "inference_objective_input_tokens_count") == before + 1)
    assert (
        metric(stack, "inference_objective_prompt_cached_tokens_sum") >= usage["prompt_tokens_details"]["cached_tokens"]
    )


async def _until(condition, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "BadRequest"),
        (json.dumps({"prompt": "no model"}).encode(), 400, "BadRequest"),
        (json.dumps({"model": 7, "prompt": "x"}).encode(), 400, "BadRequest"),
        (json.dumps({"model": "m", "prompt": 3.5}).encode(), 400, "BadRequest"),
        (completion("y" * (3 << 20)), 413, "PayloadTooLarge"),
    ],
)
async def test_bad_requests_get_openai_style_errors(stack: Stack, body: bytes, status: int, code: str) -> None:
    async with aiohttp.ClientSession() as session:
        got, headers, raw = await post(session, stack.envoy.url + "/v1/completions", body)
    assert got == status
    assert headers["Content-Type"] == "application/json"
    error = json.loads(raw)["error"]
    assert error["code"] == code and error["message"] and error["type"]
    # The picker survives and keeps routing.
    async with aiohttp.ClientSession() as session:
        ok, _, _ = await post(session, stack.envoy.url + "/v1/completions", completion())
    assert ok == 200


async def test_two_hundred_concurrent_requests_none_misrouted(stack: Stack) -> None:
    connector = aiohttp.TCPConnector(limit=200)
    async with aiohttp.ClientSession(connector=connector) as session:
        results = await asyncio.gather(
            *(
                post(
                    session,
                    stack.envoy.url + "/v1/chat/completions",
                    json.dumps({"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]}).encode(),
                )
                for i in range(200)
            )
        )
    assert all(status == 200 for status, _, _ in results)
    answers = [json.loads(body) for _, _, body in results]
    assert all(a["headers"]["x-gateway-destination-endpoint"] == a["backend"] for a in answers)
    assert {a["backend"] for a in answers} == set(stack.backends)
    # Every in-flight slot was released.
    await _until(lambda: metric(stack, "picker_in_flight_requests") == 0)
