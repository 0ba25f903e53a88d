"""The infinite-cache bound: the best prefix hit ratio any router could reach on a workload.

With one cache that never evicts, a prompt's leading full blocks hit if an earlier prompt
already computed them (chained block hashes, as the engine keys them). Like vLLM, at least the
last prompt token is always computed, so a prompt never hits on more than `(n - 1) // block_size`
blocks. Because blocks are chained, the total does not depend on the order of the prompts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from picker.prefix.hashing import token_block_hashes

_ROOT = 0


class PrefixBound:
    """Accumulates prompts (as token ids) and reports the infinite-cache hit ratio."""

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.seen: set[int] = set()
        self.prompt_tokens = 0
        self.hit_tokens = 0

    def add(self, token_ids: Sequence[int]) -> None:
        """Count one prompt, then remember its blocks."""
        hashes = token_block_hashes(token_ids, self.block_size, _ROOT)
        limit = (len(token_ids) - 1) // self.block_size
        hits = 0
        for h in hashes[:limit]:
            if h not in self.seen:
                break
            hits += 1
        self.seen.update(hashes)
        self.prompt_tokens += len(token_ids)
        self.hit_tokens += hits * self.block_size

    @property
    def ratio(self) -> float:
        """Cached prompt tokens / all prompt tokens (0 for no prompts)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def infinite_cache_hit_ratio(prompts: Iterable[Sequence[int]], block_size: int) -> float:
    """The bound over `prompts` (token id lists)."""
    bound = PrefixBound(block_size)
    for tokens in prompts:
        bound.add(tokens)
    return bound.ratio
