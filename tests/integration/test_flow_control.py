"""Flow control through the real Envoy and a simulated vLLM pod.

One pod, the `concurrency-detector` at one request: the pool is saturated while one request is
in flight. The pod's `hang` fault holds a *blocker* request in flight, so everything after it
queues at the picker; clearing the fault lets the queue drain one request at a time, and the
order in which responses come back is the dispatch order.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from picker_bench.process import ManagedProcess
from picker_bench.soak import MODEL, start_sim_pods
from tests.sim_fixtures import eventually
from tests.stack import Picker, start_envoy, start_picker

OBJECTIVES = """apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata: {name: batch}
spec: {priority: -1, poolRef: {name: pool}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata: {name: chat}
spec: {priority: 10, poolRef: {name: pool}}
"""


def config(flow_control: str = "", fairness: str = "global-strict-fairness-policy") -> str:
    """The gate on, one request of concurrency per pod, `fairness` in the default band."""
    return f"""apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: concurrency-detector
  parameters: {{maxConcurrency: 1}}
- type: {fairness}
- type: queue-scorer
- type: max-score-picker
saturationDetector: {{pluginRef: concurrency-detector}}
schedulingProfiles:
- name: default
  plugins: [{{pluginRef: queue-scorer}}, {{pluginRef: max-score-picker}}]
flowControl:
  defaultPriorityBand: {{fairnessPolicyRef: {fairness}}}
{flow_control}"""


class FlowStack:
    """The sim pod, the picker (config file watched) and Envoy."""

    def __init__(self, sim: ManagedProcess, pod: str, picker: Picker, url: str, config_path: Path) -> None:
        self.sim, self.pod, self.picker, self.url, self.config_path = sim, pod, picker, url, config_path

    def samples(self, name: str) -> list[tuple[dict[str, str], float]]:
        """The picker's samples named `name` (a histogram's `_count`, a counter's `_total`)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.picker.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return [(s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]

    def queued(self) -> float:
        return sum(v for _, v in self.samples("inference_extension_flow_control_queue_size"))

    def saturation(self) -> float:
        (sample,) = self.samples("inference_extension_flow_control_pool_saturation")
        return sample[1]

    def routed(self) -> float:
        return sum(v for _, v in self.samples("picker_requests_routed_total"))

    def outcomes(self, outcome: str) -> float:
        """Requests that left flow control with `outcome`."""
        samples = self.samples("inference_extension_flow_control_request_queue_duration_seconds_count")
        return sum(v for labels, v in samples if labels["outcome"] == outcome)

    def hang(self, on: bool) -> None:
        req = urllib.request.Request(
            f"http://{self.pod}/sim/fault",
            data=json.dumps({"hang": on}).encode(),
            headers={"content-type": "application/json"},
        )
        urllib.request.urlopen(req, timeout=5).close()

    async def use(self, text: str) -> None:
        """Install `text` as the config and wait until the picker has it in force."""
        staged = self.config_path.with_suffix(".new")
        staged.write_text(text)
        os.replace(staged, self.config_path)
        digest = hashlib.sha256(text.encode()).hexdigest()

        async def installed() -> bool:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.picker.metrics_port}/config", timeout=5) as r:
                return bool(json.loads(r.read())["sha256"] == digest)

        await eventually(installed, 10)


@pytest.fixture(scope="module")
def flow_stack(log_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FlowStack]:
    tmp = tmp_path_factory.mktemp("flow")
    config_path, objectives = tmp / "config.yaml", tmp / "objectives.yaml"
    config_path.write_text(config())
    objectives.write_text(OBJECTIVES)
    sim, (pod,) = start_sim_pods(1, log_dir, "--time-scale", "50", name="sim-flow")
    try:
        picker = start_picker(
            log_dir,
            "--endpoints",
            pod,
            "--config-file",
            str(config_path),
            "--objectives-file",
            str(objectives),
            name="picker-flow",
        )
        try:
            envoy = start_envoy("duplex", picker.grpc_port, log_dir, name="envoy-flow")
            try:
                yield FlowStack(sim, pod, picker, envoy.url, config_path)
            finally:
                envoy.stop()
        finally:
            picker.stop()
    finally:
        sim.stop()


async def post(
    http: aiohttp.ClientSession, stack: FlowStack, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, object]]:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
    async with http.post(stack.url + "/v1/completions", json=body, headers=headers or {}) as resp:
        return resp.status, await resp.json(content_type=None)


async def blocked(stack: FlowStack, http: aiohttp.ClientSession) -> asyncio.Task[tuple[int, dict[str, object]]]:
    """Hang the pod and put one request in flight on it: the pool is saturated from here."""
    stack.hang(True)
    before = stack.routed()
    blocker = asyncio.create_task(post(http, stack))
    await eventually(lambda: stack.routed() == before + 1, 10)
    return blocker


async def queued(stack: FlowStack, count: int) -> None:
    await eventually(lambda: stack.queued() == count, 20)


