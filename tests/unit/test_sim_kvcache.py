"""The paged, prefix-cached KV block pool and its events."""

from __future__ import annotations

from picker_sim.kvcache import (
    ROOT_HASH,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCache,
    block_hashes,
)


def test_hashes_are_chained_and_cover_full_blocks_only() -> None:
    tokens = list(range(40))
    hashes = block_hashes(tokens, 16)
    assert len(hashes) == 2
    assert block_hashes(tokens[:32], 16) == hashes
    assert block_hashes(tokens[16:32], 16, parent=hashes[0], first_block=1) == hashes[1:]
    # a different first block changes every later hash (chaining)
    other = block_hashes([99] + tokens[1:], 16)
    assert other[0] != hashes[0] and other[1] != hashes[1]
    assert all(0 <= h < 2**64 for h in hashes) and ROOT_HASH not in hashes


def test_extra_keys_lora_everywhere_salt_on_first_block() -> None:
    tokens = list(range(32))
    plain = block_hashes(tokens, 16)
    lora = block_hashes(tokens, 16, lora_name="a")
    salted = block_hashes(tokens, 16, cache_salt="tenant")
    assert lora[0] != plain[0] and lora != block_hashes(tokens, 16, lora_name="b")
    assert salted[0] != plain[0]
    # the salt only enters the first block; the second differs only through the chain
    assert block_hashes(tokens[16:], 16, parent=salted[0], first_block=1) == salted[1:]
    assert block_hashes(tokens[16:], 16, parent=salted[0], first_block=1, cache_salt="x") == salted[1:]


def _fill(cache: KVCache, tokens: list[int]) -> list[int]:
    """Allocate and commit all full blocks of `tokens` as one request; returns its hashes."""
    hashes = block_hashes(tokens, cache.block_size)
    hit = cache.cached_prefix(hashes)
    cache.acquire(hashes[:hit])
    assert cache.allocate(len(hashes) - hit)
    cache.commit(hashes[hit:], hashes[hit - 1] if hit else None, tokens[hit * 4 :], None)
    return hashes


def test_shared_prefix_is_referenced_not_duplicated() -> None:
    cache = KVCache(num_blocks=8, block_size=4)
    a = _fill(cache, list(range(12)))
    stored = cache.drain_events()
    assert stored == [BlockStored(tuple(a), None, tuple(range(12)), 4, None)]
    b = _fill(cache, list(range(8)) + [50, 51, 52, 53])
    assert a[:2] == b[:2]
    assert cache.drain_events() == [BlockStored((b[2],), b[1], (50, 51, 52, 53), 4, None)]
    assert cache.refs[a[0]] == 2 and cache.refs[a[2]] == 1 and cache.free == 4


def test_lru_eviction_never_touches_referenced_blocks() -> None:
    cache = KVCache(num_blocks=4, block_size=4)
    held = _fill(cache, list(range(8)))  # 2 blocks, still referenced
    old = _fill(cache, list(range(100, 108)))
    cache.release(old, 0)  # unreferenced: evictable, tail first
    cache.drain_events()
    assert cache.usage == 0.5
    assert cache.allocate(1)
    assert cache.drain_events() == [BlockRemoved((old[1],))]
    assert cache.allocate(1)
    assert cache.drain_events() == [BlockRemoved((old[0],))]
    assert not cache.allocate(1)  # only referenced blocks left: allocation fails instead
    assert set(cache.refs) == set(held)


def test_commit_of_a_block_cached_meanwhile_shares_it() -> None:
    cache = KVCache(num_blocks=4, block_size=4)
    hashes = block_hashes(list(range(4)), 4)
    assert cache.allocate(1) and cache.allocate(1)  # two requests computing the same block
    cache.commit(hashes, None, list(range(4)), None)
    cache.commit(hashes, None, list(range(4)), None)
    assert cache.refs[hashes[0]] == 2 and cache.private == 0 and cache.free == 3
    assert len(cache.drain_events()) == 1


def test_clear_records_all_blocks_cleared() -> None:
    cache = KVCache(num_blocks=4, block_size=4)
    _fill(cache, list(range(8)))
    cache.clear()
    assert cache.refs == {} and cache.free == 4
    assert cache.drain_events()[-1] == AllBlocksCleared()
