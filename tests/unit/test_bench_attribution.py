"""Where prefix-cache hits go: the LRU fleet figure, arrival order, and per-request miss attribution."""

from __future__ import annotations

import random

import pytest

from picker_bench.attribution import CATEGORIES, attribute
from picker_bench.bound import BlockLRU, PrefixBound, PromptBlocks, belady_hits, lru_hits
from picker_bench.loadgen import RequestResult
from picker_bench.runner import arrival_order, bounds_of
from picker_bench.systems import FleetOptions
from picker_bench.workloads import Prompt, Session

BS = 4  # tokens per block in the hand-made sequences


def test_the_lru_cache_holds_whole_prefixes_so_its_binary_search_matches_a_walk() -> None:
    rng = random.Random(7)
    trunks = [[rng.randrange(1000) for _ in range(40)] for _ in range(5)]
    cache = BlockLRU(30)
    for _ in range(300):
        trunk = rng.choice(trunks)
        tokens = trunk[: rng.randint(1, 40)] + [rng.randrange(1000) for _ in range(rng.randint(0, 12))]
        prompt = PromptBlocks.of(tokens, BS)
        walked = 0
        for h in prompt.hashes[: prompt.limit]:
            if h not in cache.blocks:
                break
            walked += 1
        assert cache.cached_prefix(prompt.hashes, prompt.limit) == walked
        cache.touch(prompt.hashes)
        assert len(cache.blocks) <= 30


def test_lru_hits_stop_at_the_first_miss_and_never_count_the_last_token() -> None:
    # Prompts as (block hashes, blocks that can hit), one cache of 3 blocks.
    assert lru_hits([([1, 2], 1), ([1, 2], 1)], 3) == 1  # the second block holds the last token
    assert lru_hits([([1, 2, 3], 3), ([1, 9, 3], 3)], 3) == 1  # block 3 after the miss does not count
    # A 4-block prompt in a 3-block cache keeps its first 3 blocks (its tail is evicted first).
    assert lru_hits([([1, 2, 3, 4], 4), ([1, 2, 3, 4, 5], 5)], 3) == 3
    cyclic = [([b], 1) for b in [1, 2, 3] * 4]  # LRU's worst case, where the optimal eviction shines
    assert lru_hits(cyclic, 2) == 0 < belady_hits(cyclic, 2)
    assert lru_hits([], 3) == lru_hits([([1], 1), ([1], 1)], 0) == 0


def test_the_lru_fleet_figure_needs_room_to_reach_the_infinite_cache() -> None:
    rng = random.Random(1)
    prefixes = [[rng.randrange(5000) for _ in range(64)] for _ in range(8)]
    bound = PrefixBound(16)
    for i in range(64):
        bound.add(prefixes[i % 8] + [rng.randrange(5000) for _ in range(20)])
    assert bound.lru_ratio(10**6) == pytest.approx(bound.ratio)  # enough room: the infinite cache
    # 8 prefixes of 4 blocks in turn, each prompt with a fifth block of its own: a prefix comes back
    # after the 35 blocks of the 7 other prompts, so an LRU of 39 blocks keeps it whole, one of 36
    # only its first block (touched last), one of 35 nothing; the optimal eviction keeps all 32.
    assert bound.lru_ratio(39) == pytest.approx(bound.ratio)
    assert bound.lru_ratio(36) == pytest.approx(bound.ratio / 4)
    assert bound.lru_ratio(35) == 0 < bound.fleet_ratio(35) == pytest.approx(bound.ratio)
    assert PrefixBound(16).lru_ratio(40) == 0


def test_bounds_take_turns_in_arrival_order() -> None:
    def prompt(n: int) -> Prompt:
        return Prompt(1, (("user", " ".join(["ab"] * n)),))

    sessions = [
        Session(0.0, (prompt(10), prompt(20), prompt(30)), (5.0, 5.0)),  # turns due at 0, 5 and 10
        Session(1.0, (prompt(40),)),
        Session(7.0, (prompt(50), prompt(60)), (0.5,)),  # 7 and 7.5
    ]
    assert arrival_order(sessions) == [(0, 0), (1, 0), (0, 1), (2, 0), (2, 1), (0, 2)]
    bounds = bounds_of(sessions, FleetOptions(pods=1, num_gpu_blocks=4))
    assert 0 < bounds.lru_hit_ratio <= bounds.hit_ratio


def rec(
    session: int,
    turn: int,
    due: float,
    pod: str | None,
    prompt: int,
    cached: int,
    e2e: float = 0.5,
    error: str | None = None,
) -> RequestResult:
    return RequestResult(session, turn, due, 0.1, None if error else e2e, prompt, cached, 4, pod, error)


