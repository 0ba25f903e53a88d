"""`vllmgrpc-parser`: requests to vLLM's gRPC engine API (`vllm.grpc.engine.VllmEngine`), read
as the reference's parser reads them.

The messages come from the `smg-grpc-proto` package (the Shepherd Model Gateway's generated
vllm_engine code): the same package, service and field numbers as the reference's
vllm_engine.proto for every field read here, with more fields the parser ignores.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import Any

from google.protobuf.message import DecodeError

from picker.framework.handle import Handle
from picker.framework.parameters import Parameters
from picker.framework.plugin import Parser
from picker.framework.request import Api, InferenceRequest, Usage
from picker.request.errors import bad_request
from picker.request.openai import flow_headers

GENERATE_PATH = "/vllm.grpc.engine.VllmEngine/Generate"
EMBED_PATH = "/vllm.grpc.engine.VllmEngine/Embed"
_FRAME_HEADER_BYTES = 5  # gRPC's length prefix: a compressed flag and a big-endian length


@functools.cache
def _messages() -> Any:
    """The generated vllm_engine messages, imported on first use: only configs with this
    parser load them (~5 MB)."""
    from smg_grpc_proto.generated import vllm_engine_pb2

    return vllm_engine_pb2


def grpc_messages(data: bytes) -> Iterator[bytes]:
    """The messages of gRPC length-prefixed frames, in order; ValueError for a compressed or
    truncated frame (an incomplete last frame ends the iteration with the error)."""
    offset = 0
    while offset < len(data):
        if len(data) - offset < _FRAME_HEADER_BYTES:
            raise ValueError(f"invalid gRPC frame: {len(data) - offset} bytes, fewer than the 5-byte header")
        if data[offset] == 1:
            raise ValueError("compressed vllmgrpc payload is not supported")
        length = int.from_bytes(data[offset + 1 : offset + _FRAME_HEADER_BYTES], "big")
        start = offset + _FRAME_HEADER_BYTES
        if len(data) - start < length:
            raise ValueError(f"incomplete gRPC payload: the header says {length} bytes, {len(data) - start} arrived")
        yield data[start : start + length]
        offset = start + length


def grpc_frame(message: bytes) -> bytes:
    """`message` as one uncompressed gRPC frame."""
    return b"\x00" + len(message).to_bytes(4, "big") + message


class VllmGrpcParser(Parser):
    """`vllmgrpc-parser` (no parameters): a `Generate` request's prompt is its `text`, or its
    `tokenized.original_text`; an `Embed` request's, its `tokenized.original_text` (required);
    `stream` is the request's. Any other method, a compressed or malformed message, or a
    request without input is a 400. The model is empty (the messages name none), so no model
    rewrite applies; objective, fairness id and tenant come from the headers.

    Usage is read from the response's messages (`GenerateResponse` chunk or complete,
    else `EmbedResponse`). Difference: the reference reads only the first message of a
    response; the parser reads them all and keeps the last usage, which for a streamed
    `Generate` is the final count rather than the first chunk's.
    """

    plugin_type = "vllmgrpc-parser"
    reads_response_usage = True

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> VllmGrpcParser:
        Parameters(parameters).finish()
        _messages()  # imported now, with the config, not on the first request
        return cls(name)

    def parse(
        self, body: bytes, headers: Mapping[str, str], request_id: str, tenant_header: str | None
    ) -> InferenceRequest:
        path = headers.get(":path", "")
        pb = _messages()
        if path == GENERATE_PATH:
            generate = pb.GenerateRequest()
            self._decode(body, generate, "Generate")
            kind = generate.WhichOneof("input")
            if kind is None:
                raise bad_request("parsing gRPC payload for Generate: not supported request inputType")
            prompt = generate.text if kind == "text" else generate.tokenized.original_text
            api, stream = Api.COMPLETIONS, generate.stream
        elif path == EMBED_PATH:
            embed = pb.EmbedRequest()
            self._decode(body, embed, "Embed")
            if not embed.HasField("tokenized"):
                raise bad_request("parsing gRPC payload for Embed: missing tokenized input in EmbedRequest")
            prompt, api, stream = embed.tokenized.original_text, Api.EMBEDDINGS, False
        else:
            raise bad_request(f"unsupported gRPC path: {path}")
        flow = flow_headers(headers, tenant_header)
        return InferenceRequest(
            request_id=request_id,
            api=api,
            model="",
            target_model="",
            stream=stream,
            prompt_text=prompt,
            headers=headers,
            objective=flow.objective,
            fairness_id=flow.fairness_id,
            tenant=flow.tenant,
            size_bytes=len(body),
        )

    @staticmethod
    def _decode(body: bytes, message: Any, method: str) -> None:
        """The body's first message into `message` (the reference reads the first frame)."""
        try:
            first = next(grpc_messages(body), b"")
            message.ParseFromString(first)
        except (ValueError, DecodeError) as error:
            raise bad_request(f"parsing gRPC payload for {method}: {error}") from None

    def rewrite_model(self, request: InferenceRequest) -> bytes:
        raise AssertionError("never called: the model is always empty, so never rewritten")

    def response_usage(self, body: bytes) -> Usage | None:
        usage = None
        try:
            for message in grpc_messages(body):
                usage = _usage(message) or usage
        except ValueError:
            pass  # a truncated or compressed tail: what was read stands (usage is telemetry)
        return usage


def _usage(message: bytes) -> Usage | None:
    """The usage one response message reports, if any."""
    pb = _messages()
    try:
        response = pb.GenerateResponse.FromString(message)
    except DecodeError:
        response = None
    kind = response.WhichOneof("response") if response is not None else None
    if response is not None and kind is not None:
        counts = response.chunk if kind == "chunk" else response.complete
        if counts.prompt_tokens <= 0 and counts.completion_tokens <= 0:
            return None
        total = counts.prompt_tokens + counts.completion_tokens
        return Usage(counts.prompt_tokens, counts.completion_tokens, counts.cached_tokens, total)
    try:
        embedded = pb.EmbedResponse.FromString(message)
    except DecodeError:
        return None
    if embedded.prompt_tokens > 0:
        return Usage(embedded.prompt_tokens, 0, 0, embedded.prompt_tokens)
    return None
