"""Prefix-cache routing plugins (listed in `picker.plugins`).

* `approx-prefix-cache-producer` (DataProducer, PreRequest, ResponseComplete): hashes the
  prompt once per request (token blocks when the model has a tokenizer, else the reference's
  character blocks), matches it against the approximate index, writes `PrefixMatch` under
  `PrefixCacheMatchInfo` and `PromptBlocks` under `PromptBlocks`; after the pick it records
  the prompt at the primary target (and a `prefill` profile's target); when the response ends
  it learns TTFT rates and counts the value metrics.
* `prefix-cache-scorer`: matched blocks / prompt blocks, as in the reference. Its parameters are
  the producer's: as in the reference, they configure the producer the loader adds when none is
  configured (`Registration.configures_default_producer`).
* `ttft-cost-scorer`: best predicted TTFT / the endpoint's predicted TTFT (see `ttft`).
* `cache-fit-scorer` (no parameters): 1 where the prompt fits beside the endpoint's recently
  reused blocks, 0 where it would evict them.

Tokenizing can take milliseconds, so the producer's `prepare_async` tokenizes in a thread pool
and leaves the blocks in the request's CycleState for `prepare`, which otherwise hashes in the
calling thread.

Example (`tokenizers` and `ttft-cost-scorer` are the picker's own; reference configs keep their meaning)::

    plugins:
    - type: approx-prefix-cache-producer
      parameters: {blockSizeTokens: 16, tokenizers: {llama-3-8b: /models/llama-3-8b, "*": builtin}}
    - type: prefix-cache-scorer
    - type: ttft-cost-scorer
    schedulingProfiles:
    - name: default
      plugins: [{pluginRef: prefix-cache-scorer, weight: 3}, {pluginRef: ttft-cost-scorer, weight: 2}]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from itertools import compress
from typing import TYPE_CHECKING, Any, NamedTuple

from picker.datastore.endpoint import EndpointState
from picker.framework.cycle_state import CycleState, StateKey
from picker.framework.handle import Handle
from picker.framework.parameters import Parameters, PluginConfigError
from picker.framework.plugin import (
    Affinity,
    AffinitySource,
    BackgroundWork,
    DataProducer,
    PreRequest,
    ResponseComplete,
    ResponseStreaming,
    SchedulingResult,
    Scorer,
    ScorerCategory,
)
from picker.framework.request import InferenceRequest, ResponseOutcome
from picker.prefix.chars import CHARS_PER_TOKEN
from picker.prefix.hashing import token_block_hashes
from picker.prefix.hotspot import load_limit
from picker.prefix.index import DEFAULT_LRU_CAPACITY, DEFAULT_REUSE_WINDOW_S, PrefixIndex
from picker.prefix.prompt_blocks import TOKENS, BlockSizing, PromptBlocks, PromptHasher
from picker.prefix.token_cache import DEFAULT_CAPACITY_TOKENS, TokenPrefixCache
from picker.prefix.tokenizer import PromptTokenizer, load_prompt_tokenizer
from picker.prefix.ttft import TtftEstimate, TtftModel, TtftPriors, ttft_scores
from picker.request.completion import completion_text
from picker.scheduling.scorers import ParameterlessScorer
from picker.telemetry.metrics import (
    PREFIX_EXPECTED_CACHED_TOKENS,
    PREFIX_EXPECTED_HIT_RATIO,
    PREFIX_FIRST_BLOCK,
    PREFIX_INDEXER_HIT_BYTES,
    PREFIX_INDEXER_HIT_RATIO,
    PREFIX_INDEXER_SIZE,
    PREFIX_PROMPT_TOKENS,
    PREFIX_SAVED_GPU_SECONDS,
    PREFIX_SAVED_PREFILL_TOKENS,
)

if TYPE_CHECKING:
    from picker.state.sync import SharedIndex, SharedTtft

PREDICTED_TTFT = "predicted_ttft"  # explain topic: {address: TtftEstimate}
OBSERVED_TTFT = "observed_ttft"  # explain topic: {endpoint, seconds, prompt_tokens, cached_tokens}
# {address: prompt tokens an engine reported cached}, from the KV-event (precise) index when one
# is configured; the TTFT model prefers it to the approximate index's guess.
ENGINE_CACHED_TOKENS_KEY = StateKey("EngineCachedTokens", dict)
PREFILL_PROFILE = "prefill"

# Objects that outlive config reloads (Handle.persistent keys); a producer's index and TTFT
# model are its own, keyed by its name (`index_key`, `ttft_model_key`).
_INDEX_KEY = "prefix/approx-index"
_TTFT_MODEL_KEY = "prefix/ttft-model"
_TOKEN_CACHE_KEY = "prefix/token-cache"
_EXECUTOR_KEY = "prefix/tokenize-executor"


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """How much of one request's prompt each candidate holds (the reference's match info).

    `matched` is the raw match; endpoints in `over_bound` lost their affinity to the load bound
    and count as holding nothing.
    """

    blocks: PromptBlocks
    matched: Mapping[str, int]
    over_bound: frozenset[str] = frozenset()
    room: Callable[[EndpointState], int] | None = None  # an endpoint's cache blocks beside its reused ones
    # `matched` read for each of the candidates the producer saw, in their order: a consumer
    # given that same list (the first filter is) reads these instead of a pass over the pool.
    candidates: Sequence[EndpointState] = ()
    held: Sequence[int] = ()

    def fits(self, state: EndpointState, cached_tokens: int | None = None) -> bool:
        """Whether the blocks `state`'s endpoint lacks fit in its cache beside the blocks reused
        there recently, so placing the prompt there evicts nothing in use (True if unknown).
        What it holds: `cached_tokens` when given (`expected_cached_tokens`), else the match."""
        if self.room is None:
            return True
        if cached_tokens is None:
            held = self.matched.get(state.address, 0)
        else:
            held = min(self.total_blocks, -(-cached_tokens // self.blocks.block_tokens))
        return self.total_blocks - held <= self.room(state)

    @property
    def total_blocks(self) -> int:
        return len(self.blocks.hashes)

    def matched_blocks(self, address: str) -> int:
        """Blocks that count for affinity: none at an endpoint past the load bound."""
        return 0 if address in self.over_bound else self.matched.get(address, 0)

    def cached_tokens(self, address: str) -> int:
        """Prompt tokens expected cached at `address`, load bound or not (the engine still has
        them), at most `cached_tokens_limit()`."""
        return min(self.cached_tokens_limit(), self.matched.get(address, 0) * self.blocks.block_tokens)

    def cached_tokens_limit(self) -> int:
        """The most prompt tokens an engine can have cached: for token blocks as the engine
        counts them, full blocks and never the prompt's last token (vLLM always computes at
        least one); for characters the prompt's estimated tokens."""
        blocks = self.blocks
        if blocks.kind == TOKENS:
            return max(0, blocks.prompt_tokens - 1) // blocks.block_tokens * blocks.block_tokens
        return blocks.prompt_tokens

    def score(self, address: str) -> float:
        total = self.total_blocks
        return self.matched_blocks(address) / total if total else 0.0


