"""The precise prefix index: which endpoint caches which block, learnt from the engines' KV events.

Keys are the picker's own block hashes (`picker.prefix.hashing`), so a request's block hashes
can be looked up directly and the engine's hash algorithm or seed never matters. Each
endpoint's engine hashes are mapped onto own keys through the token ids `BlockStored` carries:
the event's tokens are re-chunked at the picker's block size and the own chain is continued
from the own key of the event's `parent_block_hash` (or from the scope seed for a chain's
first block). Engine and picker block sizes may differ: an engine block then maps to the own
blocks it covers, and a partial own block at an event's end is carried in the engine block's
"tail" until a child event completes it. An own block spanning several engine blocks remembers
them, so after a parent-first eviction (offloading tiers evict that way) it returns when the
parent is stored again while the child stayed cached.

Scopes. An event carries the LoRA name but neither the request's `cache_salt` nor the
picker's tenant. A chain's first block is therefore placed under, in order of preference:
1. a scope hint recorded at pick time (`record_scope`): the request's scoped seed, keyed by
   (endpoint, first block's key under the plain model seed);
2. a cache salt found in the first block's `extra_keys` (vLLM puts `cache_salt` there);
3. the plain seed `chain_seed(lora_name or model)`.
Every later block follows its parent's own key, so the whole chain stays in the first
block's scope.

Engine keys. With `engine_keys` the index keys blocks by the engine's own hashes as the events
carry them, and requests are hashed the engine's way (`picker.kvevents.vllm_hash`: the same
algorithm, seed and block size): no token ids are needed, a chain whose parent was never seen
is still placed, and LoRA and `cache_salt` scopes are the engine's own, but only engines that
hash that way can be matched. Events of another block size are ignored then.

Tiers: a block can be on the GPU, on CPU (offloaded), and "speculative" (inserted after a pick,
counted as GPU until `speculative_ttl` passes without a confirming event; a prediction made with
`hold` lasts while its request is in flight, up to `hold` seconds, and `speculative_ttl` after
`end_speculative`: a request queued at a busy engine stores its blocks only when it runs).
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Final

from picker.kvevents.decode import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from picker.prefix.hashing import chain_seed, token_block_hashes
from picker.prefix.holders import NOBODY, HolderSets

GPU, CPU, SPECULATIVE = 1, 2, 4
_FULL_ATTENTION_KINDS = (None, "full_attention")


@dataclass(frozen=True, slots=True)
class TierWeights:
    """How much a cached block counts, by where it is (a block on several tiers counts its best)."""

    gpu: float = 1.0
    cpu: float = 0.8

    def weight(self, tiers: int) -> float:
        best = 0.0
        if tiers & (GPU | SPECULATIVE):
            best = self.gpu
        if tiers & CPU and self.cpu > best:
            best = self.cpu
        return best


def tier_of(medium: str | None) -> int:
    """The tier bit of an event's `medium`: nil or "GPU" is the GPU, anything else offloaded (CPU)."""
    if medium is None or medium.lower() in ("gpu", "cuda"):
        return GPU
    return CPU


@lru_cache(maxsize=4096)
def _seed(model: str, cache_salt: str | None, tenant: str | None) -> int:
    return chain_seed(model, cache_salt, tenant)


# One engine block of one endpoint: (own keys it completes, tier bits, own key the next own
# block chains from, tokens after its last complete own block (empty if sizes match), engine
# blocks whose tokens those are). A plain tuple of ints and int tuples because CPython's garbage
# collector stops tracking those (not a NamedTuple or a slotted class, which stay tracked): the
# index holds one per cached block of every endpoint (see `picker.prefix.holders`).
# The commonest block, one own key of the same size held on the GPU alone, is stored as that
# key: no tuple to build per block, and bulk dict operations apply whole events at once.
_EngineBlock = tuple[tuple[int, ...], int, int, tuple[int, ...], tuple[int, ...]]
_Stored = int | _EngineBlock
OWN_KEYS: Final = 0
TIERS: Final = 1


