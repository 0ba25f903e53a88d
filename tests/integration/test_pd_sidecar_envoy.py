"""Prefill/decode disaggregation end to end, all real processes: Envoy -> picker (llm-d's P/D
plugins, configured with llm-d's own `sim-pd-epp-config.yaml`) -> llm-d's `pd-sidecar` v0.4.0
(built from its Go module) in front of each decode `picker sim` pod -> the prefill sim pod.

The picker's decode endpoints are the sidecars (what Envoy forwards to; they proxy the decode
pods' /metrics too), labelled `llm-d.ai/role: decode`; its prefill endpoints are the prefill sim
pods, labelled `prefill`. What happened is read from the sims' vLLM metrics: prefill work on a
prefill pod, `prompt_tokens_by_source{source="external_kv_transfer"}` on the decode pod.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from picker.prefix.builtin_tokenizer import encode
from picker_bench.envoy import EnvoyProcess
from picker_bench.llmd import PdSidecar
from picker_bench.process import wait_until
from picker_bench.systems import FleetPod, write_endpoints_file
from tests.sim_fixtures import delta, eventually, pod_metrics, start_sim, stop_process
from tests.stack import Picker, start_envoy, start_picker

# On a fresh machine the sidecar is built first: about 4 minutes of CPU on 2 cores
# (tools/install-test-binaries.sh builds it before the suite, so `make test` does not wait here).
pytestmark = pytest.mark.timeout(600)

CONFIG = Path(__file__).resolve().parents[1] / "data" / "llmd_configs" / "sim-pd-epp-config.yaml"
THRESHOLD_CHARS = 10  # the config's pd-profile-handler threshold: shorter prompts are not disaggregated
BLOCK = 16  # the sims' KV block size (tokens)
LOCAL = "vllm:prompt_tokens_by_source_total{local_compute}"
TRANSFERRED = "vllm:prompt_tokens_by_source_total{external_kv_transfer}"
RUNNING = "vllm:num_requests_running"
PREFILL_DECODE = "llm_d_inference_scheduler_pd_decision_total{prefill-decode}"
DECODE_ONLY = "llm_d_inference_scheduler_pd_decision_total{decode-only}"
PREFILL_UNAVAILABLE = "picker_pd_prefill_unavailable_total"
STALENESS_SECONDS = 2.0  # picker serve's --metrics-staleness-threshold default
ANSWER_DEADLINE = aiohttp.ClientTimeout(total=60)  # a hang fails the test here


def _sim(args: Sequence[str]) -> tuple[subprocess.Popen[str], list[FleetPod]]:
    proc, lines = start_sim(["--base-port", "0", "--profile", "tiny", *args])
    return proc, [FleetPod.parse(line) for line in lines]


@pytest.fixture(scope="module")
def decode_pods() -> Iterator[list[FleetPod]]:
    proc, pods = _sim(["--role", "decode", "--pods", "2"])
    yield pods
    assert stop_process(proc) == 0


@pytest.fixture(scope="module")
def prefill_pods() -> Iterator[list[FleetPod]]:
    proc, pods = _sim(["--role", "prefill", "--pods", "2"])
    yield pods
    assert stop_process(proc) == 0


@pytest.fixture(scope="module")
def sidecars(sidecar_binary: Path, decode_pods: list[FleetPod], log_dir: Path) -> Iterator[dict[str, FleetPod]]:
    """Each decode pod's sidecar as the picker sees it (an endpoint labelled decode), by the
    decode pod's address."""
    started: list[PdSidecar] = []
    try:
        for pod in decode_pods:
            port = int(pod.address.rsplit(":", 1)[1])
            started.append(PdSidecar(sidecar_binary, port, log_dir, f"pd-sidecar-{pod.name}").start())
        yield {
            pod.address: FleetPod(f"{pod.name}-sidecar", sidecar.address, role="decode")
            for pod, sidecar in zip(decode_pods, started, strict=True)
        }
    finally:
        for sidecar in started:
            sidecar.stop()