PREFIX_MATCH_KEY = StateKey("PrefixCacheMatchInfo", PrefixMatch)


def expected_cached_tokens(match: PrefixMatch, cycle_state: CycleState, addresses: Sequence[str]) -> list[int]:
    """Prompt tokens each endpoint is expected to have cached: what the engines reported (the
    precise index) when a producer put that in `cycle_state`, else the approximate index's
    guess. One source for the TTFT prediction and the backlog the pick adds: a backlog counted
    from another estimate than the one the pick was made on let a pod whose cache the two
    disagreed on look idle and draw every request."""
    engine_cached = cycle_state.read(ENGINE_CACHED_TOKENS_KEY)
    if engine_cached is None:
        return [match.cached_tokens(a) for a in addresses]
    limit = match.cached_tokens_limit()
    return [min(engine_cached.get(a, 0), limit) for a in addresses]


def prompt_and_cached_tokens(
    request: InferenceRequest, cycle_state: CycleState, candidates: Sequence[EndpointState]
) -> tuple[int, list[int]]:
    """The prompt's tokens and each candidate's expected cached share of them (none without a
    prefix match: the request's own estimate, nothing cached), for latency predictions."""
    match = cycle_state.read(PREFIX_MATCH_KEY)
    if match is None:
        return request.estimated_prompt_tokens(), [0] * len(candidates)
    return match.blocks.prompt_tokens, expected_cached_tokens(match, cycle_state, [c.address for c in candidates])


PROMPT_BLOCKS_KEY = StateKey("PromptBlocks", PromptBlocks)
# Set once prepare_async has hashed the prompt (blocks or none), so prepare does not hash again.
_HASHED_KEY = StateKey("approx-prefix-cache-producer/hashed", bool)
# The index's match for the prompt's blocks and the index version it was read at: flow control's
# affinity lookup and the scheduling right after it (a request dispatched at once) ask the same.
_MATCHED_KEY = StateKey("approx-prefix-cache-producer/matched", tuple)


# The predicted seconds a disaggregated request's TTFT spends on the KV transfer (from the prefill
# pod to the decode pod), written by the P/D profile handler when it disaggregates.
KV_TRANSFER_SECONDS_KEY = StateKey("KvTransferSeconds", float)


