"""Real peer routers (sglang-router, vllm-router) register simulated pods and route to them."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.sim_fixtures import eventually, start_sim, stop_process

VENV_BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sim_pods() -> Iterator[list[str]]:
    proc, lines = start_sim(["--pods", "2", "--base-port", "0", "--profile", "tiny", "--time-scale", "5"])
    try:
        yield [line.split()[2] for line in lines]
    finally:
        stop_process(proc)


def _router_command(kind: str, port: int, workers: list[str]) -> list[str]:
    if kind == "sglang":
        return [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *workers,
            "--policy",
            "cache_aware",
        ]
    exe = shutil.which("vllm-router", path=str(VENV_BIN)) or "vllm-router"
    return [exe, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers, "--policy", "cache_aware"]


async def _served_requests(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(url + "/metrics") as resp:
        for family in text_string_to_metric_families(await resp.text()):
            if family.name == "vllm:request_success":
                return sum(s.value for s in family.samples)
    raise AssertionError("no vllm:request_success on the pod's metrics page")


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
async def test_router_routes_to_sim_pods(kind: str, sim_pods: list[str], tmp_path: Path) -> None:
    port = _free_port()
    log = (tmp_path / f"{kind}.log").open("w")
    router = subprocess.Popen(
        _router_command(kind, port, sim_pods), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            before = sum([await _served_requests(http, url) for url in sim_pods])

            pings = 0

            async def completion_ok() -> bool:
                nonlocal pings
                try:
                    async with http.post(
                        base + "/v1/completions", json={"model": "sim-model", "prompt": "ping", "max_tokens": 1}
                    ) as r:
                        pings += r.status == 200
                        return r.status == 200
                except aiohttp.ClientError:
                    return False

            await eventually(completion_ok, deadline_s=30)

            async def one(i: int) -> str:
                body = {
                    "model": "sim-model",
                    "max_tokens": 4,
                    "stream": i % 2 == 0,
                    "messages": [{"role": "user", "content": f"question {i} " + "context " * (i * 7)}],
                }
                async with http.post(base + "/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    text = await resp.text()
                    assert ("data: [DONE]" in text) == (i % 2 == 0)
                    return resp.headers["x-inference-pod"]

            served = await asyncio.gather(*(one(i) for i in range(24)))
            assert set(served) <= {"sim-0", "sim-1"}
            after = sum([await _served_requests(http, url) for url in sim_pods])
            assert after - before == 24 + pings  # every request was served by a sim pod
    finally:
        stop_process(router)
        log.close()
