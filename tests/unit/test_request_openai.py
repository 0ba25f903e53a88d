"""OpenAI request parsing: API selection, every API's prompt forms, and every 400."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
import xxhash

from picker.framework.request import Api, Message
from picker.request.errors import RequestError
from picker.request.openai import api_for_path, parse_request, rewrite_model

CHAT = {":path": "/v1/chat/completions"}
COMPLETIONS = {":path": "/v1/completions"}
RESPONSES = {":path": "/v1/responses"}
CONVERSATIONS = {":path": "/v1/conversations"}
EMBEDDINGS = {":path": "/v1/embeddings"}


def parse(payload: Any, headers: dict[str, str], **kwargs: Any):
    return parse_request(orjson.dumps(payload), headers, "req-1", **kwargs)


DEEP = "<deep>"


def with_deep(payload: Any, depth: int) -> bytes:
    """`payload` as JSON with the string DEEP replaced by arrays nested `depth` levels.

    Built as text because orjson cannot serialise more than 255 levels.
    """
    return orjson.dumps(payload).replace(b'"<deep>"', b"[" * depth + b"]" * depth)


@pytest.mark.parametrize(
    ("headers", "api"),
    [
        ({":path": "/v1/chat/completions"}, Api.CHAT_COMPLETIONS),
        ({":path": "/v1/chat/completions?api-version=1&x=/v1/embeddings"}, Api.CHAT_COMPLETIONS),
        ({":path": "/v1/completions"}, Api.COMPLETIONS),
        ({":path": "/v1/responses"}, Api.RESPONSES),
        ({":path": "/v1/conversations"}, Api.CONVERSATIONS),
        ({":path": "/v1/embeddings/"}, Api.EMBEDDINGS),
        ({":path": "/openai/deployments/x/embeddings"}, Api.EMBEDDINGS),
        ({":path": "/v1/generate"}, Api.COMPLETIONS),
        ({":path": "/"}, Api.COMPLETIONS),
        ({}, Api.COMPLETIONS),
        ({"x-original-path": "/v1/chat/completions"}, Api.CHAT_COMPLETIONS),
        ({"x-forwarded-path": "/v1/responses"}, Api.RESPONSES),
        ({"x-original-path": "/v1/embeddings", "x-forwarded-path": "/v1/responses"}, Api.EMBEDDINGS),
        ({":path": "/v1/responses", "x-original-path": "/v1/embeddings"}, Api.RESPONSES),
        ({":path": "", "x-original-path": "/v1/embeddings"}, Api.EMBEDDINGS),
    ],
)
def test_api_is_chosen_from_the_path_suffix(headers: dict[str, str], api: Api) -> None:
    payload = {
        "model": "m",
        "prompt": "p",
        "messages": [{"role": "user", "content": "c"}],
        "input": "i",
        "items": [],
    }
    assert parse(payload, headers).api is api


def test_api_for_path_ignores_query_string() -> None:
    assert api_for_path("/v1/models?next=/v1/chat/completions") is Api.COMPLETIONS


@pytest.mark.parametrize(
    ("prompt", "text", "token_ids"),
    [
        ("Hello world", "Hello world", None),
        ("", "", None),
        (["one"], "one", None),
        (["one", "two", "three"], "one two three", None),
        ([1, 2, 3], None, (1, 2, 3)),
        ([0, 2**32 - 1], None, (0, 2**32 - 1)),
        ([[1, 2], [3], []], None, (1, 2, 3)),
    ],
)
def test_completions_prompt_forms(prompt: Any, text: str | None, token_ids: tuple[int, ...] | None) -> None:
    request = parse({"model": "m", "prompt": prompt}, COMPLETIONS)
    assert request.prompt_text == text
    assert request.prompt_token_ids == token_ids
    assert request.messages is None


def test_request_fields_from_body_and_headers() -> None:
    body = orjson.dumps({"model": "llama", "prompt": "hi", "stream": True, "cache_salt": "s1"})
    headers = {
        ":path": "/v1/completions",
        "x-gateway-inference-objective": "premium",
        "x-gateway-inference-fairness-id": "team-a",
        "x-gateway-model-name-rewrite": "llama-lora",
        "x-tenant": "acme",
    }
    request = parse_request(body, headers, "req-7", tenant_header="X-Tenant")
    assert request.request_id == "req-7"
    assert request.model == "llama"
    assert request.target_model == "llama-lora"
    assert request.stream is True
    assert request.cache_salt == "s1"
    assert request.objective == "premium"
    assert request.fairness_id == "team-a"
    assert request.tenant == "acme"
    assert request.size_bytes == len(body)
    assert request.body == orjson.loads(body)
    assert request.headers is headers


def test_defaults_when_headers_and_optional_fields_are_absent() -> None:
    request = parse({"model": "llama", "prompt": "hi", "stream": None, "cache_salt": None}, COMPLETIONS)
    assert request.target_model == "llama"
    assert request.stream is False
    assert request.cache_salt is None
    assert request.objective is None
    assert request.fairness_id == "default-flow"
    assert request.tenant is None
    no_tenant = parse({"model": "llama", "prompt": "hi"}, COMPLETIONS, tenant_header="x-tenant")
    assert no_tenant.tenant is None


def test_chat_messages_flatten_content() -> None:
    long_url = "data:image/png;base64," + "A" * 1000
    request = parse(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "look"},
                        {"type": "image_url", "image_url": {"url": "https://x/cat.png"}},
                        {"type": "image_url", "image_url": {"url": long_url}},
                        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
                        {"type": "video_url", "video_url": {"url": "https://x/v.mp4"}},
                        {"type": "text", "text": "again"},
                    ],
                },
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                },
                {"role": "tool", "content": "42", "tool_call_id": "c1"},
            ],
        },
        CHAT,
    )
    digest = xxhash.xxh3_128_hexdigest(long_url.encode())
    assert request.messages == (
        Message("system", "be brief"),
        Message(
            "user",
            "look\n<image_url:https://x/cat.png>\n<image_url:xxh3-128:" + digest + ">\n"
            "<input_audio:UklGRg==>\n<video_url:https://x/v.mp4>\nagain",
        ),
        Message("assistant", '[{"function":{"arguments":"{}","name":"f"},"id":"c1","type":"function"}]'),
        Message("tool", "42"),
    )
    assert request.prompt_text is None and request.prompt_token_ids is None


def test_chat_rendering_ignores_key_order_of_unknown_parts() -> None:
    first = parse({"model": "m", "messages": [{"role": "user", "content": [{"type": "file", "a": 1, "b": 2}]}]}, CHAT)
    second = parse({"model": "m", "messages": [{"role": "user", "content": [{"b": 2, "a": 1, "type": "file"}]}]}, CHAT)
    assert first.messages == second.messages
    assert first.messages is not None and first.messages[0].content == '<file:{"a":1,"b":2,"type":"file"}>'


def test_responses_text_is_prefix_stable_across_turns() -> None:
    turn = [{"role": "user", "content": "hi"}]
    first = parse({"model": "m", "instructions": "be nice", "tools": [{"type": "web"}], "input": turn}, RESPONSES)
    longer = turn + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    second = parse({"model": "m", "instructions": "be nice", "tools": [{"type": "web"}], "input": longer}, RESPONSES)
    assert first.prompt_text == 'be nice\n[{"type":"web"}]\n{"content":"hi","role":"user"}'
    assert second.prompt_text is not None and second.prompt_text.startswith(first.prompt_text + "\n")
    assert parse({"model": "m", "input": "just text"}, RESPONSES).prompt_text == "just text"


def test_conversations_and_embeddings() -> None:
    conversation = parse({"model": "m", "items": [{"type": "message", "role": "user", "content": "x"}]}, CONVERSATIONS)
    assert conversation.prompt_text == '{"content":"x","role":"user","type":"message"}'
    assert parse({"model": "m", "input": ["a", "b"]}, EMBEDDINGS).prompt_text == "a b"
    assert parse({"model": "m", "input": [[5, 6], [7]]}, EMBEDDINGS).prompt_token_ids == (5, 6, 7)


def test_ten_megabyte_prompt_is_accepted() -> None:
    prompt = "token " * (10 * 1024 * 1024 // 6)
    body = orjson.dumps({"model": "m", "prompt": prompt})
    request = parse_request(body, COMPLETIONS, "big")
    assert request.prompt_text == prompt
    assert request.size_bytes == len(body) > 10_000_000


def test_deep_nesting_orjson_can_read_is_accepted_where_unread() -> None:
    request = parse_request(with_deep({"model": "m", "prompt": "p", "metadata": DEEP}, 1000), COMPLETIONS, "r")
    assert request.prompt_text == "p"


BAD_REQUESTS: list[tuple[str, dict[str, str], bytes | Any, str | None, str]] = [
    # (case id, headers, body (bytes or a value to serialise), expected param, message fragment)
    ("invalid json", COMPLETIONS, b'{"model": "m",', None, "not valid JSON"),
    ("empty body", COMPLETIONS, b"", None, "not valid JSON"),
    ("invalid utf-8", COMPLETIONS, b'{"model": "m", "prompt": "\xff\xfe"}', None, "not valid JSON"),
    ("lone surrogate", COMPLETIONS, b'{"model": "m", "prompt": "\\ud800"}', None, "not valid JSON"),
    ("too deep for orjson", COMPLETIONS, b'{"model":"m","prompt":' + b"[" * 5000 + b"]" * 5000 + b"}", None, "JSON"),
    ("huge number", COMPLETIONS, b'{"model": "m", "prompt": 1e999}', None, "not valid JSON"),
    ("array body", COMPLETIONS, [], None, "JSON object"),
    ("string body", COMPLETIONS, "text", None, "JSON object"),
    ("null body", COMPLETIONS, None, None, "JSON object"),
    ("model missing", COMPLETIONS, {"prompt": "p"}, "model", "model not found"),
    ("model null", COMPLETIONS, {"model": None, "prompt": "p"}, "model", "model not found"),
    ("model number", COMPLETIONS, {"model": 3, "prompt": "p"}, "model", "model not found"),
    ("model empty", COMPLETIONS, {"model": "", "prompt": "p"}, "model", "model not found"),
    ("model object", CHAT, {"model": {"name": "m"}, "messages": []}, "model", "model not found"),
    ("stream string", COMPLETIONS, {"model": "m", "prompt": "p", "stream": "true"}, "stream", "boolean"),
    ("stream number", COMPLETIONS, {"model": "m", "prompt": "p", "stream": 1}, "stream", "boolean"),
    ("cache_salt empty", COMPLETIONS, {"model": "m", "prompt": "p", "cache_salt": ""}, "cache_salt", "non-empty"),
    ("cache_salt number", COMPLETIONS, {"model": "m", "prompt": "p", "cache_salt": 7}, "cache_salt", "string"),
    ("prompt missing", COMPLETIONS, {"model": "m"}, "prompt", "required"),
    ("prompt null", COMPLETIONS, {"model": "m", "prompt": None}, "prompt", "required"),
    ("prompt number", COMPLETIONS, {"model": "m", "prompt": 5}, "prompt", "must be a string"),
    ("prompt object", COMPLETIONS, {"model": "m", "prompt": {"t": 1}}, "prompt", "must be a string"),
    ("prompt bool", COMPLETIONS, {"model": "m", "prompt": True}, "prompt", "must be a string"),
    ("prompt empty list", COMPLETIONS, {"model": "m", "prompt": []}, "prompt", "non-empty"),
    ("prompt float token", COMPLETIONS, {"model": "m", "prompt": [1, 2.0]}, "prompt[1]", "token id"),
    ("prompt bool token", COMPLETIONS, {"model": "m", "prompt": [1, True]}, "prompt[1]", "token id"),
    ("prompt first bool", COMPLETIONS, {"model": "m", "prompt": [False, 1]}, "prompt[0]", "token id"),
    ("prompt negative token", COMPLETIONS, {"model": "m", "prompt": [3, -1]}, "prompt[1]", "0..4294967295"),
    ("prompt token too big", COMPLETIONS, {"model": "m", "prompt": [2**32]}, "prompt[0]", "0..4294967295"),
    ("prompt string then int", COMPLETIONS, {"model": "m", "prompt": ["a", 1]}, "prompt[1]", "a string"),
    ("prompt int then string", COMPLETIONS, {"model": "m", "prompt": [1, "a"]}, "prompt[1]", "token id"),
    ("prompt null element", COMPLETIONS, {"model": "m", "prompt": ["a", None]}, "prompt[1]", "got null"),
    ("prompt object element", COMPLETIONS, {"model": "m", "prompt": [{}]}, "prompt[0]", "token id"),
    ("prompt list then int", COMPLETIONS, {"model": "m", "prompt": [[1], 2]}, "prompt[1]", "array of token ids"),
    ("prompt nested bool", COMPLETIONS, {"model": "m", "prompt": [[1], [2, True]]}, "prompt[1][1]", "token id"),
    ("prompt nested string", COMPLETIONS, {"model": "m", "prompt": [["a"]]}, "prompt[0][0]", "token id"),
    ("prompt nested too deep", COMPLETIONS, {"model": "m", "prompt": [[[1]]]}, "prompt[0][0]", "token id"),
    ("unknown path, no prompt", {":path": "/v2/x"}, {"model": "m", "messages": []}, "prompt", "required"),
    ("messages missing", CHAT, {"model": "m"}, "messages", "non-empty array"),
    ("messages empty", CHAT, {"model": "m", "messages": []}, "messages", "non-empty array"),
    ("messages object", CHAT, {"model": "m", "messages": {"role": "user"}}, "messages", "non-empty array"),
    ("messages string", CHAT, {"model": "m", "messages": "hi"}, "messages", "non-empty array"),
    ("message string", CHAT, {"model": "m", "messages": ["hi"]}, "messages[0]", "object"),
    (
        "role missing",
        CHAT,
        {"model": "m", "messages": [{"role": "user", "content": "a"}, {"content": "b"}]},
        "messages[1].role",
        "string",
    ),
    ("role number", CHAT, {"model": "m", "messages": [{"role": 1, "content": "a"}]}, "messages[0].role", "string"),
    (
        "content number",
        CHAT,
        {"model": "m", "messages": [{"role": "user", "content": "a"}] * 2 + [{"role": "user", "content": 3}]},
        "messages[2].content",
        "string or an array",
    ),
    ("content object", CHAT, {"model": "m", "messages": [{"role": "user", "content": {}}]}, "messages[0].content", ""),
    ("content missing", CHAT, {"model": "m", "messages": [{"role": "user"}]}, "messages[0].content", "null only"),
    (
        "user content null",
        CHAT,
        {"model": "m", "messages": [{"role": "user", "content": None}]},
        "messages[0].content",
        "tool_calls",
    ),
    (
        "assistant null, no tool_calls",
        CHAT,
        {"model": "m", "messages": [{"role": "assistant", "content": None}]},
        "messages[0].content",
        "tool_calls",
    ),
    (
        "assistant null, empty tool_calls",
        CHAT,
        {"model": "m", "messages": [{"role": "assistant", "content": None, "tool_calls": []}]},
        "messages[0].content",
        "tool_calls",
    ),
    (
        "tool_calls object",
        CHAT,
        {"model": "m", "messages": [{"role": "assistant", "content": None, "tool_calls": {}}]},
        "messages[0].tool_calls",
        "array",
    ),
    (
        "tool_calls too deep",
        CHAT,
        with_deep({"model": "m", "messages": [{"role": "assistant", "content": "x", "tool_calls": [DEEP]}]}, 300),
        "messages[0].tool_calls",
        "nests too deeply",
    ),
    (
        "part string",
        CHAT,
        {"model": "m", "messages": [{"role": "user", "content": ["hi"]}]},
        "messages[0].content[0]",
        "object",
    ),
    (
        "part type missing",
        CHAT,
        {"model": "m", "messages": [{"role": "user", "content": [{"text": "hi"}]}]},
        "messages[0].content[0].type",
        "string",
    ),
    (
        "text part number",
        CHAT,
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
        "messages[0].content[0].text",
        "string",
    ),
    (
        "image_url string",
        CHAT,
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]},
        "messages[0].content[0].image_url.url",
        "string",
    ),
    (
        "image url missing",
        CHAT,
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0].image_url.url",
        "string",
    ),
    (
        "audio data number",
        CHAT,
        {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": 1}}]}],
        },
        "messages[0].content[0].input_audio.data",
        "string",
    ),
    (
        "video missing",
        CHAT,
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "video_url"}]}]},
        "messages[0].content[0].video_url.url",
        "string",
    ),
    ("responses input missing", RESPONSES, {"model": "m"}, "input", "required"),
    ("responses input number", RESPONSES, {"model": "m", "input": 3}, "input", "string or an array"),
    ("responses input object", RESPONSES, {"model": "m", "input": {"a": 1}}, "input", "string or an array"),
    ("responses item string", RESPONSES, {"model": "m", "input": [{}, "x"]}, "input[1]", "object"),
    ("responses item too deep", RESPONSES, with_deep({"model": "m", "input": [{"a": DEEP}]}, 300), "input[0]", "deep"),
    ("instructions number", RESPONSES, {"model": "m", "input": "x", "instructions": 1}, "instructions", "string"),
    ("tools object", RESPONSES, {"model": "m", "input": "x", "tools": {}}, "tools", "array"),
    ("conversations items missing", CONVERSATIONS, {"model": "m"}, "items", "required"),
    ("conversations items object", CONVERSATIONS, {"model": "m", "items": {}}, "items", "array of items"),
    ("conversations item number", CONVERSATIONS, {"model": "m", "items": [1]}, "items[0]", "object"),
    ("embeddings input missing", EMBEDDINGS, {"model": "m"}, "input", "required"),
    ("embeddings input object", EMBEDDINGS, {"model": "m", "input": {}}, "input", "must be a string"),
    ("embeddings token bool", EMBEDDINGS, {"model": "m", "input": [True]}, "input[0]", "token id"),
    (
        "kv params string",
        COMPLETIONS,
        {"model": "m", "prompt": "p", "kv_transfer_params": "x"},
        "kv_transfer_params",
        "object",
    ),
    (
        "kv params flag string",
        CHAT,
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "kv_transfer_params": {"do_remote_prefill": "yes"},
        },
        "kv_transfer_params.do_remote_prefill",
        "boolean",
    ),
    (
        "kv params block ids",
        COMPLETIONS,
        {"model": "m", "prompt": "p", "kv_transfer_params": {"remote_block_ids": [1, -2]}},
        "kv_transfer_params.remote_block_ids",
        "non-negative",
    ),
    (
        "kv params port string",
        COMPLETIONS,
        {"model": "m", "prompt": "p", "kv_transfer_params": {"remote_port": "80"}},
        "kv_transfer_params.remote_port",
        "number",
    ),
]


@pytest.mark.parametrize(
    ("headers", "body", "param", "fragment"),
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
def test_bad_requests_are_400_naming_the_field(
    headers: dict[str, str], body: bytes | Any, param: str | None, fragment: str
) -> None:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    with pytest.raises(RequestError) as caught:
        parse_request(raw, headers, "req-bad")
    error = caught.value
    assert error.status == 400
    assert error.param == param
    assert fragment in error.message
    if param is not None:
        assert param in error.message
    assert orjson.loads(error.body())["error"]["param"] == param


def test_well_formed_kv_transfer_params_pass() -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [0, 7], "remote_host": "h", "remote_port": 1, "x": 1}
    assert parse({"model": "m", "prompt": "p", "kv_transfer_params": params}, COMPLETIONS).body["kv_transfer_params"]
    assert parse({"model": "m", "prompt": "p", "kv_transfer_params": None}, COMPLETIONS).prompt_text == "p"


def test_rewrite_model_replaces_only_the_model() -> None:
    request = parse({"stream": True, "model": "a", "prompt": "p", "n": 2}, COMPLETIONS)
    rewritten = rewrite_model(request.body, "b")
    assert rewritten == b'{"stream":true,"model":"b","prompt":"p","n":2}'
    assert request.body["model"] == "a"


def test_rewrite_model_of_a_body_too_deep_to_serialise_is_a_400() -> None:
    request = parse_request(with_deep({"model": "a", "prompt": "p", "metadata": DEEP}, 300), COMPLETIONS, "r")
    with pytest.raises(RequestError) as caught:
        rewrite_model(request.body, "b")
    assert caught.value.status == 400
