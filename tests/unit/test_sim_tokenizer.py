"""The built-in tokenizer: deterministic, word-level, with a fixed chat template."""

from __future__ import annotations

import re
import subprocess
import sys

import xxhash
from hypothesis import given
from hypothesis import strategies as st

from picker.prefix import builtin_tokenizer
from picker.prefix.builtin_tokenizer import (
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    BuiltinTokenizer,
    encode,
    pieces,
    render_chat,
)


def test_words_and_punctuation_are_tokens() -> None:
    assert pieces("Hello, world!  foo_bar 42") == ["Hello", ",", "world", "!", "foo_bar", "42"]
    ids = encode("Hello, world!  foo_bar 42")
    assert len(ids) == 6
    assert all(SPECIAL_TOKENS <= i < VOCAB_SIZE for i in ids)


def test_same_word_same_id_whitespace_ignored() -> None:
    assert encode("a  b\n\tc") == encode("a b c")
    assert encode("cat dog cat")[0] == encode("cat dog cat")[2]
    assert encode("cat") != encode("Cat")


def test_ids_are_stable_across_processes_and_hash_seeds() -> None:
    code = "from picker.prefix.builtin_tokenizer import encode; print(encode('The quick, brown fox! ünïcode'))"
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
        ).stdout.strip()
        for seed in ("0", "1", "random")
    }
    assert outputs == {str(encode("The quick, brown fox! ünïcode"))}


def test_chat_template_is_the_documented_one() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi"}, {"type": "image_url"}, {"type": "text", "text": "there"}],
        },
    ]
    assert render_chat(messages) == "<|system|>\nBe brief.\n<|user|>\nHi\nthere\n<|assistant|>\n"
    assert render_chat(messages, add_generation_prompt=False).endswith("there\n")
    tok = BuiltinTokenizer()
    assert tok.encode(tok.render_chat(messages)) == encode(render_chat(messages))


def test_load_tokenizer_builtin_and_bad_path() -> None:
    assert builtin_tokenizer.load_tokenizer("builtin").name == "builtin"
    try:
        builtin_tokenizer.load_tokenizer("/nonexistent/tokenizer/dir")
    except ValueError as exc:
        assert "/nonexistent/tokenizer/dir" in str(exc) or "transformers" in str(exc)
    else:
        raise AssertionError("a missing tokenizer directory must be a ValueError")


@given(st.text(max_size=60))
def test_encode_matches_the_documented_definition(text: str) -> None:
    # documented: pieces are \w+ runs or single non-space characters; id = 256 + xxh3_64 % (2^17 - 256)
    expected = [
        SPECIAL_TOKENS + xxhash.xxh3_64_intdigest(p.encode("utf-8", "surrogatepass")) % (VOCAB_SIZE - SPECIAL_TOKENS)
        for p in re.findall(r"\w+|[^\w\s]", text)
    ]
    assert encode(text) == expected
    assert encode(text) == expected  # memoised path gives the same answer
