"""Bench workloads: deterministic by seed, exact token counts, faithful Mooncake trace replay."""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter
from pathlib import Path

import pytest

from picker.prefix.builtin_tokenizer import encode
from picker.prefix.hashing import token_block_hashes
from picker_bench import workloads as w
from picker_bench.bound import PrefixBound, belady_hits, decode_floor_s, infinite_cache_hit_ratio, prefill_floor_s
from picker_bench.runner import bounds_of
from picker_bench.systems import FleetOptions
from picker_sim.profiles import get_profile


def small_trace(tmp_path: Path, conversations: int = 12, turns: int = 4) -> Path:
    """A Mooncake-format trace shaped like the real one: multi-turn conversations whose turns
    extend the previous turn's blocks, a few shared "system" blocks, partial last blocks."""
    rng = random.Random(5)
    next_id = 100
    rows = []
    for c in range(conversations):
        ids = [c % 3]  # three shared first blocks
        t = rng.uniform(0, 20_000)
        for _ in range(turns):
            fresh = rng.randint(1, 3)
            ids = ids + list(range(next_id, next_id + fresh))
            next_id += fresh
            length = 512 * (len(ids) - 1) + rng.randint(1, 512)
            rows.append(
                {"timestamp": int(t), "input_length": length, "output_length": rng.randint(0, 9), "hash_ids": ids}
            )
            t += rng.uniform(500, 4000)
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_vocabulary_words_are_one_distinct_token_each() -> None:
    ids = [encode(word) for word in w.VOCAB]
    assert all(len(i) == 1 for i in ids)
    assert len({i[0] for i in ids}) == len(w.VOCAB)


@pytest.mark.parametrize(
    "generate,spec",
    [
        (w.shared_prefix, w.SharedPrefixSpec(groups=4, prompts_per_group=3, system_prompt_len=40, question_len=8)),
        (w.multi_turn, w.MultiTurnSpec(sessions=5, turns=3, system_prompt_len=30, question_len=5, answer_len=4)),
        (w.long_doc, w.LongDocSpec(documents=3, document_len=50, question_len=6)),
        (
            w.conversation,
            w.ConversationSpec(applications=3, system_prompt_len=30, user_len=5, answer_len=4, one_off_len=40),
        ),
    ],
)
def test_generators_are_deterministic_by_seed(generate, spec) -> None:
    first = generate(spec, 5.0, 10.0, seed=7)
    assert first == generate(spec, 5.0, 10.0, seed=7)
    assert first != generate(spec, 5.0, 10.0, seed=8)
    starts = [s.start_s for s in first]
    assert starts == sorted(starts) and all(0 <= t < 10.0 for t in starts)


def test_shared_prefix_groups_and_lengths_are_exact() -> None:
    spec = w.SharedPrefixSpec(groups=3, prompts_per_group=4, system_prompt_len=64, question_len=16, output_len=9)
    sessions = w.shared_prefix(spec, rate=50.0, duration_s=10.0, seed=1)
    prompts = list(w.all_prompts(sessions))
    systems = [p.messages[0][1] for p in prompts]
    assert all(len(encode(s)) == 64 for s in systems)
    assert all(len(encode(p.messages[1][1])) == 16 and p.max_tokens == 9 for p in prompts)
    # Each round of 12 requests holds every group exactly 4 times.
    first_round = systems[:12]
    assert sorted(first_round.count(s) for s in set(first_round)) == [4, 4, 4]


def test_group_skew_makes_a_few_groups_hot() -> None:
    spec = w.SharedPrefixSpec(groups=8, system_prompt_len=4, question_len=2, group_skew=1.5)
    sessions = w.shared_prefix(spec, rate=200.0, duration_s=10.0, seed=4)
    assert sessions == w.shared_prefix(spec, rate=200.0, duration_s=10.0, seed=4)
    counts = [n for _, n in Counter(s.turns[0].messages[0] for s in sessions).most_common()]
    assert counts[0] > 0.35 * len(sessions) > counts[-1] * 10  # Zipf 1.5 over 8 groups: the top one ~ 44%