def _expand(block: _Stored) -> _EngineBlock:
    """An engine block in its full form."""
    if type(block) is int:
        return ((block,), GPU, block, (), ())
    return block  # type: ignore[return-value]


def _packed(block: _EngineBlock) -> _Stored:
    """An engine block in its shortest form."""
    own_keys, tiers, tail_parent, tail_tokens, _ = block
    if tiers == GPU and len(own_keys) == 1 and own_keys[0] == tail_parent and not tail_tokens:
        return tail_parent
    return block


def _with_tiers(block: _EngineBlock, tiers: int) -> _EngineBlock:
    own_keys, _, tail_parent, tail_tokens, tail_engine = block
    return (own_keys, tiers, tail_parent, tail_tokens, tail_engine)


def _with_own_key(block: _EngineBlock, key: int) -> _EngineBlock:
    own_keys, tiers, tail_parent, tail_tokens, tail_engine = block
    return ((*own_keys, key), tiers, tail_parent, tail_tokens, tail_engine)


class Prediction:
    """The blocks one pick predicted at an endpoint, and until when (`insert_speculative`)."""

    __slots__ = ("deadline", "endpoint", "keys")

    def __init__(self, endpoint: str, deadline: float, keys: list[int]) -> None:
        self.endpoint = endpoint
        self.deadline = deadline
        self.keys = keys  # emptied when the prediction ends or is replaced


class _EndpointCache:
    """What the index knows about one endpoint."""

    __slots__ = ("capacity", "cover", "covered_by", "engine", "groups", "known", "model", "speculative", "tiers")

    def __init__(self, model: str, capacity: int) -> None:
        self.model = model
        self.capacity = capacity
        self.known = True
        self.tiers: dict[int, int] = {}  # own key -> tier bits; insertion order = oldest first
        self.engine: dict[int, _Stored] = {}  # engine hash -> mapping
        self.speculative: dict[int, float] = {}  # own key -> expiry (monotonic seconds)
        self.groups: set[int | None] = set()  # KV-cache groups seen in BlockStored
        # Own keys spanning several engine blocks (block sizes differ): the engine blocks each
        # needs, and the reverse, kept past evictions so a key returns with its last block.
        self.cover: dict[int, tuple[int, ...]] = {}
        self.covered_by: dict[int, set[int]] = {}


