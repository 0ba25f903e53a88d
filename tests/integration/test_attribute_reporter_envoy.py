"""`request-attribute-reporter` through the real Envoy: the value the picker computes from the
response's usage reaches Envoy as dynamic metadata, where its access log reads it
(`%DYNAMIC_METADATA(envoy.lb:...)%`), for a JSON response and for an event stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import yaml

from picker_bench.envoy import EnvoyProcess, picker_config
from picker_bench.process import free_port
from tests.backends import usage_for
from tests.stack import Picker, loopback_addresses, start_backends, start_picker

COST = "x-gateway-inference-request-cost"
CONFIG = {
    "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
    "kind": "EndpointPickerConfig",
    "plugins": [
        {"type": "queue-scorer"},
        {
            "name": "cost",
            "type": "request-attribute-reporter",
            "parameters": {
                "attributes": [
                    {
                        "key": {"name": COST},  # the namespace defaults to envoy.lb
                        "expression": "usage.prompt_tokens + usage.completion_tokens",
                        "condition": "has(usage.prompt_tokens) && has(usage.completion_tokens)",
                    }
                ]
            },
        },
    ],
}


def logging_envoy(picker: Picker, log_dir: Path, access_log: Path) -> EnvoyProcess:
    """Envoy (not started) with the shipped duplex gateway config and an access log line per
    request: the cost."""
    listen, admin = ("127.0.0.1", free_port()), ("127.0.0.1", free_port())
    config = picker_config("duplex", listen, ("127.0.0.1", picker.grpc_port), admin)
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["access_log"] = [
        {
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                "path": str(access_log),
                "log_format": {"text_format_source": {"inline_string": f"%DYNAMIC_METADATA(envoy.lb:{COST})%\n"}},
            },
        }
    ]
    return EnvoyProcess("envoy-reporter", config, log_dir)


@pytest.fixture(scope="module")
def gateway(log_dir: Path) -> Iterator[tuple[EnvoyProcess, Path]]:
    addresses = loopback_addresses(2)
    backends = start_backends(addresses, log_dir)
    processes = [backends]
    try:
        picker = start_picker(
            log_dir, "--endpoints", ",".join(addresses), "--config-text", yaml.safe_dump(CONFIG), name="picker-reporter"
        )
        processes.append(picker.process)
        access_log = log_dir / "reporter-access.log"
        envoy = logging_envoy(picker, log_dir, access_log)
        processes.append(envoy)  # stopped even if it never becomes ready
        envoy.start().wait_ready(envoy.ready, timeout=30)
        yield envoy, access_log
    finally:
        for process in reversed(processes):
            process.stop()


async def logged_costs(access_log: Path, count: int, timeout: float = 10.0) -> list[str]:
    """The access log's first `count` lines, once Envoy has flushed them (it does every second)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        lines = access_log.read_text().splitlines() if access_log.exists() else []
        if len(lines) >= count:
            return lines[:count]
        assert loop.time() < deadline, f"the access log has {len(lines)} of {count} lines"
        await asyncio.sleep(0.05)


async def test_the_cost_reaches_envoy_as_dynamic_metadata(gateway: tuple[EnvoyProcess, Path]) -> None:
    envoy, access_log = gateway
    bodies = [
        json.dumps({"model": "m", "prompt": "price me " * 40}).encode(),
        json.dumps({"model": "m", "prompt": "stream me " * 90, "stream": True}).encode(),
    ]
    async with aiohttp.ClientSession() as session:
        for body in bodies:  # one after the other: the log's lines are in this order
            async with session.post(
                envoy.url + "/v1/completions", data=body, headers={"content-type": "application/json"}
            ) as response:
                assert response.status == 200
                await response.read()
    expected = [usage_for(body)["prompt_tokens"] + usage_for(body)["completion_tokens"] for body in bodies]
    assert await logged_costs(access_log, 2) == [str(cost) for cost in expected]
