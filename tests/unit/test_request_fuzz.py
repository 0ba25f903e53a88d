"""Fuzzing `parse_request`: any input gives an `InferenceRequest` or a 400 `RequestError`."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from picker.framework.request import InferenceRequest
from picker.request.errors import RequestError
from picker.request.openai import parse_request, rewrite_model

PATHS = st.sampled_from(
    ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/conversations", "/v1/embeddings", "/x", ""]
)
# Field names and values the parser looks at, so generated bodies reach its deeper checks.
KEYS = st.sampled_from(
    [
        "model",
        "prompt",
        "messages",
        "role",
        "content",
        "tool_calls",
        "type",
        "text",
        "image_url",
        "url",
        "input_audio",
        "data",
        "video_url",
        "input",
        "items",
        "instructions",
        "tools",
        "stream",
        "cache_salt",
    ]
) | st.text(max_size=5)
STRINGS = st.sampled_from(["m", "user", "assistant", "text", "image_url", "input_audio", "video_url", "", "x" * 300])
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | STRINGS
    | st.text(max_size=20)
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(KEYS, children, max_size=6),
    max_leaves=30,
)
BODIES = st.dictionaries(KEYS, JSON_VALUES, max_size=8).map(lambda body: {"model": "m", **body}) | JSON_VALUES


def parse_or_reject(body: bytes, path: str) -> InferenceRequest | None:
    try:
        request = parse_request(body, {":path": path}, "fuzz")
    except RequestError as error:
        assert error.status == 400
        assert error.message
        return None
    prompt_forms = (request.prompt_text, request.prompt_token_ids, request.messages)
    assert sum(form is not None for form in prompt_forms) == 1
    return request


@settings(max_examples=300, deadline=None)
@given(body=st.binary(max_size=300), path=PATHS)
def test_arbitrary_bytes_only_raise_request_error(body: bytes, path: str) -> None:
    parse_or_reject(body, path)


@settings(max_examples=300, deadline=None)
@given(payload=BODIES, path=PATHS)
def test_arbitrary_json_only_raises_request_error(payload: Any, path: str) -> None:
    request = parse_or_reject(orjson.dumps(payload), path)
    if request is not None:
        assert orjson.loads(rewrite_model(request.body, "other"))["model"] == "other"


@settings(max_examples=60, deadline=None)
@given(
    depth=st.integers(min_value=0, max_value=1500),
    field=st.sampled_from(["prompt", "messages", "input", "items", "tools", "extra"]),
)
def test_any_nesting_depth_only_raises_request_error(depth: int, field: str) -> None:
    body = b'{"model":"m","prompt":"p","input":"i","items":[],"messages":[{"role":"user","content":"c"}],'
    body += f'"{field}":'.encode() + b"[" * depth + b"{}" + b"]" * depth + b"}"
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/conversations", "/v1/embeddings"):
        request = parse_or_reject(body, path)
        if request is not None:
            try:
                rewrite_model(request.body, "other")
            except RequestError as error:
                assert error.status == 400
