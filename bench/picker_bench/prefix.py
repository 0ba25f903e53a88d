"""`python -m picker_bench.prefix`: request-path cost of prefix hashing and matching.

Measures, per request, the work the producer does before scoring — render (chat), tokenize
through the token cache, hash blocks, match the index — for ~16k-token prompts whose long
prefix was seen before (a shared document plus a new question), with the built-in tokenizer
and a byte-level BPE Hugging Face tokenizer trained on the spot (no hub is needed). Also the
approximate character path at 64 KB. Prints p50/p99 in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from time import perf_counter, thread_time

from picker.framework.request import Api, InferenceRequest, Message
from picker.prefix.index import PrefixIndex
from picker.prefix.prompt_blocks import BlockSizing, PromptHasher
from picker.prefix.token_cache import TokenPrefixCache
from picker.prefix.tokenizer import PromptTokenizer, load_prompt_tokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "this",
    "are",
    "from",
    "at",
    "or",
    "an",
    "have",
    "not",
    "which",
    "model",
    "request",
    "prefix",
    "cache",
    "token",
    "block",
    "endpoint",
    "router",
    "latency",
    "queue",
    "prefill",
    "decode",
    "server",
    "kubernetes",
    "gateway",
    "inference",
    "python",
    "function",
    "return",
    "value",
    "error",
    "result",
    "system",
    "user",
    "assistant",
]


def corpus_text(rng: random.Random, words: int) -> str:
    """English-like text with punctuation, numbers and line breaks."""
    out = []
    for _ in range(words):
        out.append(rng.choice(_WORDS))
        r = rng.random()
        out.append(
            ", "
            if r < 0.06
            else ". "
            if r < 0.1
            else "\n"
            if r < 0.12
            else f" {rng.randint(0, 999)} "
            if r < 0.14
            else " "
        )
    return "".join(out)


def build_bpe_tokenizer(directory: Path, vocab_size: int = 4000, split_words: bool = True) -> str:
    """Train a byte-level BPE (GPT-2 style) and save it as a hub-style tokenizer directory.

    With `split_words=False` it has no pre-tokenizer, so merges span spaces and the tokens of
    a text are not the tokens of its words (a tokenizer that does not split cleanly)."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    specials = ["<|bos|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    if split_words:
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet)
    rng = random.Random(11)
    tokenizer.train_from_iterator([corpus_text(rng, 200) for _ in range(200)], trainer)
    bos = tokenizer.token_to_id("<|bos|>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", bos)])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|im_end|>",
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return str(directory)


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] * 1000


def _report(walls: Sequence[float], cpus: Sequence[float] = ()) -> str:
    """Wall-clock and CPU (this thread) p50/p99 in ms: on a shared machine the wall clock also
    counts time the OS gave other processes; the CPU time is the request path's own cost."""
    text = f"wall p50 {_percentile(walls, 0.5):6.3f} p99 {_percentile(walls, 0.99):7.3f} ms"
    if cpus:
        text += f" | cpu p50 {_percentile(cpus, 0.5):6.3f} p99 {_percentile(cpus, 0.99):6.3f} ms"
    return text


def _decide(hasher: PromptHasher, index: PrefixIndex, sizing: BlockSizing) -> Callable[[InferenceRequest], None]:
    """The producer's request-path work: hash the prompt (tokenizing if needed) and match it."""

    def step(request: InferenceRequest) -> None:
        blocks = hasher.hash(request, sizing)
        assert blocks is not None
        index.match(blocks.hashes)

    return step


def _time(requests: Sequence[InferenceRequest], step: Callable[[InferenceRequest], None]) -> str:
    """Run `step` on a third of `requests` to warm up, then time it on the rest."""
    warm_up = len(requests) // 3
    for request in requests[:warm_up]:
        step(request)
    walls, cpus = [], []
    for request in requests[warm_up:]:
        wall, cpu = perf_counter(), thread_time()
        step(request)
        cpus.append(thread_time() - cpu)
        walls.append(perf_counter() - wall)
    return _report(walls, cpus)


def _requests(api: Api, shared: str, rng: random.Random, count: int, tail_words: int) -> list[InferenceRequest]:
    """`count` requests starting with `shared` (a system message for chat), each with a new tail."""
    out = []
    for i in range(count):
        question = corpus_text(rng, tail_words)
        if api is Api.CHAT_COMPLETIONS:
            messages = (Message("system", shared), Message("user", question))
            out.append(InferenceRequest(f"r{i}", api, "m", "m", messages=messages))
        else:
            out.append(InferenceRequest(f"r{i}", api, "m", "m", prompt_text=shared + question))
    return out


