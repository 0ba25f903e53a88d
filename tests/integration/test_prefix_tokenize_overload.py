"""A tokenizer slower than the 400 ms preparation bound never runs on the event loop.

When tokenizing a prompt takes longer than the bound, the request is scheduled without its
prefix data (as the reference does for any PrepareData timeout); the loop must not tokenize
the prompt again itself, or every stream stalls behind it exactly when the picker is loaded.
Real Envoy, the real compiled core and real backends; only the tokenizer is slowed on purpose
(the built-in one, held until the test lets it go).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import aiohttp
import pytest

from picker.config.runtime import RuntimeHolder
from picker.datastore.endpoint import Endpoint, split_host_port
from picker.datastore.store import Datastore
from picker.extproc.server import ExtProcServer
from picker.prefix.plugins import ApproxPrefixCacheProducer
from picker.prefix.prompt_blocks import INLINE_TOKENIZE_CHARS
from picker.prefix.tokenizer import BuiltinPromptTokenizer
from picker.requestcontrol.director import Director
from tests.stack import loopback_addresses, start_backends, start_envoy

CONFIG = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: approx-prefix-cache-producer
  name: prefix
  parameters: {tokenizers: {"*": builtin}}
- type: prefix-cache-scorer
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-scorer
  - pluginRef: queue-scorer
  - pluginRef: max-score-picker
"""
# How long a held tokenizer call waits to be let go before it gives up (a bound, not a pause).
HOLD_LIMIT_S = 10.0


class HeldTokenizer(BuiltinPromptTokenizer):
    """The built-in tokenizer, held in every call until `release` is set; records the threads
    that called it."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.threads: list[str] = []

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        self.threads.append(threading.current_thread().name)
        self.release.wait(HOLD_LIMIT_S)
        return super().encode_batch(texts)


@pytest.fixture
async def envoy_url(tmp_path: Path) -> AsyncIterator[tuple[str, HeldTokenizer]]:
    addresses = loopback_addresses(2)
    backends = start_backends(addresses, tmp_path)
    store = Datastore()
    store.set_endpoints([Endpoint(*split_host_port(a)) for a in addresses])
    holder = RuntimeHolder(store)
    holder.load_text(CONFIG)
    producer = holder.current.plugins["prefix"]
    assert isinstance(producer, ApproxPrefixCacheProducer)
    held = HeldTokenizer()
    producer.hasher.tokenizers["*"] = held
    server = ExtProcServer(Director(store, holder))
    port = server.start("127.0.0.1:0")
    envoy = start_envoy("duplex", port, tmp_path, tls=False)
    try:
        yield envoy.url, held
    finally:
        held.release.set()
        envoy.stop()
        await server.stop(0)
        backends.stop()


async def test_a_prompt_tokenized_past_the_bound_is_routed_without_the_loop_tokenizing(
    envoy_url: tuple[str, HeldTokenizer],
) -> None:
    url, held = envoy_url
    prompts = [f"conversation {i} " + "word " * INLINE_TOKENIZE_CHARS for i in range(3)]
    async with aiohttp.ClientSession() as session:

        async def post(prompt: str) -> tuple[int, dict[str, object]]:
            body = json.dumps({"model": "m", "prompt": prompt}).encode()
            async with session.post(url + "/v1/completions", data=body) as response:
                return response.status, json.loads(await response.read())

        # All three are routed while their tokenizing is still held: none waits for it.
        answers = await asyncio.gather(*(post(p) for p in prompts))
    held.release.set()
    assert [status for status, _ in answers] == [200, 200, 200], answers
    loop_thread = threading.main_thread().name
    assert loop_thread not in held.threads, f"the event loop tokenized: {held.threads}"
    # The first prompt holds the one tokenizer thread; the two queued behind it were dropped
    # when their requests gave up on them, so abandoned work does not pile up under load.
    assert len(held.threads) == 1, held.threads
