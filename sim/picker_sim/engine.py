"""One simulated vLLM engine: continuous batching over a paged, prefix-cached KV cache.

A single asyncio task runs engine steps back to back while there is work. Each step schedules
running requests first (one decode token each, or the next prefill chunk), then admits waiting
requests while seats (`max_num_seqs`), the per-step token budget (`max_num_batched_tokens`,
i.e. chunked prefill) and KV blocks allow. A running request that needs a block when none is
free preempts the most recently admitted request (recomputed later, as vLLM does). The step
then sleeps for the profile's step time divided by `time_scale`, and applies its results:
computed tokens, newly full blocks cached, one new token per request that finished its prefill
or decoded. HTTP handlers wait on a per-request future woken once per step (or, for an
established stream, receive each token through the request's `on_token` callback).

KV transfer (prefill/decode disaggregation, as vLLM's NixlConnector does it): a request
submitted as a KV producer (`do_remote_decode`) keeps its full blocks referenced when it
finishes ("pinned", under consecutive block ids) until a consumer takes them (`take_pinned`)
or `kv_transfer_timeout` passes (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT). A consumer request
(`do_remote_prefill`) is submitted with the block hashes the remote engine handed over: at
admission it takes its local prefix hits, allocates blocks for the remote full blocks that
continue them, and waits outside the batch (vLLM's WAITING_FOR_REMOTE_KVS) for the profile's
transfer time; the received blocks then join its cache (BlockStored events) and it computes
only the rest of the prompt. No remote blocks (expired, unknown) means a local prefill.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from picker.kvevents.vllm_hash import DEFAULT_SEED
from picker.prefix.builtin_tokenizer import encode
from picker_sim.kvcache import ROOT_HASH, EngineHasher, KVCache, KVEvent, block_hashes
from picker_sim.profiles import Profile
from picker_sim.stats import EngineStats

# What the simulated model "says": a fixed word cycle; each word is one built-in token.
OUTPUT_WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "simulated",
    "engines",
    "stream",
    "tokens",
    "to",
    "every",
    "client",
    "that",
    "asks",
    "politely",
    "and",
    "routers",
    "learn",
    "where",
    "each",
    "prefix",
    "lives",
    "in",
    "the",
    "cache",
]
OUTPUT_IDS = [encode(w)[0] for w in OUTPUT_WORDS]


def answer_offset(prompt_ids: Sequence[int]) -> int:
    """Where in OUTPUT_WORDS the answer to a prompt starts: a function of the prompt alone, so a
    prompt gets the same answer on every pod and in every run, and a benchmark can put that
    answer into the conversation's next turn, as chat clients do (the engine then finds the
    answer's blocks cached, as vLLM does for generated tokens)."""
    return hash(tuple(prompt_ids[-16:])) % len(OUTPUT_WORDS)


def answer_text(prompt_ids: Sequence[int], max_tokens: int) -> str:
    """The text the simulator answers `prompt_ids` with when it generates `max_tokens` tokens."""
    offset = answer_offset(prompt_ids)
    return " ".join(OUTPUT_WORDS[(offset + i) % len(OUTPUT_WORDS)] for i in range(max_tokens))


def answer_ids(prompt_ids: Sequence[int], max_tokens: int) -> list[int]:
    """The token ids of `answer_text`: what the engine appends to the prompt, and caches."""
    offset = answer_offset(prompt_ids)
    return [OUTPUT_IDS[(offset + i) % len(OUTPUT_IDS)] for i in range(max_tokens)]


_BACK_TO_BACK = 0.002  # a step that starts this soon after the last one continues its clock


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Sizes and timing of one engine."""

    profile: Profile
    num_gpu_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_loras: int = 0
    max_model_len: int = 32768
    time_scale: float = 1.0
    kv_transfer_timeout: float = 480.0  # seconds pinned blocks wait for their consumer
    block_hash: str = "sha256_cbor"  # vLLM's --prefix-caching-hash-algo, or "builtin"
    hash_seed: str = DEFAULT_SEED  # vLLM's PYTHONHASHSEED


@dataclass(frozen=True, slots=True)
class PinnedBlocks:
    """A finished KV producer's blocks, held for a consumer engine to take."""

    block_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]
    expiry: asyncio.TimerHandle = field(compare=False)