class Pick(NamedTuple):
    """What the producer expected at pick time; the response teaches the TTFT model with it.

    A prompt prefilled on another pod (`prefill_address`, P/D) teaches that pod instead: the
    client's TTFT less the predicted KV transfer and the decode pod's first step, with what the
    prefill pod was expected to hold and have queued (the answer's cached tokens count the
    transferred blocks, so they describe the decode pod)."""

    address: str
    expected_cached_tokens: int
    work_ahead: float
    prefill_address: str = ""
    prefill_cached_tokens: int = 0
    prefill_work_ahead: float = 0.0
    transfer_seconds: float = 0.0


# llm-d's later prefix-cache-scorer with its own KV-event index (`mode: cache_tracking`), which
# llm-d v0.4.0 (the reference's v1.2.0 scorer) ignores: accepted and ignored alike.
LLMD_TRACKING_PARAMETERS = ("mode", "kvEventsConfig", "indexerConfig")
_PICK_KEY = StateKey("approx-prefix-cache-producer/pick", Pick)
# The answer's chunks as they stream back (`indexResponses`, token-hashed prompts only).
_RESPONSE_KEY = StateKey("approx-prefix-cache-producer/response", list)


@dataclass(frozen=True, slots=True)
class PrefixConfig:
    """The producer's parameters (reference names, plus the picker's own)."""

    auto_tune: bool = True
    block_size_tokens: int = 16
    max_prefix_blocks: int = 256
    max_prefix_tokens: int = 0
    lru_capacity_per_server: int = DEFAULT_LRU_CAPACITY
    max_token_blocks: int = 4096
    max_load_factor: float = 0.0
    tokenizers: Mapping[str, str] = field(default_factory=dict)
    token_cache_tokens: int = DEFAULT_CAPACITY_TOKENS
    reuse_window_s: float = DEFAULT_REUSE_WINDOW_S
    index_responses: bool = False

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> tuple[PrefixConfig, dict[str, Any]]:
        """The config, and the effective parameters (defaults included) for `config show`."""
        p = Parameters(raw)
        auto_tune = p.boolean("autoTune", True)
        # Deprecated (a size in characters) and ignored, as in the reference, where it is an
        # error only beside a blockSizeTokens <= 0, which is invalid here anyway.
        # `hashBlockSize` is the same size by its name before the reference's v1.0, which llm-d's
        # configs still use.
        for key in ("blockSize", "hashBlockSize"):
            block_size = p.deprecated(key)
            if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)):
                raise PluginConfigError(f"{key}: must be an integer, got {block_size!r}")
        for key in LLMD_TRACKING_PARAMETERS:
            p.deprecated(key)
        config = cls(
            auto_tune=auto_tune,
            block_size_tokens=p.integer("blockSizeTokens", 16, at_least=1),
            max_prefix_blocks=p.integer("maxPrefixBlocksToMatch", 256, at_least=1),
            max_prefix_tokens=p.integer("maxPrefixTokensToMatch", 0, at_least=0),
            lru_capacity_per_server=p.integer("lruCapacityPerServer", DEFAULT_LRU_CAPACITY, at_least=1),
            max_token_blocks=p.integer("maxTokenBlocksToMatch", 4096, at_least=1),
            max_load_factor=p.number("maxLoadFactor", 0.0, at_least=0),
            tokenizers=_tokenizer_specs(p.mapping("tokenizers")),
            token_cache_tokens=p.integer("tokenCacheTokens", DEFAULT_CAPACITY_TOKENS, at_least=1),
            reuse_window_s=p.number("reuseWindowSeconds", DEFAULT_REUSE_WINDOW_S, above=0),
            index_responses=p.boolean("indexResponses", False),
        )
        return config, p.finish()

    def sizing(self, candidates: Sequence[EndpointState]) -> BlockSizing:
        """Block sizes for one request: with autoTune, the first candidate's engine block size."""
        block = self.block_size_tokens
        if self.auto_tune:
            for candidate in candidates:
                if candidate.metrics.cache_block_size > 0:
                    block = candidate.metrics.cache_block_size
                    break
        max_chars = self.max_prefix_tokens // block if self.max_prefix_tokens > 0 else self.max_prefix_blocks
        max_tokens = self.max_prefix_tokens // block if self.max_prefix_tokens > 0 else self.max_token_blocks
        return BlockSizing(block, max(1, max_chars), block, max(1, max_tokens))


def _tokenizer_specs(raw: Mapping[str, Any]) -> dict[str, str]:
    specs: dict[str, str] = {}
    for model, spec in raw.items():
        if not isinstance(spec, str) or not spec:
            raise PluginConfigError(f'tokenizers.{model}: must be "builtin" or a tokenizer directory, got {spec!r}')
        specs[str(model)] = spec
    return specs


def index_key(producer_name: str) -> str:
    """The persistent key of the prefix index of the producer called `producer_name` (also the
    name its inserts go by between picker processes, `--state-store`)."""
    return f"{_INDEX_KEY}:{producer_name}"


def ttft_model_key(producer_name: str) -> str:
    """The persistent key of the TTFT model of the producer called `producer_name`."""
    return f"{_TTFT_MODEL_KEY}:{producer_name}"