def test_multi_turn_sessions_grow_their_own_history() -> None:
    spec = w.MultiTurnSpec(sessions=4, turns=3, system_prompt_len=20, question_len=5, answer_len=6, think_time_s=0.5)
    sessions = w.multi_turn(spec, rate=30.0, duration_s=100.0, seed=3)
    assert len(sessions) == 4
    for session in sessions:
        assert len(session.turns) == 3 and len(session.think_s) == 2
        for earlier, later in zip(session.turns, session.turns[1:]):
            assert later.messages[: len(earlier.messages)] == earlier.messages
            assert later.messages[len(earlier.messages)][0] == "assistant"
    assert len({s.turns[0].messages[0] for s in sessions}) == 1  # one shared system prompt
    keys = [{p.session_key for p in s.turns} for s in sessions]
    assert all(len(k) == 1 and None not in k for k in keys)  # one key per session, on every turn
    assert len(set.union(*keys)) == 4  # and a different one for each session
    assert sessions[0].turns[1].payload()["prompt_cache_key"] == sessions[0].turns[0].session_key


def tokens(text: str) -> int:
    return len(encode(text))


def test_conversation_turns_resend_the_whole_history_under_one_key() -> None:
    spec = w.ConversationSpec(applications=4, system_prompt_len=24, user_len=6, answer_len=8, one_off_len=50)
    sessions = w.conversation(spec, rate=20.0, duration_s=60.0, seed=2)
    conversations = [s for s in sessions if s.turns[0].session_key is not None]
    one_offs = [s for s in sessions if s.turns[0].session_key is None]
    assert conversations and one_offs and any(len(s.turns) >= 3 for s in conversations)
    systems = {s.turns[0].messages[0] for s in sessions}
    assert len(systems) <= 4 and all(role == "system" and tokens(text) == 24 for role, text in systems)
    for session in conversations:
        assert len(session.think_s) == len(session.turns) - 1 and all(t > 0 for t in session.think_s)
        assert len({p.session_key for p in session.turns}) == 1
        for n, prompt in enumerate(session.turns):
            # system, then (user, assistant) for every earlier turn, then this turn's user message.
            assert [role for role, _ in prompt.messages] == ["system"] + ["user", "assistant"] * n + ["user"]
        for earlier, later in itertools.pairwise(session.turns):
            assert later.messages[: len(earlier.messages)] == earlier.messages  # history only grows
            answer = later.messages[len(earlier.messages)][1]
            assert tokens(answer) == earlier.max_tokens  # the earlier answer, as long as was asked
            assert len(later.token_ids()) > len(earlier.token_ids())
    assert len({s.turns[0].session_key for s in conversations}) == len(conversations)
    for session in one_offs:
        (prompt,) = session.turns
        assert [role for role, _ in prompt.messages] == ["system", "user"]
        assert "prompt_cache_key" not in prompt.payload()


