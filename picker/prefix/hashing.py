"""Chained block hashes over token ids: the picker's own block keys.

The chain seed scopes every key by model (or LoRA adapter), cache_salt and tenant, so two
scopes never share a key. Keys are the picker's own: engine hashes from KV events are mapped
onto them through the events' token ids, so the engine's hash algorithm never matters.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash


def chain_seed(model: str, cache_salt: str | None = None, tenant: str | None = None) -> int:
    """The root of a hash chain: one value per (model or adapter, cache_salt, tenant)."""
    scope = "\x00".join((model, cache_salt or "", tenant or ""))
    return xxhash.xxh3_64_intdigest(scope.encode("utf-8", "surrogatepass"))


def token_block_hashes(token_ids: Sequence[int], block_size: int, parent: int) -> list[int]:
    """Hashes of each *full* block of `token_ids`, chained from `parent`.

    Like vLLM's prefix cache, a trailing partial block gets no hash: it is never cached.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    data = array("I", token_ids).tobytes()  # uint32 per token
    step = 4 * block_size
    hashes: list[int] = []
    h = parent
    digest = xxhash.xxh3_64_intdigest
    for start in range(0, len(data) - step + 1, step):
        h = digest(data[start : start + step], seed=h)
        hashes.append(h)
    return hashes
