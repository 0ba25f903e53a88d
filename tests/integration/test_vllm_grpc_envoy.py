"""`vllmgrpc-parser` through the real Envoy: gRPC `VllmEngine/Generate` calls are routed by
their prompt (a repeated prompt returns to the endpoint that holds it) and the usage of the
streamed gRPC answer reaches the picker's metrics. The model servers are real grpc.aio servers
speaking vLLM's gRPC engine API (smg-grpc-proto's generated code), on their own 127.0.0.x
addresses; Envoy speaks HTTP/2 to them, as a gateway in front of gRPC model servers does."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import yaml
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from picker_bench.envoy import EnvoyProcess, picker_config
from picker_bench.process import ManagedProcess, free_port
from tests.stack import loopback_addresses, start_picker

CONFIG = {
    "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
    "kind": "EndpointPickerConfig",
    "plugins": [{"type": "prefix-cache-scorer"}, {"type": "vllmgrpc-parser"}],
    "parser": {"pluginRef": "vllmgrpc-parser"},
}
PROMPT_TOKENS, COMPLETION_TOKENS = 40, 3


class Engine(pb_grpc.VllmEngineServicer):  # type: ignore[misc]  # generated, untyped base
    """A vLLM gRPC engine stand-in: streams one chunk per token, then the completion, and
    counts the prompts it served."""

    def __init__(self) -> None:
        self.prompts: list[str] = []

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.prompts.append(request.text)
        for i in range(1, COMPLETION_TOKENS + 1):
            counts = pb.GenerateStreamChunk(token_ids=[i], prompt_tokens=PROMPT_TOKENS, completion_tokens=i)
            yield pb.GenerateResponse(chunk=counts)
        complete = pb.GenerateComplete(
            output_ids=list(range(1, COMPLETION_TOKENS + 1)),
            finish_reason="stop",
            prompt_tokens=PROMPT_TOKENS,
            completion_tokens=COMPLETION_TOKENS,
        )
        yield pb.GenerateResponse(complete=complete)


def grpc_gateway(picker_port: int, log_dir: Path) -> EnvoyProcess:
    """Envoy (not started) with the shipped duplex gateway config, its original-destination
    cluster speaking HTTP/2 (gRPC) to the model servers."""
    listen, admin = ("127.0.0.1", free_port()), ("127.0.0.1", free_port())
    config = picker_config("duplex", listen, ("127.0.0.1", picker_port), admin)
    (cluster,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "original_destination_cluster"]
    options = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    cluster["typed_extension_protocol_options"] = {
        options: {"@type": f"type.googleapis.com/{options}", "explicit_http_config": {"http2_protocol_options": {}}}
    }
    return EnvoyProcess("envoy-grpc", config, log_dir)


def input_tokens_count(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as page:
        lines = page.read().decode().splitlines()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("inference_objective_input_tokens_count")
    )


async def test_generate_calls_are_routed_by_prompt_and_their_usage_counted(log_dir: Path) -> None:
    engines: dict[str, Engine] = {}
    servers = []
    stopped: list[ManagedProcess] = []
    try:
        for address in loopback_addresses(3):
            server = grpc.aio.server()
            engines[address] = Engine()
            pb_grpc.add_VllmEngineServicer_to_server(engines[address], server)
            server.add_insecure_port(address)
            await server.start()
            servers.append(server)
        picker = start_picker(
            log_dir, "--endpoints", ",".join(engines), "--config-text", yaml.safe_dump(CONFIG), name="picker-grpc"
        )
        stopped.append(picker.process)
        envoy = grpc_gateway(picker.grpc_port, log_dir)
        stopped.append(envoy)
        envoy.start().wait_ready(envoy.ready, timeout=30)

        async with grpc.aio.insecure_channel(envoy.url.removeprefix("http://")) as channel:
            stub = pb_grpc.VllmEngineStub(channel)
            prompt = "You are a helpful assistant. " * 20
            for i in range(4):
                request = pb.GenerateRequest(request_id=f"r{i}", text=prompt, stream=True)
                answers = [answer async for answer in stub.Generate(request, timeout=10)]
                assert answers[-1].complete.completion_tokens == COMPLETION_TOKENS
        # Every call reached one engine: the one the first call taught the picker holds the prompt.
        served = {address: len(engine.prompts) for address, engine in engines.items()}
        assert sorted(served.values()) == [0, 0, 4], served
        # The usage of each streamed answer was read from its gRPC messages.
        deadline = asyncio.get_running_loop().time() + 5
        while input_tokens_count(picker.metrics_port) < 4:
            assert asyncio.get_running_loop().time() < deadline, "usage not counted"
            await asyncio.sleep(0.05)
    finally:
        for process in reversed(stopped):
            process.stop()
        for server in servers:
            await server.stop(None)