def _seeded(
    hasher: PromptHasher,
    index: PrefixIndex,
    sizing: BlockSizing,
    request: InferenceRequest,
) -> float:
    """Hash `request` (first sight of the shared prefix), record it, return the seconds taken."""
    started = perf_counter()
    blocks = hasher.hash(request, sizing)
    elapsed = perf_counter() - started
    assert blocks is not None
    index.insert("10.0.0.1:8000", blocks.hashes)
    return elapsed


def bench_tokens(name: str, tokenizer: PromptTokenizer, target_tokens: int, count: int) -> None:
    rng = random.Random(5)
    probe = corpus_text(rng, 2000)
    tokens_per_word = len(tokenizer.encode_batch([probe])[0]) / 2000
    shared = corpus_text(rng, int(target_tokens / tokens_per_word) - 100)
    sizing = BlockSizing(token_block_size=16, max_token_blocks=4096)
    for api in (Api.COMPLETIONS, Api.CHAT_COMPLETIONS):
        index = PrefixIndex()
        hasher = PromptHasher({"m": tokenizer}, TokenPrefixCache())
        requests = _requests(api, shared, rng, count + count // 2 + 1, 100)
        cold = _seeded(hasher, index, sizing, requests[0])
        blocks = hasher.hash(requests[1], sizing)
        assert blocks is not None
        print(
            f"{name:7s} {api.value:17s} {blocks.prompt_tokens:6d} tokens, seen prefix: "
            f"{_time(requests[1:], _decide(hasher, index, sizing))}   (first sight {cold * 1000:.1f} ms)"
        )
    # The async path as the Director runs it, with every request's new tail tokenized in the
    # worker thread (inline_chars=0) to show what the thread hop costs.
    with ThreadPoolExecutor(1) as executor:
        hasher = PromptHasher({"m": tokenizer}, TokenPrefixCache(), executor, inline_chars=0)
        requests = _requests(Api.COMPLETIONS, shared, rng, count + 1, 100)

        async def run() -> list[float]:
            await hasher.hash_async(requests[0], sizing)
            walls = []
            for request in requests[1:]:
                started = perf_counter()
                await hasher.hash_async(request, sizing)
                walls.append(perf_counter() - started)
            return walls

        print(f"{name:7s} {'completions, async':17s} (thread pool), seen prefix: {_report(asyncio.run(run()))}")


def bench_chars(count: int) -> None:
    rng = random.Random(6)
    shared = corpus_text(rng, 11000)[: 64 * 1024 - 600]
    for max_blocks in (256, 1024):
        sizing = BlockSizing(char_block_tokens=16, max_char_blocks=max_blocks)
        index = PrefixIndex()
        hasher = PromptHasher()
        requests = _requests(Api.COMPLETIONS, shared, rng, count + count // 2 + 1, 100)
        _seeded(hasher, index, sizing, requests[0])
        size = len(requests[1].prompt_text or "") // 1024
        print(
            f"chars   completions {size} KB, maxPrefixBlocksToMatch {max_blocks:4d}: "
            f"{_time(requests[1:], _decide(hasher, index, sizing))}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m picker_bench.prefix", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="timed requests per case")
    parser.add_argument("--tokens", type=int, default=16384, help="prompt size in tokens")
    parser.add_argument(
        "--tokenizer",
        help="a local Hugging Face tokenizer directory (default: train a BPE)",
    )
    args = parser.parse_args(argv)
    bench_chars(args.requests)
    bench_tokens("builtin", load_prompt_tokenizer("builtin"), args.tokens, args.requests)
    try:
        if args.tokenizer:
            hf = load_prompt_tokenizer(args.tokenizer)
        else:
            with tempfile.TemporaryDirectory() as directory:
                hf = load_prompt_tokenizer(build_bpe_tokenizer(Path(directory)))
    except (ImportError, ValueError) as error:
        print(f"hf-bpe  skipped: {error}", file=sys.stderr)
        return 0
    bench_tokens("hf-bpe", hf, args.tokens, args.requests)
    return 0


if __name__ == "__main__":
    sys.exit(main())
