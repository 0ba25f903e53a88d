"""Parse an OpenAI-style request body into an `InferenceRequest` (the reference's openai-parser).

The API is chosen from the request path; each API's prompt field is validated and turned into
the form prefix matching needs: plain text, token ids, or chat messages. Every problem with the
input is a `RequestError` (400) naming the offending field; nothing else escapes.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from functools import lru_cache
from itertools import chain
from typing import Any, NamedTuple

import orjson
import xxhash

from picker.framework.request import Api, InferenceRequest, Message
from picker.request.errors import RequestError, bad_request

OBJECTIVE_HEADER = "x-gateway-inference-objective"
FAIRNESS_ID_HEADER = "x-gateway-inference-fairness-id"
MODEL_REWRITE_HEADER = "x-gateway-model-name-rewrite"
DEFAULT_FAIRNESS_ID = "default-flow"


class FlowHeaders(NamedTuple):
    """What a request's headers say about its flow, the same for every parser."""

    objective: str | None
    fairness_id: str
    tenant: str | None


def flow_headers(headers: Mapping[str, str], tenant_header: str | None) -> FlowHeaders:
    """The InferenceObjective, the fairness id (the default flow when absent) and the tenant
    (from the configured header) of a request."""
    tenant = headers.get(tenant_header.lower()) if tenant_header else None
    return FlowHeaders(
        headers.get(OBJECTIVE_HEADER) or None, headers.get(FAIRNESS_ID_HEADER) or DEFAULT_FAIRNESS_ID, tenant or None
    )


# Longest suffix first: "/chat/completions" must win over "/completions".
_API_BY_SUFFIX = (
    ("/chat/completions", Api.CHAT_COMPLETIONS),
    ("/completions", Api.COMPLETIONS),
    ("/responses", Api.RESPONSES),
    ("/conversations", Api.CONVERSATIONS),
    ("/embeddings", Api.EMBEDDINGS),
)

_MAX_TOKEN_ID = 2**32 - 1  # token ids are hashed as uint32 (picker.prefix.hashing)

# Media content parts: the part's field and the key inside it that identifies the media.
_MEDIA_REFERENCE = {
    "image_url": "url",
    "video_url": "url",
    "audio_url": "url",
    "input_audio": "data",
}
# Media references longer than this (base64 data URLs, inline audio) are replaced by a digest,
# so the placeholder stays deterministic without inflating the prompt's size estimate.
_MAX_REFERENCE_CHARS = 256

_TOKEN_ID = f"a token id (an integer in 0..{_MAX_TOKEN_ID})"
_PROMPT_TYPES = "a string, an array of strings, an array of token ids or an array of token-id arrays"


def request_path(headers: Mapping[str, str]) -> str:
    """The request's path: Envoy's `:path`, else what a proxy in front recorded."""
    return headers.get(":path") or headers.get("x-original-path") or headers.get("x-forwarded-path") or ""


@lru_cache(maxsize=1024)  # few distinct paths, one lookup per request
def api_for_path(path: str) -> Api:
    """The API a request path targets, by suffix (query string ignored); unknown → completions."""
    path = path.partition("?")[0].rstrip("/")
    for suffix, api in _API_BY_SUFFIX:
        if path.endswith(suffix):
            return api
    return Api.COMPLETIONS


def parse_request(
    body: bytes,
    headers: Mapping[str, str],
    request_id: str,
    tenant_header: str | None = None,
) -> InferenceRequest:
    """Parse one request body; `headers` have lower-case names, repeated values already joined.

    Raises `RequestError` (400, `param` naming the field) for any invalid input.
    """
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise bad_request(f"request body must be a JSON object, got {_json_type(payload)}")

    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model not found in request body: 'model' must be a non-empty string", "model")

    api = api_for_path(request_path(headers))
    prompt_text: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[Message, ...] | None = None
    if api is Api.COMPLETIONS:
        prompt_text, prompt_token_ids = _text_or_tokens(_required(payload, "prompt"), "prompt")
    elif api is Api.CHAT_COMPLETIONS:
        messages = _messages(payload.get("messages"))
    elif api is Api.RESPONSES:
        prompt_text = _responses_text(payload)
    elif api is Api.CONVERSATIONS:
        prompt_text = "\n".join(_items(_required(payload, "items"), "items"))
    else:
        prompt_text, prompt_token_ids = _text_or_tokens(_required(payload, "input"), "input")

    _check_kv_transfer_params(payload.get("kv_transfer_params"))
    flow = flow_headers(headers, tenant_header)
    return InferenceRequest(
        request_id=request_id,
        api=api,
        model=model,
        target_model=headers.get(MODEL_REWRITE_HEADER) or model,
        stream=_stream(payload),
        cache_salt=_cache_salt(payload),
        prompt_text=prompt_text,
        prompt_token_ids=prompt_token_ids,
        messages=messages,
        body=payload,
        headers=headers,
        objective=flow.objective,
        fairness_id=flow.fairness_id,
        tenant=flow.tenant,
        size_bytes=len(body),
    )


