"""Restarting the picker while requests wait in its flow-control queue, through the real Envoy
and a simulated vLLM pod (the setup of `test_flow_control`: one pod, one request of concurrency).

The picker is stopped (SIGTERM: it drains, and the queued requests wait out the shutdown grace)
or killed (SIGKILL). The gateway runs FailClose: the queued requests die with the picker's ext_proc streams and fail
at the gateway; none of them reaches the pod, then or after the new picker starts, and the one
request that was already on the pod (hung there) is not sent again: the gateway fails it too
and the pod drops it when Envoy closes the connection. The pod counts what it serves
(`vllm:request_success_total`): the count is taken at the pod, not at the picker.
"""

from __future__ import annotations

import asyncio
import os
import signal
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from picker_bench.soak import start_sim_pods
from tests.integration.test_flow_control import OBJECTIVES, FlowStack, config, post
from tests.sim_fixtures import eventually
from tests.stack import Picker, start_envoy, start_picker

QUEUED = 20


def served_by_pod(pod: str) -> float:
    """Requests the pod has finished serving (every finish reason but abort)."""
    with urllib.request.urlopen(f"http://{pod}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vllm:request_success_total" and s.labels.get("finished_reason") != "abort"
    )


@pytest.fixture
def restart_stack(log_dir: Path, tmp_path: Path) -> Iterator[tuple[FlowStack, list[str]]]:
    """A stack of its own (the test replaces its picker) and the picker's arguments."""
    config_path, objectives = tmp_path / "config.yaml", tmp_path / "objectives.yaml"
    config_path.write_text(config())
    objectives.write_text(OBJECTIVES)
    sim, (pod,) = start_sim_pods(1, log_dir, "--time-scale", "50", name="sim-flow-restart")
    args = ["--endpoints", pod, "--config-file", str(config_path), "--objectives-file", str(objectives)]
    stack: FlowStack | None = None
    try:
        picker = start_picker(log_dir, *args, name="picker-flow-restart-1")
        stack = FlowStack(sim, pod, picker, "", config_path)
        envoy = start_envoy("duplex", picker.grpc_port, log_dir, name="envoy-flow-restart")
        stack.url = envoy.url
        try:
            yield stack, args
        finally:
            envoy.stop()
    finally:
        if stack is not None:
            stack.picker.stop()  # the one running now: the first or its replacement
        sim.stop()


def crash(picker: Picker) -> None:
    """SIGKILL: the picker dies without draining."""
    os.killpg(picker.process.pid, signal.SIGKILL)
    assert picker.process.proc is not None
    picker.process.proc.wait(10)


@pytest.mark.parametrize("stop", [Picker.stop, crash], ids=["sigterm", "sigkill"])
async def test_a_restart_fails_the_queued_requests_at_the_gateway_and_none_reaches_the_pod_twice(
    restart_stack: tuple[FlowStack, list[str]],
    http: aiohttp.ClientSession,
    log_dir: Path,
    stop: Callable[[Picker], None],
) -> None:
    stack, picker_args = restart_stack
    served_before = served_by_pod(stack.pod)
    stack.hang(True)  # the pod holds the blocker: the pool is saturated and the rest queue
    blocker = asyncio.create_task(post(http, stack))
    await eventually(lambda: stack.routed() == 1, 10)
    waiting = [
        asyncio.create_task(post(http, stack, {"x-gateway-inference-fairness-id": f"t{i % 2}"})) for i in range(QUEUED)
    ]
    await eventually(lambda: stack.queued() == QUEUED, 20)

    grpc_port = stack.picker.grpc_port
    await asyncio.to_thread(stop, stack.picker)  # drained (the queue waits out the grace) or killed
    statuses = [status for status, _ in await asyncio.wait_for(asyncio.gather(*waiting), 30)]
    assert statuses == [500] * QUEUED  # FailClose: the gateway answers for the picker that left

    stack.picker = await asyncio.to_thread(
        start_picker,
        log_dir,
        *picker_args,
        name="picker-flow-restart-2",
        grpc_port=grpc_port,
    )
    stack.hang(False)
    # The blocker's ext_proc stream died too: its client got 500, and the pod, seeing Envoy close
    # the upstream connection, dropped it unserved (as vLLM aborts a request whose client left).
    assert (await asyncio.wait_for(blocker, 30))[0] == 500
    after = [await post(http, stack) for _ in range(3)]
    assert [status for status, _ in after] == [200] * 3
    # The pod served the three new requests and nothing else: not one of the queued twenty, and
    # not the blocker a second time.
    await eventually(lambda: served_by_pod(stack.pod) == served_before + 3, 10)
    assert stack.routed() == 3  # the new picker routed only the new requests
