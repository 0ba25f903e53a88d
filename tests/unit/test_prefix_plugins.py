"""Prefix plugins through the real scheduler: affinity, config, isolation, hot spots, metrics."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from prometheus_client import REGISTRY

from picker.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState
from picker.datastore.store import Datastore
from picker.framework.cycle_state import CycleState
from picker.framework.handle import Handle
from picker.framework.parameters import PluginConfigError
from picker.framework.plugin import SchedulingResult
from picker.framework.request import Api, InferenceRequest, Message, ResponseOutcome, Usage
from picker.plugins import REGISTRY as PLUGINS
from picker.prefix.plugins import (
    ENGINE_CACHED_TOKENS_KEY,
    PREFIX_MATCH_KEY,
    PROMPT_BLOCKS_KEY,
    ApproxPrefixCacheProducer,
    CacheFitScorer,
    PrefixCacheScorer,
    PrefixMatch,
    TtftCostScorer,
    ttft_model_key,
)
from picker.prefix.prompt_blocks import CHARS, TOKENS
from picker.prefix.ttft import TtftModel
from picker.scheduling.pickers import MaxScorePicker
from picker.scheduling.profile_handler import SingleProfileHandler
from picker.scheduling.scheduler import Scheduler, SchedulerProfile, WeightedScorer
from picker.scheduling.scorers import QueueScorer
from picker.telemetry.decisions import DecisionLog

ADDRESSES = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"]


def _store(addresses: list[str] = ADDRESSES) -> Datastore:
    store = Datastore()
    store.set_endpoints([Endpoint(a.split(":")[0], 8000, name=a) for a in addresses])
    return store


def _producer(handle: Handle, **parameters: Any) -> ApproxPrefixCacheProducer:
    registration = PLUGINS.lookup("approx-prefix-cache-producer")
    assert registration is not None
    producer = registration.factory("approx-prefix-cache-producer", parameters, handle)
    assert isinstance(producer, ApproxPrefixCacheProducer)
    return producer


class _PreparingScheduler:
    """A scheduler whose requests the producer prepares first, as the director does."""

    def __init__(self, producer: ApproxPrefixCacheProducer, scheduler: Scheduler) -> None:
        self.producer = producer
        self.scheduler = scheduler

    def schedule(
        self,
        request: InferenceRequest,
        candidates: Sequence[EndpointState],
        cycle_state: CycleState | None = None,
    ) -> SchedulingResult:
        """Prepare `cycle_state` (a new one by default) with the producer, then schedule."""
        cycle_state = CycleState() if cycle_state is None else cycle_state
        self.producer.prepare(request, candidates, cycle_state)
        return self.scheduler.schedule(request, candidates, cycle_state)


def _scheduler(producer: ApproxPrefixCacheProducer, extra: Sequence[WeightedScorer] = ()) -> _PreparingScheduler:
    scorers = [WeightedScorer(PrefixCacheScorer("prefix-cache-scorer"), 3.0), *extra]
    profile = SchedulerProfile("default", [], scorers, MaxScorePicker("max-score-picker", rng=random.Random(0)))
    return _PreparingScheduler(producer, Scheduler(SingleProfileHandler("single-profile-handler"), [profile]))


def _completion(
    request_id: str,
    prompt: str,
    *,
    model: str = "m",
    tenant: str | None = None,
    salt: str | None = None,
) -> InferenceRequest:
    return InferenceRequest(
        request_id,
        Api.COMPLETIONS,
        model,
        model,
        prompt_text=prompt,
        tenant=tenant,
        cache_salt=salt,
    )


PROMPT = "You are a helpful assistant. " * 40


def test_a_routed_prompt_scores_one_at_its_endpoint_and_zero_elsewhere() -> None:
    store = _store()
    producer = _producer(Handle(store))
    scheduler = _scheduler(producer)
    request = _completion("r1", PROMPT + "question one")
    first = scheduler.schedule(request, store.snapshot())
    producer.pre_request(request, first)
    chosen = first.targets[0].address
    result = scheduler.schedule(_completion("r2", PROMPT + "question two"), store.snapshot())
    scores = dict(
        zip(
            [c.address for c in result.profile_results["default"].candidates],
            result.profile_results["default"].scores["prefix-cache-scorer"],
        )
    )
    assert result.targets[0].address == chosen
    assert scores[chosen] == pytest.approx(len(PROMPT.encode()) // 64 / ((len(PROMPT) + 12) // 64 + 1))
    assert all(score == 0.0 for address, score in scores.items() if address != chosen)
    match = result.cycle_state[PREFIX_MATCH_KEY]
    assert isinstance(match, PrefixMatch) and match.blocks.kind == CHARS


def test_parameters_follow_the_reference() -> None:
    handle = Handle(_store())
    legacy = _producer(handle, blockSize=64, autoTune=False)  # deprecated and ignored, as the reference does
    assert legacy.config.sizing(_store().snapshot()).char_block_tokens == 16
    assert "blockSize" not in legacy.parameters
    with pytest.raises(PluginConfigError, match="blockSize: must be an integer"):
        _producer(handle, blockSize="64")
    with pytest.raises(PluginConfigError, match="noSuchThing"):
        _producer(handle, noSuchThing=1)
    with pytest.raises(PluginConfigError, match="tokenizers.m"):
        _producer(handle, tokenizers={"m": "/nonexistent/tokenizer"})
    producer = _producer(
        handle,
        blockSize=64,
        blockSizeTokens=8,
        maxPrefixTokensToMatch=80,
        autoTune=False,
    )
    sizing = producer.config.sizing(_store().snapshot())
    assert (sizing.char_block_tokens, sizing.max_char_blocks) == (8, 10)
    # The scorer takes the producer's parameters (it passes them on) and checks them as such.
    scorer = PLUGINS.lookup("prefix-cache-scorer").factory("prefix-cache-scorer", {"blockSizeTokens": 5}, handle)  # type: ignore[union-attr]
    assert scorer.parameters == {"blockSizeTokens": 5}
    with pytest.raises(PluginConfigError, match="blockSizeTokens: must be >= 1"):
        PLUGINS.lookup("prefix-cache-scorer").factory("prefix-cache-scorer", {"blockSizeTokens": 0}, handle)  # type: ignore[union-attr]


def test_auto_tune_takes_block_size_and_capacity_from_engine_metrics() -> None:
    store = _store(ADDRESSES[:1])
    store.set_metrics(ADDRESSES[0], EndpointMetrics(cache_block_size=32, cache_num_blocks=3))
    producer = _producer(Handle(store))
    scheduler = _scheduler(producer)
    request = _completion("r", "z" * 1000)
    result = scheduler.schedule(request, store.snapshot())
    blocks = result.cycle_state[PROMPT_BLOCKS_KEY]
    assert blocks.block_tokens == 32 and len(blocks.hashes) == 8  # 1000 chars / 128 → 7 + tail
    producer.pre_request(request, result)
    assert producer.index.capacity(ADDRESSES[0]) == 3 and len(producer.index) == 3


def test_a_new_prefix_avoids_an_endpoint_whose_cache_is_full_of_reused_prefixes() -> None:
    # Each endpoint caches 50 char blocks; a prompt here is 19 (18 of prefix + its question).
    store = _store(ADDRESSES[:1])
    producer = _producer(Handle(store), autoTune=False, lruCapacityPerServer=50)
    fit = WeightedScorer(CacheFitScorer("cache-fit-scorer"), 1.0)
    scheduler = _scheduler(producer, [fit])
    prefixes = {name: name * (len(PROMPT) // len(name)) for name in ("alpha ", "beta ", "gamma ")}
    for name in ("alpha ", "beta "):  # two shared prefixes, each sent twice: reused at the first endpoint
        for i in range(2):
            request = _completion(f"{name}{i}", f"{prefixes[name]}question {i}")
            producer.pre_request(request, scheduler.schedule(request, store.snapshot()))
    assert producer.index.reused_blocks(ADDRESSES[0]) == 36
    store.set_endpoints([Endpoint(a.split(":")[0], 8000, name=a) for a in ADDRESSES])

    def fit_scores(prompt: str) -> dict[str, float]:
        result = scheduler.schedule(_completion("probe", prompt), store.snapshot())
        default = result.profile_results["default"]
        return dict(zip([c.address for c in default.candidates], default.scores["cache-fit-scorer"]))

    # A third prefix would push reused blocks out of the first endpoint: 0 there, 1 elsewhere.
    assert fit_scores(prefixes["gamma "] + "new") == {a: float(a != ADDRESSES[0]) for a in ADDRESSES}
    # A known prefix needs only its question there: it fits.
    assert fit_scores(prefixes["alpha "] + "question 9")[ADDRESSES[0]] == 1.0


def test_cache_fit_counts_what_the_engines_report_cached_when_a_kv_event_index_says() -> None:
    # The approximate index believes the first endpoint holds the prompt, so it fits there; its
    # engine reports the prefix evicted (ENGINE_CACHED_TOKENS_KEY), so the whole prompt would
    # have to be cached again beside its reused blocks: it no longer fits there.
    store = _store(ADDRESSES[:1])
    producer = _producer(Handle(store), autoTune=False, lruCapacityPerServer=50)
    fit = CacheFitScorer("cache-fit-scorer")
    scheduler = _scheduler(producer)
    prefix = "alpha " * (len(PROMPT) // 6)
    for i in range(2):  # sent twice: reused at the first endpoint
        request = _completion(f"a{i}", f"{prefix}question {i}")
        producer.pre_request(request, scheduler.schedule(request, store.snapshot()))
    filler = "beta " * (len(PROMPT) // 5)
    for i in range(2):
        request = _completion(f"b{i}", f"{filler}question {i}")
        producer.pre_request(request, scheduler.schedule(request, store.snapshot()))
    request = _completion("probe", prefix + "question 9")
    result = scheduler.schedule(request, store.snapshot())
    candidates = result.profile_results["default"].candidates
    state = result.cycle_state
    assert fit.score(request, state, candidates) == [1.0]  # the approximate guess: cached, fits
    state[ENGINE_CACHED_TOKENS_KEY] = {ADDRESSES[0]: 0}
    assert fit.score(request, state, candidates) == [0.0]
    state[ENGINE_CACHED_TOKENS_KEY] = {ADDRESSES[0]: state[PROMPT_BLOCKS_KEY].prompt_tokens}
    assert fit.score(request, state, candidates) == [1.0]


def test_endpoints_removed_from_the_datastore_are_forgotten() -> None:
    store = _store()
    producer = _producer(Handle(store))
    scheduler = _scheduler(producer)
    request = _completion("r", PROMPT)
    result = scheduler.schedule(request, store.snapshot())
    producer.pre_request(request, result)
    chosen = result.targets[0].address
    assert producer.index.endpoints() == [chosen]
    store.set_endpoints([Endpoint(a.split(":")[0], 8000) for a in ADDRESSES if a != chosen])
    assert producer.index.endpoints() == [] and len(producer.index) == 0


@pytest.mark.parametrize("tokenizers", [{}, {"m": "builtin"}])
def test_one_tenant_never_influences_where_anothers_requests_go(
    tokenizers: Mapping[str, str],
) -> None:
    store = _store()
    producer = _producer(Handle(store), tokenizers=dict(tokenizers))
    scheduler = _scheduler(producer, [WeightedScorer(QueueScorer("queue-scorer"), 1.0)])
    for i in range(20):  # tenant A's traffic builds affinity
        request = _completion(f"a{i}", PROMPT + f" question {i}", tenant="A")
        producer.pre_request(request, scheduler.schedule(request, store.snapshot()))
    kind = TOKENS if tokenizers else CHARS
    for other in ({"tenant": "B"}, {"salt": "s1"}, {"tenant": "A", "salt": "s2"}):
        result = scheduler.schedule(_completion("b", PROMPT + " question 3", **other), store.snapshot())
        match = result.cycle_state[PREFIX_MATCH_KEY]
        assert match.blocks.kind == kind
        assert match.matched == {}
        assert set(result.profile_results["default"].scores["prefix-cache-scorer"]) == {0.0}
    same = scheduler.schedule(_completion("a", PROMPT + " question 3", tenant="A"), store.snapshot())
    assert max(same.profile_results["default"].scores["prefix-cache-scorer"]) > 0.5


def test_a_hot_prefix_replicates_instead_of_overloading_one_endpoint() -> None:
    store = _store()
    factor = 1.5
    producer = _producer(Handle(store), maxLoadFactor=factor)
    scheduler = _scheduler(producer, [WeightedScorer(QueueScorer("queue-scorer"), 1.0)])
    bound_violations = 0
    holders: set[str] = set()
    for i in range(40):  # every request stays in flight: load only grows
        request = _completion(f"h{i}", PROMPT + f" q{i}")
        snapshot = store.snapshot()
        result = scheduler.schedule(request, snapshot)
        producer.pre_request(request, result)
        target = result.targets[0].address
        match = result.cycle_state[PREFIX_MATCH_KEY]
        loads = {s.address: s.in_flight_requests for s in snapshot}
        if match.matched_blocks(target):
            holders.add(target)
            limit = factor * (sum(loads.values()) / len(loads) + 1)
            bound_violations += loads[target] + 1 > limit
        store.acquire(target, 100)
    final = [store.in_flight(a) for a in ADDRESSES]
    assert bound_violations == 0
    assert len(holders) >= 3  # the prefix replicated as load grew
    assert max(final) <= factor * (sum(final) / len(final) + 1) + 1


def test_without_the_bound_a_hot_prefix_pins_one_endpoint() -> None:
    store = _store()
    producer = _producer(Handle(store), maxLoadFactor=0)
    scheduler = _scheduler(producer, [WeightedScorer(QueueScorer("queue-scorer"), 1.0)])
    for i in range(20):
        request = _completion(f"p{i}", PROMPT + f" q{i}")
        result = scheduler.schedule(request, store.snapshot())
        producer.pre_request(request, result)
        store.acquire(result.targets[0].address, 100)
    assert max(store.in_flight(a) for a in ADDRESSES) >= 19


def test_async_preparation_is_used_by_prepare_and_token_hashes_are_shared() -> None:
    store = _store()
    producer = _producer(Handle(store), tokenizers={"*": "builtin"})
    scheduler = _scheduler(producer)
    chat = InferenceRequest(
        "c1",
        Api.CHAT_COMPLETIONS,
        "m",
        "m",
        messages=(Message("system", PROMPT), Message("user", "hi")),
    )
    cycle_state = CycleState()
    asyncio.run(producer.prepare_async(chat, store.snapshot(), cycle_state))
    prepared = cycle_state.read(PROMPT_BLOCKS_KEY)
    result = scheduler.schedule(chat, store.snapshot(), cycle_state)
    assert result.cycle_state[PROMPT_BLOCKS_KEY] is prepared and prepared is not None
    assert prepared.kind == TOKENS and prepared.block_tokens == 16


def _sample(name: str, labels: dict[str, str]) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_value_metrics_compare_expected_and_actual_cached_tokens() -> None:
    store = _store(ADDRESSES[:1])
    producer = _producer(Handle(store), tokenizers={"vm": "builtin"})
    scheduler = _scheduler(producer)
    address = ADDRESSES[0]
    labels = {"model_name": "vm", "endpoint": address}
    before = {
        n: _sample(n, labels)
        for n in (
            "picker_prefix_expected_cached_tokens_total",
            "picker_prefix_saved_prefill_tokens_total",
            "picker_prefix_saved_gpu_seconds_total",
            "picker_prefix_prompt_tokens_total",
        )
    }
    unseen = _sample(
        "picker_prefix_first_block_total",
        {"model_name": "vm", "tenant": "t", "seen": "false"},
    )
    seen = _sample(
        "picker_prefix_first_block_total",
        {"model_name": "vm", "tenant": "t", "seen": "true"},
    )
    results = []
    for i in range(2):
        request = _completion(f"v{i}", PROMPT, model="vm", tenant="t")
        result = scheduler.schedule(request, store.snapshot())
        producer.pre_request(request, result)
        results.append((request, result))
    request, result = results[1]
    blocks = result.cycle_state[PROMPT_BLOCKS_KEY]
    expected = result.cycle_state[PREFIX_MATCH_KEY].cached_tokens(address)
    assert expected == (blocks.prompt_tokens - 1) // 16 * 16  # all but the last block, as the engine
    producer.response_complete(
        request,
        result,
        ResponseOutcome(address, 200, 0.05, 0.5, Usage(blocks.prompt_tokens, 5, expected - 16)),
    )
    assert (
        _sample("picker_prefix_expected_cached_tokens_total", labels)
        - before["picker_prefix_expected_cached_tokens_total"]
        == expected
    )
    assert (
        _sample("picker_prefix_saved_prefill_tokens_total", labels) - before["picker_prefix_saved_prefill_tokens_total"]
        == expected - 16
    )
    assert (
        _sample("picker_prefix_prompt_tokens_total", labels) - before["picker_prefix_prompt_tokens_total"]
        == blocks.prompt_tokens
    )
    saved_seconds = (
        _sample("picker_prefix_saved_gpu_seconds_total", labels) - before["picker_prefix_saved_gpu_seconds_total"]
    )
    assert saved_seconds == pytest.approx((expected - 16) / 5000.0)
    assert (
        _sample(
            "picker_prefix_first_block_total",
            {"model_name": "vm", "tenant": "t", "seen": "false"},
        )
        - unseen
        == 1
    )
    assert (
        _sample(
            "picker_prefix_first_block_total",
            {"model_name": "vm", "tenant": "t", "seen": "true"},
        )
        - seen
        == 1
    )
    assert (REGISTRY.get_sample_value("inference_extension_prefix_indexer_size") or 0) >= len(blocks.hashes)


CONFIG = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: approx-prefix-cache-producer
  parameters: {tokenizers: {m: builtin}, maxLoadFactor: 1.5, blockSizeTokens: 16}
- type: prefix-cache-scorer
- type: ttft-cost-scorer
  parameters: {prefillTokensPerSecond: 8000}
- type: queue-scorer
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: prefix-cache-scorer, weight: 3}
  - {pluginRef: ttft-cost-scorer, weight: 2}
  - {pluginRef: queue-scorer, weight: 1}
"""