class PreciseIndex:
    """Own block key -> {endpoint: tier weight}, fed by KV events, scored by longest prefix.

    Not thread-safe: the KV-event subscriber and the request path share one event loop.
    """

    def __init__(
        self,
        block_size: int = 16,
        *,
        weights: TierWeights = TierWeights(),
        speculative_ttl: float = 2.0,
        default_capacity: int = 200_000,
        max_scope_hints: int = 65_536,
        clock: Callable[[], float] = time.monotonic,
        engine_keys: bool = False,
    ) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        if default_capacity <= 0:
            raise ValueError("default_capacity must be positive")
        self.block_size = block_size
        self.engine_keys = engine_keys
        self.models: set[str] = set()  # the models endpoints serve (others are LoRA adapters)
        self.speculative_ttl = speculative_ttl
        self.default_capacity = default_capacity
        self._max_scope_hints = max_scope_hints
        self._clock = clock
        self._set_weights(weights)
        # own key -> the endpoints holding it (interned, see picker.prefix.holders), and for the
        # few keys some endpoint holds below the top weight (offloaded), {endpoint: weight}.
        self._where: dict[int, frozenset[str]] = {}
        self._below_top: dict[int, dict[str, float]] = {}
        self._holder_sets = HolderSets()
        self._caches: dict[str, _EndpointCache] = {}
        # (deadline, sequence, prediction): a heap, as held predictions end out of order.
        self._expiries: list[tuple[float, int, Prediction]] = []
        self._predictions = itertools.count()
        self._scope_hints: dict[tuple[str, int], int] = {}

    def _set_weights(self, weights: TierWeights) -> None:
        self.weights = weights
        self._top = max(weights.gpu, weights.cpu)
        # Weight of every combination of tier bits, looked up per published key.
        self._tier_weights = [weights.weight(tiers) for tiers in range((GPU | CPU | SPECULATIVE) + 1)]

    def reconfigure(
        self, weights: TierWeights, speculative_ttl: float, default_capacity: int, *, keep_capacities: bool
    ) -> None:
        """Take new tier weights, prediction TTL and default capacity (a reload changed them) and
        keep what the index holds: held keys are weighed again; endpoints at the old default
        capacity take the new one (losing their oldest keys beyond it), and so does every other
        endpoint unless `keep_capacities` (capacities tuned from the engines' block counts).
        Predictions made already keep their deadlines."""
        if default_capacity <= 0:
            raise ValueError("default_capacity must be positive")
        old_default, self.default_capacity = self.default_capacity, default_capacity
        self.speculative_ttl = speculative_ttl
        if weights != self.weights:
            self._set_weights(weights)
            below: dict[int, dict[str, float]] = {}
            for endpoint, cache in self._caches.items():
                for key, tiers in cache.tiers.items():
                    weight = self._tier_weights[tiers]
                    if weight < self._top:
                        below.setdefault(key, {})[endpoint] = weight
            self._below_top = below
        for endpoint, cache in self._caches.items():
            if cache.capacity == old_default or not keep_capacities:
                self.set_capacity(endpoint, default_capacity)

    # -- endpoints -----------------------------------------------------------------------------

    def track(self, endpoint: str, model: str = "", capacity: int | None = None) -> None:
        """Start (or update) tracking `endpoint`; `model` seeds chains of blocks without a LoRA."""
        if model:
            self.models.add(model)
        cache = self._caches.get(endpoint)
        if cache is None:
            self._caches[endpoint] = _EndpointCache(model, capacity or self.default_capacity)
            return
        cache.model = model
        if capacity:
            self.set_capacity(endpoint, capacity)

    def set_capacity(self, endpoint: str, blocks: int) -> None:
        """Bound the own keys kept for `endpoint` (e.g. 2 x its GPU blocks); oldest go first."""
        cache = self._caches.get(endpoint)
        if cache is None or blocks <= 0 or blocks == cache.capacity:
            return
        cache.capacity = blocks
        self._enforce_capacity(endpoint, cache)

    def forget(self, endpoint: str) -> None:
        """Drop everything about an endpoint that left the pool."""
        cache = self._caches.pop(endpoint, None)
        if cache is not None:
            self._drop_all(endpoint, cache)
        for hint in [h for h in self._scope_hints if h[0] == endpoint]:
            del self._scope_hints[hint]

    def reset(self, endpoint: str) -> None:
        """The endpoint's cache is empty and fully known (AllBlocksCleared, engine restart)."""
        cache = self._caches.get(endpoint)
        if cache is None:
            return
        self._drop_all(endpoint, cache)
        cache.known = True

    def mark_unknown(self, endpoint: str) -> None:
        """Events were lost: exclude the endpoint from scoring until `reset` rebuilds it.

        Its entries are dropped, as removals may have been missed. Later events still apply,
        harmlessly: only `reset` (AllBlocksCleared, a new engine) makes the state known again.
        """
        cache = self._caches.get(endpoint)
        if cache is None:
            return
        self._drop_all(endpoint, cache)
        cache.known = False

    def is_known(self, endpoint: str) -> bool:
        cache = self._caches.get(endpoint)
        return cache is not None and cache.known

    def endpoints(self) -> list[str]:
        return list(self._caches)

    # -- events --------------------------------------------------------------------------------

    def apply(self, endpoint: str, event: KVEvent) -> None:
        """Apply one decoded KV event of `endpoint` (which must be tracked; others are ignored)."""
        cache = self._caches.get(endpoint)
        if cache is None:
            return
        if isinstance(event, BlockStored):
            self._stored(endpoint, cache, event)
        elif isinstance(event, BlockRemoved):
            self._removed(endpoint, cache, event)
        elif isinstance(event, AllBlocksCleared):
            self.reset(endpoint)

    def _stored(self, endpoint: str, cache: _EndpointCache, event: BlockStored) -> None:
        if event.kv_cache_spec_kind not in _FULL_ATTENTION_KINDS:
            return  # sliding-window / mamba groups do not hold reusable prefixes
        cache.groups.add(event.group_idx)
        tier = tier_of(event.medium)
        if self.engine_keys:
            self._stored_engine_keys(endpoint, cache, event.block_hashes, event.block_size, tier)
            return
        engine = cache.engine
        hashes = event.block_hashes
        size = event.block_size
        if len(event.token_ids) < len(hashes) * size:
            # An offload event (e.g. GPU -> CPU) names blocks already known, without tokens.
            for h in hashes:
                found = engine.get(h)
                if found is not None:
                    block = _expand(found)
                    engine[h] = _packed(_with_tiers(block, block[TIERS] | tier))
                    self._add(endpoint, cache, block[OWN_KEYS], tier)
            return
        if event.parent_block_hash is None:
            parent_own = self._first_block_seed(endpoint, cache, event)
            tail_tokens: tuple[int, ...] = ()
            tail_engine: tuple[int, ...] = ()
        else:
            parent = engine.get(event.parent_block_hash)
            if parent is None:
                return  # its chain was never seen (joined mid-stream): placing it would be a guess
            _, _, parent_own, tail_tokens, tail_engine = _expand(parent)
        own_size = self.block_size
        base = len(tail_tokens)
        tokens = event.token_ids[: len(hashes) * size]
        if base:
            tokens = tail_tokens + tokens
        own = token_block_hashes(tokens, own_size, parent_own)
        if size == own_size:  # the common case: one own key per engine block, no tails
            if tier == GPU and engine.keys().isdisjoint(hashes):
                engine.update(zip(hashes, own))  # new blocks (a prompt's uncached part): in bulk
            else:
                for h, key in zip(hashes, own):
                    previous = engine.pop(h, None)
                    tiers = tier
                    if previous is not None:
                        old = _expand(previous)
                        tiers |= old[TIERS]
                        if old[OWN_KEYS] != (key,):  # stored again under other tokens
                            self._remove(endpoint, cache, [k for k in old[OWN_KEYS] if k != key], old[TIERS])
                    engine[h] = key if tiers == GPU else ((key,), tiers, key, (), ())
            self._add(endpoint, cache, own, tier)
            self._bound_engine(cache)
            return
        if base and own:  # the first own block also covers the parent's tail blocks
            for h in tail_engine:
                found = engine.get(h)
                if found is not None and own[0] not in (block := _expand(found))[OWN_KEYS]:
                    engine[h] = _with_own_key(block, own[0])
        # Block sizes differ: an own key may need several engine blocks.
        covers: list[list[int]] = [[] for _ in own]
        if base and own:
            covers[0].extend(tail_engine)
        for i, h in enumerate(hashes):
            start = base + i * size
            end = start + size
            keys = own[start // own_size : min((end - 1) // own_size + 1, len(own))]
            complete = end // own_size
            tail_start = complete * own_size
            if tail_start >= end:
                block_tail: tuple[int, ...] = ()
                block_tail_engine: tuple[int, ...] = ()
            elif tail_start < base:
                block_tail = tokens[tail_start:end]
                block_tail_engine = tail_engine + hashes[: i + 1]
            else:
                block_tail = tokens[tail_start:end]
                block_tail_engine = hashes[(tail_start - base) // size : i + 1]
            popped = engine.pop(h, None)
            previous = None if popped is None else _expand(popped)
            if previous is not None:
                self._remove(endpoint, cache, [k for k in previous[OWN_KEYS] if k not in keys], previous[TIERS])
            engine[h] = _packed(
                (
                    tuple(keys),
                    tier | (previous[TIERS] if previous is not None else 0),
                    own[complete - 1] if complete else parent_own,
                    block_tail,
                    block_tail_engine,
                )
            )
            self._add(endpoint, cache, keys, tier)
            for j in range(start // own_size, min((end - 1) // own_size + 1, len(own))):
                covers[j].append(h)
        self._record_covers(cache, own, covers)
        self._restore_spanning(endpoint, cache, hashes)
        self._bound_engine(cache)

    def _stored_engine_keys(
        self, endpoint: str, cache: _EndpointCache, hashes: tuple[int, ...], size: int, tier: int
    ) -> None:
        """Engine keys: each stored block is its own key."""
        if size != self.block_size:
            return  # keys at another block size never match a request's
        engine = cache.engine
        if tier == GPU and engine.keys().isdisjoint(hashes):
            engine.update(zip(hashes, hashes))
        else:
            for h in hashes:
                previous = engine.get(h)
                tiers = tier if previous is None else tier | _expand(previous)[TIERS]
                engine[h] = h if tiers == GPU else ((h,), tiers, h, (), ())
        self._add(endpoint, cache, hashes, tier)
        self._bound_engine(cache)

    @staticmethod
    def _bound_engine(cache: _EndpointCache) -> None:
        engine = cache.engine
        if len(engine) > 2 * cache.capacity:  # removals were lost: drop the oldest mappings
            for h in list(engine)[: len(engine) - 2 * cache.capacity]:
                del engine[h]

    def _record_covers(self, cache: _EndpointCache, own: list[int], covers: list[list[int]]) -> None:
        """Remember which engine blocks each own key spanning several of them needs."""
        for key, blocks in zip(own, covers):
            if len(blocks) > 1:
                cache.cover[key] = tuple(blocks)
                for h in blocks:
                    cache.covered_by.setdefault(h, set()).add(key)
        if len(cache.cover) > 2 * cache.capacity:  # bounded: forgetting only under-reports
            cache.cover.clear()
            cache.covered_by.clear()

    def _restore_spanning(self, endpoint: str, cache: _EndpointCache, hashes: Sequence[int]) -> None:
        """Re-add spanning own keys complete again now that `hashes` are stored: a parent stored
        again after a parent-first eviction, while its child stayed cached."""
        engine = cache.engine
        for h in hashes:
            for key in cache.covered_by.get(h, ()):
                if key in cache.tiers:
                    continue
                covering = cache.cover.get(key, ())
                found = [engine.get(b) for b in covering]
                blocks = [_expand(block) for block in found if block is not None]
                if not blocks or len(blocks) != len(found):  # some covered block is not stored
                    continue
                tier = GPU | CPU
                for block in blocks:
                    tier &= block[TIERS]
                if not tier:
                    continue
                for b, block in zip(covering, blocks):  # every covered block found: aligned
                    if key not in block[OWN_KEYS]:
                        engine[b] = _with_own_key(block, key)
                self._add(endpoint, cache, (key,), tier)

    def _first_block_seed(self, endpoint: str, cache: _EndpointCache, event: BlockStored) -> int:
        scope = event.lora_name or cache.model
        plain = _seed(scope, None, None)
        if self._scope_hints and len(event.token_ids) >= self.block_size:
            first_key = self._first_key(event.token_ids, plain)
            hinted = self._scope_hints.get((endpoint, first_key))
            if hinted is not None:
                return hinted
        salt = _salt(event.extra_keys, event.lora_name)
        return plain if salt is None else _seed(scope, salt, None)

    def _first_key(self, token_ids: Sequence[int], seed: int) -> int:
        """The own key of the first block of `token_ids` (which must hold a full block)."""
        return token_block_hashes(token_ids[: self.block_size], self.block_size, seed)[0]

    def _removed(self, endpoint: str, cache: _EndpointCache, event: BlockRemoved) -> None:
        if event.group_idx is not None and event.group_idx not in cache.groups:
            return
        tier = tier_of(event.medium)
        if tier == GPU:
            tier |= SPECULATIVE  # an eviction overrides a prediction
        engine = cache.engine
        hashes = event.block_hashes
        found = list(map(engine.get, hashes))
        if tier & GPU and set(map(type, found)) <= _KEY_OR_NONE:
            # Blocks held on the GPU alone (or unknown): each leaves with its one key, in bulk.
            held: list[int] = list(filter(_is_key, found))  # type: ignore[arg-type]  # ints, as checked
            deque(map(engine.pop, hashes, itertools.repeat(None)), maxlen=0)
            self._remove(endpoint, cache, held, tier)
            return
        keys: list[int] = []
        for h, stored in zip(hashes, found):
            if stored is None:
                continue
            block = _expand(stored)
            left = block[TIERS] & ~tier
            if left:
                engine[h] = _packed(_with_tiers(block, left))
            else:
                del engine[h]
            keys.extend(block[OWN_KEYS])
        self._remove(endpoint, cache, keys, tier)

    # -- request path --------------------------------------------------------------------------

    def score(self, block_hashes: Sequence[int], endpoints: Sequence[str]) -> list[float]:
        """Per endpoint (in order): tier-weighted length of its longest cached prefix of
        `block_hashes` (own keys at `block_size`) divided by the number of blocks.

        Endpoints that are untracked or whose state is unknown score 0.
        """
        total = len(block_hashes)
        if not total or not endpoints:
            return [0.0] * len(endpoints)
        self._expire(self._clock())
        caches = self._caches
        active: set[str] = set()
        for e in endpoints:
            cache = caches.get(e)
            if cache is not None and cache.known:
                active.add(e)
        if not active:
            return [0.0] * len(endpoints)
        where = self._where
        below = self._below_top
        top = self._top
        matched: dict[str, int] = {}
        deficit: dict[str, float] = {}
        position = 0
        previous: frozenset[str] | None = None
        for key in block_hashes:
            holders = where.get(key)
            if holders is None:
                break
            if holders is not previous:  # the same interned set as the last block: nothing drops out
                if not holders >= active:
                    still = active & holders
                    for e in active - still:
                        matched[e] = position
                    active = still
                    if not active:
                        break
                previous = holders
            if below and (weights := below.get(key)) is not None:
                for e, w in weights.items():
                    if e in active:
                        deficit[e] = deficit.get(e, 0.0) + top - w
            position += 1
        for e in active:
            matched[e] = position
        return [(matched.get(e, 0) * top - deficit.get(e, 0.0)) / total for e in endpoints]

    def insert_speculative(self, endpoint: str, block_hashes: Sequence[int], hold: float = 0.0) -> Prediction | None:
        """Predict that `endpoint` will cache `block_hashes` (the pick just sent them there);
        the prediction counts as GPU until `speculative_ttl` unless an event confirms it, or with
        `hold` until `end_speculative` (the request ended) and `speculative_ttl` more, at most
        `hold` seconds. None if nothing was predicted."""
        if not block_hashes or self.speculative_ttl <= 0:
            return None
        cache = self._caches.get(endpoint)
        if cache is None:
            return None
        now = self._clock()
        self._expire(now)
        held = cache.tiers
        on_gpu = map(operator.and_, map(held.get, block_hashes, itertools.repeat(0)), itertools.repeat(GPU))
        fresh = list(itertools.compress(block_hashes, map(operator.not_, on_gpu)))  # the rest is cached already
        if not fresh:
            return None
        prediction = Prediction(endpoint, now + max(self.speculative_ttl, hold), fresh)
        cache.speculative.update(dict.fromkeys(fresh, prediction.deadline))
        self._add(endpoint, cache, fresh, SPECULATIVE)
        heapq.heappush(self._expiries, (prediction.deadline, next(self._predictions), prediction))
        return prediction

    def end_speculative(self, prediction: Prediction) -> None:
        """The request of `prediction` ended: it lasts `speculative_ttl` more (for the engine's
        events to arrive). Keys a later prediction holds keep that one's deadline."""
        cache = self._caches.get(prediction.endpoint)
        keys, prediction.keys = prediction.keys, []  # its heap entry lets go of them now
        if cache is None or not keys:
            return
        still_mine = map(operator.eq, itertools.repeat(prediction.deadline), map(cache.speculative.get, keys))
        mine = list(itertools.compress(keys, still_mine))
        if not mine:
            return
        ending = Prediction(prediction.endpoint, self._clock() + self.speculative_ttl, mine)
        cache.speculative.update(dict.fromkeys(mine, ending.deadline))
        heapq.heappush(self._expiries, (ending.deadline, next(self._predictions), ending))

    def record_scope(
        self,
        endpoint: str,
        token_ids: Sequence[int],
        model: str,
        cache_salt: str | None = None,
        tenant: str | None = None,
    ) -> None:
        """Remember that a request in scope (model, cache_salt, tenant) starting with `token_ids`
        went to `endpoint`, so the engine's coming `BlockStored` for that chain (which carries
        no salt or tenant) is keyed in the request's scope. A no-op for the plain scope, and
        with engine keys (which carry the engine's scope)."""
        if (cache_salt is None and tenant is None) or len(token_ids) < self.block_size or self.engine_keys:
            return
        plain_key = self._first_key(token_ids, _seed(model, None, None))
        hints = self._scope_hints
        hints.pop((endpoint, plain_key), None)
        hints[(endpoint, plain_key)] = _seed(model, cache_salt, tenant)
        if len(hints) > self._max_scope_hints:
            del hints[next(iter(hints))]

    # -- introspection (tests, debugging) ------------------------------------------------------

    def engine_hashes(self, endpoint: str, tier: int = GPU) -> set[int]:
        """Engine block hashes the endpoint holds on `tier`, as the events told."""
        cache = self._caches.get(endpoint)
        if cache is None:
            return set()
        return {h for h, block in cache.engine.items() if _expand(block)[TIERS] & tier}

    def predicted_until(self, endpoint: str) -> float | None:
        """The latest deadline of the endpoint's predictions (None without any)."""
        cache = self._caches.get(endpoint)
        return max(cache.speculative.values()) if cache is not None and cache.speculative else None

    def own_keys(self, endpoint: str) -> dict[int, int]:
        """Own key -> tier bits for `endpoint`."""
        cache = self._caches.get(endpoint)
        return dict(cache.tiers) if cache is not None else {}

    def __len__(self) -> int:
        """Distinct own keys held by any endpoint."""
        return len(self._where)

    # -- internals -----------------------------------------------------------------------------

    # Changes come in runs (the blocks of one event or prediction) and are applied with bulk
    # dict operations where the run allows: per block they cost several times less than a loop.

    def _add(self, endpoint: str, cache: _EndpointCache, keys: Sequence[int], tier: int) -> None:
        """`endpoint` holds `keys` on `tier` (as well as where it held them)."""
        held = cache.tiers
        if self._tier_weights[tier] == self._top and held.keys().isdisjoint(keys):
            held.update(dict.fromkeys(keys, tier))  # none held before: no weights to record
            self._join(endpoint, keys)
        else:
            joined: list[int] = []
            # Weights need recording only below the top, or to clear an entry that was.
            weigh = self._weigh if self._below_top or self._tier_weights[tier] < self._top else None
            for key in keys:
                old = held.pop(key, 0)
                held[key] = tiers = old | tier  # re-inserted: newest last
                if tiers != old:
                    if not old:
                        joined.append(key)
                    if weigh is not None:
                        weigh(endpoint, key, tiers)
            if joined:
                self._join(endpoint, joined)
        if len(held) > cache.capacity:
            self._enforce_capacity(endpoint, cache)

    def _remove(self, endpoint: str, cache: _EndpointCache, keys: Sequence[int], tier: int) -> None:
        """`endpoint` no longer holds `keys` on `tier`."""
        held = cache.tiers
        found = list(map(held.get, keys))
        if set(found) <= _EMPTIED_BY[tier]:  # every key leaves (a GPU eviction, an expiry): in bulk
            deque(map(held.pop, keys, itertools.repeat(None)), maxlen=0)
            if cache.speculative:
                deque(map(cache.speculative.pop, keys, itertools.repeat(None)), maxlen=0)
            self._leave(endpoint, keys)
            return
        speculative = cache.speculative if tier & SPECULATIVE else None
        left: list[int] = []
        weights, top = self._tier_weights, self._top
        for key in keys:
            tiers = held.get(key)  # not `found`: a key may be listed twice (spanning engine blocks)
            if tiers is None or not tiers & tier:
                continue
            if speculative:
                speculative.pop(key, None)
            tiers &= ~tier
            if tiers:
                held[key] = tiers
                if self._below_top or weights[tiers] < top:
                    self._weigh(endpoint, key, tiers)
            else:
                del held[key]
                left.append(key)
        if left:
            self._leave(endpoint, left)

    def _join(self, endpoint: str, keys: Sequence[int]) -> None:
        """`endpoint` now holds each of `keys`."""
        where = self._where
        before = list(map(where.get, keys, itertools.repeat(NOBODY)))
        add = self._holder_sets.add
        after = {holders: add(holders, endpoint) for holders in set(before)}
        where.update(zip(keys, map(after.__getitem__, before)))

    def _leave(self, endpoint: str, keys: Sequence[int]) -> None:
        """`endpoint` no longer holds any of `keys`."""
        where = self._where
        before = list(map(where.get, keys, itertools.repeat(NOBODY)))
        remove = self._holder_sets.remove
        after = {holders: remove(holders, endpoint) for holders in set(before)}
        if not any(after.values()):  # nobody else held any of them
            deque(map(where.pop, keys, itertools.repeat(None)), maxlen=0)
        else:
            where.update(zip(keys, map(after.__getitem__, before)))
            if not all(after.values()):
                emptied = map(operator.not_, map(after.__getitem__, before))
                deque(map(where.pop, itertools.compress(keys, emptied), itertools.repeat(None)), maxlen=0)
        if self._below_top:
            for key in keys:
                self._weigh(endpoint, key, 0)

    def _weigh(self, endpoint: str, key: int, tiers: int) -> None:
        """Record `endpoint`'s weight for `key` where it is below the top (an offloaded block)."""
        below = self._below_top
        w = self._tier_weights[tiers] if tiers else self._top
        if w < self._top:
            below.setdefault(key, {})[endpoint] = w
            return
        weights = below.get(key)
        if weights is not None and weights.pop(endpoint, None) is not None and not weights:
            del below[key]

    def _enforce_capacity(self, endpoint: str, cache: _EndpointCache) -> None:
        tiers = cache.tiers
        oldest = list(itertools.islice(tiers, max(0, len(tiers) - cache.capacity)))
        for key in oldest:
            del tiers[key]
            cache.speculative.pop(key, None)
        self._leave(endpoint, oldest)

    def _drop_all(self, endpoint: str, cache: _EndpointCache) -> None:
        self._leave(endpoint, list(cache.tiers))
        cache.tiers.clear()
        cache.engine.clear()
        cache.speculative.clear()
        cache.groups.clear()
        cache.cover.clear()
        cache.covered_by.clear()

    def _expire(self, now: float) -> None:
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:
            _, _, prediction = heapq.heappop(expiries)
            endpoint, keys = prediction.endpoint, prediction.keys
            cache = self._caches.get(endpoint)
            if cache is None:
                continue
            # The keys whose deadline passed (a later prediction may have extended some).
            deadlines = map(cache.speculative.get, keys, itertools.repeat(math.inf))
            due = list(itertools.compress(keys, map(operator.ge, itertools.repeat(now), deadlines)))
            self._remove(endpoint, cache, due, SPECULATIVE)


_KEY_OR_NONE = frozenset({int, type(None)})
_is_key = partial(operator.is_not, None)
# For each set of tier bits removed, the tier bits it leaves empty.
_EMPTIED_BY = [frozenset(t for t in range(1, 8) if not t & ~removed) for removed in range(8)]


def _salt(extra_keys: tuple[object, ...] | None, lora_name: str | None) -> str | None:
    """The cache salt in the first block's extra keys: its last string other than the LoRA name.

    vLLM builds a block's extra keys as LoRA name, multimodal identifiers, then `cache_salt`
    (first block only); with multimodal input the last string could be an image id, which a
    pick-time scope hint then overrides.
    """
    if not extra_keys:
        return None
    first = extra_keys[0]
    if isinstance(first, str):
        return None if first == lora_name else first
    if isinstance(first, (list, tuple)):
        for item in reversed(first):
            if isinstance(item, str) and item != lora_name:
                return item
    return None