@dataclass(frozen=True)
class Gateway:
    """Envoy and the picker behind it, routing over one P/D fleet."""

    envoy: EnvoyProcess
    picker: Picker

    @property
    def url(self) -> str:
        return self.envoy.url

    def picker_metrics(self) -> dict[str, float]:
        """The picker's samples, by name with the label values appended as in `name{v1,v2}`."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.picker.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return {
            s.name + (f"{{{','.join(s.labels.values())}}}" if s.labels else ""): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def decisions(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.picker.metrics_port}/debug/decisions", timeout=5) as r:
            entries: list[dict[str, Any]] = json.loads(r.read())["decisions"]
        return entries


@contextmanager
def gateway(
    prefill: Sequence[FleetPod], sidecars: dict[str, FleetPod], log_dir: Path, tmp: Path, tag: str
) -> Iterator[Gateway]:
    """Envoy -> picker over `prefill` and the decode pods' sidecars, once the picker has scraped
    every endpoint. llm-d's deploy scripts fill the config's `${PRIMARY_PORT}` in; 0 is its
    pd-profile-handler's default (no data-parallel ranks)."""
    config = tmp / f"pd-config-{tag}.yaml"
    config.write_text(CONFIG.read_text().replace("${PRIMARY_PORT}", "0"))
    endpoints = write_endpoints_file([*prefill, *sidecars.values()], tmp / f"endpoints-{tag}.yaml")
    picker = start_picker(
        log_dir,
        "--endpoints-file",
        str(endpoints),
        "--config-file",
        str(config),
        "--enable-debug-decisions",
        name=f"picker-pd-{tag}",
    )
    envoy: EnvoyProcess | None = None
    try:
        envoy = start_envoy("duplex", picker.grpc_port, log_dir, name=f"envoy-pd-{tag}")
        pool = Gateway(envoy, picker)
        fresh = len(prefill) + len(sidecars)

        def all_fresh() -> bool:
            return [v for k, v in pool.picker_metrics().items() if k.startswith("inference_pool_ready_pods")] == [fresh]

        wait_until(all_fresh, 30, "fresh metrics of every endpoint")
        yield pool
    finally:
        if envoy is not None:
            envoy.stop()
        picker.stop()


@pytest.fixture(scope="module")
def pd(
    prefill_pods: list[FleetPod],
    sidecars: dict[str, FleetPod],
    log_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Gateway]:
    with gateway(prefill_pods, sidecars, log_dir, tmp_path_factory.mktemp("pd"), "pd") as pool:
        yield pool


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=ANSWER_DEADLINE) as session:
        yield session


async def _snapshot(http: aiohttp.ClientSession, pods: Sequence[FleetPod]) -> dict[str, dict[str, float]]:
    return {pod.address: await pod_metrics(http, pod.address) for pod in pods}


def _grown(after: dict[str, dict[str, float]], before: dict[str, dict[str, float]], name: str) -> dict[str, float]:
    """Per pod address, how much sample `name` grew."""
    return {address: delta(after[address], before[address], name) for address in after}


def _words(tag: str, n: int) -> str:
    """A prompt of `n` words that no other prompt shares a prefix with (one token a word)."""
    return " ".join(f"{tag}{i}" for i in range(n))


def _sse_events(body: str) -> list[dict[str, Any]]:
    events = [line.removeprefix("data: ") for line in body.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", body
    return [json.loads(event) for event in events[:-1]]


@dataclass(frozen=True)
class Work:
    """Where a request's prompt was computed, per pod address, from the sims' metrics before and
    after it: on prefill pods, computed on decode pods, received by decode pods."""

    prefill: dict[str, float]
    decode_local: dict[str, float]
    transferred: dict[str, float]


async def _work_of(
    http: aiohttp.ClientSession,
    prefill_pods: Sequence[FleetPod],
    decode_pods: Sequence[FleetPod],
    before: tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]],
) -> Work:
    prefill_after, decode_after = await _snapshot(http, prefill_pods), await _snapshot(http, decode_pods)
    return Work(
        _grown(prefill_after, before[0], LOCAL),
        _grown(decode_after, before[1], LOCAL),
        _grown(decode_after, before[1], TRANSFERRED),
    )


def _only(grown: dict[str, float]) -> str:
    """The one pod whose sample grew."""
    grew = [address for address, d in grown.items() if d]
    assert len(grew) == 1, grown
    return grew[0]