async def test_configs_load_and_the_index_survives_a_reload() -> None:
    from tests.routing import Router, completion

    router = Router(_store())
    holder = router.runtimes
    default = holder.current  # the reference default: prefix-cache-scorer auto-creates its producer
    assert any(isinstance(p, ApproxPrefixCacheProducer) for p in default.plugins.values())
    runtime = holder.load_text(CONFIG)
    producer = runtime.plugins["approx-prefix-cache-producer"]
    assert isinstance(producer, ApproxPrefixCacheProducer) and producer.config.max_load_factor == 1.5
    result = await router.pick(completion(PROMPT), "cfg")  # its pre-request hook records the prompt
    assert result.cycle_state[PROMPT_BLOCKS_KEY].kind == TOKENS
    holder.load_text(CONFIG)
    again = await router.pick(completion(PROMPT), "cfg2")
    assert again.targets[0].address == result.targets[0].address
    assert max(again.profile_results["default"].scores["prefix-cache-scorer"]) == 1.0


HEADER = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"


async def test_a_reload_that_changes_the_index_capacity_keeps_the_warm_index_and_resizes_it() -> None:
    from picker.config.runtime import RuntimeHolder

    holder = RuntimeHolder(_store())
    text = HEADER + (
        "plugins: [{type: prefix-cache-scorer},"
        " {type: approx-prefix-cache-producer, parameters: {autoTune: false, lruCapacityPerServer: 100}}]\n"
    )
    holder.load_text(text)
    await holder.start()
    index = holder.current.plugins["approx-prefix-cache-producer"].index
    blocks = list(range(100))
    index.insert(ADDRESSES[0], blocks)
    holder.load_text(text.replace("lruCapacityPerServer: 100", "lruCapacityPerServer: 60"))
    await holder.settle()
    assert holder.current.plugins["approx-prefix-cache-producer"].index is index
    assert (index.default_capacity, len(index)) == (60, 60)
    assert index.match(blocks) == {ADDRESSES[0]: 60}  # the prefix's head stays, its tail went
    await holder.stop()


