"""The precise index against `picker sim` pods (real processes, real HTTP and ZMQ).

Each pod's cache (`GET /sim/cache`) is the ground truth: the index must hold exactly the same
engine blocks, and score every prompt exactly as the pod's cached prefix, through eviction
(a small cache), lost messages (with and without the replay socket) and crashes
(AllBlocksCleared), in every event encoding, keyed by the picker's own hashes or by the
engines' (vLLM's sha256_cbor with the sims' seed).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import zmq.asyncio

from picker.datastore.endpoint import Endpoint
from picker.datastore.store import Datastore
from picker.kvevents.plugins import PreciseScorer
from picker.kvevents.precise import PreciseIndex
from picker.kvevents.subscriber import KVEventSubscriber, SubscriberConfig
from picker.kvevents.vllm_hash import SHA256_CBOR, VllmBlockHasher, external
from picker.prefix.builtin_tokenizer import encode
from picker.prefix.hashing import chain_seed, token_block_hashes
from picker.telemetry import metrics
from picker_bench.llmd_epp import write_builtin_tokenizer
from picker_bench.workloads import VOCAB
from tests.routing import Router, completion

MODEL = "sim-model"
BLOCK = 16
SEED = "42"  # the sims' --hash-seed (vLLM's PYTHONHASHSEED)
HOSTS = {
    "array": ("127.0.0.8", "127.0.0.9"),
    "positional": ("127.0.0.2", "127.0.0.3"),
    "map": ("127.0.0.4", "127.0.0.5"),
}
ENGINE_HASHER = VllmBlockHasher(SHA256_CBOR, SEED)


def engine_keys(prompt: list[int]) -> list[int]:
    """The sims' block hashes of `prompt`: vLLM's sha256_cbor chain."""
    return [external(d) for d in ENGINE_HASHER.digests(prompt, BLOCK)]


def own_keys(prompt: list[int]) -> list[int]:
    return token_block_hashes(prompt, BLOCK, chain_seed(MODEL))


@dataclass
class Sim:
    process: subprocess.Popen[str]
    encoding: str
    pods: list[Endpoint]
    kv_port: int
    replay_port: int


def _free_port_on(hosts: list[str], avoid: set[int]) -> int:
    """A TCP port free on every host in `hosts` (probed by binding)."""
    while True:
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port = probe.getsockname()[1]
        if port in avoid:
            continue
        try:
            for host in hosts[1:]:
                with socket.socket() as other:
                    other.bind((host, port))
        except OSError:
            continue
        return port


def _start_sim(encoding: str) -> tuple[subprocess.Popen[str], int, int]:
    hosts = list(HOSTS[encoding])
    kv_port = _free_port_on(hosts, set())
    replay_port = _free_port_on(hosts, {kv_port})
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "picker.cli",
            "sim",
            "--pods",
            "2",
            "--distinct-hosts",
            "--host",
            hosts[0],
            "--base-port",
            "0",
            "--kv-events-base-port",
            str(kv_port),
            "--kv-events-replay-base-port",
            str(replay_port),
            "--kv-events-format",
            encoding,
            "--hash-seed",
            SEED,
            "--profile",
            "tiny",
            "--time-scale",
            "20",
            "--num-gpu-blocks",
            "48",
            "--model",
            MODEL,
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    return process, kv_port, replay_port


def _read_pods(process: subprocess.Popen[str]) -> list[Endpoint]:
    pods = []
    assert process.stdout is not None
    for line in process.stdout:
        if line.strip() == "ready":
            return pods
        fields = line.split()
        host, port = fields[2].removeprefix("http://").rsplit(":", 1)
        pods.append(Endpoint(host, int(port), name=fields[1]))
    raise AssertionError(f"picker sim exited with {process.wait()}")


def _stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module")
def sims() -> Iterator[dict[str, Sim]]:
    started = {encoding: _start_sim(encoding) for encoding in HOSTS}  # in parallel
    try:
        yield {
            encoding: Sim(process, encoding, _read_pods(process), kv_port, replay_port)
            for encoding, (process, kv_port, replay_port) in started.items()
        }
    finally:
        for process, _, _ in started.values():
            _stop(process)


async def until(condition: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


class Client:
    """HTTP to the pods, and the comparison of a pod's cache with the index.

    The session must not keep connections alive: a crashed pod leaves stale ones behind.
    """

    def __init__(self, http: aiohttp.ClientSession, index: PreciseIndex) -> None:
        self.http = http
        self.index = index
        self.keys = engine_keys if index.engine_keys else own_keys  # a request's keys in the index

    async def complete(self, pod: Endpoint, prompt: list[int]) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        async with self.http.post(f"http://{pod.address}/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()

    async def cache(self, pod: Endpoint) -> set[int]:
        async with self.http.get(f"http://{pod.address}/sim/cache") as response:
            return set((await response.json())["block_hashes"])

    async def fault(self, pod: Endpoint, **faults: object) -> None:
        async with self.http.post(f"http://{pod.address}/sim/fault", json=faults) as response:
            assert response.status == 200

    async def crash(self, pod: Endpoint) -> None:
        cleared = metrics.KV_EVENTS.labels(pod.address, "AllBlocksCleared")
        before = cleared._value.get()
        async with self.http.post(f"http://{pod.address}/sim/crash", json={"down_seconds": 0.05}) as response:
            assert response.status == 200
        await until(lambda: cleared._value.get() > before, what="the crash's AllBlocksCleared")
        assert self.index.own_keys(pod.address) == {}
        deadline = time.monotonic() + 10
        while True:  # the pod listens again after its outage
            try:
                async with self.http.get(f"http://{pod.address}/health") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            assert time.monotonic() < deadline, "pod did not come back"
            await asyncio.sleep(0.01)

    async def assert_mirrors(self, pod: Endpoint, prompts: list[list[int]]) -> None:
        """Wait until the index holds the pod's blocks, then check every prompt's score."""
        deadline = time.monotonic() + 10
        truth = await self.cache(pod)
        while self.index.engine_hashes(pod.address) != truth:
            assert time.monotonic() < deadline, "index never matched the pod's cache"
            await asyncio.sleep(0.01)
            truth = await self.cache(pod)
        assert self.index.is_known(pod.address)
        for prompt in prompts:
            cached = 0
            for h in engine_keys(prompt):
                if h not in truth:
                    break
                cached += 1
            keys = self.keys(prompt)
            assert self.index.score(keys, [pod.address]) == [cached / len(keys)]


def prompts(seed: int) -> list[list[int]]:
    """Two families sharing 6-block prefixes, each prompt 11 blocks: 52 blocks, more than a pod holds."""
    rng = random.Random(seed)
    families = [[rng.randrange(300, 60_000) for _ in range(6 * BLOCK)] for _ in range(2)]
    return [families[i % 2] + [rng.randrange(300, 60_000) for _ in range(5 * BLOCK)] for i in range(8)]


async def _subscribe(sim: Sim, index: PreciseIndex, replay: bool) -> KVEventSubscriber:
    datastore = Datastore()
    datastore.set_endpoints(sim.pods)
    config = SubscriberConfig(port=sim.kv_port, replay_port=sim.replay_port if replay else None, model=MODEL)
    subscriber = KVEventSubscriber(index, datastore, config, zmq.asyncio.Context.instance())
    subscriber.start()
    return subscriber


@pytest.mark.parametrize(
    ("encoding", "by_engine_keys"), [("array", False), ("array", True), ("positional", False), ("map", True)]
)
async def test_index_mirrors_sim_pods_through_eviction_gaps_and_crashes(
    sims: dict[str, Sim], encoding: str, by_engine_keys: bool
) -> None:
    sim = sims[encoding]
    index = PreciseIndex(BLOCK, engine_keys=by_engine_keys)
    subscriber = await _subscribe(sim, index, replay=True)
    pod0, pod1 = sim.pods
    work = prompts(1)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
            client = Client(http, index)
            for prompt in work:  # through 48-block caches: evictions
                await asyncio.gather(client.complete(pod0, prompt), client.complete(pod1, prompt[: 7 * BLOCK]))
            for pod in (pod0, pod1):
                await client.assert_mirrors(pod, work)
            assert metrics.KV_BLOCKS_EVICTED.labels(pod0.address)._value.get() > 0

            # Lost messages, recovered through the replay socket.
            gaps = metrics.KV_EVENT_GAPS.labels(pod0.address)._value.get()
            await client.fault(pod0, drop_kv_events=1.0)
            for prompt in work[:3]:
                await client.complete(pod0, prompt[::-1])
            await client.fault(pod0, drop_kv_events=0.0)
            await client.complete(pod0, work[5])
            await client.assert_mirrors(pod0, work + [p[::-1] for p in work[:3]])
            assert metrics.KV_EVENT_GAPS.labels(pod0.address)._value.get() == gaps + 1

            # A crash clears the cache (AllBlocksCleared); the index follows and stays exact.
            await client.crash(pod1)
            await client.complete(pod1, work[0])
            await client.assert_mirrors(pod1, work)
    finally:
        await subscriber.stop()


@pytest.mark.parametrize("encoding", ["array", "map"])
async def test_a_gap_without_replay_excludes_the_pod_until_its_cache_is_cleared(
    sims: dict[str, Sim], encoding: str
) -> None:
    sim = sims[encoding]
    index = PreciseIndex(BLOCK)
    subscriber = await _subscribe(sim, index, replay=False)
    pod = sim.pods[0]
    work = prompts(2)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
            client = Client(http, index)
            await client.crash(pod)  # start from an empty cache, so the joined index is complete
            await client.complete(pod, work[0])
            await client.assert_mirrors(pod, work)
            await client.fault(pod, drop_kv_events=1.0)
            await client.complete(pod, work[1])
            await client.fault(pod, drop_kv_events=0.0)
            await client.complete(pod, work[2])
            await until(lambda: not index.is_known(pod.address), what="the gap")
            own = token_block_hashes(work[2], BLOCK, chain_seed(MODEL))
            assert index.score(own, [pod.address]) == [0.0]  # cached, but the view is incomplete
            await client.crash(pod)
            assert index.is_known(pod.address)
            await client.complete(pod, work[3])
            await client.assert_mirrors(pod, work)
    finally:
        await subscriber.stop()


def precise_router(pods: list[Endpoint], parameters: str) -> tuple[Router, PreciseScorer]:
    """A router over `pods` with a config of the precise scorer (`parameters`, a YAML flow
    mapping) and a max-score picker; and the scorer."""
    datastore = Datastore()
    datastore.set_endpoints(pods)
    router = Router(datastore)
    runtime = router.runtimes.load_text(
        "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
        f"- type: precise-prefix-cache-scorer\n  parameters: {parameters}\n- type: max-score-picker\n"
        "schedulingProfiles:\n- name: default\n"
        "  plugins: [{pluginRef: precise-prefix-cache-scorer}, {pluginRef: max-score-picker}]\n"
    )
    scorer = runtime.plugins["precise-prefix-cache-scorer"]
    assert isinstance(scorer, PreciseScorer)
    return router, scorer


@pytest.mark.parametrize("hashing", ["own", "sha256_cbor"])
async def test_a_request_goes_to_the_pod_whose_events_stored_its_prefix(sims: dict[str, Sim], hashing: str) -> None:
    """The scorer from its config, on vLLM-exact events (array layout, sha256_cbor hashes): a
    prompt one pod computed routes there, keyed by the picker's own hashes or the engines'."""
    sim = sims["array"]
    parameters = (
        f"{{kvEventsPort: {sim.kv_port}, kvEventsReplayPort: {sim.replay_port}, modelName: {MODEL}, "
        f"blockSizeTokens: {BLOCK}, speculativeTTL: 0, prefixCachingHashAlgo: {hashing}, hashSeed: '{SEED}'}}"
    )
    router, scorer = precise_router(sim.pods, parameters)
    prompt = prompts(3)[0]
    try:
        await router.runtimes.start()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
            client = Client(http, scorer.index)
            for pod in sim.pods:  # start from empty caches, so the index knows each pod whole
                await client.crash(pod)
            holder = sim.pods[1]
            await client.complete(holder, prompt)
            await client.assert_mirrors(holder, [prompt])
        result = await router.pick(completion(prompt, MODEL), f"r-{hashing}")
        assert result.targets[0].address == holder.address
        ranked = result.profile_results["default"]
        scores = dict(zip((c.address for c in ranked.candidates), ranked.scores[scorer.name]))
        assert scores == {sim.pods[0].address: 0.0, holder.address: 1.0}
    finally:
        await router.runtimes.stop()


@pytest.fixture(scope="module")
def connecting_sim() -> Iterator[tuple[list[Endpoint], str]]:
    """Two pods whose engines connect to a subscriber's bound endpoint, as in an llm-d fleet
    (vLLM's `--kv-events-config` endpoint naming the scheduler), topic `kv@<pod IP>@<model>`."""
    bind = f"tcp://127.0.0.1:{_free_port_on(['127.0.0.1'], set())}"
    argv = [sys.executable, "-m", "picker.cli", "sim", "--pods", "2", "--distinct-hosts", "--host", "127.0.0.6"]
    argv += ["--base-port", "0", "--kv-events-endpoint", bind, "--hash-seed", SEED, "--profile", "tiny"]
    argv += ["--time-scale", "20", "--model", MODEL]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        yield _read_pods(process), bind
    finally:
        _stop(process)


async def test_llmds_form_binds_for_the_engines_and_routes_to_the_pod_whose_events_stored_the_prefix(
    connecting_sim: tuple[list[Endpoint], str], tmp_path: Path
) -> None:
    """llm-d's own form of the scorer's parameters (its indexerConfig and kvEventsConfig): the
    picker binds `zmqEndpoint`, the engines publish there, their sha256_cbor hashes with the seed
    key the index, and a prompt one pod computed routes there: token ids, and text that the local
    tokenizer it names (`tokenizersPoolConfig.local.modelTokenizerMap`) tokenizes as the pods do."""
    pods, bind = connecting_sim
    tokenizer = write_builtin_tokenizer(tmp_path / MODEL)  # the sims' built-in tokenizer's ids
    indexer = (
        f"{{tokenProcessorConfig: {{blockSize: {BLOCK}, hashSeed: '{SEED}'}}, "
        f"tokenizersPoolConfig: {{local: {{modelTokenizerMap: {{{MODEL}: '{tokenizer}'}}}}}}}}"
    )
    parameters = f"{{indexerConfig: {indexer}, kvEventsConfig: {{zmqEndpoint: '{bind}'}}, modelName: {MODEL}, speculativeTTL: 0}}"
    router, scorer = precise_router(pods, parameters)
    assert scorer.index.engine_keys  # keyed by the engines' hashes, as llm-d's index is
    prompt = prompts(5)[0]
    warmups = iter(prompts(6))  # of other families than `prompt`
    holder = pods[1]
    try:
        await router.runtimes.start()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
            client = Client(http, scorer.index)
            for pod in pods:
                await events_flow(client, pod, warmups)
            await client.complete(holder, prompt)
            await until(lambda: scorer.index.score(engine_keys(prompt), [holder.address]) == [1.0], what="the prompt")
            text = " ".join(VOCAB[i] for i in range(100, 100 + 12 * BLOCK))  # 12 blocks of one token a word
            text_holder = pods[0]
            async with http.post(
                f"http://{text_holder.address}/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 2}
            ) as response:
                assert response.status == 200
            text_keys = engine_keys(list(encode(text)))
            await until(lambda: scorer.index.score(text_keys, [text_holder.address]) == [1.0], what="the text")
        for body, expected in ((completion(prompt, MODEL), holder), (completion(text, MODEL), text_holder)):
            result = await router.pick(body, f"r-llmd-form-{expected.port}")
            assert result.targets[0].address == expected.address
            ranked = result.profile_results["default"]
            scores = dict(zip((c.address for c in ranked.candidates), ranked.scores[scorer.name]))
            assert scores == {pod.address: float(pod == expected) for pod in pods}
    finally:
        await router.runtimes.stop()


async def events_flow(client: Client, pod: Endpoint, warmups: Iterator[list[int]]) -> None:
    """Send `pod` new prompts until the index has its events: what an engine publishes before
    the bound subscriber's subscription reaches it is dropped (ZMQ's slow joiner), as with
    llm-d's subscriber; the feed then starts from the first message it sees."""
    for warmup in warmups:
        await client.complete(pod, warmup)
        try:
            await until(lambda: bool(client.index.engine_hashes(pod.address)), timeout=1.0, what="events")
        except AssertionError:
            continue
        return
    raise AssertionError(f"no KV events from {pod.address}")
