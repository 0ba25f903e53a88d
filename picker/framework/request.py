"""A request and its outcome as plugins see them: the parsed form of one inference request (the
reference's LLMRequest), the usage its response reported and how it ended."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class Api(enum.Enum):
    """The OpenAI-style API a request targets, chosen from its path."""

    COMPLETIONS = "completions"
    CHAT_COMPLETIONS = "chat/completions"
    RESPONSES = "responses"
    CONVERSATIONS = "conversations"
    EMBEDDINGS = "embeddings"


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message with its content flattened to text (parts joined in order)."""

    role: str
    content: str


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """An inference request after parsing; built once per request, read by every plugin.

    Exactly one of `prompt_text`, `prompt_token_ids` and `messages` describes the prompt
    (`prompt_text` also carries Responses/Conversations input rendered as text; Embeddings
    input follows the completions rules).
    """

    request_id: str
    api: Api
    model: str  # as the client sent it
    target_model: str  # after the model-name rewrite header and InferenceModelRewrites
    stream: bool = False
    cache_salt: str | None = None
    prompt_text: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[Message, ...] | None = None
    body: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    headers: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)
    objective: str | None = None  # x-gateway-inference-objective
    fairness_id: str = "default-flow"
    tenant: str | None = None  # from the configured tenant header, when set
    size_bytes: int = 0

    def with_target_model(self, target_model: str) -> InferenceRequest:
        """This request with another `target_model` (an InferenceModelRewrite's choice). Copied
        slot by slot: on the request path, where `dataclasses.replace` costs twice as much."""
        copy = object.__new__(InferenceRequest)
        for name in InferenceRequest.__slots__:
            object.__setattr__(copy, name, getattr(self, name))
        object.__setattr__(copy, "target_model", target_model)
        return copy

    def prompt_chars(self) -> int:
        """Prompt size in characters (token ids count 4 each), for load estimates."""
        if self.prompt_text is not None:
            return len(self.prompt_text)
        if self.prompt_token_ids is not None:
            return 4 * len(self.prompt_token_ids)
        if self.messages is not None:
            return sum(len(m.content) for m in self.messages)
        return 0

    def estimated_prompt_tokens(self) -> int:
        """A cheap token estimate (4 characters a token) for in-flight token accounting."""
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        return self.prompt_chars() // 4


@dataclass(frozen=True, slots=True)
class Usage:
    """Token usage reported by the model server in its response."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens
    total_tokens: int = 0  # usage.total_tokens as reported (0 when absent), not computed


@dataclass(frozen=True, slots=True)
class ResponseOutcome:
    """How one routed request ended, as seen on the response path."""

    endpoint: str  # ip:port that served it (the served-endpoint metadata, else the pick)
    status: int = 0  # HTTP status of the response; 0 if none arrived
    ttft_seconds: float | None = None  # decision → first response body byte
    duration_seconds: float = 0.0  # decision → end of stream
    usage: Usage | None = None
    error: str | None = None  # set when the stream ended abnormally (e.g. "cancelled")