def test_producers_by_different_names_keep_their_own_index_and_ttft_model() -> None:
    from picker.config.runtime import RuntimeHolder

    runtime = RuntimeHolder(_store()).load_text(
        HEADER + "plugins: [{name: first, type: approx-prefix-cache-producer},"
        " {name: second, type: approx-prefix-cache-producer}, {type: ttft-cost-scorer}]\n"
    )
    first, second, scorer = (runtime.plugins[name] for name in ("first", "second", "ttft-cost-scorer"))
    assert isinstance(first, ApproxPrefixCacheProducer) and isinstance(second, ApproxPrefixCacheProducer)
    assert first.index is not second.index and first.ttft is not second.ttft  # equal parameters
    assert isinstance(scorer, TtftCostScorer) and scorer.model is first.ttft  # the first configured producer's


def test_ttft_priors_follow_the_installed_config_not_a_rejected_one() -> None:
    from picker.config.runtime import RuntimeHolder
    from picker.config.schema import ConfigError

    async def run() -> None:
        holder = RuntimeHolder(_store())
        holder.load_text(CONFIG)
        await holder.start()
        scorer = holder.current.plugins["ttft-cost-scorer"]
        assert isinstance(scorer, TtftCostScorer)
        assert scorer.model.priors.prefill_tokens_per_second == 8000
        # Valid up to the scorer, then a reference to a plugin that does not exist.
        rejected = CONFIG.replace("{prefillTokensPerSecond: 8000}", "{prefillTokensPerSecond: 1}").replace(
            "pluginRef: queue-scorer", "pluginRef: no-such-plugin"
        )
        with pytest.raises(ConfigError):
            holder.load_text(rejected)
        assert scorer.model.priors.prefill_tokens_per_second == 8000
        holder.load_text(CONFIG.replace("8000", "9000"))
        await holder.settle()
        assert scorer.model.priors.prefill_tokens_per_second == 9000
        await holder.stop()

    asyncio.run(run())


