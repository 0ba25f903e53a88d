"""A request's prompt as chained block hashes, computed once per request.

Token blocks when the request's model has a tokenizer (or the prompt is token ids): blocks of
the engine's KV block size, hashed with `picker.prefix.hashing` from
`chain_seed(target model or adapter, cache_salt, tenant)`. Character blocks (the reference's
approximate hashing, `picker.prefix.chars`) otherwise.
"""

from __future__ import annotations

import asyncio
import logging
from array import array
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from picker.framework.request import InferenceRequest
from picker.prefix.chars import (
    CHARS_PER_TOKEN,
    char_block_hashes,
    char_chain_seed,
    prompt_bytes,
)
from picker.prefix.hashing import chain_seed, token_block_hashes
from picker.prefix.token_cache import TokenizePlan, TokenPrefixCache
from picker.prefix.tokenizer import PromptTokenizer, prompt_text
from picker.telemetry.metrics import PREFIX_TOKENIZE_SEGMENTS

log = logging.getLogger(__name__)

TOKENS = "tokens"
CHARS = "chars"
DEFAULT_TOKENIZER = "*"  # tokenizer config key that applies to every other model
INLINE_TOKENIZE_CHARS = 2048  # below this, a thread hop costs more than the work
_SEGMENTS_REUSED = PREFIX_TOKENIZE_SEGMENTS.labels("hit")
_SEGMENTS_TOKENIZED = PREFIX_TOKENIZE_SEGMENTS.labels("miss")


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """The hashed prompt of one request.

    `block_tokens` is how many prompt tokens one block stands for (for character blocks, the
    configured tokens per block at 4 characters a token); `prompt_tokens` is exact for token
    blocks and an estimate otherwise. `token_ids` is kept for token blocks (uint32 array).
    """

    kind: str
    hashes: tuple[int, ...]
    block_tokens: int
    prompt_tokens: int
    seed: int
    token_ids: Sequence[int] | None = None


@dataclass(frozen=True, slots=True)
class BlockSizing:
    """How to cut one request: tokens per block and how many blocks at most (0 = no limit)."""

    char_block_tokens: int = 16
    max_char_blocks: int = 256
    token_block_size: int = 16
    max_token_blocks: int = 0


class PromptHasher:
    """Turns requests into `PromptBlocks`, tokenizing through a shared `TokenPrefixCache`."""

    def __init__(
        self,
        tokenizers: Mapping[str, PromptTokenizer] | None = None,
        token_cache: TokenPrefixCache | None = None,
        executor: Executor | None = None,
        inline_chars: int = INLINE_TOKENIZE_CHARS,
    ) -> None:
        self.tokenizers = dict(tokenizers or {})
        self.token_cache = token_cache if token_cache is not None else TokenPrefixCache()
        self.executor = executor
        self.inline_chars = inline_chars

    def tokenizer_for(self, model: str) -> PromptTokenizer | None:
        """The tokenizer configured for `model`, else the `*` default, else None."""
        tokenizer = self.tokenizers.get(model)
        return tokenizer if tokenizer is not None else self.tokenizers.get(DEFAULT_TOKENIZER)

    def needs_tokenizing(self, request: InferenceRequest) -> bool:
        """True when hashing `request` runs a tokenizer (worth awaiting `hash_async`)."""
        return request.prompt_token_ids is None and self.tokenizer_for(request.target_model) is not None

    def hash(self, request: InferenceRequest, sizing: BlockSizing) -> PromptBlocks | None:
        """Hash `request` in the calling thread."""
        plan = self._plan(request)
        if plan is None:
            return self._without_tokenizer(request, sizing)
        encoded, whole = self.token_cache.encode(plan)
        return self._finish(request, plan, encoded, whole, sizing)

    async def hash_async(self, request: InferenceRequest, sizing: BlockSizing) -> PromptBlocks | None:
        """Hash `request`; tokenizing more than `inline_chars` of new text runs in the executor
        (a thread pool) so it never blocks the event loop."""
        plan = self._plan(request)
        if plan is None:
            return self._without_tokenizer(request, sizing)
        cache = self.token_cache
        if plan.missing and (plan.verify or plan.missing_chars() > self.inline_chars):
            loop = asyncio.get_running_loop()
            encoded, whole = await loop.run_in_executor(self.executor, cache.encode, plan)
        else:
            encoded, whole = cache.encode(plan)
        return self._finish(request, plan, encoded, whole, sizing)

    def _finish(
        self,
        request: InferenceRequest,
        plan: TokenizePlan,
        encoded: list[list[int]],
        whole: list[int] | None,
        sizing: BlockSizing,
    ) -> PromptBlocks:
        tokens = self.token_cache.complete(plan, encoded, whole)
        _SEGMENTS_REUSED.inc(len(plan.segments) - len(plan.missing))
        _SEGMENTS_TOKENIZED.inc(len(plan.missing))
        return self._token_blocks(request, tokens, sizing)

    def _plan(self, request: InferenceRequest) -> TokenizePlan | None:
        if request.prompt_token_ids is not None:
            return None
        tokenizer = self.tokenizer_for(request.target_model)
        if tokenizer is None:
            return None
        try:
            source = prompt_text(tokenizer, request)
        except Exception as error:
            # Hash characters for this request instead.
            log.debug("chat template failed for request %s: %s", request.request_id, error)
            return None
        if source is None:
            return None
        return self.token_cache.plan(tokenizer, source.text, source.add_special_tokens)

    def _without_tokenizer(self, request: InferenceRequest, sizing: BlockSizing) -> PromptBlocks | None:
        if request.prompt_token_ids is not None:
            try:
                tokens = array("I", request.prompt_token_ids)
            except (OverflowError, TypeError):  # not uint32 token ids: the engine rejects it anyway
                return None
            return self._token_blocks(request, tokens, sizing)
        return self.char_blocks(request, sizing)

    @staticmethod
    def char_blocks(request: InferenceRequest, sizing: BlockSizing) -> PromptBlocks | None:
        """The reference's character blocks, or None when the prompt has no text."""
        data = prompt_bytes(request)
        if data is None:
            return None
        block_chars = sizing.char_block_tokens * CHARS_PER_TOKEN
        seed = char_chain_seed(request.target_model, request.cache_salt, request.tenant)
        hashes = char_block_hashes(data, block_chars, seed, sizing.max_char_blocks)
        return PromptBlocks(
            CHARS,
            tuple(hashes),
            sizing.char_block_tokens,
            len(data) // CHARS_PER_TOKEN,
            seed,
        )

    @staticmethod
    def _token_blocks(request: InferenceRequest, tokens: array[int], sizing: BlockSizing) -> PromptBlocks:
        seed = chain_seed(request.target_model, request.cache_salt, request.tenant)
        block = sizing.token_block_size
        hashed = tokens if sizing.max_token_blocks <= 0 else tokens[: sizing.max_token_blocks * block]
        hashes = token_block_hashes(hashed, block, seed)
        return PromptBlocks(TOKENS, tuple(hashes), block, len(tokens), seed, tokens)
