"""`passthrough-parser`: the reference's parser for bodies in any format. Nothing is read from
the body, so the prompt is unknown (prefix-cache scoring sees nothing) and the body is
forwarded unchanged; the objective, fairness id and tenant still come from the headers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from picker.framework.handle import Handle
from picker.framework.parameters import Parameters
from picker.framework.plugin import Parser
from picker.framework.request import InferenceRequest
from picker.request.openai import api_for_path, flow_headers, request_path


class PassthroughParser(Parser):
    """`passthrough-parser`: no parameters; the request's model is empty (as in the reference),
    so no model rewrite applies and the body goes to the endpoint as it came."""

    plugin_type = "passthrough-parser"

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> PassthroughParser:
        Parameters(parameters).finish()
        return cls(name)

    def parse(
        self, body: bytes, headers: Mapping[str, str], request_id: str, tenant_header: str | None
    ) -> InferenceRequest:
        flow = flow_headers(headers, tenant_header)
        return InferenceRequest(
            request_id=request_id,
            api=api_for_path(request_path(headers)),
            model="",
            target_model="",
            headers=headers,
            objective=flow.objective,
            fairness_id=flow.fairness_id,
            tenant=flow.tenant,
            size_bytes=len(body),
        )

    def rewrite_model(self, request: InferenceRequest) -> bytes:
        raise AssertionError("never called: the model is always empty, so never rewritten")