class ApproxPrefixCacheProducer(
    DataProducer, PreRequest, ResponseStreaming, ResponseComplete, AffinitySource, BackgroundWork
):
    """`approx-prefix-cache-producer`: see the module docstring.

    Its prefix index and TTFT model are its own and outlive reloads by its name: a reload that
    changes `lruCapacityPerServer` or `reuseWindowSeconds` keeps the warm index (resized once
    the new config is installed), and two producers by different names keep separate ones.
    The TTFT model's consumers (`ttft-cost-scorer`, `predicted-latency-producer`) read it
    from this producer (`ProducerTtftModel`).

    Reference parameters: `autoTune` (true: block size from the first candidate's engine
    block size, LRU capacity from each endpoint's KV block count), `blockSizeTokens` (16),
    `maxPrefixBlocksToMatch` (256), `maxPrefixTokensToMatch` (overrides it when > 0),
    `lruCapacityPerServer` (31250); `blockSize` (deprecated, in characters; `hashBlockSize` by
    its older name, as llm-d's configs have it) is ignored. The picker's own:

    - `tokenizers`: model (or LoRA adapter) name → `builtin` or a local tokenizer directory;
      the key `*` applies to every other model. Those models hash token blocks.
    - `maxTokenBlocksToMatch` (4096): the cap for token blocks (`maxPrefixTokensToMatch`
      also applies when set).
    - `maxLoadFactor` (off by default, so reference configs keep their meaning; e.g. 2.0): the
      hot-spot bound (`picker.prefix.hotspot`).
    - `tokenCacheTokens` (4,000,000): capacity of the tokenized-prefix cache.
    - `reuseWindowSeconds` (30): blocks sent to an endpoint again within this long count as its
      reused working set (`cache-fit-scorer`).
    - `indexResponses` (false): for token-hashed prompts, read the answer as it streams back
      (the gateway's response phases must reach the picker) and, once it has ended, record the
      prompt and the answer's full blocks at the endpoint that served it: the engine caches the
      tokens it generated, and a chat client sends the answer back as the start of the next
      turn, so the next turn's match covers the whole history.
    """

    plugin_type = "approx-prefix-cache-producer"
    produces = frozenset({PREFIX_MATCH_KEY, PROMPT_BLOCKS_KEY})

    def __init__(
        self,
        name: str,
        config: PrefixConfig,
        index: PrefixIndex,
        hasher: PromptHasher,
        ttft: TtftModel,
        shared: SharedIndex | None = None,
        shared_ttft: SharedTtft | None = None,
    ) -> None:
        super().__init__(name)
        self.config = config
        self.index = index
        self.hasher = hasher
        self.ttft = ttft
        self.shared = shared  # --state-store: what this index learns goes to the other pickers
        self.shared_ttft = shared_ttft  # ... and what the TTFT model learns

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> ApproxPrefixCacheProducer:
        config, effective = PrefixConfig.parse(parameters)
        tokenizers: dict[str, PromptTokenizer] = {}
        for model, spec in config.tokenizers.items():
            try:
                tokenizers[model] = handle.persistent(
                    f"prefix/tokenizer:{spec}",
                    partial(load_prompt_tokenizer, spec),
                )
            except ValueError as error:
                raise PluginConfigError(f"tokenizers.{model}: {error}") from None
        index_name, ttft_name = index_key(name), ttft_model_key(name)
        index = handle.persistent(
            index_name,
            lambda: PrefixIndex(config.lru_capacity_per_server, config.reuse_window_s),
        )
        ttft = handle.persistent(ttft_name, TtftModel)
        datastore = handle.datastore
        if datastore is not None:
            handle.persistent(
                f"{index_name}/listener",
                lambda: datastore.on_departure(partial(_forget, index, ttft)),
                datastore.remove_listener,
            )
        cache = handle.persistent(
            f"{_TOKEN_CACHE_KEY}:{config.token_cache_tokens}",
            lambda: TokenPrefixCache(config.token_cache_tokens),
        )
        executor = handle.persistent(
            _EXECUTOR_KEY,
            lambda: ThreadPoolExecutor(1, thread_name_prefix="picker-tokenize"),
            lambda executor: executor.shutdown(wait=False, cancel_futures=True),
        )
        shared = shared_ttft = None
        sync = handle.state_sync
        if sync is not None:
            shared = handle.persistent(
                f"{index_name}/state-sync",
                lambda: sync.share_index(index_name, partial(_apply_shared, index)),
                lambda shared: shared.close(),
            )
            shared_ttft = handle.persistent(
                f"{ttft_name}/state-sync", lambda: sync.share_ttft(ttft), lambda shared: shared.close()
            )
        producer = cls(name, config, index, PromptHasher(tokenizers, cache, executor), ttft, shared, shared_ttft)
        producer.parameters = effective
        return producer

    def start(self) -> None:
        """The index takes this config's capacity and reuse window once the config is installed
        (a config that fails validation after this producer was built leaves it alone)."""
        self.index.reconfigure(self.config.lru_capacity_per_server, self.config.reuse_window_s)

    async def stop(self) -> None:
        """Nothing runs: the index and the TTFT model outlive the config."""

    # -- request path ----------------------------------------------------------------------

    async def prepare_async(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle_state: CycleState
    ) -> None:
        """Tokenize off the event loop ahead of `prepare` (a no-op when nothing is tokenized)."""
        if not self.hasher.needs_tokenizing(request):
            return
        # Marked before the wait: when the director's bound cancels it, `prepare` must go on
        # without the blocks, not tokenize the prompt again on the event loop.
        cycle_state[_HASHED_KEY] = True
        blocks = await self.hasher.hash_async(request, self.config.sizing(candidates))
        if blocks is not None:
            cycle_state[PROMPT_BLOCKS_KEY] = blocks

    def _blocks(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle_state: CycleState
    ) -> PromptBlocks | None:
        """The prompt's blocks, hashed once per request (kept in `cycle_state`)."""
        blocks = cycle_state.read(PROMPT_BLOCKS_KEY)
        if blocks is None and not cycle_state.read(_HASHED_KEY):
            blocks = self.hasher.hash(request, self.config.sizing(candidates))
            if blocks is not None:
                cycle_state[PROMPT_BLOCKS_KEY] = blocks
            cycle_state[_HASHED_KEY] = True
        return blocks

    def _match(self, blocks: PromptBlocks, cycle_state: CycleState) -> dict[str, int]:
        """How many leading blocks each endpoint holds; read from the index again only once it
        has changed since this request last read it."""
        version = self.index.version
        kept = cycle_state.read(_MATCHED_KEY)
        if kept is not None and kept[0] == version:
            matched: dict[str, int] = kept[1]
            return matched
        matched = self.index.match(blocks.hashes)
        cycle_state[_MATCHED_KEY] = (version, matched)
        return matched

    def affinity(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle_state: CycleState
    ) -> Affinity | None:
        blocks = self._blocks(request, candidates, cycle_state)
        if blocks is None:
            return None
        matched = self._match(blocks, cycle_state)
        depth = max((matched.get(c.address, 0) for c in candidates), default=0)
        if not depth:
            return None
        return Affinity(frozenset(c.address for c in candidates if matched.get(c.address, 0) == depth))

    def prepare(
        self,
        request: InferenceRequest,
        candidates: Sequence[EndpointState],
        cycle_state: CycleState,
    ) -> None:
        blocks = self._blocks(request, candidates, cycle_state)
        if blocks is None:
            return
        matched = self._match(blocks, cycle_state)
        over: frozenset[str] = frozenset()
        held: list[int] = []
        best = 0
        if matched:
            # One read per candidate; the load bound then reads the pool's mean and the holders.
            held = [matched.get(c.address, 0) for c in candidates]
            best = max(held, default=0)
            if best and self.config.max_load_factor > 0:
                loads = [c.load for c in candidates]
                limit = load_limit(loads, self.config.max_load_factor)
                holders = compress(range(len(held)), held)
                over = frozenset(candidates[i].address for i in holders if loads[i] > limit)
        match = PrefixMatch(blocks, matched, over, self._room, candidates if matched else (), held)
        cycle_state[PREFIX_MATCH_KEY] = match
        if blocks.hashes:
            PREFIX_INDEXER_HIT_RATIO.observe(best / len(blocks.hashes))
            PREFIX_INDEXER_HIT_BYTES.observe(best * blocks.block_tokens * CHARS_PER_TOKEN)

    def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        match = result.cycle_state.read(PREFIX_MATCH_KEY)
        if match is None or not result.targets:
            return
        blocks = match.blocks
        target = result.targets[0]
        PREFIX_FIRST_BLOCK.labels(
            request.target_model,
            request.tenant or "",
            "true" if match.matched else "false",
        ).inc()
        (expected,) = expected_cached_tokens(match, result.cycle_state, [target.address])
        if blocks.prompt_tokens:
            PREFIX_EXPECTED_HIT_RATIO.labels(request.target_model, target.address).observe(
                expected / blocks.prompt_tokens
            )
        # Remember what was expected at pick time; the response teaches the TTFT model.
        work_ahead = self.ttft.work_ahead(target)
        targets = [target]
        pick = Pick(target.address, expected, work_ahead)
        prefill = result.profile_results.get(PREFILL_PROFILE)
        if prefill is not None and prefill.targets and result.primary_profile != PREFILL_PROFILE:
            # The prefill work queues where the prompt is prefilled: the prefill pick (the decode
            # pod then computes at most the last partial block).
            prefilled_at = prefill.targets[0]
            targets.append(prefilled_at)
            (expected,) = expected_cached_tokens(match, result.cycle_state, [prefilled_at.address])
            transfer = result.cycle_state.read(KV_TRANSFER_SECONDS_KEY) or 0.0
            pick = pick._replace(
                prefill_address=prefilled_at.address,
                prefill_cached_tokens=expected,
                prefill_work_ahead=self.ttft.work_ahead(prefilled_at),
                transfer_seconds=transfer,
            )
        result.cycle_state[_PICK_KEY] = pick
        if self.config.index_responses and blocks.token_ids is not None:
            result.cycle_state[_RESPONSE_KEY] = []
        prefilled_at = targets[-1]
        self.ttft.add_backlog(prefilled_at.address, blocks.prompt_tokens - expected)
        if self.shared_ttft is not None:
            self.shared_ttft.queued(prefilled_at.address, blocks.prompt_tokens - expected)
        for state in targets:
            self._insert(state.address, blocks.hashes, self._capacity(state))
        PREFIX_INDEXER_SIZE.set(len(self.index))

    @property
    def streams_responses(self) -> bool:
        return self.config.index_responses

    def response_streaming(
        self, request: InferenceRequest, result: SchedulingResult, chunk: bytes, end_of_stream: bool
    ) -> None:
        chunks = result.cycle_state.read(_RESPONSE_KEY)
        if chunks is not None and chunk:
            chunks.append(chunk)

    def response_complete(
        self,
        request: InferenceRequest,
        result: SchedulingResult,
        outcome: ResponseOutcome,
    ) -> None:
        pick = result.cycle_state.read(_PICK_KEY)
        if pick is not None and 200 <= outcome.status < 300 and outcome.endpoint in ("", pick.address):
            self._index_response(request, result.cycle_state, pick.address)
        usage = outcome.usage
        if pick is None or usage is None or usage.prompt_tokens <= 0:
            return
        address, expected, work_ahead = pick.address, pick.expected_cached_tokens, pick.work_ahead
        if outcome.endpoint and outcome.endpoint != address:
            return  # served elsewhere (a fallback): nothing to compare or learn
        ttft = outcome.ttft_seconds if 200 <= outcome.status < 300 else None
        if pick.prefill_address:
            # Prefilled on the prefill pod (P/D): its share of the TTFT is what is left after the
            # transfer and the decode pod's first step (a step with no prefill: the overhead).
            if ttft is not None:
                ttft -= pick.transfer_seconds + self.ttft.overhead_seconds
                cached = min(pick.prefill_cached_tokens, usage.prompt_tokens)
                self._observe(
                    result, pick.prefill_address, ttft, usage.prompt_tokens, cached, pick.prefill_work_ahead, True
                )
            return
        model = request.target_model
        cached = min(usage.cached_tokens, usage.prompt_tokens)
        PREFIX_PROMPT_TOKENS.labels(model, address).inc(usage.prompt_tokens)
        PREFIX_EXPECTED_CACHED_TOKENS.labels(model, address).inc(min(expected, usage.prompt_tokens))
        PREFIX_SAVED_PREFILL_TOKENS.labels(model, address).inc(cached)
        PREFIX_SAVED_GPU_SECONDS.labels(model, address).inc(cached / self.ttft.prefill_rate(address))
        if ttft is not None:
            self._observe(result, address, ttft, usage.prompt_tokens, cached, work_ahead)

    def _observe(
        self,
        result: SchedulingResult,
        address: str,
        ttft_seconds: float,
        prompt_tokens: int,
        cached_tokens: int,
        work_ahead: float,
        remote_prefill: bool = False,
    ) -> None:
        """Teach the TTFT model (and the other pickers' with `--state-store`) one TTFT at `address`
        (`remote_prefill`: a prefill pod's share of a disaggregated TTFT, see `TtftModel.observe`)."""
        self.ttft.observe(address, ttft_seconds, prompt_tokens, cached_tokens, work_ahead, remote_prefill)
        if self.shared_ttft is not None:
            self.shared_ttft.observed(address, ttft_seconds, prompt_tokens, cached_tokens, work_ahead, remote_prefill)
        result.cycle_state.explain()[OBSERVED_TTFT] = {
            "endpoint": address,
            "seconds": ttft_seconds,
            "prompt_tokens": prompt_tokens,
            "cached_tokens": cached_tokens,
        }

    def _index_response(self, request: InferenceRequest, cycle_state: CycleState, address: str) -> None:
        """Record the prompt and its answer's full blocks at `address` (`indexResponses`)."""
        chunks = cycle_state.read(_RESPONSE_KEY)
        blocks = cycle_state.read(PROMPT_BLOCKS_KEY)
        if not chunks or blocks is None or blocks.token_ids is None:
            return
        tokenizer = self.hasher.tokenizer_for(request.target_model)
        text = completion_text(b"".join(chunks))
        size = blocks.block_tokens
        if tokenizer is None or not text or len(blocks.token_ids) // size != len(blocks.hashes):
            return  # no answer, or a prompt cut at the block cap: its chain cannot be continued
        hashed = len(blocks.hashes) * size
        tail = [*blocks.token_ids[hashed:], *tokenizer.encode_batch([text])[0]]
        parent = blocks.hashes[-1] if blocks.hashes else blocks.seed
        answer = token_block_hashes(tail, size, parent)
        if answer:
            self._insert(address, [*blocks.hashes, *answer], None, count_reuse=False)
            PREFIX_INDEXER_SIZE.set(len(self.index))

    def _insert(self, address: str, hashes: Sequence[int], capacity: int | None, count_reuse: bool = True) -> None:
        """Record at `address` locally, and queue it for the other pickers when state is shared."""
        self.index.insert(address, hashes, capacity, count_reuse)
        if self.shared is not None:
            self.shared.publish(address, hashes, capacity, count_reuse)

    def _capacity(self, state: EndpointState) -> int | None:
        if self.config.auto_tune and state.metrics.cache_num_blocks > 0:
            return state.metrics.cache_num_blocks
        return None

    def _room(self, state: EndpointState) -> int:
        """Blocks of `state`'s cache not taken by blocks reused there recently."""
        index = self.index
        capacity = self._capacity(state) or index.capacity(state.address) or index.default_capacity
        return capacity - index.reused_blocks(state.address)