def rewrite_model(body: Mapping[str, Any], target: str) -> bytes:
    """`body` serialised again with `model` set to `target` (key order kept).

    Raises `RequestError` (400) if the body nests deeper than orjson can serialise (255 levels),
    which a body accepted by `parse_request` may still do in a field the picker does not read.
    """
    try:
        return orjson.dumps({**body, "model": target})
    except orjson.JSONEncodeError as exc:
        raise bad_request(f"request body cannot be re-serialised: {exc}") from None


def _json_type(value: object) -> str:
    """The JSON name of a decoded value's type, for error messages (never its contents)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _field_error(field: str, problem: str) -> RequestError:
    return bad_request(f"'{field}' {problem}", field)


def _required(payload: dict[str, Any], name: str) -> Any:
    value = payload.get(name)
    if value is None:
        raise _field_error(name, "is required")
    return value


def _stream(payload: dict[str, Any]) -> bool:
    stream = payload.get("stream")
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise _field_error("stream", f"must be a boolean, got {_json_type(stream)}")
    return stream


def _cache_salt(payload: dict[str, Any]) -> str | None:
    salt = payload.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise _field_error("cache_salt", "must be a non-empty string")
    return salt


# vLLM's KV connector fields (NixlConnector) and the JSON type each must have when not null.
_KV_TRANSFER_FIELDS = {
    "do_remote_prefill": "boolean",
    "do_remote_decode": "boolean",
    "remote_block_ids": "array",
    "remote_engine_id": "string",
    "remote_request_id": "string",
    "remote_host": "string",
    "remote_port": "number",
    "tp_size": "number",
}


def _check_kv_transfer_params(value: Any) -> None:
    """A client's `kv_transfer_params` (prefill/decode disaggregation's) must have the types vLLM
    reads, so the request fails alike whichever path it takes: a disaggregated request's are
    replaced by the sidecar's, and only the EPP sees every request's."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise _field_error("kv_transfer_params", f"must be an object, got {_json_type(value)}")
    for name, expected in _KV_TRANSFER_FIELDS.items():
        field = value.get(name)
        if field is not None and _json_type(field) != expected:
            raise _field_error(f"kv_transfer_params.{name}", f"must be a {expected}, got {_json_type(field)}")
    block_ids = value.get("remote_block_ids")
    if block_ids is not None and not all(type(b) is int and b >= 0 for b in block_ids):
        raise _field_error("kv_transfer_params.remote_block_ids", "must be an array of non-negative integers")


