"""`precise-prefix-cache-scorer` loaded from an EndpointPickerConfig, fed by real ZMQ publishers."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator
from typing import NamedTuple

import pytest
import zmq
import zmq.asyncio

from picker.config.runtime import Runtime
from picker.datastore.endpoint import Endpoint, EndpointMetrics
from picker.datastore.store import Datastore
from picker.framework.parameters import PluginConfigError
from picker.kvevents.decode import BlockRemoved, BlockStored
from picker.kvevents.plugins import OFFLOAD_BLOCKS, PreciseConfig, PreciseRuntime, PreciseScorer
from picker.kvevents.precise import TierWeights
from picker.kvevents.vllm_hash import SHA256_CBOR, VllmBlockHasher, external
from picker.prefix.builtin_tokenizer import encode
from picker.prefix.hashing import chain_seed, token_block_hashes
from tests.integration.test_kvevents_subscriber import HOST, Publisher, until
from tests.routing import Router, completion

HEADER = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
MODEL = "m"


def config(block_size: int = 4, ttl: str = "2s") -> str:
    return (
        HEADER
        + f"""
plugins:
- type: precise-prefix-cache-scorer
  parameters: {{kvEventsPort: null, modelName: {MODEL}, blockSizeTokens: {block_size}, speculativeTTL: {ttl}}}
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins: [{{pluginRef: precise-prefix-cache-scorer}}, {{pluginRef: max-score-picker}}]
"""
    )


def body(tokens: list[int], salt: str | None = None) -> bytes:
    """A completion of these prompt token ids."""
    return completion(tokens, MODEL, **({"cache_salt": salt} if salt is not None else {}))


def stored(tokens: list[int], size: int = 4) -> BlockStored:
    return BlockStored(tuple(token_block_hashes(tokens, size, 5)), None, tuple(tokens), size)


PROMPT = list(range(1, 41))


async def test_scorer_routes_to_the_endpoint_whose_engine_reports_the_prefix() -> None:
    ctx = zmq.asyncio.Context()
    publishers = [Publisher(ctx), Publisher(ctx)]
    datastore = Datastore()
    endpoints = [Endpoint(HOST, 9000 + i, kv_events_address=p.address) for i, p in enumerate(publishers)]
    datastore.set_endpoints(endpoints)
    for e in endpoints:
        datastore.set_metrics(e.address, EndpointMetrics(cache_block_size=16, cache_num_blocks=100))
    router = Router(datastore)
    holder = router.runtimes
    runtime = holder.load_text(config())
    scorer = runtime.plugins["precise-prefix-cache-scorer"]
    assert isinstance(scorer, PreciseScorer)
    try:
        await holder.start()  # the installed config's background work: the subscriber
        for p in publishers:
            await p.subscribed()
        publishers[1].publish(stored(PROMPT[:32]))
        await until(
            lambda: (
                scorer.index.score(token_block_hashes(PROMPT, 4, chain_seed(MODEL)), [endpoints[1].address])[0] == 0.8
            )
        )
        result = await router.pick(body(PROMPT), "r2")
        assert result.targets[0].address == endpoints[1].address
        assert result.profile_results["default"].scores[scorer.name] == [0.0, 0.8]
        assert scorer.index.own_keys(endpoints[0].address) == {}
        assert scorer.runtime.index.own_keys(endpoints[1].address)  # capacity auto-tuned, entries kept

        # After a pick the target is predicted to hold the whole prompt (speculative entries).
        other = list(range(100, 140))
        picked = await router.route(body(other), "r3")
        routed_again = await router.route(body(other), "r4")
        assert picked.result is not None and routed_again.result is not None
        again = routed_again.result
        target = picked.targets[0]
        scores = dict(
            zip(
                (c.address for c in again.profile_results["default"].candidates),
                again.profile_results["default"].scores[scorer.name],
            )
        )
        assert scores[target] == 1.0 and again.targets[0].address == target
        # It lasts while the request is in flight (up to speculativeHold), the TTL after it ends.
        held_until = scorer.index.predicted_until(target)
        assert held_until is not None and held_until > time.monotonic() + 50
        for routed in (routed_again, picked):
            routed.response_headers(200, target, "application/json", end_of_stream=True)
        ending = scorer.index.predicted_until(target)
        assert ending is not None and ending <= time.monotonic() + 2.0

        # A reload with the same parameters keeps the warm index; a new block size replaces it.
        assert holder.load_text(config()).plugins["precise-prefix-cache-scorer"].index is scorer.index
        replaced = holder.load_text(config(block_size=8)).plugins["precise-prefix-cache-scorer"]
        assert replaced.index is not scorer.index
        await until(lambda: not scorer.runtime.subscriber.started, what="the old subscriber to stop")
    finally:
        await holder.stop()
        for p in publishers:
            await p.close()
        ctx.term()


class OneEngine(NamedTuple):
    """A pool of one endpoint whose engine publishes KV events, and a router over it."""

    publisher: Publisher
    endpoint: Endpoint
    router: Router


@pytest.fixture
async def one_engine() -> AsyncIterator[OneEngine]:
    ctx = zmq.asyncio.Context()
    publisher = Publisher(ctx)
    # Every subscription reported, not only a topic's first: a second subscriber can be waited for.
    publisher.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
    datastore = Datastore()
    endpoint = Endpoint(HOST, 9000, kv_events_address=publisher.address)
    datastore.set_endpoints([endpoint])
    router = Router(datastore)
    try:
        yield OneEngine(publisher, endpoint, router)
    finally:
        await router.runtimes.stop()
        await publisher.close()
        ctx.term()


async def test_a_salted_request_maps_the_engines_blocks_into_its_scope(one_engine: OneEngine) -> None:
    publisher, endpoint, router = one_engine
    holder = router.runtimes
    runtime = holder.load_text(config(block_size=16, ttl="0s"))  # only events count
    scorer = runtime.plugins["precise-prefix-cache-scorer"]
    await holder.start()
    salted = await router.route(body(PROMPT * 2, salt="tenant-a"), "s1")  # its pre-request maps the scope
    await publisher.subscribed()
    publisher.publish(stored(PROMPT * 2, 16))  # the engine's event carries no salt
    salted_keys = token_block_hashes(PROMPT * 2, 16, chain_seed(MODEL, "tenant-a"))
    await until(lambda: scorer.index.score(salted_keys, [endpoint.address]) == [1.0], what="the salted chain")
    plain = await router.pick(body(PROMPT * 2), "p1")
    assert plain.profile_results["default"].scores[scorer.name] == [0.0]
    salted.finish()


def engine_keys_config(parameters: str = "", producer: str = "") -> str:
    """A precise scorer keyed by the engines' sha256_cbor hashes (with `parameters`), after
    `producer` if given, and the max-score picker."""
    return (
        HEADER
        + "plugins:\n"
        + producer
        + "- type: precise-prefix-cache-scorer\n"
        + f"  parameters: {{kvEventsPort: null, modelName: {MODEL}, blockSizeTokens: 4, speculativeTTL: 0s,"
        + f" prefixCachingHashAlgo: sha256_cbor{parameters}}}\n"
        + "- type: max-score-picker\nschedulingProfiles:\n- name: default\n"
        + "  plugins: [{pluginRef: precise-prefix-cache-scorer}, {pluginRef: max-score-picker}]\n"
    )


async def test_engine_keys_hash_requests_as_vllm_with_lora_and_cache_salt(one_engine: OneEngine) -> None:
    """`prefixCachingHashAlgo`: the engine's events name blocks by vLLM's sha256_cbor chain, with
    the adapter in every block's extra keys and the salt in the first's; requests match them."""
    publisher, endpoint, router = one_engine
    text = engine_keys_config(', hashSeed: "42"')
    scorer = precise(router.runtimes.load_text(text), "precise-prefix-cache-scorer")
    await router.runtimes.start()
    await publisher.subscribed()
    hasher = VllmBlockHasher(SHA256_CBOR, "42")
    for lora, salt in ((None, None), ("adapter-1", None), (None, "tenant-a"), ("adapter-1", "tenant-a")):
        chain = [external(d) for d in hasher.digests(PROMPT[:32], 4, lora, salt)]  # 8 of 10 blocks
        publisher.publish(BlockStored(tuple(chain), None, tuple(PROMPT[:32]), 4, lora_name=lora))
        request = completion(PROMPT, lora or MODEL, **({"cache_salt": salt} if salt is not None else {}))
        await until(lambda c=chain: scorer.index.engine_hashes(endpoint.address) >= set(c), what="the event")
        result = await router.pick(request, f"r-{lora}-{salt}")
        assert result.profile_results["default"].scores[scorer.name] == [0.8], (lora, salt)
        publisher.publish(BlockRemoved(tuple(chain)))
        await until(lambda: not scorer.index.engine_hashes(endpoint.address), what="the removal")


async def test_engine_keys_of_a_long_tokenized_prompt_are_hashed_off_the_event_loop(one_engine: OneEngine) -> None:
    publisher, endpoint, router = one_engine
    producer = '- type: approx-prefix-cache-producer\n  parameters: {blockSizeTokens: 4, tokenizers: {"*": builtin}}\n'
    text = engine_keys_config(producer=producer)
    scorer = precise(router.runtimes.load_text(text), "precise-prefix-cache-scorer")
    await router.runtimes.start()
    await publisher.subscribed()
    prompt = " ".join(f"word{i}" for i in range(600))
    tokens = encode(prompt)
    blocks = len(tokens) // 4
    assert blocks >= OFFLOAD_BLOCKS
    chain = [external(d) for d in VllmBlockHasher().digests(tokens, 4)]  # vLLM's default seed
    publisher.publish(BlockStored(tuple(chain), None, tuple(tokens[: blocks * 4]), 4))
    await until(lambda: scorer.index.engine_hashes(endpoint.address) == set(chain), what="the event")
    result = await router.pick(completion(prompt, MODEL), "long")
    assert result.profile_results["default"].scores[scorer.name] == [1.0]
    assert any(t.name.startswith("picker-vllm-hash") for t in threading.enumerate())  # the executor ran


def scorers(*names: str, parameters: str = "") -> str:
    """A config of precise scorers called `names`, each with the same parameters (and `parameters`)."""
    entries = "".join(
        f"- {{name: {name}, type: precise-prefix-cache-scorer,"
        f" parameters: {{kvEventsPort: null, modelName: {MODEL}, blockSizeTokens: 4{parameters}}}}}\n"
        for name in names
    )
    return HEADER + "plugins:\n" + entries


def precise(runtime: Runtime, name: str) -> PreciseScorer:
    scorer = runtime.plugins[name]
    assert isinstance(scorer, PreciseScorer)
    return scorer


async def another_subscription(publisher: Publisher) -> None:
    """Wait for a new subscription to the publisher (skipping unsubscriptions)."""
    while True:
        assert await publisher.pub.poll(5000), "no subscriber connected"
        if (await publisher.pub.recv()).startswith(b"\x01kv@"):
            return


async def test_a_reload_keeps_the_warm_index_unless_its_block_size_or_publishers_change(one_engine: OneEngine) -> None:
    publisher, endpoint, router = one_engine
    holder = router.runtimes
    keys = token_block_hashes(PROMPT, 4, chain_seed(MODEL))
    scorer = precise(holder.load_text(scorers("p")), "p")
    await holder.start()
    await another_subscription(publisher)
    publisher.publish(stored(PROMPT[:32]))
    await until(lambda: scorer.index.score(keys, [endpoint.address]) == [0.8], what="the engine's blocks")

    # Weights, TTL, capacity and replay timeout apply to the warm index and its subscription.
    changed = ", tierWeights: {cpu: 0.5}, speculativeTTL: 1s, replayTimeout: 3s, autoTune: false"
    tuned = precise(holder.load_text(scorers("p", parameters=changed + ", capacityPerEndpoint: 6")), "p")
    await holder.settle()
    index = scorer.index
    assert tuned.runtime is scorer.runtime and tuned.index is index
    assert (index.weights, index.speculative_ttl, index.default_capacity) == (TierWeights(1.0, 0.5), 1.0, 6)
    assert set(index.own_keys(endpoint.address)) == set(keys[2:8])  # the newest 6 of the 8 blocks
    subscriber = tuned.runtime.subscriber
    assert subscriber is not None and subscriber.started and subscriber.config.replay_timeout == 3.0
    publisher.publish(stored(PROMPT[:8]))  # the same subscription goes on
    await until(lambda: keys[0] in index.own_keys(endpoint.address), what="the next event")

    # A new block size cannot reuse the index's keys: a new index and subscriber replace them.
    rebuilt = precise(holder.load_text(scorers("p", parameters=changed + ", blockSizeTokens: 8")), "p")
    await holder.settle()
    assert rebuilt.runtime is not tuned.runtime and rebuilt.index.block_size == 8
    new_subscriber = rebuilt.runtime.subscriber
    assert new_subscriber is not None and new_subscriber.started and not subscriber.started
    await another_subscription(publisher)  # the new subscriber connected to the same publisher
    publisher.publish(stored(PROMPT[:32]))
    wide = token_block_hashes(PROMPT, 8, chain_seed(MODEL))
    await until(lambda: rebuilt.index.score(wide, [endpoint.address]) == [0.8], what="the new index")
    await holder.stop()
    assert not new_subscriber.started


async def test_scorers_by_different_names_keep_their_own_index_and_subscriber(one_engine: OneEngine) -> None:
    publisher, endpoint, router = one_engine
    holder = router.runtimes
    runtime = holder.load_text(scorers("first", "second"))  # equal parameters
    first, second = precise(runtime, "first"), precise(runtime, "second")
    assert first.runtime is not second.runtime and first.index is not second.index
    await holder.start()
    for _ in (first, second):
        await another_subscription(publisher)
    publisher.publish(stored(PROMPT[:32]))
    keys = token_block_hashes(PROMPT, 4, chain_seed(MODEL))
    await until(
        lambda: all(s.index.score(keys, [endpoint.address]) == [0.8] for s in (first, second)), what="both indexes"
    )


@pytest.mark.parametrize(
    "change, served",
    [
        ({"blockSizeTokens": 8}, False),  # the index's keys
        ({"prefixCachingHashAlgo": "sha256_cbor"}, False),
        ({"hashSeed": "42"}, False),
        ({"kvEventsPort": 5557}, False),  # the publishers, their topic and the model the entries came from
        ({"kvEventsReplayPort": 5558}, False),
        ({"topicFilter": "kv@pod-1"}, False),
        ({"modelName": "other"}, False),
        ({"replayTimeout": "3s"}, True),  # applied in place
        ({"tierWeights": {"cpu": 0.5}, "speculativeTTL": "1s", "speculativeHold": "5s"}, True),
        ({"capacityPerEndpoint": 6, "autoTune": False}, True),
    ],
)
def test_a_runtime_serves_a_config_unless_its_keys_or_publishers_change(change: dict, served: bool) -> None:
    parameters = {"kvEventsPort": None, "modelName": MODEL, "blockSizeTokens": 4}
    runtime = PreciseRuntime.build(PreciseConfig.parse(parameters)[0], None)
    assert runtime.serves(PreciseConfig.parse({**parameters, **change})[0]) is served


@pytest.mark.parametrize(
    "parameters, message",
    [
        ({"kvEventsPort": 70000}, "kvEventsPort: must be a port number"),
        ({"kvEventsReplayPort": 0}, "kvEventsReplayPort: must be >= 1"),
        ({"tierWeights": {"gpu": 2}}, r"tierWeights.gpu: must be a number in \[0, 1\]"),
        ({"tierWeights": {"disk": 0.5}}, "tierWeights.disk: unknown tier"),
        ({"speculativeTTL": "soon"}, "speculativeTTL: invalid duration"),
        ({"speculativeHold": "later"}, "speculativeHold: invalid duration"),
        ({"blockSize": 16}, "blockSize: unknown parameter"),
        ({"prefixCachingHashAlgo": "md5"}, "prefixCachingHashAlgo: must be one of own, sha256_cbor, sha256"),
    ],
)
def test_bad_parameters_are_named(parameters: dict, message: str) -> None:
    with pytest.raises(PluginConfigError, match=message):
        PreciseConfig.parse(parameters)


def test_parameters_have_the_documented_defaults() -> None:
    parsed, _ = PreciseConfig.parse(
        {"kvEventsReplayPort": 5558, "tierWeights": {"cpu": 0.5}, "speculativeTTL": "500ms"}
    )
    assert (parsed.subscriber.port, parsed.subscriber.replay_port, parsed.subscriber.topic_filter) == (
        5557,
        5558,
        "kv@",
    )
    assert (parsed.weights.gpu, parsed.weights.cpu, parsed.speculative_ttl, parsed.block_size) == (1.0, 0.5, 0.5, 16)
    assert parsed.speculative_hold == 60.0
    assert (parsed.hash_algorithm, parsed.hash_seed) == ("own", "vllm-none-hash")