class EngineError(Exception):
    """A request the engine can never run (empty, or larger than the context or the cache)."""


class Request:
    """One generation request moving through the engine."""

    __slots__ = (
        "arrival",
        "cache_salt",
        "finish_reason",
        "finished_at",
        "first_token_at",
        "hashes",
        "held",
        "id",
        "keys",
        "kv_producer",
        "last_token_at",
        "lora",
        "max_tokens",
        "num_cached",
        "num_computed",
        "num_external",
        "num_output",
        "on_token",
        "pinned_block_ids",
        "private",
        "prompt_len",
        "remote_hashes",
        "scheduled_at",
        "stream",
        "tokens",
        "waiter",
        "word_offset",
    )

    def __init__(
        self,
        rid: int,
        prompt_ids: list[int],
        max_tokens: int,
        lora: str | None,
        cache_salt: str | None,
        hasher: EngineHasher,
        block_size: int,
        stream: bool,
        arrival: float,
    ) -> None:
        self.id = rid
        self.stream = stream  # woken once per step with new output, else only when finished
        self.tokens = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.max_tokens = max_tokens
        self.lora = lora
        self.cache_salt = cache_salt
        self.keys = block_hashes(prompt_ids, block_size, lora_name=lora, cache_salt=cache_salt)
        self.hashes = hasher(self.keys, prompt_ids, block_size, lora, cache_salt)  # as the engine reports them
        self.held: list[int] = []  # cached block hashes this request references, in order
        self.private = 0  # blocks allocated but not (yet) cached
        self.num_computed = 0
        self.num_cached = -1  # prompt tokens served from the prefix cache; -1 until admitted
        self.num_output = 0
        self.arrival = arrival
        self.scheduled_at = 0.0
        self.first_token_at = 0.0
        self.last_token_at = 0.0
        self.finished_at = 0.0
        self.finish_reason: str | None = None
        self.waiter: asyncio.Future[None] | None = None
        # Called by the step loop for each new token instead of waking the handler: lets a
        # streaming response write its chunk without a task switch per token.
        self.on_token: Callable[[Request], None] | None = None
        self.word_offset = answer_offset(prompt_ids)
        self.kv_producer = False  # do_remote_decode: pin the blocks for a consumer when finished
        self.pinned_block_ids: tuple[int, ...] = ()  # what a producer's blocks are pinned as
        # do_remote_prefill: the block hashes a remote engine holds for this prompt, taken
        # when the request is first admitted; None for a request without a remote prefill.
        self.remote_hashes: list[int] | None = None
        self.num_external = 0  # prompt tokens received from the remote engine

    def output_word(self, index: int) -> str:
        """The text of output token `index`."""
        return OUTPUT_WORDS[(self.word_offset + index) % len(OUTPUT_WORDS)]

    def output_text(self) -> str:
        """All output so far, words separated by spaces."""
        return " ".join(self.output_word(i) for i in range(self.num_output))

    async def wait(self) -> None:
        """Wait until the engine produced more output or finished this request."""
        if self.finish_reason is not None:
            return
        self.waiter = asyncio.get_running_loop().create_future()
        await self.waiter