def _canonical_json(value: Any, field: str) -> str:
    """Key-sorted JSON text of `value`: the same content renders the same for every client."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    except orjson.JSONEncodeError:
        raise _field_error(field, "nests too deeply") from None


def _text_or_tokens(value: Any, field: str) -> tuple[str | None, tuple[int, ...] | None]:
    """A completions prompt (or embeddings input) as (text, None) or (None, token ids).

    An array of strings is joined with a single space, as the reference EPP does before prefix
    hashing; a one-element array then hashes exactly like the plain string. An array of
    token-id arrays is concatenated into one token sequence.
    """
    if isinstance(value, str):
        return value, None
    if not isinstance(value, list) or not value:
        raise _field_error(field, f"must be {_PROMPT_TYPES} (non-empty)")
    first = type(value[0])
    if first is str and set(map(type, value)) == {str}:
        return " ".join(value), None
    if first is list and set(map(type, value)) == {list}:
        token_ids = _token_ids(list(chain.from_iterable(value)))
    else:
        token_ids = _token_ids(value)
    if token_ids is None:
        raise _prompt_element_error(value, field)
    return None, token_ids


def _token_ids(values: list[Any]) -> tuple[int, ...] | None:
    """`values` as a tuple if every one is a uint32 token id, else None.

    Both checks run in C (no per-element Python code): array("I") rejects non-integers and
    out-of-range values but takes booleans as 0/1, and only JSON true/false render with an "e".
    """
    try:
        array("I", values)
    except (TypeError, OverflowError):
        return None
    if b"e" in orjson.dumps(values):
        return None
    return tuple(values)


def _prompt_element_error(value: list[Any], field: str) -> RequestError:
    """The error naming the first element that breaks the kind `value[0]` sets for the array."""
    kind = type(value[0])
    for index, item in enumerate(value):
        where = f"{field}[{index}]"
        if kind is str:
            if type(item) is not str:
                return _field_error(where, f"must be a string like '{field}[0]', got {_json_type(item)}")
        elif kind is list:
            if type(item) is not list:
                return _field_error(where, f"must be an array of token ids, got {_json_type(item)}")
            inner = next((i for i, token in enumerate(item) if not _is_token_id(token)), None)
            if inner is not None:
                return _field_error(f"{where}[{inner}]", f"must be {_TOKEN_ID}")
        elif not _is_token_id(item):
            return _field_error(where, f"must be {_TOKEN_ID}, a string or an array of token ids")
    return _field_error(field, f"must be {_PROMPT_TYPES}")  # every element fits: not reached


def _is_token_id(value: Any) -> bool:
    return type(value) is int and 0 <= value <= _MAX_TOKEN_ID


def _messages(value: Any) -> tuple[Message, ...]:
    if not isinstance(value, list) or not value:
        raise _field_error("messages", "must be a non-empty array")
    return tuple([_message(message, index) for index, message in enumerate(value)])


def _message(message: Any, index: int) -> Message:
    """One chat message, its content flattened to text (tool calls appended as JSON)."""
    if not isinstance(message, dict):
        raise _field_error(f"messages[{index}]", "must be an object")
    role = message.get("role")
    if not isinstance(role, str):
        raise _field_error(f"messages[{index}].role", "must be a string")
    content = message.get("content")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None and not isinstance(tool_calls, list):
        raise _field_error(f"messages[{index}].tool_calls", "must be an array")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        # vLLM joins text parts with a newline when it renders the chat template.
        text = "\n".join([_content_part(part, index, i) for i, part in enumerate(content)])
    elif content is None and role == "assistant" and tool_calls:
        text = ""
    else:
        raise _field_error(
            f"messages[{index}].content",
            "must be a string or an array of content parts (null only for an assistant message with tool_calls)",
        )
    if tool_calls:
        # Tool calls are part of the rendered conversation, so they belong in the prefix.
        calls = _canonical_json(tool_calls, f"messages[{index}].tool_calls")
        text = f"{text}\n{calls}" if text else calls
    return Message(role, text)


def _content_part(part: Any, message_index: int, index: int) -> str:
    """A content part as text; media parts become a stable placeholder naming the media."""
    if not isinstance(part, dict):
        raise _field_error(f"messages[{message_index}].content[{index}]", "must be an object")
    kind = part.get("type")
    if not isinstance(kind, str):
        raise _field_error(f"messages[{message_index}].content[{index}].type", "must be a string")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise _field_error(f"messages[{message_index}].content[{index}].text", "must be a string")
        return text
    key = _MEDIA_REFERENCE.get(kind)
    if key is None:
        reference = _canonical_json(part, f"messages[{message_index}].content[{index}]")
    else:
        media = part.get(kind)
        value = media.get(key) if isinstance(media, dict) else None
        if not isinstance(value, str):
            raise _field_error(f"messages[{message_index}].content[{index}].{kind}.{key}", "must be a string")
        reference = value
    if len(reference) > _MAX_REFERENCE_CHARS:
        reference = "xxh3-128:" + xxhash.xxh3_128_hexdigest(reference.encode())
    return f"<{kind}:{reference}>"


def _items(value: Any, field: str) -> list[str]:
    """Each item of a Responses/Conversations item array as canonical JSON text."""
    if not isinstance(value, list):
        raise _field_error(field, "must be an array of items")
    rendered = []
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            raise _field_error(f"{field}[{index}]", "must be an object")
        rendered.append(_canonical_json(item, f"{field}[{index}]"))
    return rendered


def _responses_text(payload: dict[str, Any]) -> str:
    """Instructions, tools and input as lines, in the reference's order.

    One line per input item keeps the rendering prefix-stable: a follow-up request that
    appends items renders to an extension of the earlier text.
    """
    instructions = payload.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _field_error("instructions", "must be a string")
    tools = payload.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _field_error("tools", "must be an array")
    source = _required(payload, "input")
    if not isinstance(source, (str, list)):
        raise _field_error("input", "must be a string or an array of items")
    lines = [instructions] if instructions else []
    if tools:
        lines.append(_canonical_json(tools, "tools"))
    if isinstance(source, str):
        lines.append(source)
    else:
        lines.extend(_items(source, "input"))
    return "\n".join(lines)
