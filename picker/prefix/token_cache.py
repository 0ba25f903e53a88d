"""Incremental tokenization: reuse the tokens of text prefixes seen before.

Tokenizing a 16k-token prompt costs milliseconds to tens of milliseconds, and most prompts
start with text the picker has tokenized before (system prompts, earlier chat turns). So a
text is cut into segments at *safe boundaries*, each segment is tokenized on its own, and each
segment's tokens are cached under a chained hash of all the text before and in it. A new text
reuses every segment whose chain key is cached and tokenizes only the rest.

A safe boundary is a space preceded by a non-space and followed by a letter (`"word| next"`):
word-level tokenizers and the regex pre-tokenizers of GPT-2/Llama-3/Qwen-style byte-level
BPEs all start a new piece there, so the tokens of the whole text equal the tokens of the
parts. Boundaries are searched backwards from every `segment_chars` characters, so they depend
only on the text before them and two texts sharing a prefix share its segments.

Not every tokenizer splits cleanly (SentencePiece adds a leading "▁" to each piece it is
given, normalizers may strip). The first `verify_first` multi-segment texts of each tokenizer
are also tokenized whole and compared; on a mismatch that tokenizer is only ever tokenized
whole from then on (exact repeats still hit the cache).
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import xxhash

from picker.prefix.tokenizer import PromptTokenizer

log = logging.getLogger(__name__)

DEFAULT_SEGMENT_CHARS = 1024
DEFAULT_CAPACITY_TOKENS = 4_000_000  # ~16 MB of uint32 token ids
_MAX_CHECKS = 16  # candidate spaces checked per window before it is widened


def safe_boundaries(text: str, segment_chars: int) -> list[int]:
    """Cut points of `text` (exclusive of 0 and len): the last safe boundary in each window of
    `segment_chars` characters after the previous cut."""
    boundaries: list[int] = []
    length = len(text)
    lo = 1  # candidates below lo were checked already (or are the previous cut)
    end = segment_chars
    while end < length:
        # Candidates b < end - 1, so text[b + 1] is inside the window: the choice depends only
        # on text[:end].
        hi = end - 1
        found = -1
        for _ in range(_MAX_CHECKS):  # bounded: text with many spaces but few words stays cheap
            b = text.rfind(" ", lo, hi)
            if b < 0:
                break
            if not text[b - 1].isspace() and text[b + 1].isalpha():
                found = b
                break
            hi = b
        if found > 0:
            boundaries.append(found)
            lo = found + 1
            end = found + segment_chars
        else:
            lo = end - 1  # no boundary in this window: widen it, checking only the new part
            end += segment_chars
    return boundaries


@dataclass(slots=True)
class TokenizePlan:
    """One text's segments, which are cached, and which still need tokenizing."""

    tokenizer: PromptTokenizer
    text: str
    add_special_tokens: bool
    keys: list[int]
    segments: list[str]
    cached: list[array[int] | None]
    missing: list[int] = field(default_factory=list)  # indexes into segments
    verify: bool = False  # also tokenize the whole text and compare

    def missing_texts(self) -> list[str]:
        return [self.segments[i] for i in self.missing]

    def missing_chars(self) -> int:
        return sum(len(self.segments[i]) for i in self.missing)


