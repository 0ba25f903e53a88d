"""`request-attribute-reporter`: CEL over the response's usage, reported as dynamic metadata,
with the reference plugin's rules (its README, plugin.go and the integration tests
test/integration/epp/request_attribute_reporter*_test.go, whose exchanges are replayed here
over a real grpc.aio server and channel, a client standing in for Envoy as in the reference's)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from picker.config.loader import build, parse_text
from picker.config.runtime import RuntimeHolder
from picker.config.schema import ConfigError
from picker.datastore.store import Datastore
from picker.extproc.servicer import ExtProcSettings
from picker.framework.request import Api, InferenceRequest, Usage
from picker.request.attribute_reporter import RequestAttributeReporter
from picker.requestcontrol.director import Director
from tests.unit.test_extproc_stream import ENDPOINTS, body, headers, serving

COST = "x-gateway-inference-request-cost"
REQUEST = InferenceRequest("r1", Api.COMPLETIONS, "m", "m", prompt_text="hello")
# The reference integration test's config (testdata/request-attribute-reporter-config.yaml).
REFERENCE_ATTRIBUTE = {
    "key": {"namespace": "envoy.lb", "name": COST},
    "expression": "usage.completion_tokens\n",
    "condition": "has(usage.completion_tokens)",
}


def config_text(*attributes: Mapping[str, Any]) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
            "kind": "EndpointPickerConfig",
            "plugins": [
                {"type": "queue-scorer"},
                {"name": "cost", "type": "request-attribute-reporter", "parameters": {"attributes": list(attributes)}},
            ],
        }
    )


def reporter(expression: str, condition: str = "", **key: str) -> RequestAttributeReporter:
    attribute: dict[str, Any] = {"key": {"name": COST, **key}, "expression": expression}
    if condition:
        attribute["condition"] = condition
    plugin = build(parse_text(config_text(attribute))).plugins["cost"]
    assert isinstance(plugin, RequestAttributeReporter)
    return plugin


def config_errors(*attributes: Mapping[str, Any]) -> str:
    with pytest.raises(ConfigError) as caught:
        build(parse_text(config_text(*attributes)))
    return str(caught.value)


def test_the_readme_example_reports_total_tokens_in_envoy_lb() -> None:
    plugin = reporter(
        "usage.prompt_tokens + usage.completion_tokens", "has(usage.prompt_tokens) && has(usage.completion_tokens)"
    )
    assert plugin.response_metadata(REQUEST, Usage(32, 10, 0, 42)) == {"envoy.lb": {COST: 42.0}}


def test_the_namespace_is_the_one_configured() -> None:
    plugin = reporter("usage.total_tokens", namespace="billing")
    assert plugin.response_metadata(REQUEST, Usage(32, 10, 0, 42)) == {"billing": {COST: 42.0}}


@pytest.mark.parametrize(
    ("expression", "condition", "usage", "reported"),
    [
        ("usage.completion_tokens", "usage.completion_tokens > 5.0", Usage(1, 4), None),  # condition false
        ("usage.completion_tokens", "'yes'", Usage(1, 4), None),  # a condition that is not a bool: not met
        ("usage.completion_tokens", "", Usage(), None),  # zero is not reported (no usage yet)
        ("usage.completion_tokens / 3.0", "", Usage(1, 10), 3.0),  # doubles are truncated to an integer
        ("-usage.completion_tokens / 4.0", "", Usage(1, 10), -2.0),  # toward zero, as Go's int64()
        ("int(usage.prompt_tokens) * 2", "", Usage(7, 1), 14.0),  # an int is a number too
        ("usage.prompt_token_details.cached_tokens", "", Usage(8, 1, 6), 6.0),
        ("usage.prompt_token_details.cached_tokens", "", Usage(8, 1, 0), None),  # no such key: an eval error
        ("string(usage.prompt_tokens)", "", Usage(8, 1), None),  # not a number
        ("uint(usage.prompt_tokens)", "", Usage(8, 1), None),  # cel-go's uint64 is not accepted either
        ("usage.prompt_tokens / 0.0", "", Usage(8, 1), None),  # not finite
    ],
)
def test_the_reference_rules_for_what_is_reported(
    expression: str, condition: str, usage: Usage, reported: float | None
) -> None:
    metadata = reporter(expression, condition).response_metadata(REQUEST, usage)
    assert metadata == ({} if reported is None else {"envoy.lb": {COST: reported}})


def test_an_evaluation_error_is_logged_naming_the_request(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR):
        assert reporter("usage.no_such_count").response_metadata(REQUEST, Usage(1, 1)) == {}
    assert "request r1: expression of cost failed" in caplog.text and "no_such_count" in caplog.text


@pytest.mark.parametrize(
    ("attributes", "error"),
    [
        ([], "plugins[1].parameters.attributes: must contain exactly one entry, got 0"),
        ([REFERENCE_ATTRIBUTE, REFERENCE_ATTRIBUTE], "plugins[1].parameters.attributes: must contain exactly one"),
        ([{"expression": "1"}], "plugins[1].parameters.attributes[0].key.name: must not be empty"),
        ([{"key": {"name": COST}}], "plugins[1].parameters.attributes[0].expression: must not be empty"),
        (
            [{"key": {"name": COST, "space": "x"}, "expression": "1"}],
            "plugins[1].parameters.attributes[0].key.space: unknown parameter",
        ),
        (
            [{**REFERENCE_ATTRIBUTE, "when": "true"}],
            "plugins[1].parameters.attributes[0].when: unknown parameter",
        ),
        (
            [{"key": {"name": COST}, "expression": "usage.prompt_tokens +"}],
            "plugins[1].parameters.attributes[0].expression: failed to compile: ERROR: <input>:1:22: Syntax error",
        ),
        (
            [{"key": {"name": COST}, "expression": "request.size"}],
            "plugins[1].parameters.attributes[0].expression: failed to compile: ERROR: <input>:1:8: "
            "undeclared reference to 'request.size'",
        ),
        (
            [{"key": {"name": COST}, "expression": "1", "condition": "1 + 'a'"}],
            "plugins[1].parameters.attributes[0].condition: failed to compile: ERROR: <input>:1:3: "
            "found no matching overload for '_+_' applied to '(int, string)'",
        ),
    ],
)
def test_bad_parameters_are_config_errors_naming_the_place(attributes: list[Any], error: str) -> None:
    assert error in config_errors(*attributes)


# -- the reference integration tests' exchanges, over a real gRPC stream --------------------


@pytest.fixture
async def stub() -> AsyncIterator[pb_grpc.ExternalProcessorStub]:
    store = Datastore()
    store.set_endpoints(ENDPOINTS)
    runtimes = RuntimeHolder(store)
    runtimes.load_text(config_text(REFERENCE_ATTRIBUTE))
    async with serving(Director(store, runtimes), ExtProcSettings(close_wait_seconds=0.1)) as stub:
        yield stub


def response_headers(content_type: str) -> pb.ProcessingRequest:
    pairs = {":status": "200", "content-type": content_type}
    return pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
            )
        )
    )


async def exchange(
    stub: pb_grpc.ExternalProcessorStub, content_type: str, chunks: list[bytes]
) -> list[pb.ProcessingResponse]:
    """Request headers and body, response headers and `chunks` as Envoy sends them in duplex
    mode; the answers to the response messages (headers, then one per chunk)."""
    call = stub.Process()
    await call.write(headers(path="/v1/chat/completions"))
    await call.write(
        body(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}]}).encode(), True)
    )
    await call.read()  # the routing headers
    await call.read()  # the re-emitted body
    answers = []
    await call.write(response_headers(content_type))
    answers.append(await call.read())
    for i, chunk in enumerate(chunks):
        await call.write(
            pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=i == len(chunks) - 1))
        )
        answers.append(await call.read())
    call.cancel()
    return answers


def cost(answer: pb.ProcessingResponse) -> float | None:
    if not answer.HasField("dynamic_metadata"):
        return None
    value: float = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields[COST].number_value
    return value


async def test_a_json_response_reports_on_the_answer_to_its_last_chunk(stub: pb_grpc.ExternalProcessorStub) -> None:
    # The reference's TestRequestAttributeReporter body, split in two chunks.
    answer = json.dumps(
        {
            "choices": [{"finish_reason": "stop", "index": 0, "message": {"content": "Hi", "role": "assistant"}}],
            "model": "modelName",
            "object": "chat.completion",
            "usage": {"completion_tokens": 10, "prompt_tokens": 32, "total_tokens": 42},
        }
    ).encode()
    answers = await exchange(stub, "application/json", [answer[:40], answer[40:]])
    assert [cost(a) for a in answers] == [None, None, 10.0]
    assert answers[-1].response_body.response.body_mutation.streamed_response.body == answer[40:]


async def test_an_event_stream_reports_from_the_chunk_carrying_usage_on(stub: pb_grpc.ExternalProcessorStub) -> None:
    # The reference's TestRequestAttributeReporterStreaming chunks.
    chunks = [
        b'data: {"choices":[{"delta":{"content":"Hello! "},"index":0,"finish_reason":null}],"id":"123",'
        b'"created":1,"model":"modelName","object":"chat.completion.chunk"}\n',
        b'data: {"choices":[{"delta":{},"index":0,"finish_reason":"stop"}],"id":"123","created":1,'
        b'"model":"modelName","object":"chat.completion.chunk",'
        b'"usage":{"completion_tokens":10,"prompt_tokens":32,"total_tokens":42}}\n',
        b"data: [DONE]\n",
    ]
    answers = await exchange(stub, "text/event-stream", chunks)
    assert [cost(a) for a in answers] == [None, None, 10.0, 10.0]