async def test_a_high_priority_request_overtakes_the_queued_low_priority_ones(
    flow_stack: FlowStack, http: aiohttp.ClientSession
) -> None:
    await flow_stack.use(config())
    blocker = await blocked(flow_stack, http)
    order: list[str] = []

    async def one(name: str, objective: str) -> int:
        status, _ = await post(http, flow_stack, {"x-gateway-inference-objective": objective})
        order.append(name)
        return status

    lows = [asyncio.create_task(one(f"low{i}", "batch")) for i in range(200)]
    await queued(flow_stack, 200)
    high = asyncio.create_task(one("high", "chat"))
    await queued(flow_stack, 201)
    assert flow_stack.saturation() == 1.0  # the one pod's one slot is taken
    flow_stack.hang(False)
    statuses = await asyncio.gather(blocker, high, *lows)
    assert statuses[0][0] == 200 and set(statuses[1:]) == {200}
    await eventually(lambda: flow_stack.saturation() == 0.0, 10)  # read at scrape time: nothing in flight
    assert order[0] == "high"  # dispatched first, ahead of 200 requests queued before it
    assert order[1:] == sorted(order[1:], key=lambda n: int(n[3:]))  # the lows in arrival order (FCFS)


async def test_round_robin_gives_two_flows_equal_dispatch_shares(
    flow_stack: FlowStack, http: aiohttp.ClientSession
) -> None:
    await flow_stack.use(config(fairness="round-robin-fairness-policy"))
    blocker = await blocked(flow_stack, http)
    order: list[str] = []

    async def one(tenant: str) -> int:
        status, _ = await post(http, flow_stack, {"x-gateway-inference-fairness-id": tenant})
        order.append(tenant)
        return status

    noisy = [asyncio.create_task(one("noisy")) for _ in range(150)]
    await queued(flow_stack, 150)
    quiet = [asyncio.create_task(one("quiet")) for _ in range(50)]
    await queued(flow_stack, 200)
    flow_stack.hang(False)
    await blocker
    assert set(await asyncio.gather(*noisy, *quiet)) == {200}
    contended = order[:100]  # both flows had requests queued throughout these dispatches
    assert abs(contended.count("quiet") - 50) <= 5, contended


async def test_a_request_past_its_ttl_gets_503_and_a_full_queue_429(
    flow_stack: FlowStack, http: aiohttp.ClientSession
) -> None:
    await flow_stack.use(config("  defaultRequestTTL: 500ms\n  maxRequests: 2\n"))
    expired_before = flow_stack.outcomes("EvictedTTL")
    blocker = await blocked(flow_stack, http)
    try:
        waiting = [asyncio.create_task(post(http, flow_stack)) for _ in range(2)]
        await queued(flow_stack, 2)
        status, answer = await post(http, flow_stack)
        assert status == 429 and answer["error"]["code"] == "ResourceExhausted"  # type: ignore[index]
        for status, answer in await asyncio.wait_for(asyncio.gather(*waiting), 10):
            assert status == 503 and "timed out in queue" in answer["error"]["message"]  # type: ignore[index]
        assert flow_stack.outcomes("EvictedTTL") >= expired_before + 2
    finally:
        flow_stack.hang(False)
        await blocker


async def test_a_client_that_leaves_while_queued_leaves_the_queue_and_reaches_no_pod(
    flow_stack: FlowStack, http: aiohttp.ClientSession
) -> None:
    await flow_stack.use(config())
    blocker = await blocked(flow_stack, http)
    routed = flow_stack.routed()
    cancelled_before = flow_stack.outcomes("EvictedContextCancelled")
    leaving = asyncio.create_task(post(http, flow_stack))
    await queued(flow_stack, 1)
    leaving.cancel()  # the client closes its connection: Envoy resets the ext_proc stream
    await queued(flow_stack, 0)
    await eventually(lambda: flow_stack.outcomes("EvictedContextCancelled") == cancelled_before + 1, 5)
    flow_stack.hang(False)
    assert (await blocker)[0] == 200
    assert (await post(http, flow_stack))[0] == 200  # the queue is idle again
    assert flow_stack.routed() == routed + 1  # the later request only: the cancelled one never left


async def test_a_reload_with_requests_queued_loses_none(flow_stack: FlowStack, http: aiohttp.ClientSession) -> None:
    await flow_stack.use(config())
    blocker = await blocked(flow_stack, http)
    waiting = [
        asyncio.create_task(post(http, flow_stack, {"x-gateway-inference-fairness-id": f"t{i % 3}"})) for i in range(30)
    ]
    await queued(flow_stack, 30)
    await flow_stack.use(config("  defaultRequestTTL: 60s\n", fairness="round-robin-fairness-policy"))
    assert flow_stack.queued() == 30
    flow_stack.hang(False)
    assert (await blocker)[0] == 200
    assert [s for s, _ in await asyncio.gather(*waiting)] == [200] * 30
