"""A paged KV cache with automatic prefix caching, modelled on vLLM's block pool.

`num_blocks` blocks of `block_size` tokens. A *full* block whose tokens are computed gets a
chained hash and joins the prefix cache; requests share cached blocks by reference count.
Unreferenced cached blocks stay cached until space is needed and are then evicted least
recently used first. Every change to the set of cached blocks is recorded as a KV event
(`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) for the publisher to drain.

Block hashes are vLLM's (`EngineHasher`): `sha256_cbor` by default, `sha256`, or the sim's
own `builtin` chain, which also keys the digest cache of the other two: xxh3-64 over the
block's token ids (uint32 little-endian) followed by the extra keys (LoRA name on every block,
`cache_salt` on the first block), seeded with the parent's hash; the first block's parent is
`ROOT_HASH`. Deterministic across processes and restarts.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import xxhash

from picker.kvevents.vllm_hash import ALGORITHMS, DEFAULT_SEED, VllmBlockHasher

BUILTIN = "builtin"
HASH_ALGORITHMS = (*ALGORITHMS, BUILTIN)
ROOT_HASH = xxhash.xxh3_64_intdigest(b"picker-sim/none-hash")


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    parent: int = ROOT_HASH,
    first_block: int = 0,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[int]:
    """Chained hashes of the full blocks of `token_ids`, which start at block `first_block`."""
    data = array("I", token_ids).tobytes()
    step = 4 * block_size
    lora = ("\x00lora:" + lora_name).encode() if lora_name else b""
    salt = ("\x00salt:" + cache_salt).encode() if cache_salt else b""
    digest = xxhash.xxh3_64_intdigest
    out: list[int] = []
    h = parent
    for i, start in enumerate(range(0, len(data) - step + 1, step)):
        extra = lora + salt if first_block + i == 0 else lora
        h = digest(data[start : start + step] + extra, seed=h)
        out.append(h)
    return out


@cache
def _digests(algorithm: str, seed: str) -> VllmBlockHasher:
    """One digest cache for the pods of a fleet that hash alike (they share the process)."""
    return VllmBlockHasher(algorithm, seed)


class EngineHasher:
    """The block hashes one engine reports, from its `builtin` chain keys: those keys as they
    are, or vLLM's `sha256_cbor` / `sha256` chain from `NONE_HASH = H(seed)`."""

    def __init__(self, algorithm: str = "sha256_cbor", seed: str = DEFAULT_SEED) -> None:
        if algorithm not in HASH_ALGORITHMS:
            raise ValueError(f"block hash must be one of {HASH_ALGORITHMS}, not {algorithm!r}")
        self.algorithm = algorithm
        self._vllm = None if algorithm == BUILTIN else _digests(algorithm, seed)

    def __call__(
        self, keys: list[int], token_ids: Sequence[int], block_size: int, lora_name: str | None, cache_salt: str | None
    ) -> list[int]:
        """The hashes of the blocks `keys` (`block_hashes` of `token_ids`) name."""
        if self._vllm is None:
            return keys
        return self._vllm.block_hashes(keys, token_ids, block_size, lora_name, cache_salt)


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks newly cached, in chain order; `parent_block_hash` is None for a chain's first block."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted from the cache."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every cached block is gone (cache reset or engine restart)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVCache:
    """Block accounting for one engine: cached (hashed, ref-counted) blocks plus private ones."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refs: dict[int, int] = {}  # cached block hash -> reference count
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, oldest first
        self.private = 0  # allocated blocks not in the cache (partial or duplicate blocks)
        self.events: list[KVEvent] = []

    @property
    def free(self) -> int:
        """Blocks allocatable without evicting anything."""
        return self.num_blocks - len(self.refs) - self.private

    @property
    def available(self) -> int:
        """Blocks allocatable now, evicting unreferenced cached blocks if needed."""
        return self.free + len(self.evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests (vLLM's kv_cache_usage_perc)."""
        return (self.num_blocks - self.available) / self.num_blocks

    def cached_prefix(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` are cached."""
        n = 0
        refs = self.refs
        for h in hashes:
            if h not in refs:
                break
            n += 1
        return n

    def acquire(self, hashes: Sequence[int]) -> None:
        """Take a reference on cached blocks (a prefix hit)."""
        for h in hashes:
            count = self.refs[h]
            if count == 0:
                del self.evictable[h]
            self.refs[h] = count + 1

    def allocate(self, n: int) -> bool:
        """Allocate `n` private blocks, evicting LRU unreferenced blocks; False if impossible."""
        if n > self.available:
            return False
        shortfall = n - self.free
        if shortfall > 0:
            removed = []
            for _ in range(shortfall):
                h, _ = self.evictable.popitem(last=False)
                del self.refs[h]
                removed.append(h)
            self.events.append(BlockRemoved(tuple(removed)))
        self.private += n
        return True

    def commit(
        self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int], lora_name: str | None
    ) -> None:
        """Turn private blocks, now full and computed, into cached blocks the caller references.

        A block another request cached meanwhile is shared and the private copy freed.
        """
        stored: list[int] = []
        first_parent = parent
        bs = self.block_size
        stored_tokens: list[int] = []
        for i, h in enumerate(hashes):
            self.private -= 1
            count = self.refs.get(h)
            if count is None:
                self.refs[h] = 1
                if not stored:
                    first_parent = parent if i == 0 else hashes[i - 1]
                stored.append(h)
                stored_tokens.extend(token_ids[i * bs : (i + 1) * bs])
                continue
            if stored:  # a gap in what is new: flush the run so each event is one chain
                self._stored(stored, first_parent, stored_tokens, lora_name)
                stored, stored_tokens = [], []
            if count == 0:
                del self.evictable[h]
            self.refs[h] = count + 1
        if stored:
            self._stored(stored, first_parent, stored_tokens, lora_name)

    def _stored(self, hashes: list[int], parent: int | None, tokens: list[int], lora_name: str | None) -> None:
        self.events.append(BlockStored(tuple(hashes), parent, tuple(tokens), self.block_size, lora_name))

    def release(self, hashes: Sequence[int], private: int) -> None:
        """Drop a request's references; its tail blocks become the first to be evicted."""
        self.private -= private
        for h in reversed(hashes):
            count = self.refs[h] - 1
            self.refs[h] = count
            if count == 0:
                self.evictable[h] = None

    def clear(self) -> None:
        """Forget every block (engine restart); records AllBlocksCleared."""
        self.refs.clear()
        self.evictable.clear()
        self.private = 0
        self.events.append(AllBlocksCleared())

    def drain_events(self) -> list[KVEvent]:
        """The events recorded since the last drain."""
        events, self.events = self.events, []
        return events