class Engine:
    """The scheduler and step loop of one simulated engine."""

    def __init__(
        self,
        config: EngineConfig,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        """`clock` and `sleep`: the time steps take (a test passes virtual ones to run without waiting)."""
        self.config = config
        self._clock = clock
        self._sleep = sleep
        self.cache = KVCache(config.num_gpu_blocks, config.block_size)
        self.hasher = EngineHasher(config.block_hash, config.hash_seed)
        self.stats = EngineStats()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loaded_loras: dict[str, None] = {}  # insertion order = least recently used first
        self._lora_load_cost = 0.0
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.on_events: Callable[[list[KVEvent]], None] | None = None  # the pod's publisher
        self.receiving: set[Request] = set()  # waiting for their remote KV blocks
        self.pinned: dict[int, PinnedBlocks] = {}  # by first block id
        self._next_block_id = 0

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.abort_all()

    def abort_all(self) -> None:
        """Finish every request with reason `abort` (crash)."""
        for req in list(self.running) + list(self.waiting) + list(self.receiving):
            self._finish(req, "abort", self._clock(), record=False)
        self.running.clear()
        self.waiting.clear()
        self.receiving.clear()

    def reset_cache(self) -> None:
        """Crash/restart: abort everything, clear the cache (AllBlocksCleared) and LoRAs."""
        self.abort_all()
        for pinned in self.pinned.values():
            pinned.expiry.cancel()
        self.pinned.clear()
        self.cache.clear()
        self.loaded_loras.clear()
        self._flush_events()

    # -- requests -------------------------------------------------------------------------------
    def submit(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        lora: str | None = None,
        cache_salt: str | None = None,
        stream: bool = False,
        kv_producer: bool = False,
        remote_hashes: list[int] | None = None,
    ) -> Request:
        """Queue a request; EngineError if it can never fit. `kv_producer`: pin its blocks for a
        consumer when it finishes; `remote_hashes`: the blocks a remote prefill holds for it."""
        cfg = self.config
        if not prompt_ids:
            raise EngineError("prompt must not be empty")
        if max_tokens < 1:
            raise EngineError("max_tokens must be at least 1")
        if len(prompt_ids) + max_tokens > cfg.max_model_len:
            raise EngineError(
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, you requested "
                f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the messages, "
                f"{max_tokens} in the completion)."
            )
        if -(-(len(prompt_ids) + max_tokens) // cfg.block_size) > cfg.num_gpu_blocks:
            raise EngineError("request needs more KV blocks than the engine has")
        req = Request(
            next(self._ids),
            prompt_ids,
            max_tokens,
            lora,
            cache_salt,
            self.hasher,
            cfg.block_size,
            stream,
            self._clock(),
        )
        req.kv_producer = kv_producer
        req.remote_hashes = remote_hashes
        self.waiting.append(req)
        self._wake.set()
        return req

    def abort(self, req: Request) -> None:
        """The client went away: free the request's seat and blocks."""
        if req.finish_reason is not None:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.receiving.discard(req)
        self._finish(req, "abort", self._clock(), record=False)

    def take_pinned(self, block_ids: Sequence[int]) -> list[int] | None:
        """A consumer takes a producer's pinned blocks: their hashes, now unpinned (they stay
        cached here like any finished request's); None if `block_ids` name no pinned blocks
        (expired, taken already, or never pinned)."""
        pinned = self.pinned.get(block_ids[0]) if block_ids else None
        if pinned is None or pinned.block_ids != tuple(block_ids):
            return None
        del self.pinned[block_ids[0]]
        pinned.expiry.cancel()
        self.cache.release(pinned.block_hashes, 0)
        return list(pinned.block_hashes)

    def _pin(self, req: Request) -> None:
        first = self._next_block_id
        ids = tuple(range(first, first + len(req.held)))
        self._next_block_id += len(ids)
        delay = self.config.kv_transfer_timeout / self.config.time_scale
        expiry = asyncio.get_running_loop().call_later(delay, self._expire, first)
        self.pinned[first] = PinnedBlocks(ids, tuple(req.held), expiry)
        req.pinned_block_ids = ids

    def _expire(self, first_block_id: int) -> None:
        pinned = self.pinned.pop(first_block_id, None)
        if pinned is not None:
            self.cache.release(pinned.block_hashes, 0)
            self.stats.kv_expired_reqs += 1

    def _remote_blocks(self, req: Request, hits: int) -> int:
        """How many of the remote engine's blocks continue `req`'s local prefix hit of `hits`
        blocks: full prompt blocks only, as NIXL transfers (the last partial one is computed)."""
        remote = req.remote_hashes or []
        end = min(req.prompt_len // self.config.block_size, len(remote))
        n = 0
        while hits + n < end and remote[hits + n] == req.hashes[hits + n]:
            n += 1
        return n

    def _unadmit(self, req: Request) -> None:
        """Undo an admission that found no room: drop the prefix hits the request took."""
        self.cache.release(req.held, 0)
        req.held = []
        req.num_computed = 0

    def _first_admission(self, req: Request, now: float) -> None:
        """Count a request's prefix lookups and queueing once, when it is first admitted."""
        stats = self.stats
        req.scheduled_at = now
        stats.prefix_queries += req.prompt_len
        stats.prefix_hits += req.num_computed
        stats.queue_time.observe(now - req.arrival)
        if req.remote_hashes is not None:
            stats.external_queries += req.prompt_len
        req.remote_hashes = None

    def _start_receive(self, req: Request, hits: int, blocks: int) -> None:
        self.waiting.popleft()
        self.receiving.add(req)
        req.private += blocks
        seconds = self.config.profile.transfer_time(blocks * self.config.block_size)
        asyncio.get_running_loop().call_later(
            seconds / self.config.time_scale, self._received, req, hits, blocks, seconds
        )

    def _received(self, req: Request, hits: int, blocks: int, seconds: float) -> None:
        """The remote blocks arrived: cache them and put the request back at the queue's head."""
        if req not in self.receiving:
            return  # aborted meanwhile; its blocks went with it
        self.receiving.discard(req)
        bs = self.config.block_size
        end = hits + blocks
        new = req.hashes[hits:end]
        self.cache.commit(new, req.hashes[hits - 1] if hits else None, req.tokens[hits * bs : end * bs], req.lora)
        req.private -= blocks
        req.held = req.hashes[:end]
        req.num_external = blocks * bs
        req.num_computed = min(end * bs, req.prompt_len - 1)  # the last token is always computed
        stats = self.stats
        stats.external_hits += req.num_external
        stats.kv_transfer_time.observe(seconds)
        stats.kv_bytes_transferred.observe(req.num_external * self.config.profile.kv_bytes_per_token)
        self.waiting.appendleft(req)
        self._wake.set()
        self._flush_events()

    # -- the step loop --------------------------------------------------------------------------
    async def _run(self) -> None:
        scale = self.config.time_scale
        profile = self.config.profile
        clock = self._clock
        step_end = 0.0
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
            scheduled, prefill_tokens, decode_seqs, context = self._schedule()
            if not scheduled:
                self._flush_events()
                self._wake.clear()
                await self._wake.wait()
                continue
            step = profile.step_time(prefill_tokens, decode_seqs, context) + self._lora_load_cost
            self._lora_load_cost = 0.0
            # Back-to-back steps chain on the previous step's end, so timer granularity (1 ms
            # under uvloop) shifts single steps but never accumulates into the rate.
            now = clock()
            start = step_end if now - step_end < _BACK_TO_BACK else now
            step_end = start + step / scale
            delay = step_end - clock()
            if delay > 0:
                await self._sleep(delay)
            self._apply(scheduled)
            self._flush_events()

    def _flush_events(self) -> None:
        if self.cache.events:
            events = self.cache.drain_events()
            if self.on_events is not None:
                self.on_events(events)

    def _ensure_blocks(self, req: Request, upto_tokens: int) -> bool:
        need = -(-upto_tokens // self.config.block_size) - len(req.held) - req.private
        if need <= 0:
            return True
        if not self.cache.allocate(need):
            return False
        req.private += need
        return True

    def _preempt(self, req: Request) -> None:
        self.cache.release(req.held, req.private)
        req.held = []
        req.private = 0
        req.num_computed = 0
        self.waiting.appendleft(req)
        self.stats.num_preemptions += 1

    def _lora_ready(self, name: str) -> bool:
        loaded = self.loaded_loras
        if name in loaded:
            del loaded[name]
            loaded[name] = None
            return True
        if len(loaded) >= self.config.max_loras:
            busy = {r.lora for r in self.running}
            idle = next((n for n in loaded if n not in busy), None)
            if idle is None:
                return False
            del loaded[idle]
        loaded[name] = None
        self._lora_load_cost += self.config.profile.lora_load
        return True

    def _schedule(self) -> tuple[list[tuple[Request, int]], int, int, int]:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        prefill_tokens = decode_seqs = context = 0
        running = self.running
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            need = min(len(req.tokens) - req.num_computed, budget)
            if not self._ensure_blocks(req, req.num_computed + need):
                preempted = True
                victim = None
                while victim is not req:
                    victim = running.pop()
                    self._preempt(victim)
                    if victim is not req and self._ensure_blocks(req, req.num_computed + need):
                        break
                if victim is req:
                    continue
            scheduled.append((req, need))
            budget -= need
            context += req.num_computed
            if req.num_computed >= req.prompt_len:
                decode_seqs += 1
            else:
                prefill_tokens += need
            i += 1
        now = self._clock()
        while self.waiting and not preempted and len(running) < cfg.max_num_seqs and budget > 0:
            req = self.waiting[0]
            if req.lora is not None and not self._lora_ready(req.lora):
                break
            received = bool(req.held)  # back from a KV transfer, holding its blocks
            if not received:
                hits = self.cache.cached_prefix(req.hashes[: (len(req.tokens) - 1) // cfg.block_size])
                self.cache.acquire(req.hashes[:hits])
                req.held = req.hashes[:hits]
                req.num_computed = hits * cfg.block_size
                remote = self._remote_blocks(req, hits) if req.remote_hashes else 0
                if remote:
                    if not self.cache.allocate(remote):
                        self._unadmit(req)
                        break
                    self._first_admission(req, now)
                    self._start_receive(req, hits, remote)
                    continue
            need = min(len(req.tokens) - req.num_computed, budget)
            if not self._ensure_blocks(req, req.num_computed + need):
                if not received:
                    self._unadmit(req)
                break
            self.waiting.popleft()
            running.append(req)
            if req.num_cached < 0:
                if not received:
                    self._first_admission(req, now)
                req.num_cached = req.num_computed
            scheduled.append((req, need))
            budget -= need
            context += req.num_computed
            prefill_tokens += need
        return scheduled, prefill_tokens, decode_seqs, context

    def _apply(self, scheduled: list[tuple[Request, int]]) -> None:
        bs = self.config.block_size
        cache = self.cache
        stats = self.stats
        now = self._clock()
        n_ids = len(OUTPUT_IDS)
        for req, n in scheduled:
            if req.finish_reason is not None:  # aborted while the step ran
                continue
            req.num_computed += n
            full = req.num_computed // bs
            have = len(req.held)
            if full > have:
                if full > len(req.hashes):
                    parent = req.keys[-1] if req.keys else ROOT_HASH
                    start = len(req.keys)
                    req.keys += block_hashes(
                        req.tokens[start * bs : full * bs], bs, parent, start, req.lora, req.cache_salt
                    )
                    req.hashes = self.hasher(req.keys, req.tokens, bs, req.lora, req.cache_salt)
                new = req.hashes[have:full]
                cache.commit(new, req.hashes[have - 1] if have else None, req.tokens[have * bs : full * bs], req.lora)
                req.held = req.hashes[:full]
                req.private -= full - have
            if req.num_computed < len(req.tokens):
                continue  # prefill chunk not finished
            req.tokens.append(OUTPUT_IDS[(req.word_offset + req.num_output) % n_ids])
            req.num_output += 1
            if req.num_output == 1 and not req.first_token_at:
                req.first_token_at = now
                stats.ttft.observe(now - req.arrival)
                stats.prefill_time.observe(now - req.scheduled_at)
            elif req.num_output > 1:
                stats.itl.observe(now - req.last_token_at)
            req.last_token_at = now
            if req.on_token is not None:
                req.on_token(req)
            if req.num_output >= req.max_tokens:
                self.running.remove(req)
                self._finish(req, "length", now, record=True)
            elif req.stream and req.on_token is None and req.waiter is not None and not req.waiter.done():
                req.waiter.set_result(None)

    def _finish(self, req: Request, reason: str, now: float, record: bool) -> None:
        req.finish_reason = reason
        req.finished_at = now
        if req.kv_producer and reason == "length" and req.held:
            self.cache.release((), req.private)  # the held blocks stay referenced: pinned
            self._pin(req)
        else:
            self.cache.release(req.held, req.private)
        req.held = []
        req.private = 0
        if record:
            self.stats.record_finished(req, now)
        if req.waiter is not None and not req.waiter.done():
            req.waiter.set_result(None)