async def test_a_long_unary_prompt_is_prefilled_where_the_picker_said_then_decoded(
    pd: Gateway, prefill_pods: list[FleetPod], decode_pods: list[FleetPod], sidecars: dict[str, FleetPod], http
) -> None:
    prompt = _words("unary", 12 * BLOCK + 5)
    before = await _snapshot(http, prefill_pods), await _snapshot(http, decode_pods)
    counted = pd.picker_metrics()
    async with http.post(
        f"{pd.url}/v1/completions", json={"model": "sim-model", "prompt": prompt, "max_tokens": 7}
    ) as r:
        assert r.status == 200, await r.text()
        answer = await r.json()
    work = await _work_of(http, prefill_pods, decode_pods, before)

    tokens = len(encode(prompt))
    usage = answer["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (tokens, 7, tokens + 7)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 12 * BLOCK  # received, not computed
    # The whole prompt was computed on one prefill pod; its full blocks came over to one decode
    # pod, which computed only the rest.
    prefilled_on, decoded_on = _only(work.prefill), _only(work.transferred)
    assert work.prefill[prefilled_on] == tokens
    assert work.transferred[decoded_on] == 12 * BLOCK and work.decode_local[decoded_on] == 5
    # Where the picker said: its prefill pick (x-prefiller-host-port) and its decode pick (the sidecar).
    decision = pd.decisions()[0]  # the newest
    assert decision["profiles"]["prefill"]["picks"] == [prefilled_on]
    assert decision["targets"] == [sidecars[decoded_on].address]
    after = pd.picker_metrics()
    assert after[PREFILL_DECODE] == counted.get(PREFILL_DECODE, 0) + 1


async def test_a_long_streamed_chat_is_disaggregated_and_its_usage_counts_the_transfer(
    pd: Gateway, prefill_pods: list[FleetPod], decode_pods: list[FleetPod], http
) -> None:
    messages = [{"role": "user", "content": _words("stream", 10 * BLOCK)}]
    body = {
        "model": "sim-model",
        "messages": messages,
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    before = await _snapshot(http, prefill_pods), await _snapshot(http, decode_pods)
    async with http.post(f"{pd.url}/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(await r.text())
    work = await _work_of(http, prefill_pods, decode_pods, before)

    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert len(text.split()) == 6
    usage = events[-1]["usage"]
    prefilled_on, decoded_on = _only(work.prefill), _only(work.transferred)
    prompt_tokens = usage["prompt_tokens"]
    assert work.prefill[prefilled_on] == prompt_tokens  # the prefill pod computed the whole prompt
    transferred = work.transferred[decoded_on]
    assert transferred == prompt_tokens // BLOCK * BLOCK and transferred > 0
    assert work.decode_local[decoded_on] == prompt_tokens - transferred
    assert usage["prompt_tokens_details"]["cached_tokens"] == transferred
    assert (usage["completion_tokens"], usage["total_tokens"]) == (6, prompt_tokens + 6)


async def test_a_prompt_below_the_threshold_is_decoded_alone_even_if_the_client_names_a_prefiller(
    pd: Gateway, prefill_pods: list[FleetPod], decode_pods: list[FleetPod], http
) -> None:
    prompt = "short one"
    assert len(prompt) < THRESHOLD_CHARS
    before = await _snapshot(http, prefill_pods), await _snapshot(http, decode_pods)
    counted = pd.picker_metrics()
    for headers in ({}, {"x-prefiller-host-port": prefill_pods[0].address}):
        body = {"model": "sim-model", "prompt": prompt, "max_tokens": 3}
        async with http.post(f"{pd.url}/v1/completions", json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
            usage = (await r.json())["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (2, 3)
    work = await _work_of(http, prefill_pods, decode_pods, before)
    # No prefill pod worked (the picker cleared the client's header), nothing was transferred.
    assert set(work.prefill.values()) == {0} and set(work.transferred.values()) == {0}
    assert sum(work.decode_local.values()) > 0
    after = pd.picker_metrics()
    assert after[DECODE_ONLY] == counted.get(DECODE_ONLY, 0) + 2
    assert after.get(PREFILL_UNAVAILABLE, 0) == counted.get(PREFILL_UNAVAILABLE, 0)


async def test_a_pd_config_over_a_fleet_without_prefill_pods_decodes_alone_logged_and_counted(
    sidecars: dict[str, FleetPod], decode_pods: list[FleetPod], log_dir: Path, tmp_path: Path, http
) -> None:
    prompt = _words("alone", 8 * BLOCK)
    with gateway([], sidecars, log_dir, tmp_path, "no-prefill") as pool:
        before = pool.picker_metrics()
        decode_before = await _snapshot(http, decode_pods)
        async with http.post(f"{pool.url}/v1/completions", json={"model": "sim-model", "prompt": prompt}) as r:
            assert r.status == 200, await r.text()
            usage = (await r.json())["usage"]
        decode_after = await _snapshot(http, decode_pods)
        after = pool.picker_metrics()
    assert usage["prompt_tokens"] == len(encode(prompt)) and usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert set(_grown(decode_after, decode_before, TRANSFERRED).values()) == {0}
    assert sum(_grown(decode_after, decode_before, LOCAL).values()) == len(encode(prompt))
    assert after[DECODE_ONLY] == before.get(DECODE_ONLY, 0) + 1
    assert after[PREFILL_UNAVAILABLE] == before.get(PREFILL_UNAVAILABLE, 0) + 1
    assert "no prefill pod passed the filters, decode only" in pool.picker.process.log_path.read_text()


async def test_a_prefill_pod_that_dies_mid_request_fails_the_request_without_a_hang(
    sidecars: dict[str, FleetPod], log_dir: Path, tmp_path: Path, http
) -> None:
    # Slowed 20,000 times: the prefill of this prompt takes over a minute and a half (longer than the
    # client waits), so it is surely still running when the pod is killed.
    proc, (prefill,) = _sim(["--role", "prefill", "--pods", "1", "--time-scale", "0.00005"])
    try:
        with gateway([prefill], sidecars, log_dir, tmp_path, "dying-prefill") as pool:
            body = {"model": "sim-model", "prompt": _words("dying", 12 * BLOCK), "max_tokens": 5, "stream": True}

            async def send() -> tuple[int, str]:
                async with http.post(f"{pool.url}/v1/completions", json=body) as r:
                    return r.status, await r.text()

            sent = asyncio.create_task(send())

            async def prefilling() -> bool:
                return (await pod_metrics(http, prefill.address)).get(RUNNING) == 1

            await eventually(prefilling, deadline_s=30)
            os.kill(proc.pid, signal.SIGKILL)
            assert proc.wait(10) == -signal.SIGKILL
            status, text = await sent  # within the session's deadline, or the test fails
            assert status == 502, text  # the sidecar's answer when its prefill request fails

            # Once its metrics are stale the picker leaves the dead pod out: long prompts are
            # decoded alone, counted as finding no prefill pod.
            def dead_pod_stale() -> bool:
                return pool.picker_metrics()[f"picker_metrics_age_seconds{{{prefill.address}}}"] > STALENESS_SECONDS

            await eventually(dead_pod_stale, deadline_s=30)
            unavailable = pool.picker_metrics().get(PREFILL_UNAVAILABLE, 0)
            body = {"model": "sim-model", "prompt": _words("after", 12 * BLOCK), "max_tokens": 5}
            async with http.post(f"{pool.url}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert pool.picker_metrics()[PREFILL_UNAVAILABLE] == unavailable + 1
    finally:
        stop_process(proc)


@pytest.mark.parametrize(
    "params",
    ["not an object", ["a", "list"], {"do_remote_prefill": "yes", "remote_block_ids": "x"}],
    ids=["string", "list", "wrong-types"],
)
async def test_malformed_kv_transfer_params_from_a_client_get_a_400_never_a_5xx(
    pd: Gateway, params: object, http
) -> None:
    for prompt in ("short", _words("malformed", 8 * BLOCK)):  # decoded alone, and disaggregated
        body = {"model": "sim-model", "prompt": prompt, "max_tokens": 3, "kv_transfer_params": params}
        async with http.post(f"{pd.url}/v1/completions", json=body, timeout=ANSWER_DEADLINE) as r:
            text = await r.text()
            assert r.status == 400, text
        # The engine's own OpenAI-style error (vLLM's type names), whichever pod refused it.
        assert "kv_transfer_params" in json.loads(text)["error"]["message"]
