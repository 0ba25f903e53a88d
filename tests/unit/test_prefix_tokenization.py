"""Token-exact prompts: tokenizers, chat rendering and incremental tokenization."""

from __future__ import annotations

import asyncio
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from picker.framework.request import Api, InferenceRequest, Message
from picker.prefix import builtin_tokenizer as sim_tokenizer
from picker.prefix.hashing import chain_seed, token_block_hashes
from picker.prefix.prompt_blocks import CHARS, TOKENS, BlockSizing, PromptHasher
from picker.prefix.token_cache import TokenPrefixCache, safe_boundaries
from picker.prefix.tokenizer import (
    BuiltinPromptTokenizer,
    HuggingFacePromptTokenizer,
    load_prompt_tokenizer,
)
from picker_bench.prefix import build_bpe_tokenizer

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "code",
    "return",
    "value",
    "assistant",
    "helpful",
]


def random_text(rng: random.Random, words: int) -> str:
    """Words with varied separators: double spaces, newlines, punctuation, digits, unicode."""
    separators = [
        " ",
        " ",
        " ",
        "  ",
        "\n",
        "\n\n",
        ", ",
        ". ",
        " (",
        ") ",
        " 42 ",
        " é",
    ]
    return "".join(rng.choice(WORDS) + rng.choice(separators) for _ in range(words))


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_bpe_tokenizer(tmp_path_factory.mktemp("bpe"), vocab_size=600)


@pytest.fixture(scope="module")
def whole_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_bpe_tokenizer(tmp_path_factory.mktemp("whole"), vocab_size=600, split_words=False)


def _chat(request_id: str, *contents: str) -> InferenceRequest:
    """A system message, then alternating user and assistant turns."""
    roles = ["system" if i == 0 else "user" if i % 2 else "assistant" for i in range(len(contents))]
    messages = tuple(Message(role, content) for role, content in zip(roles, contents))
    return InferenceRequest(request_id, Api.CHAT_COMPLETIONS, "m", "m", messages=messages)


def test_safe_boundaries_are_word_starts_and_depend_only_on_the_prefix() -> None:
    rng = random.Random(1)
    text = random_text(rng, 2000)
    cuts = safe_boundaries(text, 256)
    assert cuts and all(text[b] == " " and not text[b - 1].isspace() and text[b + 1].isalpha() for b in cuts)
    assert all(b - a <= 512 for a, b in zip([0, *cuts], cuts))
    longer = text + random_text(rng, 500)
    assert safe_boundaries(longer, 256)[: len(cuts) - 1] == cuts[:-1]
    assert safe_boundaries("x" * 5000, 256) == []  # no word boundary: one segment


def test_builtin_incremental_tokenization_equals_full_and_reuses_prefixes() -> None:
    tokenizer = BuiltinPromptTokenizer()
    cache = TokenPrefixCache(segment_chars=128)
    rng = random.Random(2)
    shared = random_text(rng, 600)
    for i in range(5):
        text = shared + random_text(rng, 20 + i)
        assert list(cache.tokenize(tokenizer, text, False)) == sim_tokenizer.encode(text)
    # After the first text only the tails were tokenized.
    assert cache.hits > 4 * (len(safe_boundaries(shared, 128)) - 1)


def test_builtin_chat_rendering_matches_the_simulator() -> None:
    tokenizer = BuiltinPromptTokenizer()
    request = _chat("r", "You are terse.", "What is two plus two?")
    expected = sim_tokenizer.render_chat(
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is two plus two?"},
        ]
    )
    assert tokenizer.render_chat(request) == expected


