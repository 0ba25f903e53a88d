"""The approximate prefix index and the reference's character-block hashing."""

from __future__ import annotations

import struct
import tracemalloc

import xxhash

from picker.framework.request import Api, InferenceRequest, Message
from picker.prefix import index as index_module
from picker.prefix.chars import char_block_hashes, char_chain_seed, prompt_bytes
from picker.prefix.index import PrefixIndex


def _reference_hashes(data: bytes, block: int, model: str, salt: str, max_blocks: int) -> list[int]:
    # The reference algorithm written out independently (gie-epp.md §4.3).
    if len(data) < block:
        return []
    data = data[: max_blocks * block]
    h = xxhash.xxh64_intdigest((model + salt).encode())
    out = []
    for i in range(0, len(data), block):
        h = xxhash.xxh64_intdigest(data[i : i + block] + struct.pack("<Q", h))
        out.append(h)
    return out


def test_char_hashes_follow_the_reference_chain_with_partial_tail_and_truncation() -> None:
    data = b"x" * 64 * 3 + b"tail"
    seed = char_chain_seed("llama", "salt")
    assert char_block_hashes(data, 64, seed, 256) == _reference_hashes(data, 64, "llama", "salt", 256)
    assert len(char_block_hashes(data, 64, seed, 256)) == 4  # 3 full blocks + the partial tail
    assert len(char_block_hashes(data, 64, seed, 2)) == 2
    assert char_block_hashes(b"short", 64, seed, 256) == []


def test_seeds_scope_model_salt_and_tenant() -> None:
    base = char_chain_seed("m")
    assert base == xxhash.xxh64_intdigest(b"m")
    assert char_chain_seed("m", "s") != base
    assert char_chain_seed("m", None, "tenant-a") != base
    assert char_chain_seed("m", None, "tenant-a") != char_chain_seed("m", None, "tenant-b")
    assert char_chain_seed("other") != base


def test_prompt_bytes_for_chat_is_deterministic_json_and_token_prompts_have_none() -> None:
    chat = InferenceRequest(
        "r1",
        Api.CHAT_COMPLETIONS,
        "m",
        "m",
        messages=(Message("system", "be brief"), Message("user", "hi")),
    )
    assert prompt_bytes(chat) == b'[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}]'
    text = InferenceRequest("r2", Api.COMPLETIONS, "m", "m", prompt_text="héllo")
    assert prompt_bytes(text) == "héllo".encode()
    tokens = InferenceRequest("r3", Api.COMPLETIONS, "m", "m", prompt_token_ids=(1, 2, 3))
    assert prompt_bytes(tokens) is None


def test_match_is_greedy_and_stops_at_first_block_nobody_has() -> None:
    index = PrefixIndex()
    index.insert("a", [1, 2, 3, 4])
    index.insert("b", [1, 2])
    assert index.match([1, 2, 3, 4, 5]) == {"a": 4, "b": 2}
    assert index.match([9, 1, 2]) == {}
    assert index.match([1, 2, 7, 4]) == {
        "a": 2,
        "b": 2,
    }  # stops at 7 though "a" holds 4


def test_lru_capacity_evicts_tails_first_and_updates_the_global_map() -> None:
    index = PrefixIndex(default_capacity=4)
    index.insert("a", [1, 2, 3, 4])
    index.insert("a", [10, 11])  # evicts the least recent: the tail of the first prefix
    assert len(index) == 4
    assert index.match([1, 2, 3, 4]) == {"a": 2}
    assert index.match([10, 11]) == {"a": 2}
    index.insert("b", [3, 4], capacity=100)
    assert index.capacity("b") == 100 and index.capacity("a") == 4


def test_removed_endpoints_are_forgotten() -> None:
    index = PrefixIndex()
    index.insert("a", [1, 2])
    index.insert("b", [1, 2, 3])
    index.retain(["b"])
    assert index.match([1, 2, 3]) == {"b": 3}
    assert index.endpoints() == ["b"] and len(index) == 3
    index.remove(["b"])
    assert index.match([1]) == {} and len(index) == 0


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_reused_blocks_count_only_blocks_sent_again_within_the_window() -> None:
    clock = _Clock()
    index = PrefixIndex(default_capacity=100, reuse_window_s=10.0, clock=clock)
    index.insert("a", [1, 2, 3, 4])
    assert index.reused_blocks("a") == 0  # sent once: a one-off prompt, not a working set
    index.insert("a", [1, 2, 5])
    assert index.reused_blocks("a") == 2
    clock.now += 6
    index.insert("a", [1, 2, 3])  # 1 and 2 again (their window restarts), 3 for the first time
    assert index.reused_blocks("a") == 3
    clock.now += 6  # the first reuse of 1 and 2 has expired, not their second
    assert index.reused_blocks("a") == 3
    clock.now += 5
    assert index.reused_blocks("a") == 0
    assert index.reused_blocks("unknown") == 0


def test_evicted_and_removed_blocks_leave_the_reused_set() -> None:
    clock = _Clock()
    index = PrefixIndex(default_capacity=4, reuse_window_s=10.0, clock=clock)
    index.insert("a", [1, 2, 3])
    index.insert("a", [1, 2, 3])
    assert index.reused_blocks("a") == 3
    index.insert("a", [7, 8])  # evicts the tail of the reused prefix: block 3
    assert index.reused_blocks("a") == 2
    assert index.match([1, 2, 3]) == {"a": 2}
    index.remove(["a"])
    assert index.reused_blocks("a") == 0


def test_the_reuse_log_stays_bounded_when_nobody_reads_it() -> None:
    clock = _Clock()
    index = PrefixIndex(default_capacity=100, reuse_window_s=10.0, clock=clock)

    def send(times: int) -> None:  # a config without cache-fit-scorer never asks for the count
        for _ in range(times):
            index.insert("a", [1, 2, 3])
            clock.now += 1.0

    def held_by_the_index() -> int:  # only what index.py allocated: other threads' allocations do not count
        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, index_module.__file__)])
        return sum(stat.size for stat in snapshot.statistics("filename"))

    send(100)
    tracemalloc.start()
    try:
        before = held_by_the_index()
        send(5000)  # ~150 bytes a reuse if the log were never trimmed
        grown = held_by_the_index() - before
    finally:
        tracemalloc.stop()
    assert grown < 20_000
    assert index.reused_blocks("a") == 3
