"""Self-benchmark: how much CPU the simulator spends per request and per streamed token.

    python -m picker_sim.selfbench [--pods 16] [--rate 300] [--duration 10] ...

Starts `picker sim` as a child process, drives it from this process at a constant open-loop
request rate (spread round-robin over the pods, streaming completions), and reads the child's
CPU time from /proc before and after the measured window. Two runs, one with a single output
token and one with `--output-tokens`, separate the per-request cost from the per-token cost.
Reports CPU per request, per streamed token, the share of one core used, and the request rate
one core would sustain at that mix (pods x req/s).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
from dataclasses import dataclass

import aiohttp
import uvloop

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


@dataclass(frozen=True, slots=True)
class RunResult:
    """One measured window."""

    requests: int
    errors: int
    tokens: int
    wall: float
    cpu: float


def _start_sim(pods: int, profile: str, time_scale: float) -> tuple[subprocess.Popen[str], list[str]]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "picker.cli",
            "sim",
            "--pods",
            str(pods),
            "--base-port",
            "0",
            "--profile",
            profile,
            "--time-scale",
            str(time_scale),
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    urls: list[str] = []
    for line in proc.stdout:
        if line.strip() == "ready":
            return proc, urls
        urls.append(line.split()[2])
    raise RuntimeError(f"picker sim exited with {proc.wait()}")


async def _drive(urls: list[str], rate: float, duration: float, output_tokens: int, prompt: str, pid: int) -> RunResult:
    tokens = errors = done = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def one(url: str) -> None:
            nonlocal tokens, errors, done
            body = {"prompt": prompt, "max_tokens": output_tokens, "stream": True}
            try:
                async with http.post(url + "/v1/completions", json=body) as resp:
                    data = await resp.read()
                    if resp.status != 200:
                        errors += 1
                        return
                tokens += data.count(b'"text":"') - 1  # minus the final empty chunk
                done += 1
            except aiohttp.ClientError:
                errors += 1

        loop = asyncio.get_running_loop()
        tasks = set()
        cpu0, t0 = _cpu_seconds(pid), loop.time()
        n = int(rate * duration)
        for i in range(n):
            delay = t0 + i / rate - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)  # open-loop pacing
            task = loop.create_task(one(urls[i % len(urls)]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
        wall, cpu = loop.time() - t0, _cpu_seconds(pid) - cpu0
    return RunResult(done, errors, tokens, wall, cpu)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m picker_sim.selfbench", description=__doc__.split("\n")[0])
    p.add_argument("--pods", type=int, default=16)
    p.add_argument("--rate", type=float, default=300.0, help="requests per second over all pods")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per measured run")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=200)
    p.add_argument("--profile", default="llama3-8b-h100")
    p.add_argument("--time-scale", type=float, default=1.0)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    prompt = " ".join(f"w{i % 997}" for i in range(args.prompt_words))
    proc, urls = _start_sim(args.pods, args.profile, args.time_scale)
    try:
        uvloop.run(_drive(urls, min(args.rate, 50.0), 2.0, 4, prompt, proc.pid))  # warm-up
        short = uvloop.run(_drive(urls, args.rate, args.duration, 1, prompt, proc.pid))
        long = uvloop.run(_drive(urls, args.rate, args.duration, args.output_tokens, prompt, proc.pid))
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(10)
    per_req_short = short.cpu / max(short.requests, 1)
    per_req_long = long.cpu / max(long.requests, 1)
    extra_tokens = long.tokens / max(long.requests, 1) - short.tokens / max(short.requests, 1)
    per_token = (per_req_long - per_req_short) / extra_tokens if extra_tokens > 0 else float("nan")
    print(
        f"machine: {os.cpu_count()} CPUs, python {sys.version.split()[0]}; {args.pods} pods, "
        f"profile {args.profile}, time-scale {args.time_scale}, prompt {args.prompt_words} words"
    )
    for name, r in (("1 output token", short), (f"{args.output_tokens} output tokens", long)):
        share = r.cpu / r.wall
        print(
            f"{name:>18}: {r.requests} ok, {r.errors} errors in {r.wall:.1f} s ({r.requests / r.wall:.0f} req/s), "
            f"{r.tokens} tokens streamed; sim CPU {r.cpu:.2f} s = {share:.0%} of a core; "
            f"{1000 * r.cpu / max(r.requests, 1):.3f} ms CPU/request; "
            f"one core sustains ~{r.requests / r.wall / max(share, 1e-9):.0f} req/s at this mix"
        )
    print(
        f"marginal CPU per streamed token: {per_token * 1e6:.1f} us; "
        f"fixed CPU per request: {per_req_short * 1e3:.3f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