def test_hf_chat_and_completion_tokens_equal_what_the_engine_computes(
    bpe_dir: str,
) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(bpe_dir)
    tokenizer = load_prompt_tokenizer(bpe_dir)
    assert isinstance(tokenizer, HuggingFacePromptTokenizer)
    hasher = PromptHasher({"m": tokenizer}, TokenPrefixCache(segment_chars=128))
    rng = random.Random(3)
    system = random_text(rng, 400)
    sizing = BlockSizing(token_block_size=16)
    turns = [system]
    for i in range(6):  # a growing conversation: every request extends the previous one
        turns.append(random_text(rng, 30 + i))
        request = _chat(f"c{i}", *turns)
        turns.append(random_text(rng, 20))  # the assistant's answer, sent back next turn
        rendered = reference.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in request.messages or ()],
            tokenize=False,
            add_generation_prompt=True,
        )
        expected = reference.encode(rendered, add_special_tokens=False)  # what vLLM does for chat
        blocks = hasher.hash(request, sizing)
        assert blocks is not None and blocks.kind == TOKENS
        assert list(blocks.token_ids or ()) == expected
        assert list(blocks.hashes) == token_block_hashes(expected, 16, chain_seed("m"))
    prompt = system + " the end"
    completion = InferenceRequest("p", Api.COMPLETIONS, "m", "m", prompt_text=prompt)
    blocks = hasher.hash(completion, sizing)
    assert blocks is not None and list(blocks.token_ids or ()) == reference.encode(prompt)  # with BOS
    assert hasher.token_cache.hits > 0


def test_hf_tokenizer_that_does_not_split_cleanly_falls_back_to_whole_texts(
    whole_dir: str,
) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(whole_dir)
    tokenizer = load_prompt_tokenizer(whole_dir)
    cache = TokenPrefixCache(segment_chars=64)
    rng = random.Random(4)
    for _ in range(6):
        text = random_text(rng, 80)
        assert list(cache.tokenize(tokenizer, text, False)) == reference.encode(text, add_special_tokens=False)
    assert not cache.splittable(tokenizer)


def test_async_hashing_runs_large_tokenizations_off_the_event_loop(
    bpe_dir: str,
) -> None:
    tokenizer = load_prompt_tokenizer(bpe_dir)
    threads: list[int] = []
    encode_batch = tokenizer.encode_batch

    def recording(texts):  # the real tokenizer, with the calling thread noted
        threads.append(threading.get_ident())
        return encode_batch(texts)

    tokenizer.encode_batch = recording  # type: ignore[method-assign]
    with ThreadPoolExecutor(1) as executor:
        hasher = PromptHasher({"*": tokenizer}, TokenPrefixCache(), executor, inline_chars=1000)
        big = InferenceRequest(
            "b",
            Api.COMPLETIONS,
            "any",
            "any",
            prompt_text=random_text(random.Random(5), 800),
        )
        blocks = asyncio.run(hasher.hash_async(big, BlockSizing()))
    assert blocks is not None and blocks.kind == TOKENS
    assert threads and threading.get_ident() not in threads


def test_models_without_tokenizer_hash_characters_and_token_prompts_hash_tokens() -> None:
    hasher = PromptHasher({"tok": BuiltinPromptTokenizer()})
    sizing = BlockSizing(char_block_tokens=16, max_char_blocks=256)
    text = InferenceRequest("t", Api.COMPLETIONS, "plain", "plain", prompt_text="a" * 200)
    blocks = hasher.hash(text, sizing)
    assert blocks is not None and blocks.kind == CHARS and len(blocks.hashes) == 4  # 3 × 64 + tail
    ids = InferenceRequest("i", Api.COMPLETIONS, "plain", "plain", prompt_token_ids=tuple(range(40)))
    blocks = hasher.hash(ids, sizing)
    assert blocks is not None and blocks.kind == TOKENS and len(blocks.hashes) == 2 and blocks.prompt_tokens == 40


def test_token_cache_is_bounded_by_total_tokens() -> None:
    tokenizer = BuiltinPromptTokenizer()
    cache = TokenPrefixCache(capacity_tokens=500, segment_chars=64)
    rng = random.Random(6)
    for _ in range(20):
        text = random_text(rng, 200)
        assert list(cache.tokenize(tokenizer, text, False)) == sim_tokenizer.encode(text)
    assert 0 < cache._tokens <= 500
    assert sum(len(tokens) for tokens in cache._segments.values()) == cache._tokens


def test_invalid_token_ids_give_no_blocks_instead_of_an_error() -> None:
    request = InferenceRequest("bad", Api.COMPLETIONS, "m", "m", prompt_token_ids=(1, -5, 2**40))
    assert PromptHasher().hash(request, BlockSizing()) is None
