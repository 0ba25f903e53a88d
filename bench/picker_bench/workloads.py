"""Benchmark workloads: deterministic request streams with open-loop arrival times.

Every workload is a list of `Session`s. A session's first turn arrives at `start_s`; each later
turn is sent when the previous one has finished plus a think time (multi-turn chat). Single-shot
workloads are sessions of one turn. The same spec and seed always give the same sessions, texts
and arrival times, so every system under test sees exactly the same load.

Conversations carry a session key, sent as OpenAI's `prompt_cache_key` body field: the name a
client gives its conversation so the server (here, the router) can keep its turns together.
Multi-tenant requests carry their tenant (the `x-gateway-inference-fairness-id` header: the flow
that flow control keeps fair) and their InferenceObjective (`x-gateway-inference-objective`: the
priority).

Texts are made of words from `VOCAB`, each exactly one token of the simulator's built-in word
tokenizer (`picker.prefix.builtin_tokenizer`), so a workload's token counts and block boundaries are exact.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from picker.prefix.builtin_tokenizer import encode, render_chat
from picker.request.openai import FAIRNESS_ID_HEADER, OBJECTIVE_HEADER
from picker_sim.engine import answer_text

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
    """One request's input: chat `messages`, or completion text built from trace blocks; and the
    key of the conversation it belongs to (None: a request that names no conversation)."""

    max_tokens: int
    messages: tuple[tuple[str, str], ...] = ()
    hash_ids: tuple[int, ...] = ()
    input_length: int = 0
    trace_seed: int = 0
    session_key: str | None = None
    tenant: str | None = None  # the fairness id
    objective: str | None = None  # the InferenceObjective naming the priority

    @property
    def api(self) -> str:
        """`chat` or `completions`: which OpenAI endpoint this prompt is sent to."""
        return "chat" if self.messages else "completions"

    def text(self) -> str:
        """The completion prompt (trace prompts): the hash-id blocks, the last one cut short."""
        return trace_text(self.hash_ids, self.input_length, self.trace_seed)

    def payload(self) -> dict[str, Any]:
        """The request-body fields carrying the input (`messages` or `prompt`) and the session key
        (`prompt_cache_key`, when there is one)."""
        fields: dict[str, Any] = (
            {"messages": [{"role": role, "content": content} for role, content in self.messages]}
            if self.messages
            else {"prompt": self.text()}
        )
        if self.session_key is not None:
            fields["prompt_cache_key"] = self.session_key
        return fields

    def headers(self) -> dict[str, str]:
        """The request headers naming its tenant and objective, when it has them."""
        headers = {}
        if self.tenant is not None:
            headers[FAIRNESS_ID_HEADER] = self.tenant
        if self.objective is not None:
            headers[OBJECTIVE_HEADER] = self.objective
        return headers

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


# A drawn message never exceeds this: a lognormal's far tail would otherwise fill a pod's whole cache.
MAX_DRAWN_TOKENS = 16384


@dataclass(frozen=True, slots=True)
class ConversationSpec:
    """Chat traffic shaped like production's: conversations with a few applications, each growing
    turn by turn, mixed with one-off requests. Lengths are tokens. Defaults are published figures
    (sources below) except where marked *scaled*: shrunk so a 60 s run on a 2-core machine works.

    Conversations and one-off requests arrive together as one Poisson process. Every request
    starts with the system prompt of one application; a conversation's turn i sends that system
    prompt, every earlier user message and answer, and user message i, so its prompt grows turn
    by turn, and carries the conversation's session key. One-offs carry none.

    - `applications` (8) system prompts of `system_prompt_len` (2,048) tokens, drawn with Zipf
      popularity `application_skew` (1.0: the most popular gets 37% of arrivals, the least 5%).
      Alibaba's production traces (Wang et al., "KVCache Cache in the Wild", arXiv 2506.02634,
      USENIX ATC 2025) find KV reuse skewed (10% of blocks get 77% of reuses) and, in API traffic,
      97% of hits on shared system prompts; their count and length here are our choice.
    - `turns_exponent` (2.0) and `max_turns` (32): P(k turns) is proportional to k^-2 for k = 1..32,
      so the mean is 2.5, 62% of conversations are single-turn, 12% have 5 turns or more and 4.6%
      have 10 or more. LMSYS-Chat-1M (1M Chatbot Arena and Vicuna-demo conversations, Zheng et al.,
      ICLR 2024; its dataset card) averages 2.0 turns; ShareGPT (94,145 conversations users chose
      to share from ChatGPT) averages 3.51 (ShareChat, Yan et al., arXiv 2512.17843, Table 1), 73%
      of them multi-turn (CachedAttention, Gao et al., USENIX ATC 2024). The mean here lies between
      the two, and the tail gives a few long conversations.
    - `user_len` (70, spread `user_sigma` 1.0) and `answer_len` (215, spread `answer_sigma` 0.7):
      the mean tokens of a user message and of an answer, each lognormal with that sigma.
      LMSYS-Chat-1M: 69.5 tokens per prompt, 214.5 per response. The spreads are ours: user
      messages are mostly a sentence, with a long tail of pasted code; answers vary less. An
      answer's length is its request's `max_tokens`, and the same number of words joins the history.
    - `think_time_s` (45 s mean, spread `think_sigma` 1.2: median 22 s, 90% under 100 s, 99.7%
      under 10 minutes): the pause between an answer and the next user message, lognormal. Reading
      a 215-token answer (about 160 words) takes ~40 s at 250 words a minute, and the next question
      has to be typed. Alibaba's consumer chatbot trace: 80% of KV reuses, mostly within one user's
      conversation, come within 10 minutes. *Scaled* by `think_scale` (0.1): 45 s become 4.5 s.
    - `one_off_share` (0.15) of arrivals are one-off requests: a single turn, never continued, whose
      user message (a pasted document and a question) is `one_off_len` tokens (6,000 mean, spread
      `one_off_sigma` 0.8: median 4,400). Mooncake's traces of Kimi (Qin et al., FAST 2025) are
      long-input: the vendored synthetic trace averages 15,325 input tokens (data/README.md).
      Alibaba finds single-turn requests as important for reuse as multi-turn ones. The share is
      our choice, the length *scaled* so a pod's cache (32k tokens in the bench) holds several.

    A drawn length is at least 1 and at most `MAX_DRAWN_TOKENS`. A conversation keeps only the
    turns its clock (arrival plus the think times before them) reaches within the run's duration,
    so every conversation can end within the bench's drain time; the turn law above is the one
    before that cut. The answers kept in the history are the simulator's own answers to the
    turns (`picker_sim.engine.answer_text`: a function of the prompt, so the workload stays
    deterministic), resent as a chat client does: the engine finds the blocks it generated for
    an answer cached when the next turn arrives, as vLLM does.
    """

    applications: int = 8
    application_skew: float = 1.0
    system_prompt_len: int = 2048
    turns_exponent: float = 2.0
    max_turns: int = 32
    user_len: int = 70
    user_sigma: float = 1.0
    answer_len: int = 215
    answer_sigma: float = 0.7
    think_time_s: float = 45.0
    think_sigma: float = 1.2
    think_scale: float = 0.1
    one_off_share: float = 0.15
    one_off_len: int = 6000
    one_off_sigma: float = 0.8

    def __post_init__(self) -> None:
        if not 0 <= self.one_off_share <= 1:
            raise ValueError("one_off_share must be between 0 and 1")

    def turn_weights(self) -> list[float]:
        """The relative probability of 1, 2, ..., `max_turns` turns in a conversation."""
        return [k**-self.turns_exponent for k in range(1, self.max_turns + 1)]

    def mean_turns(self) -> float:
        """The expected turns of a conversation (before the run's end cuts any)."""
        weights = self.turn_weights()
        return sum(k * w for k, w in enumerate(weights, 1)) / sum(weights)

    def requests_per_arrival(self) -> float:
        """The expected requests of one arrival, one-offs and conversations mixed."""
        return self.one_off_share + (1 - self.one_off_share) * self.mean_turns()


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

    The assistant replies kept in the history are the simulator's own answers to the turns
    (`picker_sim.engine.answer_text`: a function of the prompt), as a chat client resends them:
    deterministic, and the engine finds the blocks it generated cached on the next turn.
    """
    rng = random.Random(seed)
    system = words(rng, spec.system_prompt_len)
    sessions: list[Session] = []
    for t in poisson_arrivals(rng, rate / spec.turns, duration_s):
        key = f"session-{len(sessions)}"
        history: list[tuple[str, str]] = [("system", system)]
        turns: list[Prompt] = []
        for _ in range(spec.turns):
            history.append(("user", words(rng, spec.question_len)))
            turn = Prompt(spec.answer_len, tuple(history), session_key=key)
            turns.append(turn)
            history.append(("assistant", answer_text(turn.token_ids(), spec.answer_len)))
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
class PdMixSpec:
    """Short chat mixed with long prompts that want long answers: the traffic prefill/decode (P/D)
    disaggregation is for. Lengths are tokens.

    - `long_share` (0.25) of the requests are long: a fresh document of `document_len` (6,000)
      tokens and a question of `question_len` (64), answered in `long_output_len` (256) tokens (a
      report or a summary). No two documents share a prefix, so no cache hit can skip their
      prefill: a router can only choose where it runs.
    - The rest are chat: one of `applications` (4) shared system prompts of `system_prompt_len`
      (512) tokens and a fresh question of `question_len`, answered in `output_len` (128) tokens.

    Why these: on `llama3-8b-h100` a 6,000-token prompt is one engine step of about 0.49 s (it fits
    the 8,192-token batch budget), and every request decoding on that pod waits that step for its
    next token. A 128-token chat answer decodes in about 0.9 s, so one such stall adds half to its
    time per output token (TPOT), and a 256-token answer (about 1.8 s) may see several. At the
    default 10 requests/s, 2.5 long prompts arrive a second: about 1.2 s of prefill a second. On 4
    aggregated pods each is stalled ~30% of the time whatever the router does (at 6 requests/s
    picker's interference cost still finds a quiet pod for most documents, and P/D has little to
    remove); on `--pd 2:2` each prefill pod is busy ~60%, and the decode pods compute only the chat
    prompts' uncached ~60 tokens. The chat prompts are short enough for a P/D threshold to keep
    them decode-only.
    """

    long_share: float = 0.25
    document_len: int = 6000
    long_output_len: int = 256
    applications: int = 4
    system_prompt_len: int = 512
    question_len: int = 64
    output_len: int = 128

    def __post_init__(self) -> None:
        if not 0 <= self.long_share <= 1:
            raise ValueError("long_share must be between 0 and 1")


def pd_mix(spec: PdMixSpec, rate: float, duration_s: float, seed: int) -> list[Session]:
    """Chat and long-document requests (`PdMixSpec`) arriving together at `rate`, Poisson."""
    rng = random.Random(seed)
    systems = [words(rng, spec.system_prompt_len) for _ in range(spec.applications)]
    sessions = []
    for t in poisson_arrivals(rng, rate, duration_s):
        question = words(rng, spec.question_len)
        if rng.random() < spec.long_share:
            prompt = Prompt(spec.long_output_len, (("user", f"{words(rng, spec.document_len)}\n{question}"),))
        else:
            prompt = Prompt(spec.output_len, (("system", rng.choice(systems)), ("user", question)))
        sessions.append(Session(t, (prompt,)))
    return sessions


def lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    """A lognormal draw of mean `mean` (0 when `mean` is 0) and log-spread `sigma`."""
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma) if mean > 0 else 0.0


def lognormal_tokens(rng: random.Random, mean: float, sigma: float) -> int:
    """A lognormal length (`lognormal`) within [1, MAX_DRAWN_TOKENS]."""
    return max(1, min(MAX_DRAWN_TOKENS, round(lognormal(rng, mean, sigma))))


def conversation(spec: ConversationSpec, rate: float, duration_s: float, seed: int) -> list[Session]:
    """Conversations and one-off requests (`ConversationSpec`), arriving at `rate` divided by the
    expected requests of an arrival: `rate` requests/s once conversations have unfolded. The run's
    end cuts later turns, so a run sends fewer: about 80% of `rate` × `duration_s` over 60 s."""
    rng = random.Random(seed)
    systems = [words(rng, spec.system_prompt_len) for _ in range(spec.applications)]
    app_weights = [1 / (rank + 1) ** spec.application_skew for rank in range(spec.applications)]
    turn_counts = range(1, spec.max_turns + 1)
    turn_cumulative = list(itertools.accumulate(spec.turn_weights()))
    sessions: list[Session] = []
    for t in poisson_arrivals(rng, rate / spec.requests_per_arrival(), duration_s):
        system = ("system", systems[rng.choices(range(spec.applications), app_weights)[0]])
        if rng.random() < spec.one_off_share:
            document = words(rng, lognormal_tokens(rng, spec.one_off_len, spec.one_off_sigma))
            answer = lognormal_tokens(rng, spec.answer_len, spec.answer_sigma)
            sessions.append(Session(t, (Prompt(answer, (system, ("user", document))),)))
            continue
        turns = rng.choices(turn_counts, cum_weights=turn_cumulative)[0]
        think = [spec.think_scale * lognormal(rng, spec.think_time_s, spec.think_sigma) for _ in range(turns - 1)]
        clock = itertools.accumulate(think, initial=t)
        kept = sum(1 for at in clock if at < duration_s)
        key = f"conversation-{len(sessions)}"
        history = [system]
        prompts: list[Prompt] = []
        for _ in range(kept):
            history.append(("user", words(rng, lognormal_tokens(rng, spec.user_len, spec.user_sigma))))
            answer = lognormal_tokens(rng, spec.answer_len, spec.answer_sigma)
            prompt = Prompt(answer, tuple(history), session_key=key)
            prompts.append(prompt)
            history.append(("assistant", answer_text(prompt.token_ids(), answer)))
        sessions.append(Session(t, tuple(prompts), tuple(think[: kept - 1])))
    return sessions


# The InferenceObjectives of the multi-tenant workload: name -> priority.
TENANT_OBJECTIVES = {"critical": 10, "standard": 0}
NOISY_TENANT = "noisy"


@dataclass(frozen=True, slots=True)
class MultiTenantSpec:
    """Tenants sharing one pool, one of them bursting far beyond its capacity.

    Each tenant has its own fairness id and its own `prefixes` system prompts of
    `system_prompt_len` tokens, each request one of them (uniformly) plus a fresh question. The
    steady tenants send `rate` requests/s together, evenly, from start to end: `tenant-0` with the
    `critical` objective (priority 10) when `critical` is set, the others (the *quiet* tenants)
    `standard` (priority 0). The noisy tenant, also `standard` (the same priority band as the quiet
    ones, so only a fairness policy can protect them), sends a steady tenant's share outside its
    burst and `burst_rate` requests/s during it: from `burst_start` to `burst_end`, fractions of the
    run's duration.
    """

    tenants: int = 3
    critical: bool = True
    prefixes: int = 2
    system_prompt_len: int = 1024
    question_len: int = 64
    output_len: int = 64
    burst_rate: float = 12.0
    burst_start: float = 0.2
    burst_end: float = 0.8

    def __post_init__(self) -> None:
        if not 0 <= self.burst_start < self.burst_end <= 1:
            raise ValueError("the burst must satisfy 0 <= burst_start < burst_end <= 1")


def multi_tenant(spec: MultiTenantSpec, rate: float, duration_s: float, seed: int) -> list[Session]:
    """The steady tenants' and the noisy tenant's requests (`MultiTenantSpec`), by arrival time."""
    rng = random.Random(seed)
    share = rate / spec.tenants
    names = [f"tenant-{i}" for i in range(spec.tenants)] + [NOISY_TENANT]
    systems = {name: [words(rng, spec.system_prompt_len) for _ in range(spec.prefixes)] for name in names}
    arrivals: list[tuple[float, str]] = []
    for name in names[:-1]:
        arrivals += [(t, name) for t in poisson_arrivals(rng, share, duration_s)]
    start, end = spec.burst_start * duration_s, spec.burst_end * duration_s
    arrivals += [(t, NOISY_TENANT) for t in poisson_arrivals(rng, share, duration_s) if not start <= t < end]
    arrivals += [(start + t, NOISY_TENANT) for t in poisson_arrivals(rng, spec.burst_rate, end - start)]
    sessions = []
    for t, name in sorted(arrivals):
        objective = "critical" if spec.critical and name == "tenant-0" else "standard"
        messages = (("system", rng.choice(systems[name])), ("user", words(rng, spec.question_len)))
        sessions.append(Session(t, (Prompt(spec.output_len, messages, tenant=name, objective=objective),)))
    return sessions


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
    """The trace's requests at their own timestamps divided by `speed`, up to `duration_s`, each
    with the session key `trace_session_keys` finds for it."""
    if speed <= 0:
        raise ValueError("speed must be positive")
    first = min(r.timestamp_ms for r in records)
    ordered = sorted(records, key=lambda r: r.timestamp_ms)
    sessions = []
    for r, key in zip(ordered, trace_session_keys(ordered)):
        start = (r.timestamp_ms - first) / 1000 / speed
        if start >= duration_s:
            break
        prompt = Prompt(
            max(1, r.output_length), hash_ids=r.hash_ids, input_length=r.input_length, trace_seed=seed, session_key=key
        )
        sessions.append(Session(start, (prompt,)))
    return sessions


def trace_session_keys(records: Sequence[TraceRecord]) -> Iterator[str]:
    """The session of each record, in the given (time) order, as a trace's structure reveals it.

    A record continues the session of an earlier record whose full blocks all begin its own
    hash ids: the latest such record with the most blocks. Otherwise it starts a new session.
    Only full blocks are compared because a partial last block's id names just that part: the
    next turn fills the block, and the filled block has a new id (in the vendored Mooncake trace,
    comparing every id finds 213 continuations among 3,993 requests, comparing full blocks 1,455).
    A record without a full block can be continued by none.
    """
    # A trie over hash-id paths: node -> the session of the latest record whose full blocks end there.
    children: dict[tuple[int, int], int] = {}
    session_at: dict[int, int] = {}
    started = 0
    for r in records:
        node = 0
        session = None
        for h in r.hash_ids:
            child = children.get((node, h))
            if child is None:
                break
            node = child
            session = session_at.get(node, session)
        if session is None:
            session = started
            started += 1
        yield f"trace-session-{session}"
        node = 0
        full = r.input_length // TRACE_BLOCK_TOKENS
        for h in r.hash_ids[:full]:
            node = children.setdefault((node, h), len(children) + 1)
        if full:
            session_at[node] = session


def without_session_keys(sessions: Sequence[Session]) -> list[Session]:
    """The same sessions with no session key on any prompt (`picker bench --no-session-keys`)."""
    return [replace(s, turns=tuple(replace(p, session_key=None) for p in s.turns)) for s in sessions]


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