def test_expected_cached_tokens_equal_what_the_simulated_engine_reuses() -> None:
    # The real simulator engine (in process), fed the router's own token ids for chat requests.
    from picker_sim.engine import Engine, EngineConfig
    from picker_sim.profiles import DEFAULT_PROFILE, get_profile

    store = _store(ADDRESSES[:1])
    producer = _producer(Handle(store), tokenizers={"m": "builtin"})
    scheduler = _scheduler(producer)
    system = Message("system", PROMPT)
    turns = [
        (system, Message("user", "first question about the weather")),
        (system, Message("user", "second question, quite different")),
        (system, Message("user", "first question about the weather")),
    ]

    async def run() -> list[tuple[int, int]]:
        engine = Engine(EngineConfig(get_profile(DEFAULT_PROFILE), num_gpu_blocks=4096, time_scale=1000.0))
        engine.start()
        try:
            pairs = []
            for i, messages in enumerate(turns):
                request = InferenceRequest(f"s{i}", Api.CHAT_COMPLETIONS, "m", "m", messages=messages)
                cycle_state = CycleState()
                await producer.prepare_async(request, store.snapshot(), cycle_state)
                result = scheduler.schedule(request, store.snapshot(), cycle_state)
                producer.pre_request(request, result)
                match = result.cycle_state[PREFIX_MATCH_KEY]
                served = engine.submit(list(match.blocks.token_ids), 1)
                while served.finish_reason is None:
                    await served.wait()
                pairs.append((match.cached_tokens(ADDRESSES[0]), served.num_cached))
            return pairs
        finally:
            await engine.stop()

    pairs = asyncio.run(run())
    assert pairs[0] == (0, 0)
    assert all(expected == actual for expected, actual in pairs)
    assert pairs[2][1] > pairs[1][1] > 0  # the repeated question reuses more than the shared system prompt