def test_misses_are_attributed_to_another_pod_eviction_and_novelty() -> None:
    system = list(range(100, 108))  # two blocks every conversation shares
    p1 = system + [200, 201, 202, 203, 204]  # 13 tokens: 3 full blocks, the last token alone
    p3 = p1 + [205, 206, 207, 208, 209, 210, 211]  # its next turn: 20 tokens, 5 blocks
    p2 = system + [300, 301, 302, 303, 304]
    p5 = p2 + [305, 306, 307, 308, 309, 310, 311]
    x = list(range(400, 417))  # 17 tokens sharing nothing with the others
    x6 = x + [417, 418, 419]
    blocks = [[PromptBlocks.of(t, BS) for t in turns] for turns in ([p1, p3], [p2, p5], [x], [x6])]
    # Two pods of 4 blocks each. Dispatch order and what each pod's model cache holds before:
    results = [
        # 1. p1 on a, nothing anywhere: all 13 tokens never seen. In flight until t=5.
        rec(0, 0, 0.0, "a", 13, 0, e2e=5.0),
        # 2. p2 on b while a holds the 2 system blocks and has 1 request in flight, b none:
        #    8 tokens on another pod (its holder busier by 1), 5 never seen.
        rec(1, 0, 1.0, "b", 13, 0),
        # 3. p3 back on a, which holds 3 of its blocks: the engine reports only 2 (8 tokens), so
        #    4 are cached per the model only, 8 never seen. a then keeps blocks 1-4 of p3.
        rec(0, 1, 10.0, "a", 20, 8),
        # 4. x on b: never seen; its 4 blocks push b's system and p2 blocks out.
        rec(2, 0, 11.0, "b", 17, 0),
        # 5. p5 on b: a holds the 2 system blocks (8 tokens on another pod, both pods idle), b
        #    held p2's third block and evicted it (4 tokens), then 8 never seen. b keeps p5's first 4.
        rec(1, 1, 12.0, "b", 20, 0),
        # 6. x6 on a: x's 4 blocks were only ever on b, which evicted them: 16 tokens evicted
        #    everywhere, 4 never seen.
        rec(3, 0, 13.0, "a", 20, 0),
        # Neither a failed request nor one without a pod says where its blocks went.
        rec(3, 0, 14.0, "a", 20, 0, error="HTTP 500: boom"),
        rec(3, 0, 15.0, None, 20, 0),
    ]
    a = attribute(list(reversed(results)), blocks, BS, pod_blocks=4)  # replayed in dispatch order whatever given
    assert a.requests == 6 and a.prompt_tokens == 103
    assert a.tokens == {
        "hit": 8,
        "model_only": 4,
        "other_pod": 16,
        "evicted_chosen": 4,
        "evicted_everywhere": 16,
        "never_seen": 55,
    }
    assert list(a.tokens) == list(CATEGORIES) and sum(a.tokens.values()) == a.prompt_tokens
    assert a.model_hit_tokens == 12 and a.model_exact == pytest.approx(5 / 6)  # all but request 3
    assert a.other_pod_requests == 2 and a.holder_busier == 0.5 and a.in_flight_gap_p50 == 0.5
    assert a.share("other_pod") == pytest.approx(16 / 103)
    line = a.summary()
    assert "7.8% hit (model 11.7%, exact on 83% of requests)" in line
    assert "15.5% on another pod" in line and "the holder busier in 50% (median +0.5 in flight)" in line


def test_a_router_that_keeps_conversations_together_loses_nothing_to_other_pods() -> None:
    rng = random.Random(5)
    sessions: list[list[list[int]]] = []
    for _ in range(6):
        history = [rng.randrange(1000) for _ in range(9)]
        turns = []
        for _ in range(4):
            history = history + [rng.randrange(1000) for _ in range(6)]
            turns.append(history)
        sessions.append(turns)
    blocks = [[PromptBlocks.of(t, BS) for t in turns] for turns in sessions]
    due = [(s * 0.1 + t, s, t) for s in range(6) for t in range(4)]
    # An engine that keeps everything hits each turn's whole previous turn (its full blocks).
    previous = {(s, t): len(sessions[s][t - 1]) // BS * BS if t else 0 for _, s, t in due}

    def requests(pod: dict[tuple[int, int], str], cached: dict[tuple[int, int], int]) -> list[RequestResult]:
        return [rec(s, t, d, pod[s, t], len(sessions[s][t]), cached.get((s, t), 0)) for d, s, t in due]

    sticky = attribute(requests({(s, t): f"pod-{s % 2}" for _, s, t in due}, previous), blocks, BS, pod_blocks=1000)
    assert sticky.tokens["hit"] == sum(previous.values()) and sticky.model_exact == 1
    assert sum(sticky.tokens[k] for k in ("model_only", "other_pod", "evicted_chosen", "evicted_everywhere")) == 0
    # Moving each conversation to the other pod on every turn leaves its history behind.
    hopping = attribute(requests({(s, t): f"pod-{(s + t) % 2}" for _, s, t in due}, {}), blocks, BS, 1000)
    assert hopping.other_pod_requests == 18  # every turn but the first
    assert hopping.tokens["other_pod"] == sum(previous.values()) - hopping.tokens["model_only"]
