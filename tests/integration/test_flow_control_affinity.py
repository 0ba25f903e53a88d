"""Late binding with prefix affinity through the real Envoy and two simulated vLLM pods.

The `concurrency-detector` at one request per pod, requests waiting up to a minute for their
prefix holder (`maxAffinityWait`). Every request shares one long prompt, so after a first one
its pod is the only holder; the pod's `hang` fault holds a *blocker* there, so the requests
that follow are parked (the other pod has room, but they wait for the holder). Clearing the
fault lets them go through the holder one at a time, and the order in which responses come
back is the dispatch order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from picker_bench.soak import MODEL, start_sim_pods
from tests.integration.test_flow_control import FlowStack
from tests.sim_fixtures import eventually
from tests.stack import start_envoy, start_picker

CONFIG = """apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: concurrency-detector
  parameters: {maxConcurrency: 1}
- type: round-robin-fairness-policy
- type: approx-prefix-cache-producer
- type: prefix-cache-scorer
- type: max-score-picker
saturationDetector: {pluginRef: concurrency-detector}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: concurrency-detector}, {pluginRef: prefix-cache-scorer}, {pluginRef: max-score-picker}]
flowControl:
  maxAffinityWait: 60s
  defaultPriorityBand: {fairnessPolicyRef: round-robin-fairness-policy}
"""

PROMPT = "You are a helpful assistant who answers in one word. " * 30


class TwoPods:
    """The two pods' addresses and one `FlowStack` per pod (its `hang` and the shared picker)."""

    def __init__(self, stacks: dict[str, FlowStack]) -> None:
        self.stacks = stacks
        self.any = next(iter(stacks.values()))

    def routed_to(self) -> dict[str, float]:
        """Requests the picker has routed, per pod address."""
        return {labels["endpoint"]: v for labels, v in self.any.samples("picker_requests_routed_total")}


@pytest.fixture(scope="module")
def two_pods(log_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoPods]:
    config_path = tmp_path_factory.mktemp("flow-affinity") / "config.yaml"
    config_path.write_text(CONFIG)
    sim, pods = start_sim_pods(2, log_dir, "--time-scale", "50", name="sim-flow-affinity")
    try:
        picker = start_picker(
            log_dir, "--endpoints", ",".join(pods), "--config-file", str(config_path), name="picker-flow-affinity"
        )
        try:
            envoy = start_envoy("duplex", picker.grpc_port, log_dir, name="envoy-flow-affinity")
            try:
                yield TwoPods({pod: FlowStack(sim, pod, picker, envoy.url, config_path) for pod in pods})
            finally:
                envoy.stop()
        finally:
            picker.stop()
    finally:
        sim.stop()


async def test_parked_requests_take_turns_by_fairness_not_by_when_they_were_parked(
    two_pods: TwoPods, http: aiohttp.ClientSession
) -> None:
    order: list[str] = []

    async def send(name: str, tenant: str) -> int:
        body = {"model": MODEL, "prompt": PROMPT + name, "max_tokens": 1}
        headers = {"x-gateway-inference-fairness-id": tenant}
        async with http.post(two_pods.any.url + "/v1/completions", json=body, headers=headers) as resp:
            await resp.read()
        order.append(name)
        return resp.status

    before = two_pods.routed_to()
    assert await send("warm", "warm") == 200  # the prompt is now cached on one pod only
    after = two_pods.routed_to()
    (holder,) = [pod for pod, n in after.items() if n > before.get(pod, 0)]
    stack = two_pods.stacks[holder]
    stack.hang(True)
    try:
        blocker = asyncio.create_task(send("blocker", "warm"))
        await eventually(lambda: two_pods.routed_to()[holder] == after[holder] + 1, 10)
        # The other pod has room, but the holder is full: these wait for it (parked).
        noisy = [asyncio.create_task(send(f"noisy{i}", "noisy")) for i in range(6)]
        await eventually(lambda: stack.queued() == 6, 10)
        quiet = [asyncio.create_task(send(f"quiet{i}", "quiet")) for i in range(2)]
        await eventually(lambda: stack.queued() == 8, 10)
        assert two_pods.routed_to() == {**after, holder: after[holder] + 1}  # nothing went to the other pod
    finally:
        stack.hang(False)
    assert set(await asyncio.wait_for(asyncio.gather(blocker, *noisy, *quiet), 30)) == {200}
    tenants = [name.rstrip("0123456789") for name in order[order.index("blocker") + 1 :]]
    # The quiet tenant's requests, parked after all of the noisy tenant's, alternate with them.
    assert tenants[:4] in (["noisy", "quiet"] * 2, ["quiet", "noisy"] * 2), tenants
    assert two_pods.routed_to()[holder] == after[holder] + 9  # all of them on the holder, one at a time