def test_responses_teach_the_ttft_model_the_endpoints_prefill_rate() -> None:
    store = _store(ADDRESSES[:1])
    clock = [0.0]
    model = TtftModel(clock=lambda: clock[0])
    handle = Handle(store)
    handle.persistent(ttft_model_key("approx-prefix-cache-producer"), lambda: model)  # the producer's model
    producer = _producer(handle, tokenizers={"m": "builtin"})
    scheduler = _scheduler(producer)
    address = ADDRESSES[0]
    for i in range(30):  # distinct prompts, one at a time: TTFT = 10 ms + tokens / 2000
        request = _completion(f"l{i}", f"topic {i} " + PROMPT)
        result = scheduler.schedule(request, store.snapshot())
        producer.pre_request(request, result)
        prompt = result.cycle_state[PROMPT_BLOCKS_KEY].prompt_tokens
        outcome = ResponseOutcome(address, 200, 0.01 + prompt / 2000, 1.0, Usage(prompt, 1, 0))
        producer.response_complete(request, result, outcome)
        clock[0] += 10.0  # the next request arrives after this one's backlog drained
    rates = model.rates(address)
    assert rates.prefill_samples == 30
    assert rates.prefill_tokens_per_second == pytest.approx(2000, rel=0.05)


def test_the_ttft_model_trusts_engine_reported_cache_over_the_approximate_guess() -> None:
    """With a KV-event index configured, what the engines report (ENGINE_CACHED_TOKENS_KEY)
    replaces the approximate index's guess: an engine that evicted the prefix is not 'cached'."""
    store = _store(ADDRESSES[:2])
    producer = _producer(Handle(store), tokenizers={"m": "builtin"})
    model = TtftModel()
    ttft = TtftCostScorer("ttft-cost-scorer", lambda: model)
    scheduler = _scheduler(producer)
    first = _completion("t1", PROMPT)
    producer.pre_request(first, scheduler.schedule(first, store.snapshot()))
    request = _completion("t2", PROMPT + "and more")
    result = scheduler.schedule(request, store.snapshot())
    candidates = result.profile_results["default"].candidates
    guessed = result.targets[0].address  # where the approximate index believes the prefix is
    other = next(c.address for c in candidates if c.address != guessed)
    state = result.cycle_state
    assert ttft.score(request, state, candidates)[[c.address for c in candidates].index(guessed)] == 1.0
    prompt = state[PROMPT_BLOCKS_KEY].prompt_tokens
    state[ENGINE_CACHED_TOKENS_KEY] = {guessed: 0, other: prompt}  # the engines say otherwise
    scores = dict(zip([c.address for c in candidates], ttft.score(request, state, candidates)))
    assert scores[other] == 1.0 and scores[guessed] < 1.0