class ProducerTtftModel:
    """The TTFT model of the config's `approx-prefix-cache-producer` (the producer of the
    PrefixCacheMatchInfo its consumers read; the first configured if there are several), found
    when first asked: the loader adds that producer after its consumers when none is configured."""

    __slots__ = ("_handle", "_model")

    def __init__(self, handle: Handle) -> None:
        self._handle = handle
        self._model: TtftModel | None = None

    def __call__(self) -> TtftModel:
        model = self._model
        if model is None:
            producers = self._handle.plugins().values()
            producer = next((p for p in producers if isinstance(p, ApproxPrefixCacheProducer)), None)
            if producer is None:  # the loader adds one to every config that consumes its data
                raise LookupError("the TTFT model belongs to an approx-prefix-cache-producer: the config has none")
            model = self._model = producer.ttft
        return model


def _apply_shared(
    index: PrefixIndex, address: str, hashes: Sequence[int], capacity: int | None, count_reuse: bool
) -> None:
    """Another picker's insert (`--state-store`), applied to the local index."""
    index.insert(address, hashes, capacity, count_reuse)
    PREFIX_INDEXER_SIZE.set(len(index))


def _forget(index: PrefixIndex, ttft: TtftModel, departed: set[str]) -> None:
    """`index` and `ttft` forget endpoints that left the pool."""
    index.remove(departed)
    ttft.forget(departed)
    PREFIX_INDEXER_SIZE.set(len(index))


