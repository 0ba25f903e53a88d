"""The built-in tokenizer (the router's `builtin` prefix hashing and the simulator share it), and
the simulator's tokenizer loader: built-in or a local Hugging Face one.

The built-in tokenizer is pure and deterministic so the router side can reproduce its token ids
exactly (same ids in every process, on every machine):

* `encode(text)`: split `text` into words (`\\w+`) and single punctuation characters (any other
  non-space character); whitespace is dropped. Each piece maps to
  `SPECIAL_TOKENS + xxh3_64(piece as UTF-8) % (VOCAB_SIZE - SPECIAL_TOKENS)`.
* `render_chat(messages)`: the built-in chat template. Each message becomes
  `"<|{role}|>\\n{content}\\n"` (content parts of type `text` are joined with `"\\n"`), and the
  generation prompt `"<|assistant|>\\n"` is appended. The rendered text is then `encode`d.

`load_tokenizer("builtin" | path)` returns a `Tokenizer`; a path loads a Hugging Face tokenizer
directory through `transformers` (optional dependency) and uses its chat template when it has one.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import xxhash

VOCAB_SIZE = 1 << 17
SPECIAL_TOKENS = 256  # ids below this are never produced by `encode`
MAX_CACHED_CHUNKS = 1 << 18

_PIECE = re.compile(r"\w+|[^\w\s]")
_SPAN = VOCAB_SIZE - SPECIAL_TOKENS


def _piece_id(piece: str) -> int:
    return SPECIAL_TOKENS + xxhash.xxh3_64_intdigest(piece.encode("utf-8", "surrogatepass")) % _SPAN


# Memo of whitespace-separated chunks -> their ids: prompts repeat words, and a dict hit per
# chunk is ~10x cheaper than running the regex over the text. Cleared when it grows too big.
_chunk_ids: dict[str, tuple[int, ...]] = {}


def _ids_of_chunk(chunk: str) -> tuple[int, ...]:
    ids = tuple(_piece_id(p) for p in _PIECE.findall(chunk))
    if len(_chunk_ids) >= MAX_CACHED_CHUNKS:
        _chunk_ids.clear()
    _chunk_ids[chunk] = ids
    return ids


def encode(text: str) -> list[int]:
    """Token ids of `text` under the built-in word-level tokenizer."""
    out: list[int] = []
    get = _chunk_ids.get
    for chunk in text.split():  # same whitespace as the regex's \s (both use str.isspace)
        ids = get(chunk)
        out += ids if ids is not None else _ids_of_chunk(chunk)
    return out


def pieces(text: str) -> list[str]:
    """The text pieces `encode` maps to ids, one per token."""
    return _PIECE.findall(text)


def message_text(content: Any) -> str:
    """The text of an OpenAI message `content`: a string, or a list of parts (text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text"]
        return "\n".join(t for t in texts if isinstance(t, str))
    return str(content)


def render_chat(messages: Iterable[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """The built-in chat template (see the module docstring)."""
    parts = [f"<|{m.get('role', 'user')}|>\n{message_text(m.get('content'))}\n" for m in messages]
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


class Tokenizer(Protocol):
    """What the simulator needs from a tokenizer."""

    name: str

    def encode(self, text: str) -> list[int]: ...

    def token_strs(self, text: str, ids: Sequence[int]) -> list[str]: ...

    def render_chat(self, messages: list[dict[str, Any]]) -> str: ...


class BuiltinTokenizer:
    """The fast built-in word-level tokenizer (module functions behind a `Tokenizer` face)."""

    name = "builtin"

    def encode(self, text: str) -> list[int]:
        return encode(text)

    def token_strs(self, text: str, ids: Sequence[int]) -> list[str]:
        return pieces(text)

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        return render_chat(messages)


class HuggingFaceTokenizer:
    """A local Hugging Face tokenizer directory, loaded with `transformers.AutoTokenizer`."""

    def __init__(self, path: str) -> None:
        if not os.path.isdir(path):
            raise ValueError(f"tokenizer directory {path!r} does not exist")
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:  # optional dependency
            raise ValueError("--tokenizer PATH needs `pip install transformers tokenizers`") from exc
        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:
            raise ValueError(f"cannot load tokenizer from {path!r}: {exc}") from exc
        self.name = path

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def token_strs(self, text: str, ids: Sequence[int]) -> list[str]:
        return list(self._tok.convert_ids_to_tokens(list(ids)))

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        if getattr(self._tok, "chat_template", None):
            rendered = self._tok.apply_chat_template(
                [{"role": m.get("role", "user"), "content": message_text(m.get("content"))} for m in messages],
                tokenize=False,
                add_generation_prompt=True,
            )
            return str(rendered)
        return render_chat(messages)


def load_tokenizer(spec: str) -> Tokenizer:
    """`"builtin"` or a local Hugging Face tokenizer directory."""
    if spec == "builtin":
        return BuiltinTokenizer()
    return HuggingFaceTokenizer(spec)