def test_a_pick_adds_to_the_backlog_what_the_prediction_counted_uncached() -> None:
    """The backlog a pick adds uses the same cached-token estimate as the TTFT prediction: when
    the engines report the approximate index's holder evicted the prefix, the whole prompt
    queues there (counting the guess instead made that pod look idle and draw every request)."""
    store = _store(ADDRESSES[:2])
    model = TtftModel(clock=lambda: 0.0)  # no time passes: nothing drains
    handle = Handle(store)
    handle.persistent(ttft_model_key("approx-prefix-cache-producer"), lambda: model)
    producer = _producer(handle, tokenizers={"m": "builtin"})
    scheduler = _scheduler(producer)
    first = _completion("b1", PROMPT)
    producer.pre_request(first, scheduler.schedule(first, store.snapshot()))
    request = _completion("b2", PROMPT + "and more")
    result = scheduler.schedule(request, store.snapshot())
    target = result.targets[0].address  # the approximate index's holder of the prefix
    state = result.cycle_state
    prompt = state[PROMPT_BLOCKS_KEY].prompt_tokens
    before = model.backlog(target)
    state[ENGINE_CACHED_TOKENS_KEY] = {target: 0}  # its engine reports the prefix evicted
    producer.pre_request(request, result)
    assert model.backlog(target) - before == prompt