def test_conversation_shapes_match_the_spec_over_many_draws() -> None:
    # Pauses scaled to nearly nothing, so that the run's end cuts (almost) no conversation short.
    spec = w.ConversationSpec(
        applications=5, system_prompt_len=4, user_len=20, answer_len=30, one_off_len=200, think_scale=0.001
    )
    rate, duration = 60.0, 150.0
    sessions = w.conversation(spec, rate, duration, seed=11)
    conversations = [s for s in sessions if s.turns[0].session_key is not None]
    one_offs = [s for s in sessions if s.turns[0].session_key is None]
    requests = sum(len(s.turns) for s in sessions)
    assert requests == pytest.approx(rate * duration, rel=0.1)  # `rate` counts requests, not arrivals
    assert len(one_offs) / len(sessions) == pytest.approx(spec.one_off_share, abs=0.02)
    turns = [len(s.turns) for s in conversations if s.start_s < duration - 10]
    assert spec.mean_turns() == pytest.approx(2.51, abs=0.01)
    assert sum(turns) / len(turns) == pytest.approx(spec.mean_turns(), rel=0.08)
    single = spec.turn_weights()[0] / sum(spec.turn_weights())
    assert turns.count(1) / len(turns) == pytest.approx(single, abs=0.03)
    assert max(turns) > 15  # heavy-tailed: a few long conversations
    users = [tokens(p.messages[-1][1]) for s in conversations for p in s.turns]  # each turn's new message
    answers = [p.max_tokens for s in sessions for p in s.turns]
    documents = [tokens(s.turns[0].messages[1][1]) for s in one_offs]
    thinks = [t / spec.think_scale for s in conversations for t in s.think_s]
    assert sum(users) / len(users) == pytest.approx(spec.user_len, rel=0.06)
    assert sum(answers) / len(answers) == pytest.approx(spec.answer_len, rel=0.05)
    assert sum(documents) / len(documents) == pytest.approx(spec.one_off_len, rel=0.12)
    assert sum(thinks) / len(thinks) == pytest.approx(spec.think_time_s, rel=0.1)
    assert sorted(thinks)[len(thinks) // 2] < spec.think_time_s * 0.7  # lognormal: the median is well below the mean
    popularity = Counter(s.turns[0].messages[0] for s in sessions).most_common()
    top = 1 / sum(1 / rank for rank in range(1, 6))  # Zipf 1 over 5 applications
    assert popularity[0][1] / len(sessions) == pytest.approx(top, abs=0.03)
    assert popularity[0][1] > 4 * popularity[-1][1]


def test_conversation_turns_stop_where_the_run_ends() -> None:
    spec = w.ConversationSpec(system_prompt_len=4, user_len=4, answer_len=4, one_off_share=0.0, think_scale=1.0)
    sessions = w.conversation(spec, rate=5.0, duration_s=30.0, seed=1)
    for session in sessions:
        clock = itertools.accumulate(session.think_s, initial=session.start_s)
        assert all(at < 30.0 for at in clock)  # every kept turn is due (think time alone) within the run
    assert any(len(s.turns) == 1 and s.start_s > 20 for s in sessions)


def test_conversation_rejects_a_share_above_one() -> None:
    with pytest.raises(ValueError, match="one_off_share"):
        w.ConversationSpec(one_off_share=1.5)


def test_poisson_rate_is_about_right() -> None:
    arrivals = list(w.poisson_arrivals(random.Random(0), rate=20.0, duration_s=100.0))
    assert 1800 < len(arrivals) < 2200


def hash_id_bound(records: list[w.TraceRecord]) -> float:
    """The trace's own bound counted in whole 512-token blocks (full blocks only, never the last token)."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for r in records:
        full = (r.input_length - 1) // w.TRACE_BLOCK_TOKENS
        k = 0
        while k < min(full, len(r.hash_ids)) and tuple(r.hash_ids[: k + 1]) in seen:
            k += 1
        # Only whole blocks are cacheable: a cut-short last block is not (yet) a block.
        seen.update(tuple(r.hash_ids[: i + 1]) for i in range(r.input_length // w.TRACE_BLOCK_TOKENS))
        hit += k * w.TRACE_BLOCK_TOKENS
        total += r.input_length
    return hit / total


def test_trace_replay_reproduces_the_trace_prefix_sharing(tmp_path: Path) -> None:
    records = w.read_trace(small_trace(tmp_path))
    sessions = w.trace_replay(records, speed=1.0, duration_s=1e9, seed=0)
    assert len(sessions) == len(records)
    chain_of: dict[int, tuple[int, ...]] = {}
    sent: list[list[int]] = []
    for record, prompt in zip(sorted(records, key=lambda r: r.timestamp_ms), w.all_prompts(sessions)):
        tokens = prompt.token_ids()
        assert len(tokens) == record.input_length
        sent.append(tokens)
        # Every full 512-token block chain maps to exactly one hash-id prefix, and back.
        for i, h in enumerate(token_block_hashes(tokens, w.TRACE_BLOCK_TOKENS, 0)):
            assert chain_of.setdefault(h, record.hash_ids[: i + 1]) == record.hash_ids[: i + 1]
    assert len(set(chain_of.values())) == len(chain_of)
    expected = hash_id_bound(sorted(records, key=lambda r: r.timestamp_ms))
    assert expected > 0.3  # the trace really shares prefixes
    assert infinite_cache_hit_ratio(sent, w.TRACE_BLOCK_TOKENS) == pytest.approx(expected, abs=1e-12)


def test_trace_replay_speed_and_duration(tmp_path: Path) -> None:
    records = sorted(w.read_trace(small_trace(tmp_path)), key=lambda r: r.timestamp_ms)
    fast = w.trace_replay(records, speed=4.0, duration_s=5.0, seed=0)
    first = records[0].timestamp_ms
    expected = [(r.timestamp_ms - first) / 4000 for r in records if (r.timestamp_ms - first) / 4000 < 5.0]
    assert [s.start_s for s in fast] == expected
    assert 0 < len(fast) < len(records)
    assert fast[0].turns[0].max_tokens == max(1, records[0].output_length)


def test_trace_sessions_follow_the_prompts_full_blocks() -> None:
    def record(t: int, ids: list[int], length: int) -> w.TraceRecord:
        return w.TraceRecord(t, length, 1, tuple(ids))

    records = [
        record(0, [1, 2, 3], 1536),  # z: three full blocks, a new session
        record(1, [1, 2], 1024),  # x: does not begin with z's three blocks: a new session
        record(2, [1, 2, 3], 1100),  # y: begins with x's blocks and z's: z's is the longer match
        record(3, [1, 2, 4], 1500),  # w: blocks 1, 2 match; y (z's session) ended there after x did
        record(4, [1, 2, 3, 5], 2048),  # v: z's three blocks again
        record(5, [7, 8], 1000),  # u: a new session whose last block (8) is partial
        record(6, [7, 9, 10], 1400),  # u's next turn: block 8, now full, has a new id; block 7 matches
        record(7, [20], 100),  # p: no full block, so nothing can continue it
        record(8, [20, 21], 600),  # q: a new session although it begins with p's only (partial) id
    ]
    keys = list(w.trace_session_keys(records))
    z, x, p, q = keys[0], keys[1], keys[7], keys[8]
    assert keys == [z, x, z, z, z, keys[5], keys[5], p, q]
    assert len({z, x, keys[5], p, q}) == 5
    sessions = w.trace_replay(list(reversed(records)), speed=1.0, duration_s=1e9, seed=0)  # sorted by time first
    assert [s.turns[0].payload()["prompt_cache_key"] for s in sessions] == keys


def test_trace_sessions_of_the_vendored_mooncake_trace() -> None:
    trace = Path(__file__).resolve().parents[2] / "data" / "mooncake-synthetic-trace.jsonl"
    records = sorted(w.read_trace(trace), key=lambda r: r.timestamp_ms)
    sizes = Counter(w.trace_session_keys(records))
    # The figures the docstrings of ConversationSpec and trace_session_keys quote.
    assert sum(r.input_length for r in records) / len(records) == pytest.approx(15_325, abs=1)
    assert (len(records), len(records) - len(sizes)) == (3993, 1455)  # requests, continuations
    assert max(sizes.values()) >= 10  # some long sessions


def test_session_keys_can_be_dropped() -> None:
    spec = w.MultiTurnSpec(sessions=3, turns=2, system_prompt_len=8, question_len=3, answer_len=3)
    sessions = w.multi_turn(spec, rate=10.0, duration_s=60.0, seed=0)
    bare = w.without_session_keys(sessions)
    assert [s.start_s for s in bare] == [s.start_s for s in sessions]
    for with_key, without in zip(w.all_prompts(sessions), w.all_prompts(bare)):
        assert without.session_key is None and "prompt_cache_key" not in without.payload()
        assert without.payload() == {k: v for k, v in with_key.payload().items() if k != "prompt_cache_key"}


def test_trace_blocks_depend_only_on_id_and_seed() -> None:
    assert w.trace_block(42, 0) == w.trace_block(42, 0)
    assert w.trace_block(42, 0) != w.trace_block(43, 0)
    assert w.trace_block(42, 0) != w.trace_block(42, 1)
    text = w.trace_text((5, 6), 600, 0)
    assert text.split()[:512] == list(w.trace_block(5, 0)) and len(text.split()) == 600


@pytest.mark.parametrize(
    "line,message",
    [
        ("not json", "not a Mooncake trace line"),
        (json.dumps({"timestamp": 0, "input_length": 10}), "not a Mooncake trace line"),
        (json.dumps({"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1]}), "does not fit"),
    ],
)
def test_bad_trace_lines_are_named(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=message) as e:
        w.read_trace(path)
    assert "bad.jsonl:1" in str(e.value)


def test_bound_counts_shared_full_blocks_and_never_the_last_token() -> None:
    a = list(range(1000, 1048))  # 3 blocks of 16
    b = a[:32] + list(range(2000, 2020))  # shares 2 blocks
    assert infinite_cache_hit_ratio([a, b], 16) == pytest.approx(32 / 100)
    bound = PrefixBound(16)
    bound.add(a)
    bound.add(a)  # identical prompt: the last block is recomputed, as the engine does
    assert bound.hit_tokens == 32 and bound.ratio == pytest.approx(32 / 96)


def test_ttft_floor_is_each_prompt_prefilled_alone_with_its_infinite_cache_hits() -> None:
    profile = get_profile("llama3-8b-h100")
    one_step = prefill_floor_s(100, profile, 1.0, 8192)
    assert one_step == pytest.approx(profile.step_overhead + 100 * profile.prefill_per_token)
    assert prefill_floor_s(100, profile, 2.0, 8192) == pytest.approx(one_step / 2)
    assert prefill_floor_s(20_000, profile, 1.0, 8192) == pytest.approx(  # three chunks, three steps
        3 * profile.step_overhead + 20_000 * profile.prefill_per_token
    )
    spec = w.SharedPrefixSpec(groups=1, system_prompt_len=2048, question_len=16, output_len=4)
    sessions = w.shared_prefix(spec, rate=10, duration_s=2, seed=0)
    bounds = bounds_of(sessions, FleetOptions(pods=1, time_scale=1.0))
    first = len(sessions[0].turns[0].token_ids())
    cold = prefill_floor_s(first, profile, 1.0, 8192)
    assert bounds.ttft_floor_s["p99"] < cold  # one cold prompt in many: it is above the 99th percentile
    assert bounds.ttft_floor_s["p50"] < cold / 10  # the rest prefill their questions only
    assert bounds.longest_tokens == first + 4 and 0.8 < bounds.hit_ratio < 1


def test_e2e_floor_adds_each_answer_decoded_alone() -> None:
    profile = get_profile("llama3-8b-h100")
    assert decode_floor_s(100, 1, profile, 1.0) == 0.0  # the first token comes from the prefill step
    step = profile.step_overhead + profile.decode_per_seq
    assert decode_floor_s(100, 3, profile, 1.0) == pytest.approx(2 * step + (101 + 102) * profile.context_per_token)
    assert decode_floor_s(100, 3, profile, 4.0) == pytest.approx(decode_floor_s(100, 3, profile, 1.0) / 4)
    spec = w.SharedPrefixSpec(groups=1, system_prompt_len=2048, question_len=16, output_len=64)
    sessions = w.shared_prefix(spec, rate=10, duration_s=2, seed=0)
    bounds = bounds_of(sessions, FleetOptions(pods=1, time_scale=1.0))
    prompt = len(sessions[1].turns[0].token_ids())
    for q in ("p50", "p90", "p99"):
        e2e, ttft = bounds.e2e_floor_s[q], bounds.ttft_floor_s[q]
        assert e2e is not None and ttft is not None
        assert e2e == pytest.approx(ttft + decode_floor_s(prompt, 64, profile, 1.0), rel=0.01)


def _lru_hits(prompts: list[tuple[list[int], int]], capacity: int) -> int:
    from collections import OrderedDict

    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for blocks, limit in prompts:
        for j, block in enumerate(blocks):
            if block in cache:
                hits += j < limit
                cache.move_to_end(block)
            else:
                cache[block] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits


def test_belady_keeps_what_is_needed_soonest_and_beats_lru() -> None:
    # Cyclic reuse of 3 one-block prompts in a 2-block cache: LRU always misses, the optimal
    # eviction keeps two of them and hits both in every later round.
    cyclic = [([b], 1) for b in [1, 2, 3] * 4]
    assert _lru_hits(cyclic, 2) == 0
    assert belady_hits(cyclic, 2) == 6
    assert belady_hits(cyclic, 3) == 9  # everything fits: every reuse hits
    assert belady_hits(cyclic, 0) == 0
    # A block that only comes back where it cannot count (a prompt's last block) is worth nothing.
    assert belady_hits([([1, 2], 1), ([1, 2], 1)], 1) == 1
    rng = random.Random(3)
    prompts = [([rng.randrange(40) for _ in range(rng.randint(1, 6))], rng.randint(0, 6)) for _ in range(400)]
    for capacity in (1, 5, 20, 40):
        assert _lru_hits(prompts, capacity) <= belady_hits(prompts, capacity)
    assert (
        belady_hits(prompts, 40)
        == sum(  # ample capacity: every countable reuse hits
            1
            for i, (blocks, limit) in enumerate(prompts)
            for j, b in enumerate(blocks)
            if j < limit and any(b in earlier for earlier, _ in prompts[:i])
        )
    )


def test_fleet_cache_bound_lies_between_an_lru_and_the_infinite_cache() -> None:
    spec = w.SharedPrefixSpec(groups=8, system_prompt_len=256, question_len=16, output_len=4)
    sessions = w.shared_prefix(spec, rate=50, duration_s=4, seed=1)
    bound = PrefixBound(16)
    for prompt in w.all_prompts(sessions):
        bound.add(prompt.token_ids())
    assert bound.fleet_ratio(10**6) == pytest.approx(bound.ratio)  # enough room: the infinite cache
    assert bound.fleet_ratio(40) < bound.ratio  # 8 prefixes of 16 blocks do not fit in 40
    assert _lru_hits(bound.accesses, 40) * 16 / bound.prompt_tokens <= bound.fleet_ratio(40)