class PrefixCacheScorer(Scorer):
    """`prefix-cache-scorer`: matched blocks / prompt blocks from the producer; 0 without it.

    It takes the producer's parameters and uses none itself: they configure the producer the
    loader adds for it (none configured), else they are unused, both as in the reference.
    llm-d's later `mode: cache_tracking` form (`mode`, `kvEventsConfig`, `indexerConfig`) is
    accepted and ignored, with a note, as llm-d v0.4.0 ignores it: the scorer approximates.
    """

    plugin_type = "prefix-cache-scorer"
    category = ScorerCategory.AFFINITY
    consumes = frozenset({PREFIX_MATCH_KEY})

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> PrefixCacheScorer:
        PrefixConfig.parse(parameters)  # the producer's: validated here, so errors name this plugin
        scorer = cls(name)
        scorer.parameters = dict(parameters or {})  # as given: the producer shows their effect
        ignored = [key for key in LLMD_TRACKING_PARAMETERS if key in scorer.parameters]
        if ignored:
            scorer.notes = (
                f"{', '.join(ignored)}: ignored, as llm-d v0.4.0 ignores them: this scorer approximates "
                "(KV events feed precise-prefix-cache-scorer)",
            )
        return scorer

    def score(
        self,
        request: InferenceRequest,
        cycle_state: CycleState,
        candidates: Sequence[EndpointState],
    ) -> Sequence[float]:
        match = cycle_state.read(PREFIX_MATCH_KEY)
        if match is None or not match.total_blocks or not match.matched:  # nothing held anywhere
            return [0.0] * len(candidates)
        total, matched, over = match.total_blocks, match.matched, match.over_bound
        return [0.0 if c.address in over else matched.get(c.address, 0) / total for c in candidates]


