"""`precise-prefix-cache-scorer`: prefix affinity from the engines' own KV-cache events.

Scores each candidate by the tier-weighted longest prefix of the request's token blocks that
its engine reports cached (see `picker.kvevents.precise`). The request's blocks come from the
`PromptBlocks` the prefix producer computes once per request (`approx-prefix-cache-producer`,
added by default); character blocks (no tokenizer) cannot be matched and score 0. After the
pick the scorer predicts the target will cache the prompt (speculative entries) while the
request is in flight and `speculativeTTL` after it ends, and records the request's scope so the
engine's coming events land in it.

Parameters (llm-d's names where they exist; llm-d's own form, `indexerConfig` and
`kvEventsConfig`, is read as `picker.kvevents.llmd_form` says):
- `kvEventsPort` (5557): the publisher port on each endpoint's IP, for endpoints without a
  `kv_events_address`; null subscribes only endpoints that have one.
- `kvEventsReplayPort` (none): the publisher's replay ROUTER port; without it a lost message
  makes the endpoint unknown until its cache is cleared.
- `kvEventsBindAddress` (none): a ZMQ endpoint (`tcp://*:5557`) the picker binds for the engines
  to connect and publish to, topic `kv@<pod IP>@<model>`, as llm-d's subscriber does; the two
  ports above are not used then.
- `topicFilter` ("kv@"), `modelName` (""): the model seeding blocks without a LoRA when the
  topic (`kv@<pod>@<model>`) names none.
- `blockSizeTokens` (16): the index's block size; equal to the engine's and the producer's
  block size, the producer's hashes are used as they are, else re-hashed from the token ids.
- `prefixCachingHashAlgo` ("own"): "own" keys blocks by the picker's own hashes, mapped from
  the engines' through the events' token ids, whatever the engines' algorithm; `sha256_cbor` or
  `sha256` (vLLM's `--prefix-caching-hash-algo`) keys them by the engines' hashes as sent and
  hashes each request that way (`picker.kvevents.vllm_hash`), with `hashSeed` (llm-d's name;
  "vllm-none-hash", vLLM's default, unless the engines set `PYTHONHASHSEED`) and
  `blockSizeTokens` equal to the engines'. A prefix's digests are computed once and cached.
- `tierWeights` ({gpu: 1.0, cpu: 0.8}), `speculativeTTL` ("2s"; 0 disables predictions),
  `speculativeHold` ("60s": the longest a prediction waits for its request to end; 0 counts
  `speculativeTTL` from the pick, which forgot prefixes queued at a busy engine),
  `capacityPerEndpoint` (200000 blocks; with `autoTune`, 2 x the engine's GPU blocks when
  scraped), `replayTimeout` ("1s").

The index and subscriber are the scorer's own and outlive reloads by its name (two scorers by
different names keep separate ones). A reload that keeps `blockSizeTokens`, the hash settings
and the publishers' settings (`kvEventsPort`, `kvEventsReplayPort`, `topicFilter`, `modelName`) keeps the warm index
and applies the rest to it once the config is installed; one that changes them builds a new index
and subscriber, which replace the old ones (closed then) once the config is installed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from picker.datastore.endpoint import EndpointState
from picker.datastore.store import Datastore
from picker.framework.cycle_state import CycleState, StateKey
from picker.framework.handle import Handle
from picker.framework.parameters import Parameters, PluginConfigError
from picker.framework.plugin import (
    BackgroundWork,
    DataProducer,
    PreRequest,
    ResponseComplete,
    SchedulingResult,
    Scorer,
    ScorerCategory,
)
from picker.framework.request import InferenceRequest, ResponseOutcome
from picker.kvevents.llmd_form import translate
from picker.kvevents.precise import PreciseIndex, Prediction, TierWeights
from picker.kvevents.subscriber import KVEventSubscriber, SubscriberConfig
from picker.kvevents.vllm_hash import ALGORITHMS, DEFAULT_SEED, VllmBlockHasher
from picker.prefix.hashing import token_block_hashes
from picker.prefix.plugins import ENGINE_CACHED_TOKENS_KEY, PROMPT_BLOCKS_KEY
from picker.prefix.prompt_blocks import TOKENS, PromptBlocks

OWN_HASHES = "own"
_ADAPTER_MARK = 0xA0A7_7E25_1A0B_5EED  # xor-ed into a LoRA request's digest cache keys
_EXECUTOR_KEY = "kvevents/vllm-hash-executor"
OFFLOAD_BLOCKS = 64  # uncached blocks (about 5 µs each) hashed off the event loop from this many
_RUNTIME_KEY = "kvevents/precise-index"  # + ":" + the scorer's name (`Handle.persistent`)
_HASHES_KEY = StateKey("precise-prefix-cache-scorer/hashes", tuple)
_SCORES_KEY = StateKey("precise-prefix-cache-scorer/scores", list)
# The pick's prediction, ended with the request.
_PREDICTION_KEY = StateKey("precise-prefix-cache-scorer/prediction", Prediction)


@dataclass(frozen=True, slots=True)
class PreciseConfig:
    """The scorer's parameters."""

    subscriber: SubscriberConfig = field(default_factory=SubscriberConfig)
    block_size: int = 16
    weights: TierWeights = field(default_factory=TierWeights)
    speculative_ttl: float = 2.0
    speculative_hold: float = 60.0
    capacity: int = 200_000
    auto_tune: bool = True
    hash_algorithm: str = OWN_HASHES  # or the engines' (`vllm_hash.ALGORITHMS`)
    hash_seed: str = DEFAULT_SEED

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | None) -> tuple[PreciseConfig, dict[str, Any]]:
        """The config, and the effective parameters (defaults included) for `config show`."""
        p = Parameters(raw)
        port = p.optional_integer("kvEventsPort", 5557, at_least=1)
        replay = p.optional_integer("kvEventsReplayPort", None, at_least=1)
        for key, value in (("kvEventsPort", port), ("kvEventsReplayPort", replay)):
            if value is not None and value > 65535:
                raise PluginConfigError(f"{key}: must be a port number, got {value}")
        bind_address = p.string("kvEventsBindAddress", "")
        if bind_address and "://" not in bind_address:
            raise PluginConfigError(
                f'kvEventsBindAddress: must be a ZMQ endpoint such as "tcp://*:5557", got {bind_address!r}'
            )
        if bind_address:
            for key in ("kvEventsPort", "kvEventsReplayPort"):
                if raw is not None and key in raw:
                    raise PluginConfigError(f"{key}: not used with kvEventsBindAddress (the engines connect to it)")
        subscriber = SubscriberConfig(
            port=port,
            bind_address=bind_address or None,
            replay_port=replay,
            topic_filter=p.string("topicFilter", "kv@"),
            model=p.string("modelName", ""),
            replay_timeout=p.duration("replayTimeout", 1.0),
        )
        tiers = dict(p.mapping("tierWeights"))
        weights = TierWeights(_weight(tiers.pop("gpu", 1.0), "gpu"), _weight(tiers.pop("cpu", 0.8), "cpu"))
        if tiers:
            raise PluginConfigError(f"tierWeights.{next(iter(tiers))}: unknown tier (gpu, cpu)")
        config = cls(
            subscriber=subscriber,
            block_size=p.integer("blockSizeTokens", 16, at_least=1),
            weights=weights,
            speculative_ttl=p.duration("speculativeTTL", 2.0),
            speculative_hold=p.duration("speculativeHold", 60.0),
            capacity=p.integer("capacityPerEndpoint", 200_000, at_least=1),
            auto_tune=p.boolean("autoTune", True),
            hash_algorithm=p.string("prefixCachingHashAlgo", OWN_HASHES, choices=(OWN_HASHES, *ALGORITHMS)),
            hash_seed=p.string("hashSeed", DEFAULT_SEED),
        )
        return config, p.finish()


