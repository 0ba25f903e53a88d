"""The load generator: one asyncio process of streaming OpenAI clients, open loop.

Each session starts at its arrival time whatever the server is doing (open loop), and every
latency is measured from the moment the request was *due*, so a slow system cannot hide its
queueing behind a client that waited for it (no coordinated omission). Concurrency is capped so
the client itself stays cheap; time spent waiting for the cap counts as latency too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from picker_bench.workloads import Prompt, Session

POD_HEADER = "x-inference-pod"
UNFINISHED = "unfinished when the run ended"
BUILD_AHEAD_S = 0.2


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What one request did; `error` is None for a complete, well-formed answer."""

    session: int
    turn: int
    due_s: float  # when it was due, seconds from the run's start
    ttft_s: float | None
    e2e_s: float | None
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    pod: str | None
    error: str | None
    tenant: str | None = None  # the prompt's fairness id and objective, when it names them
    objective: str | None = None


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """Where and how to send."""

    base_url: str
    model: str
    max_concurrency: int = 256
    request_timeout_s: float = 300.0
    drain_timeout_s: float = 60.0  # after the last arrival, how long the rest may run
    announce_lengths: bool = True  # each answer's length as max_tokens (else only the model knows it)


class Progress:
    """Counters the progress display reads while the run goes on."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.errors = 0
        self.in_flight = 0


def _body(prompt: Prompt, model: str, announce_length: bool) -> bytes:
    # The answer's length is the workload's either way; announced, it is the request's limit (as
    # a client that knows what it needs); else only the simulated model knows it (min_tokens, its
    # natural end), as with clients that let the model decide.
    length = (
        {"max_tokens": prompt.max_tokens, "ignore_eos": True} if announce_length else {"min_tokens": prompt.max_tokens}
    )
    body: dict[str, Any] = {
        "model": model,
        **length,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    body.update(prompt.payload())
    return orjson.dumps(body)


def _has_content(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


async def _send(
    http: aiohttp.ClientSession, url: str, prompt: Prompt, body: bytes, session: int, turn: int, due: float, t0: float
) -> RequestResult:
    """One streaming request; never raises (failures become `error`)."""
    ttft = None
    usage: dict[str, Any] | None = None
    pod = None

    def result(error: str | None) -> RequestResult:
        details = (usage or {}).get("prompt_tokens_details") or {}
        return RequestResult(
            session,
            turn,
            due - t0,
            ttft,
            time.monotonic() - due if error is None else None,
            int((usage or {}).get("prompt_tokens") or 0),
            int(details.get("cached_tokens") or 0),
            int((usage or {}).get("completion_tokens") or 0),
            pod,
            error,
            prompt.tenant,
            prompt.objective,
        )

    headers = {"content-type": "application/json", **prompt.headers()}
    try:
        async with http.post(url, data=body, headers=headers) as resp:
            pod = resp.headers.get(POD_HEADER)
            if resp.status != 200:
                text = (await resp.text())[:200]
                return result(f"HTTP {resp.status}: {text}")
            last = b""
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                last = data
                if ttft is None and _has_content(orjson.loads(data)):
                    ttft = time.monotonic() - due
            # Only the final chunk (the usage chunk) needs parsing beyond the first content.
            if last:
                usage = orjson.loads(last).get("usage")
            if ttft is None:
                return result("no content in the stream")
            if not usage:
                return result("no usage in the stream")
            return result(None)
    except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError, ValueError) as e:
        return result(f"{type(e).__name__}: {e}"[:200])


async def run_load(
    sessions: Sequence[Session], options: LoadOptions, progress: Progress | None = None
) -> list[RequestResult]:
    """Play `sessions` against `options.base_url`; return every request's result."""
    results: list[RequestResult] = []
    cap = asyncio.Semaphore(options.max_concurrency)
    connector = aiohttp.TCPConnector(limit=options.max_concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=options.request_timeout_s)
    t0 = time.monotonic()

    async def play(index: int, session: Session) -> None:
        due = t0 + session.start_s
        for turn, prompt in enumerate(session.turns):
            if turn:
                due = time.monotonic() + session.think_s[turn - 1]
            # Build the body a little ahead so building it (a trace prompt is ~100 kB) never counts as latency.
            await asyncio.sleep(max(0.0, due - BUILD_AHEAD_S - time.monotonic()))
            path = "/v1/chat/completions" if prompt.api == "chat" else "/v1/completions"
            body = _body(prompt, options.model, options.announce_lengths)
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            try:
                async with cap:
                    if progress:
                        progress.in_flight += 1
                    try:
                        outcome = await _send(http, options.base_url + path, prompt, body, index, turn, due, t0)
                    finally:
                        if progress:
                            progress.in_flight -= 1
            except asyncio.CancelledError:
                record(
                    RequestResult(
                        index, turn, due - t0, None, None, 0, 0, 0, None, UNFINISHED, prompt.tenant, prompt.objective
                    )
                )
                raise
            record(outcome)
            if outcome.error is not None:
                return  # a broken conversation stops; its remaining turns are never sent

    def record(outcome: RequestResult) -> None:
        results.append(outcome)
        if progress:
            progress.done += 1
            progress.errors += outcome.error is not None

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        tasks = [asyncio.create_task(play(i, s)) for i, s in enumerate(sessions)]
        last_arrival = max((s.start_s for s in sessions), default=0.0)
        remaining = t0 + last_arrival + options.drain_timeout_s - time.monotonic()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(remaining, 0.001))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    return results
