"""The infinite-cache bound: the best prefix hit ratio any router could reach on a workload.

With one cache that never evicts, a prompt's leading full blocks hit if an earlier prompt
already computed them (chained block hashes, as the engine keys them). Like vLLM, at least the
last prompt token is always computed, so a prompt never hits on more than `(n - 1) // block_size`
blocks. Because blocks are chained, the total does not depend on the order of the prompts.

A fleet's caches are finite, so the bench also computes the *fleet-cache bound*: the hits of one
cache holding the whole fleet's KV blocks with the optimal offline eviction (Belady's: evict the
block needed again furthest in the future, or do not cache a block needed later than all the
others). A router can only do worse: its pods' caches together hold at most that many blocks,
blocks enter a pod only when a request routed there computes them, and no online eviction beats
Belady's. Every counted block is a hit, not only a prompt's leading ones, which errs upwards.

Engines do not evict optimally but least recently used, so the bench also reports the *LRU
fleet* figure: one LRU cache of the same capacity, each prompt hitting its leading blocks found in
the cache (up to the first miss, never the last token's block) and then touching all its blocks.
It is what LRU engines would hit if routing were perfect and the fleet were one pool: a
reference, not a bound. A router can fall short of it (each pod is a separate, smaller LRU;
engines also keep running requests' and outputs' blocks) but can also beat it: splitting prompts
across pods can keep a prefix that one shared LRU would have let a burst of other prompts push out.

Both finite caches depend on the order of the prompts: the bench takes them in the order they
are expected to arrive (`picker_bench.runner.arrival_order`).

The same walk gives a TTFT floor on the simulator: every prompt with its infinite-cache hits,
prefilled alone on an idle engine. A request's TTFT can only be longer, so no router's TTFT
percentiles can be lower than the floor's. The completion-time (E2E) floor adds each answer
decoded alone on that engine: a batch of one, no other prefill stalling it.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from picker.prefix.hashing import token_block_hashes
from picker_sim.profiles import Profile

_ROOT = 0


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """A prompt as a prefix cache sees it: its full blocks' chained hashes, how many leading
    blocks can hit (never the one holding the last token) and its length in tokens."""

    hashes: tuple[int, ...]
    limit: int
    tokens: int

    @classmethod
    def of(cls, token_ids: Sequence[int], block_size: int, generated: Sequence[int] = ()) -> PromptBlocks:
        """The blocks of `token_ids` in blocks of `block_size` tokens, followed by those of the
        `generated` answer that the engine computes (all but its last token) and caches too: a
        chat client's next turn resends the answer, and hits them."""
        hashes = tuple(token_block_hashes([*token_ids, *generated[:-1]], block_size, _ROOT))
        return cls(hashes, (len(token_ids) - 1) // block_size, len(token_ids))


def leading_run(n: int, present: Callable[[int], bool]) -> int:
    """How many of positions 0..n-1 are present before the first absent one, for a set where
    position j present implies every position before j present (binary search)."""
    low, high = 0, n
    while low < high:
        mid = (low + high + 1) // 2
        if present(mid - 1):
            low = mid
        else:
            high = mid - 1
    return low


class BlockLRU:
    """One least-recently-used cache of KV blocks, keyed by chained block hashes.

    Blocks only enter through `touch` with a whole prompt's chain, each block touched after the
    ones behind it (vLLM frees a finished request's blocks tail first, so its tail is evicted
    first). A block is then always more recent than the blocks after it in any chain, so the
    cache only ever holds whole prefixes of chains, which `cached_prefix` relies on.
    """

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = max(0, capacity_blocks)
        self.blocks: OrderedDict[int, None] = OrderedDict()  # least recent first

    def cached_prefix(self, hashes: Sequence[int], limit: int) -> int:
        """How many leading blocks of `hashes` (at most `limit`) are cached."""
        blocks = self.blocks
        return leading_run(min(limit, len(hashes)), lambda j: hashes[j] in blocks)

    def touch(self, hashes: Sequence[int]) -> None:
        """A prompt's blocks were computed or reused: they become the most recent, the first
        block most recent of all; least recent blocks are evicted beyond the capacity."""
        blocks = self.blocks
        for h in reversed(hashes):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)