def _weight(value: Any, tier: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise PluginConfigError(f"tierWeights.{tier}: must be a number in [0, 1], got {value!r}")
    return float(value)


class PreciseRuntime:
    """An index and the subscriber that feeds it (none without a datastore)."""

    def __init__(
        self,
        config: PreciseConfig,
        index: PreciseIndex,
        subscriber: KVEventSubscriber | None,
        hasher: VllmBlockHasher | None = None,
    ) -> None:
        self.config = config
        self.index = index
        self.subscriber = subscriber
        self.hasher = hasher  # requests' engine keys, with `prefixCachingHashAlgo`

    @classmethod
    def build(cls, config: PreciseConfig, datastore: Datastore | None) -> PreciseRuntime:
        """A new index with `config`'s settings and, with a datastore, its subscriber (not started)."""
        index = PreciseIndex(
            config.block_size,
            weights=config.weights,
            speculative_ttl=config.speculative_ttl,
            default_capacity=config.capacity,
            engine_keys=config.hash_algorithm != OWN_HASHES,
        )
        subscriber = None if datastore is None else KVEventSubscriber(index, datastore, config.subscriber)
        if config.hash_algorithm == OWN_HASHES:
            return cls(config, index, subscriber)
        return cls(config, index, subscriber, VllmBlockHasher(config.hash_algorithm, config.hash_seed))

    def serves(self, config: PreciseConfig) -> bool:
        """Whether this index and subscriber are right for `config`: the same block size and
        hashing (the index's keys) and the same publishers, topic and model (what its entries
        came from); everything else `reconfigure` applies in place."""
        keys = (config.block_size, config.hash_algorithm, config.hash_seed)
        return keys == (
            self.config.block_size,
            self.config.hash_algorithm,
            self.config.hash_seed,
        ) and self.config.subscriber == replace(config.subscriber, replay_timeout=self.config.subscriber.replay_timeout)

    def reconfigure(self, config: PreciseConfig) -> None:
        """Take `config` (which this runtime `serves`), keeping what the index holds."""
        self.index.reconfigure(
            config.weights, config.speculative_ttl, config.capacity, keep_capacities=config.auto_tune
        )
        if self.subscriber is not None:
            self.subscriber.config = config.subscriber
        self.config = config

    def start(self) -> None:
        """Start the subscriber on the running loop (a second call does nothing)."""
        if self.subscriber is not None:
            self.subscriber.start()

    async def close(self) -> None:
        """Stop the subscriber and detach it from the datastore (a second call does nothing)."""
        if self.subscriber is not None:
            await self.subscriber.stop()


class PreciseRuntimeSlot:
    """The runtime of the scorer called by one name, kept across reloads (`Handle.persistent`).

    A config's scorer takes the runtime in the slot when it `serves` the config, else a new one
    (`runtime_for`). Once the config is installed, its scorer puts its runtime in the slot
    (`install`) and the scorer of the config before closes its own if that was replaced
    (`retire`); the runtime in the slot closes when no installed config has the scorer.
    """

    def __init__(self) -> None:
        self.runtime: PreciseRuntime | None = None

    def runtime_for(self, config: PreciseConfig, datastore: Datastore | None) -> PreciseRuntime:
        """The runtime in the slot if it serves `config`, else a new one (the slot's, if empty).
        Nothing starts here: the config may yet be rejected."""
        current = self.runtime
        if current is not None and current.serves(config):
            return current
        runtime = PreciseRuntime.build(config, datastore)
        if current is None:
            self.runtime = runtime
        return runtime

    def install(self, runtime: PreciseRuntime, config: PreciseConfig) -> None:
        """`runtime` is the installed config's, with `config`: start it."""
        runtime.reconfigure(config)
        self.runtime = runtime
        runtime.start()

    async def retire(self, runtime: PreciseRuntime) -> None:
        """A scorer of this name stopped: close its runtime unless the installed one uses it."""
        if runtime is not self.runtime:
            await runtime.close()

    async def close(self) -> None:
        """No installed config has the scorer any more: close the runtime in the slot."""
        if self.runtime is not None:
            await self.runtime.close()


class PreciseScorer(DataProducer, Scorer, PreRequest, ResponseComplete, BackgroundWork):
    """`precise-prefix-cache-scorer`: see the module docstring."""

    plugin_type = "precise-prefix-cache-scorer"
    category = ScorerCategory.AFFINITY
    consumes = frozenset({PROMPT_BLOCKS_KEY})
    produces = frozenset({ENGINE_CACHED_TOKENS_KEY})

    def __init__(
        self,
        name: str,
        config: PreciseConfig,
        slot: PreciseRuntimeSlot,
        runtime: PreciseRuntime,
        executor: Executor | None = None,
    ) -> None:
        super().__init__(name)
        self.config = config
        self.slot = slot
        self.runtime = runtime
        self.index = runtime.index
        self.hasher = runtime.hasher
        self.executor = executor  # hashes a long uncached prompt the engines' way off the loop
        self._capacities: dict[str, int] = {}

    def start(self) -> None:
        """The runtime takes this config (or replaces the one before) once it is installed."""
        self.slot.install(self.runtime, self.config)

    async def stop(self) -> None:
        """Close the runtime if the installed config replaced it; one it uses stays."""
        await self.slot.retire(self.runtime)

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> PreciseScorer:
        translated = translate(parameters)
        config, effective = PreciseConfig.parse(translated.parameters)
        slot = handle.persistent(f"{_RUNTIME_KEY}:{name}", PreciseRuntimeSlot, PreciseRuntimeSlot.close)
        executor = None
        if config.hash_algorithm != OWN_HASHES:
            executor = handle.persistent(
                _EXECUTOR_KEY,
                lambda: ThreadPoolExecutor(1, thread_name_prefix="picker-vllm-hash"),
                lambda executor: executor.shutdown(wait=False, cancel_futures=True),
            )
        scorer = cls(name, config, slot, slot.runtime_for(config, handle.datastore), executor)
        scorer.parameters = effective
        scorer.notes = translated.notes
        scorer.producer_parameters = translated.producer_parameters
        return scorer

    async def prepare_async(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle_state: CycleState
    ) -> None:
        """With engine keys, hash the prompt's uncached blocks off the event loop when there are
        many (the prompt's blocks are ready when its text was tokenized off the loop too)."""
        if self.hasher is None or self.executor is None:
            return
        inputs = self._engine_inputs(cycle_state, request)
        if inputs is None:
            return
        keys, tokens, lora = inputs
        known, parent = self.hasher.cached(keys)
        miss = len(known)
        if len(keys) - miss < OFFLOAD_BLOCKS:
            return  # `prepare` does it inline
        size = self.index.block_size
        digests = await asyncio.get_running_loop().run_in_executor(
            self.executor,
            self.hasher.digests,
            tokens[miss * size : len(keys) * size],
            size,
            lora,
            request.cache_salt,
            parent,
            miss,
        )
        cycle_state[_HASHES_KEY] = (*known, *self.hasher.store(keys[miss:], digests))

    def prepare(self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle_state: CycleState) -> None:
        """Match the request once, before scoring, so that other plugins (the TTFT cost model)
        can use what the engines really hold: `{address: cached prompt tokens}`."""
        hashes = self.block_hashes(cycle_state, request)
        if not hashes:
            return
        if self.config.auto_tune:
            self._tune_capacity(candidates)
        scores = self.index.score(hashes, [c.address for c in candidates])
        cycle_state[_SCORES_KEY] = scores
        tokens = len(hashes) * self.index.block_size
        cycle_state[ENGINE_CACHED_TOKENS_KEY] = {c.address: int(s * tokens) for c, s in zip(candidates, scores)}

    def score(
        self, request: InferenceRequest, cycle_state: CycleState, candidates: Sequence[EndpointState]
    ) -> list[float]:
        scores = cycle_state.read(_SCORES_KEY)
        if scores is None or len(scores) != len(candidates):  # no prompt blocks, or filters ran since
            hashes = self.block_hashes(cycle_state, request)
            if not hashes:
                return [0.0] * len(candidates)
            scores = self.index.score(hashes, [c.address for c in candidates])
        return scores

    def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        targets = result.targets
        if not targets:
            return
        hashes = self.block_hashes(result.cycle_state, request)
        if not hashes:
            return
        address = targets[0].address
        blocks = result.cycle_state.read(PROMPT_BLOCKS_KEY)
        if blocks is not None and blocks.token_ids is not None:
            self.index.record_scope(address, blocks.token_ids, request.target_model, request.cache_salt, request.tenant)
        prediction = self.index.insert_speculative(address, hashes, self.config.speculative_hold)
        if prediction is not None:
            result.cycle_state[_PREDICTION_KEY] = prediction

    def response_complete(self, request: InferenceRequest, result: SchedulingResult, outcome: ResponseOutcome) -> None:
        """The request ended: its blocks are stored (or never will be); the prediction winds down."""
        prediction = result.cycle_state.read(_PREDICTION_KEY)
        if prediction is not None:
            self.index.end_speculative(prediction)

    def block_hashes(self, cycle_state: CycleState, request: InferenceRequest) -> tuple[int, ...]:
        """The request's token-block keys at the index's block size (computed at most once):
        own hashes, or the engines' with `prefixCachingHashAlgo`."""
        cached = cycle_state.read(_HASHES_KEY)
        if cached is not None:
            return cached
        hashes: tuple[int, ...] = ()
        if self.hasher is None:
            blocks = cycle_state.read(PROMPT_BLOCKS_KEY)
            if blocks is not None and blocks.kind == TOKENS:
                hashes = self._own_hashes(blocks)
        elif (inputs := self._engine_inputs(cycle_state, request)) is not None:
            keys, tokens, lora = inputs
            hashes = tuple(self.hasher.block_hashes(keys, tokens, self.index.block_size, lora, request.cache_salt))
        cycle_state[_HASHES_KEY] = hashes
        return hashes

    def _own_hashes(self, blocks: PromptBlocks) -> tuple[int, ...]:
        """The prompt's own block hashes at the index's block size."""
        size = self.index.block_size
        if blocks.block_tokens == size:
            return blocks.hashes
        tokens = _hashed_tokens(blocks)
        return () if tokens is None else tuple(token_block_hashes(tokens, size, blocks.seed))

    def _engine_inputs(
        self, cycle_state: CycleState, request: InferenceRequest
    ) -> tuple[Sequence[int], Sequence[int], str | None] | None:
        """What the engines' block hashes of the request come from: the own keys their digests
        are cached under (each names a prefix), the token ids and the LoRA adapter, if any."""
        blocks = cycle_state.read(PROMPT_BLOCKS_KEY)
        if blocks is None or blocks.kind != TOKENS or (tokens := _hashed_tokens(blocks)) is None:
            return None
        keys: Sequence[int] = self._own_hashes(blocks)
        # A model no endpoint serves is an adapter, which vLLM hashes into every block (its keys
        # are marked: a model may be learnt as a base model later, from a topic).
        model = request.target_model
        if model in self.index.models or model == self.config.subscriber.model:
            return keys, tokens, None
        return [key ^ _ADAPTER_MARK for key in keys], tokens, model

    def _tune_capacity(self, candidates: Sequence[EndpointState]) -> None:
        """Keep 2 x each engine's GPU blocks (in own blocks), as scraped: room for CPU tiers and
        for removals that arrive late."""
        capacities = self._capacities
        size = self.index.block_size
        for c in candidates:
            blocks = c.metrics.cache_num_blocks
            if blocks > 0 and capacities.get(c.address) != blocks:
                capacities[c.address] = blocks
                engine_size = c.metrics.cache_block_size or size
                self.index.set_capacity(c.address, 2 * -(-blocks * engine_size // size))


def _hashed_tokens(blocks: PromptBlocks) -> Sequence[int] | None:
    """The token ids the producer's blocks cover (it may have stopped at its block cap)."""
    tokens = blocks.token_ids
    if tokens is not None:
        hashed = len(blocks.hashes) * blocks.block_tokens
        if len(tokens) >= hashed + blocks.block_tokens:
            return tokens[:hashed]
    return tokens
