"""`openai-parser`: the request parser plugin for OpenAI-style bodies (the director calls it;
`picker.request.openai` does the parsing)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from picker.framework.handle import Handle
from picker.framework.parameters import Parameters
from picker.framework.plugin import Parser
from picker.framework.request import InferenceRequest
from picker.request.openai import parse_request, rewrite_model


class OpenAIParser(Parser):
    """`openai-parser`: the default request parser (OpenAI-style bodies); no parameters."""

    plugin_type = "openai-parser"

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> OpenAIParser:
        Parameters(parameters).finish()
        return cls(name)

    def parse(
        self, body: bytes, headers: Mapping[str, str], request_id: str, tenant_header: str | None
    ) -> InferenceRequest:
        return parse_request(body, headers, request_id, tenant_header)

    def rewrite_model(self, request: InferenceRequest) -> bytes:
        return rewrite_model(request.body, request.target_model)