def test_the_decision_log_explains_predicted_and_observed_ttft() -> None:
    store = _store(ADDRESSES[:2])
    producer = _producer(Handle(store), tokenizers={"m": "builtin"})
    model = TtftModel()
    ttft = WeightedScorer(TtftCostScorer("ttft-cost-scorer", lambda: model), 1.0)
    log = DecisionLog()
    profile = SchedulerProfile("default", [], [ttft], MaxScorePicker("max-score-picker", rng=random.Random(0)))
    scheduler = _PreparingScheduler(
        producer, Scheduler(SingleProfileHandler("single-profile-handler"), [profile], decision_log=log)
    )
    request = _completion("e1", PROMPT)
    result = scheduler.schedule(request, store.snapshot())
    producer.pre_request(request, result)
    (entry,) = log.entries()
    predicted = entry["explain"]["predicted_ttft"]
    assert set(predicted) == set(ADDRESSES[:2])
    prompt = result.cycle_state[PROMPT_BLOCKS_KEY].prompt_tokens
    assert all(p["uncached_tokens"] == prompt and p["seconds"] > 0 for p in predicted.values())
    assert "observed_ttft" not in entry["explain"]  # not until the response ends
    target = result.targets[0].address
    producer.response_complete(request, result, ResponseOutcome(target, 200, 0.25, 1.0, Usage(prompt, 1, 0)))
    (entry,) = log.entries()
    assert entry["explain"]["observed_ttft"] == {
        "endpoint": target,
        "seconds": 0.25,
        "prompt_tokens": prompt,
        "cached_tokens": 0,
    }
    json.dumps(entry)  # what /debug/decisions serves