class CacheFitScorer(ParameterlessScorer):
    """`cache-fit-scorer`: 1 where the prompt's missing blocks fit in the endpoint's KV cache
    beside the blocks reused there recently, 0 where they would push reused blocks out.

    Prefix affinity and the TTFT cost look at this request; this looks at the next ones. A new
    shared prefix placed on an endpoint whose cache is already full of reused prefixes evicts
    some of them, their next requests miss and evict in turn, and the endpoint thrashes. Where
    the prompt fits everywhere (or nowhere) it scores every endpoint alike and changes nothing.
    Needs the producer's capacity per endpoint: `autoTune` (the engine's `num_gpu_blocks`) or
    `lruCapacityPerServer` in the same unit as the blocks.
    """

    plugin_type = "cache-fit-scorer"
    category = ScorerCategory.DISTRIBUTION
    consumes = frozenset({PREFIX_MATCH_KEY})

    def score(
        self,
        request: InferenceRequest,
        cycle_state: CycleState,
        candidates: Sequence[EndpointState],
    ) -> Sequence[float]:
        match = cycle_state.read(PREFIX_MATCH_KEY)
        if match is None:
            return [1.0] * len(candidates)
        if cycle_state.read(ENGINE_CACHED_TOKENS_KEY) is None:
            return [1.0 if match.fits(c) else 0.0 for c in candidates]
        # What the engines report, as for the TTFT cost: the approximate index's guess made the
        # precise config count a prompt as fitting where the engine had evicted it.
        cached = expected_cached_tokens(match, cycle_state, [c.address for c in candidates])
        return [1.0 if match.fits(c, tokens) else 0.0 for c, tokens in zip(candidates, cached)]


