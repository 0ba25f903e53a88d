"""`vllmgrpc-parser`: vLLM gRPC engine requests and responses read as the reference's parser
(pkg/epp/framework/plugins/requesthandling/parsers/vllmgrpc, v1.5.0) reads them, from messages
built with the same generated code."""

from __future__ import annotations

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from picker.framework.handle import Handle
from picker.framework.request import Api, Usage
from picker.request.errors import RequestError
from picker.request.vllm_grpc import EMBED_PATH, GENERATE_PATH, VllmGrpcParser, grpc_frame

PARSER = VllmGrpcParser.create("vllmgrpc-parser", {}, Handle())
assert isinstance(PARSER, VllmGrpcParser)


def parse(path: str, body: bytes, **headers: str):
    return PARSER.parse(body, {":path": path, **headers}, "r1", "x-tenant")


def test_a_generate_request_with_text_is_a_completion_of_that_prompt() -> None:
    body = grpc_frame(pb.GenerateRequest(request_id="g", text="Hello there", stream=True).SerializeToString())
    request = parse(GENERATE_PATH, body, **{"x-gateway-inference-objective": "chat", "x-tenant": "t1"})
    assert (request.api, request.prompt_text, request.stream) == (Api.COMPLETIONS, "Hello there", True)
    assert (request.model, request.target_model, request.objective, request.tenant) == ("", "", "chat", "t1")
    assert request.size_bytes == len(body)


def test_a_tokenized_generate_request_prompts_with_its_original_text() -> None:
    tokenized = pb.TokenizedInput(original_text="Hi", input_ids=[1, 2])
    request = parse(GENERATE_PATH, grpc_frame(pb.GenerateRequest(tokenized=tokenized).SerializeToString()))
    assert (request.prompt_text, request.stream) == ("Hi", False)


def test_an_embed_request_is_an_embedding_of_its_original_text() -> None:
    body = grpc_frame(pb.EmbedRequest(tokenized=pb.TokenizedInput(original_text="embed me")).SerializeToString())
    request = parse(EMBED_PATH, body)
    assert (request.api, request.prompt_text) == (Api.EMBEDDINGS, "embed me")


@pytest.mark.parametrize(
    ("path", "body", "error"),
    [
        (
            "/vllm.grpc.engine.VllmEngine/Abort",
            grpc_frame(b""),
            "unsupported gRPC path: /vllm.grpc.engine.VllmEngine/Abort",
        ),
        (
            GENERATE_PATH,
            grpc_frame(pb.GenerateRequest(request_id="x").SerializeToString()),
            "not supported request inputType",
        ),
        (EMBED_PATH, grpc_frame(pb.EmbedRequest(request_id="x").SerializeToString()), "missing tokenized input"),
        (GENERATE_PATH, b"\x01" + grpc_frame(b"")[1:], "compressed vllmgrpc payload is not supported"),
        (GENERATE_PATH, b"\x00\x00\x00", "invalid gRPC frame"),
        (GENERATE_PATH, b"\x00\x00\x00\x00\x09abc", "incomplete gRPC payload"),
        (GENERATE_PATH, grpc_frame(b"\xff\xff\xff"), "parsing gRPC payload for Generate"),
    ],
)
def test_what_cannot_be_read_is_a_bad_request(path: str, body: bytes, error: str) -> None:
    with pytest.raises(RequestError) as caught:
        parse(path, body)
    assert caught.value.status == 400 and error in caught.value.message


def chunk(prompt: int, completion: int, cached: int = 0) -> bytes:
    counts = pb.GenerateStreamChunk(
        token_ids=[7], prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached
    )
    return grpc_frame(pb.GenerateResponse(chunk=counts).SerializeToString())


def test_usage_is_the_last_one_the_response_messages_report() -> None:
    complete = pb.GenerateResponse(
        complete=pb.GenerateComplete(finish_reason="stop", prompt_tokens=12, completion_tokens=3, cached_tokens=8)
    )
    body = chunk(12, 1, 8) + chunk(12, 2, 8) + grpc_frame(complete.SerializeToString())
    assert PARSER.response_usage(body) == Usage(12, 3, 8, 15)
    assert PARSER.response_usage(chunk(12, 1) + chunk(0, 0)) == Usage(12, 1, 0, 13)  # empty counts do not erase
    embedded = pb.EmbedResponse(embedding=[0.5], prompt_tokens=4, embedding_dim=1)
    assert PARSER.response_usage(grpc_frame(embedded.SerializeToString())) == Usage(4, 0, 0, 4)
    assert PARSER.response_usage(chunk(5, 1) + b"\x00\x00") == Usage(5, 1, 0, 6)  # a torn tail keeps what was read
    assert PARSER.response_usage(b"") is None
    assert PARSER.response_usage(grpc_frame(b"\xff\xff")) is None
