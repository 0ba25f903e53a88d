"""Benchmark workloads: deterministic request streams with open-loop arrival times.

Every workload is a list of `Session`s. A session's first turn arrives at `start_s`; each later
turn is sent when the previous one has finished plus a think time (multi-turn chat). Single-shot
workloads are sessions of one turn. The same spec and seed always give the same sessions, texts
and arrival times, so every system under test sees exactly the same load.

Texts are made of words from `VOCAB`, each exactly one token of the simulator's built-in word
tokenizer (`picker.prefix.builtin_tokenizer`), so a workload's token counts and block boundaries are exact.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from picker.prefix.builtin_tokenizer import encode, render_chat

TRACE_BLOCK_TOKENS = 512  # Mooncake traces hash prompts in blocks of 512 tokens


def _vocabulary(size: int) -> tuple[str, ...]:
    """`size` short lowercase words whose built-in token ids are all distinct."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    words: list[str] = []
    ids: set[int] = set()
    for length in (2, 3, 4):
        for chars in itertools.product(letters, repeat=length):
            word = "".join(chars)
            (token,) = encode(word)
            if token not in ids:
                ids.add(token)
                words.append(word)
                if len(words) == size:
                    return tuple(words)
    raise AssertionError("vocabulary too small")


VOCAB = _vocabulary(4096)


def words(rng: random.Random, n: int) -> str:
    """`n` random vocabulary words: exactly `n` built-in tokens."""
    return " ".join(rng.choices(VOCAB, k=n))


@dataclass(frozen=True, slots=True)
class Prompt:
    """One request's input: chat `messages`, or completion text built from trace blocks."""

    max_tokens: int
    messages: tuple[tuple[str, str], ...] = ()
    hash_ids: tuple[int, ...] = ()
    input_length: int = 0
    trace_seed: int = 0

    @property
    def api(self) -> str:
        """`chat` or `completions`: which OpenAI endpoint this prompt is sent to."""
        return "chat" if self.messages else "completions"

    def text(self) -> str:
        """The completion prompt (trace prompts): the hash-id blocks, the last one cut short."""
        return trace_text(self.hash_ids, self.input_length, self.trace_seed)

    def payload(self) -> dict[str, Any]:
        """The request-body fields carrying the input (`messages` or `prompt`)."""
        if self.messages:
            return {"messages": [{"role": role, "content": content} for role, content in self.messages]}
        return {"prompt": self.text()}

    def token_ids(self) -> list[int]:
        """The prompt tokens the simulator will see (its built-in tokenizer and chat template)."""
        if self.messages:
            return encode(render_chat([{"role": r, "content": c} for r, c in self.messages]))
        return encode(self.text())


@dataclass(frozen=True, slots=True)
class Session:
    """Turns sent one after another; `think_s[i]` is the pause before turn i+1."""

    start_s: float
    turns: tuple[Prompt, ...]
    think_s: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class SharedPrefixSpec:
    """Generated shared prefix (SGLang `generated-shared-prefix`, inference-perf `shared_prefix`)."""

    groups: int = 64
    prompts_per_group: int = 16
    system_prompt_len: int = 2048
    question_len: int = 128
    output_len: int = 256
    group_skew: float = 0.0  # Zipf exponent of group popularity; 0 = every group equally often


@dataclass(frozen=True, slots=True)
class MultiTurnSpec:
    """Chat sessions sharing one system prompt, each growing its own history turn by turn."""

    sessions: int | None = None  # at most this many sessions (None: all that arrive within the duration)
    turns: int = 5
    system_prompt_len: int = 1000
    question_len: int = 100
    answer_len: int = 100
    think_time_s: float = 2.0


@dataclass(frozen=True, slots=True)
class LongDocSpec:
    """Question answering over a few long documents: long shared prefixes, short questions."""

    documents: int = 16
    document_len: int = 8000
    question_len: int = 64
    output_len: int = 64