class TokenPrefixCache:
    """An LRU of tokenized segments, bounded by total tokens, shared by all tokenizers."""

    def __init__(
        self,
        capacity_tokens: int = DEFAULT_CAPACITY_TOKENS,
        segment_chars: int = DEFAULT_SEGMENT_CHARS,
        verify_first: int = 4,
    ) -> None:
        if capacity_tokens < 1 or segment_chars < 16:
            raise ValueError("token cache capacity must be >= 1 and segment size >= 16 characters")
        self.capacity_tokens = capacity_tokens
        self.segment_chars = segment_chars
        self.verify_first = verify_first
        self._segments: OrderedDict[int, array[int]] = OrderedDict()
        self._tokens = 0
        self._verified: dict[str, int] = {}
        self._unsplittable: set[str] = set()
        self.hits = 0  # segments reused
        self.misses = 0  # segments tokenized

    def __len__(self) -> int:
        return len(self._segments)

    def splittable(self, tokenizer: PromptTokenizer) -> bool:
        return tokenizer.key not in self._unsplittable

    def plan(self, tokenizer: PromptTokenizer, text: str, add_special_tokens: bool) -> TokenizePlan:
        """Split `text`, look every segment up; cheap (hashing only), safe on the event loop."""
        if tokenizer.key in self._unsplittable:
            cuts: list[int] = []
        else:
            cuts = safe_boundaries(text, self.segment_chars)
        starts = [0, *cuts]
        ends = [*cuts, len(text)]
        segments = [text[s:e] for s, e in zip(starts, ends)]
        keys: list[int] = []
        h = xxhash.xxh3_64_intdigest(tokenizer.key.encode())
        digest = xxhash.xxh3_64_intdigest
        for segment in segments:
            h = digest(segment.encode("utf-8", "surrogatepass"), seed=h)
            keys.append(h)
        cache = self._segments
        cached: list[array[int] | None] = []
        missing: list[int] = []
        for i, key in enumerate(keys):
            tokens = cache.get(key)
            if tokens is None:
                missing.append(i)
            else:
                cache.move_to_end(key)
            cached.append(tokens)
        verify = len(segments) > 1 and bool(missing) and self._verified.get(tokenizer.key, 0) < self.verify_first
        return TokenizePlan(tokenizer, text, add_special_tokens, keys, segments, cached, missing, verify)

    @staticmethod
    def encode(plan: TokenizePlan) -> tuple[list[list[int]], list[int] | None]:
        """Tokenize the missing segments (and the whole text when verifying): the expensive
        step, safe to run in a worker thread (it touches no shared state)."""
        texts = plan.missing_texts()
        if plan.verify:
            encoded = plan.tokenizer.encode_batch([*texts, plan.text])
            return encoded[:-1], encoded[-1]
        return (plan.tokenizer.encode_batch(texts) if texts else []), None

    def complete(self, plan: TokenizePlan, encoded: list[list[int]], whole: list[int] | None) -> array[int]:
        """Store the new segments and assemble the text's token ids (uint32)."""
        tokenizer = plan.tokenizer
        self.hits += len(plan.segments) - len(plan.missing)
        self.misses += len(plan.missing)
        for i, ids in zip(plan.missing, encoded):
            plan.cached[i] = array("I", ids)
        content = array("I")
        for part in plan.cached:
            assert part is not None  # every missing segment was filled in just above
            content += part
        if whole is not None:
            self._verified[tokenizer.key] = self._verified.get(tokenizer.key, 0) + 1
            if content != array("I", whole):
                log.warning(
                    "tokenizer %s does not split cleanly at word boundaries; tokenizing whole texts from now on",
                    tokenizer.key,
                )
                self._unsplittable.add(tokenizer.key)
                return _with_specials(tokenizer, array("I", whole), plan.add_special_tokens)
        self._store(plan)
        return _with_specials(tokenizer, content, plan.add_special_tokens)

    def tokenize(self, tokenizer: PromptTokenizer, text: str, add_special_tokens: bool) -> array[int]:
        """Plan, encode and complete in the calling thread."""
        plan = self.plan(tokenizer, text, add_special_tokens)
        encoded, whole = self.encode(plan)
        return self.complete(plan, encoded, whole)

    def _store(self, plan: TokenizePlan) -> None:
        cache = self._segments
        for i in plan.missing:
            key = plan.keys[i]
            tokens = plan.cached[i]
            assert tokens is not None
            if key in cache:  # stored by a concurrent request meanwhile
                continue
            cache[key] = tokens
            self._tokens += len(tokens)
        while self._tokens > self.capacity_tokens and cache:
            _, evicted = cache.popitem(last=False)
            self._tokens -= len(evicted)


def _with_specials(tokenizer: PromptTokenizer, content: array[int], add_special_tokens: bool) -> array[int]:
    if not add_special_tokens or not (tokenizer.special_prefix or tokenizer.special_suffix):
        return content
    tokens = array("I", tokenizer.special_prefix)
    tokens += content
    tokens += array("I", tokenizer.special_suffix)
    return tokens