class PrefixBound:
    """Accumulates prompts (as token ids) and reports the infinite-cache hit ratio."""

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.seen: set[int] = set()
        self.prompt_tokens = 0
        self.hit_tokens = 0
        self.accesses: list[tuple[tuple[int, ...], int]] = []  # per prompt: block hashes, blocks that can hit

    def add(self, token_ids: Sequence[int]) -> int:
        """Count one prompt, then remember its blocks; return its cached (hit) tokens."""
        return self.add_blocks(PromptBlocks.of(token_ids, self.block_size))

    def add_blocks(self, prompt: PromptBlocks) -> int:
        """`add` for a prompt already cut into blocks of this bound's block size."""
        hits = 0
        for h in prompt.hashes[: prompt.limit]:
            if h not in self.seen:
                break
            hits += 1
        self.seen.update(prompt.hashes)
        self.accesses.append((prompt.hashes, prompt.limit))
        self.prompt_tokens += prompt.tokens
        self.hit_tokens += hits * self.block_size
        return hits * self.block_size

    @property
    def ratio(self) -> float:
        """Cached prompt tokens / all prompt tokens (0 for no prompts)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def fleet_ratio(self, capacity_blocks: int) -> float:
        """The fleet-cache bound (module doc) for caches holding `capacity_blocks` in all."""
        if not self.prompt_tokens:
            return 0.0
        return belady_hits(self.accesses, capacity_blocks) * self.block_size / self.prompt_tokens

    def lru_ratio(self, capacity_blocks: int) -> float:
        """The LRU fleet figure (module doc) for caches holding `capacity_blocks` in all."""
        if not self.prompt_tokens:
            return 0.0
        return lru_hits(self.accesses, capacity_blocks) * self.block_size / self.prompt_tokens


def belady_hits(prompts: Sequence[tuple[Sequence[int], int]], capacity_blocks: int) -> int:
    """Block hits of one cache of `capacity_blocks` under Belady's optimal offline eviction, over
    prompts given as (block hashes, how many leading blocks count when hit)."""
    if capacity_blocks < 1:
        return 0
    blocks: list[int] = []
    counted: list[bool] = []
    for hashes, limit in prompts:
        blocks.extend(hashes)
        counted.extend(j < limit for j in range(len(hashes)))
    never = len(blocks)
    next_use = [never] * len(blocks)  # the next access that can hit, after this one
    upcoming: dict[int, int] = {}
    for i in range(len(blocks) - 1, -1, -1):
        block = blocks[i]
        next_use[i] = upcoming.get(block, never)
        if counted[i]:
            upcoming[block] = i
    cache: dict[int, int] = {}  # block -> its next use
    farthest: list[tuple[int, int]] = []  # max-heap of (-next use, block); stale entries skipped
    hits = 0
    for i, block in enumerate(blocks):
        use = next_use[i]
        if block in cache:
            hits += counted[i]
        elif use == never:
            continue  # never hits again: not worth a slot
        elif len(cache) >= capacity_blocks:
            while cache.get(farthest[0][1]) != -farthest[0][0]:
                heapq.heappop(farthest)
            if -farthest[0][0] <= use:
                continue  # everything cached is needed sooner than this block
            del cache[heapq.heappop(farthest)[1]]
        cache[block] = use
        heapq.heappush(farthest, (-use, block))
    return hits


def lru_hits(prompts: Sequence[tuple[Sequence[int], int]], capacity_blocks: int) -> int:
    """Block hits of one LRU cache of `capacity_blocks` over prompts given as (block hashes, how
    many leading blocks can hit): each prompt hits its cached leading blocks, then touches all."""
    cache = BlockLRU(capacity_blocks)
    hits = 0
    for hashes, limit in prompts:
        hits += cache.cached_prefix(hashes, limit)
        cache.touch(hashes)
    return hits


def infinite_cache_hit_ratio(prompts: Iterable[Sequence[int]], block_size: int) -> float:
    """The bound over `prompts` (token id lists)."""
    bound = PrefixBound(block_size)
    for tokens in prompts:
        bound.add(tokens)
    return bound.ratio


def prefill_floor_s(uncached_tokens: int, profile: Profile, time_scale: float, max_batched_tokens: int) -> float:
    """The simulated engine's fastest first token for `uncached_tokens` of prefill: an idle
    engine, the prefill chunked by its per-step token budget, at least one token computed."""
    tokens = max(1, uncached_tokens)
    steps = math.ceil(tokens / max_batched_tokens)
    return (steps * profile.step_overhead + tokens * profile.prefill_per_token) / time_scale


def decode_floor_s(prompt_tokens: int, output_tokens: int, profile: Profile, time_scale: float) -> float:
    """The simulated engine's fastest decode of `output_tokens` after the first: one decode step
    each, alone in the batch, its context growing from the prompt by a token a step."""
    steps = max(0, output_tokens - 1)
    context = steps * prompt_tokens + steps * (steps + 1) // 2
    per_step = profile.step_overhead + profile.decode_per_seq
    return (steps * per_step + context * profile.context_per_token) / time_scale