class TtftCostScorer(Scorer, BackgroundWork):
    """`ttft-cost-scorer`: predicted time to first token, queue wait plus uncached prefill.

    Parameters: `prefillTokensPerSecond` (5000), `drainTokensPerSecond` (5000),
    `overheadSeconds` (0.01), `typicalPromptTokens` (512), `ewmaAlpha` (0.2): the priors the
    prefix producer's model starts every endpoint from before it has learnt its rates;
    `interferenceWeight` (0): how much the stall a prefill imposes on the requests already
    running at an endpoint counts against it (`picker.prefix.ttft`).
    Each endpoint's prediction goes to the decision's explain map (`predicted_ttft`); the
    producer adds the observed TTFT when the response ends.
    """

    plugin_type = "ttft-cost-scorer"
    category = ScorerCategory.BALANCE
    consumes = frozenset({PREFIX_MATCH_KEY})

    def __init__(
        self,
        name: str,
        model: Callable[[], TtftModel],
        interference_weight: float = 0.0,
        priors: TtftPriors | None = None,
    ) -> None:
        super().__init__(name)
        self._model = model  # the prefix producer's (`ProducerTtftModel`)
        self.interference_weight = interference_weight
        self.priors = priors or TtftPriors()

    @property
    def model(self) -> TtftModel:
        """The TTFT model this scorer predicts with: the prefix producer's."""
        return self._model()

    def start(self) -> None:
        """The producer's model takes this config's priors once the config is installed (a config
        that fails validation after this scorer was built must leave the live model alone)."""
        self.model.set_priors(self.priors)

    async def stop(self) -> None:
        """Nothing runs: the model's learnt rates outlive the config."""

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> TtftCostScorer:
        p = Parameters(parameters)
        defaults = TtftPriors()
        priors = TtftPriors(
            prefill_tokens_per_second=p.number("prefillTokensPerSecond", defaults.prefill_tokens_per_second, above=0),
            drain_tokens_per_second=p.number("drainTokensPerSecond", defaults.drain_tokens_per_second, above=0),
            overhead_seconds=p.number("overheadSeconds", defaults.overhead_seconds, at_least=0),
            typical_prompt_tokens=p.number("typicalPromptTokens", defaults.typical_prompt_tokens, at_least=0),
            ewma_alpha=p.number("ewmaAlpha", defaults.ewma_alpha, above=0, at_most=1),
        )
        interference_weight = p.number("interferenceWeight", 0.0, at_least=0)
        effective = p.finish()
        scorer = cls(name, ProducerTtftModel(handle), interference_weight, priors)
        scorer.parameters = effective
        return scorer

    def score(
        self,
        request: InferenceRequest,
        cycle_state: CycleState,
        candidates: Sequence[EndpointState],
    ) -> Sequence[float]:
        prompt_tokens, cached = prompt_and_cached_tokens(request, cycle_state, candidates)
        model, weight = self.model, self.interference_weight
        now = model.clock()
        estimates = [model.estimate(c, prompt_tokens, hit, now, weight) for c, hit in zip(candidates, cached)]
        predicted: dict[str, TtftEstimate] = cycle_state.explain().setdefault(PREDICTED_TTFT, {})
        predicted.update((c.address, e) for c, e in zip(candidates, estimates))
        return ttft_scores(estimates)