def poisson_arrivals(rng: random.Random, rate: float, duration_s: float) -> Iterator[float]:
    """Open-loop Poisson arrival times in [0, duration_s)."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    t = rng.expovariate(rate)
    while t < duration_s:
        yield t
        t += rng.expovariate(rate)


def shared_prefix(spec: SharedPrefixSpec, rate: float, duration_s: float, seed: int) -> list[Session]:
    """Requests `system prompt of a group + fresh question`: groups in shuffled rounds, or drawn
    by Zipf popularity when `group_skew` > 0 (a few hot groups that one pod alone cannot serve)."""
    rng = random.Random(seed)
    systems = [words(rng, spec.system_prompt_len) for _ in range(spec.groups)]
    if spec.group_skew > 0:
        weights = [1 / (rank + 1) ** spec.group_skew for rank in range(spec.groups)]
        groups: Iterator[int] = iter(lambda: rng.choices(range(spec.groups), weights)[0], None)
    else:
        groups = _shuffled_rounds(rng, spec.groups, spec.prompts_per_group)
    return [
        Session(
            t, (Prompt(spec.output_len, (("system", systems[next(groups)]), ("user", words(rng, spec.question_len)))),)
        )
        for t in poisson_arrivals(rng, rate, duration_s)
    ]


def _shuffled_rounds(rng: random.Random, groups: int, per_group: int) -> Iterator[int]:
    """Group of each request: every group `per_group` times in random order, round after round."""
    while True:
        order = [g for g in range(groups) for _ in range(per_group)]
        rng.shuffle(order)
        yield from order


def multi_turn(spec: MultiTurnSpec, rate: float, duration_s: float, seed: int) -> list[Session]:
    """Sessions arriving at `rate / turns` per second (so turns arrive at about `rate`).

    The assistant replies kept in the history are generated here, not taken from the server,
    so the workload stays deterministic whatever the server answers.
    """
    rng = random.Random(seed)
    system = words(rng, spec.system_prompt_len)
    sessions: list[Session] = []
    for t in poisson_arrivals(rng, rate / spec.turns, duration_s):
        history: list[tuple[str, str]] = [("system", system)]
        turns: list[Prompt] = []
        for _ in range(spec.turns):
            history.append(("user", words(rng, spec.question_len)))
            turns.append(Prompt(spec.answer_len, tuple(history)))
            history.append(("assistant", words(rng, spec.answer_len)))
        think = tuple(rng.expovariate(1 / spec.think_time_s) if spec.think_time_s > 0 else 0.0 for _ in turns[1:])
        sessions.append(Session(t, tuple(turns), think))
        if len(sessions) == spec.sessions:
            break
    return sessions


def long_doc(spec: LongDocSpec, rate: float, duration_s: float, seed: int) -> list[Session]:
    """Each request: one of the documents (uniformly) followed by a fresh question about it."""
    rng = random.Random(seed)
    docs = [words(rng, spec.document_len) for _ in range(spec.documents)]
    return [
        Session(t, (Prompt(spec.output_len, (("user", f"{rng.choice(docs)}\n{words(rng, spec.question_len)}"),)),))
        for t in poisson_arrivals(rng, rate, duration_s)
    ]


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One Mooncake-format trace line."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: Path) -> list[TraceRecord]:
    """Parse a Mooncake-format JSONL trace; ValueError naming the line on bad input."""
    records: list[TraceRecord] = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read trace {path}: {e.strerror}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            record = TraceRecord(
                float(row["timestamp"]),
                int(row["input_length"]),
                int(row["output_length"]),
                tuple(int(h) for h in row["hash_ids"]),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{number}: not a Mooncake trace line ({e})") from None
        blocks = len(record.hash_ids)
        if blocks == 0 or not (blocks - 1) * TRACE_BLOCK_TOKENS < record.input_length <= blocks * TRACE_BLOCK_TOKENS:
            raise ValueError(
                f"{path}:{number}: input_length {record.input_length} does not fit {blocks} blocks of "
                f"{TRACE_BLOCK_TOKENS} tokens"
            )
        records.append(record)
    if not records:
        raise ValueError(f"{path}: empty trace")
    return records


def trace_replay(records: Sequence[TraceRecord], speed: float, duration_s: float, seed: int) -> list[Session]:
    """The trace's requests at their own timestamps divided by `speed`, up to `duration_s`."""
    if speed <= 0:
        raise ValueError("speed must be positive")
    first = min(r.timestamp_ms for r in records)
    sessions = []
    for r in sorted(records, key=lambda r: r.timestamp_ms):
        start = (r.timestamp_ms - first) / 1000 / speed
        if start >= duration_s:
            break
        sessions.append(
            Session(
                start,
                (Prompt(max(1, r.output_length), hash_ids=r.hash_ids, input_length=r.input_length, trace_seed=seed),),
            )
        )
    return sessions


@lru_cache(maxsize=16384)
def trace_block(hash_id: int, seed: int) -> tuple[str, ...]:
    """The 512 words of trace block `hash_id`: equal ids always give equal blocks."""
    return tuple(random.Random(hash_id * 1_000_003 + seed).choices(VOCAB, k=TRACE_BLOCK_TOKENS))


def trace_text(hash_ids: Sequence[int], input_length: int, seed: int) -> str:
    """`input_length` words: the blocks of `hash_ids` in order, the last one cut to fit."""
    last = input_length - TRACE_BLOCK_TOKENS * (len(hash_ids) - 1)
    parts = [" ".join(trace_block(h, seed)) for h in hash_ids[:-1]]
    parts.append(" ".join(trace_block(hash_ids[-1], seed)[:last]))
    return " ".join(parts)


def all_prompts(sessions: Sequence[Session]) -> Iterator[Prompt]:
    """Every prompt of every session, each session's turns in order."""
    for session in sessions:
        yield from session.turns
