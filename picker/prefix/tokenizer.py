"""Tokenizers the router uses for token-exact prefix hashing, one per served model.

A model's tokenizer is either `builtin` (the word-level tokenizer and chat rendering the
simulator uses too, `picker.prefix.builtin_tokenizer`) or a local Hugging Face tokenizer directory loaded with
`transformers.AutoTokenizer`. Prompts are turned into token ids the way vLLM does it:

* chat: `apply_chat_template(messages, tokenize=False, add_generation_prompt=True)` (plus the
  request's `tools`, `chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`),
  then encoded *without* special tokens (the template already holds them);
* completions: the prompt encoded *with* the tokenizer's special tokens (e.g. BOS).

`encode_batch` never adds special tokens: callers add `special_prefix`/`special_suffix`, so a
text can be encoded in pieces (see `token_cache`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from picker.framework.request import Api, InferenceRequest
from picker.prefix import builtin_tokenizer


class PromptTokenizer(Protocol):
    """What prefix hashing needs from a tokenizer."""

    key: str  # identity of the tokenizer (the token cache is keyed by it)
    special_prefix: tuple[int, ...]  # ids `add_special_tokens=True` puts before the text
    special_suffix: tuple[int, ...]  # ... and after it

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens."""

    def render_chat(self, request: InferenceRequest) -> str:
        """The chat request's prompt text as the engine's chat template renders it."""


@dataclass(frozen=True, slots=True)
class PromptText:
    """The text a request's prompt tokens come from, and whether special tokens wrap it."""

    text: str
    add_special_tokens: bool


def prompt_text(tokenizer: PromptTokenizer, request: InferenceRequest) -> PromptText | None:
    """The text to tokenize for `request`, or None when the prompt is token ids or absent."""
    if request.api is Api.CHAT_COMPLETIONS and request.messages is not None:
        return PromptText(tokenizer.render_chat(request), add_special_tokens=False)
    if request.prompt_text is not None:
        return PromptText(request.prompt_text, add_special_tokens=True)
    return None


class BuiltinPromptTokenizer:
    """The built-in word-level tokenizer and chat rendering (`builtin_tokenizer`), which the
    simulator's engines use too."""

    key = "builtin"
    special_prefix: tuple[int, ...] = ()
    special_suffix: tuple[int, ...] = ()

    def __init__(self) -> None:
        self._encode = builtin_tokenizer.encode
        self._render = builtin_tokenizer.render_chat

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        encode = self._encode
        return [encode(text) for text in texts]

    def render_chat(self, request: InferenceRequest) -> str:
        messages = request.messages or ()
        return self._render([{"role": m.role, "content": m.content} for m in messages])


class HuggingFacePromptTokenizer:
    """A local Hugging Face tokenizer directory (fast tokenizers only)."""

    def __init__(self, path: str) -> None:
        if not os.path.isdir(path):
            raise ValueError(f'tokenizer directory {path!r} does not exist (or use "builtin")')
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ValueError("a tokenizer directory needs `pip install transformers tokenizers`") from None
        try:
            self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as error:
            raise ValueError(f"cannot load tokenizer from {path!r}: {error}") from None
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"tokenizer at {path!r} is not a fast (Rust) tokenizer")
        self._backend = backend
        self.key = f"hf:{path}"
        self.special_prefix, self.special_suffix = self._special_wrapping()

    def _special_wrapping(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        # What add_special_tokens=True adds around a text, found by encoding a probe both ways.
        plain = self._backend.encode("a", add_special_tokens=False).ids
        wrapped = self._backend.encode("a", add_special_tokens=True).ids
        for start in range(len(wrapped) - len(plain) + 1):
            if wrapped[start : start + len(plain)] == plain:
                return tuple(wrapped[:start]), tuple(wrapped[start + len(plain) :])
        return (), ()

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # One call per text: the Rust batch API's parallelism costs more than it gains for the
        # few short segments a request needs, and the caller already runs in a worker thread.
        encode = self._backend.encode
        return [encode(text, add_special_tokens=False).ids for text in texts]

    def render_chat(self, request: InferenceRequest) -> str:
        body = request.body
        kwargs: dict[str, Any] = {}
        template_kwargs = body.get("chat_template_kwargs")
        if isinstance(template_kwargs, Mapping):
            kwargs.update(template_kwargs)
        continue_final = body.get("continue_final_message") is True
        add_generation = body.get("add_generation_prompt", True) is not False and not continue_final
        tools = body.get("tools")
        messages = [{"role": m.role, "content": m.content} for m in request.messages or ()]
        return str(
            self._tokenizer.apply_chat_template(
                messages,
                tools=tools if isinstance(tools, list) else None,
                tokenize=False,
                add_generation_prompt=add_generation,
                continue_final_message=continue_final,
                **kwargs,
            )
        )


def load_prompt_tokenizer(spec: str) -> PromptTokenizer:
    """`builtin` or a local tokenizer directory; ValueError with a clear message otherwise."""
    if spec == "builtin":
        return BuiltinPromptTokenizer()
    return HuggingFacePromptTokenizer(spec)
