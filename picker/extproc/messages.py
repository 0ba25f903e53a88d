"""Building and reading ext_proc protobuf messages: the EPP protocol's wire details."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

DESTINATION_HEADER = "x-gateway-destination-endpoint"
SERVED_KEY = "x-gateway-destination-endpoint-served"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
# Envoy's reference limit for one streamed body message (gie-epp.md §1.2).
BODY_CHUNK_BYTES = 62000

# Control headers the picker consumes; never forwarded upstream (gie-epp.md §1.2).
SYSTEM_OWNED_HEADERS = frozenset(
    {
        "x-gateway-inference-fairness-id",
        "x-gateway-inference-objective",
        "x-gateway-model-name-rewrite",
        SUBSET_KEY,
        DESTINATION_HEADER,
        SERVED_KEY,
        "content-length",
    }
)

BodyMode = int  # ProcessingMode.BodySendMode value
# Dynamic metadata to set: namespace → key → number (framework.plugin.DynamicMetadata).
DynamicMetadata = Mapping[str, Mapping[str, float]]
STREAMED = 1
BUFFERED = 2
BUFFERED_PARTIAL = 3
FULL_DUPLEX_STREAMED = 4

_CONTINUE_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
_CONTINUE_RESPONSE_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
_CONTINUE_REQUEST_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse())
_CONTINUE_RESPONSE_BODY = pb.ProcessingResponse(response_body=pb.BodyResponse())
_CONTINUE_REQUEST_TRAILERS = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
_CONTINUE_RESPONSE_TRAILERS = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


def continue_request_headers() -> pb.ProcessingResponse:
    return _CONTINUE_HEADERS


def continue_response_headers() -> pb.ProcessingResponse:
    return _CONTINUE_RESPONSE_HEADERS


def continue_request_body() -> pb.ProcessingResponse:
    return _CONTINUE_REQUEST_BODY


def continue_response_body(metadata: DynamicMetadata | None = None) -> pb.ProcessingResponse:
    return _CONTINUE_RESPONSE_BODY if metadata is None else _with_metadata(_CONTINUE_RESPONSE_BODY, metadata)


def continue_request_trailers() -> pb.ProcessingResponse:
    return _CONTINUE_REQUEST_TRAILERS


def continue_response_trailers(metadata: DynamicMetadata | None = None) -> pb.ProcessingResponse:
    if metadata is None:
        return _CONTINUE_RESPONSE_TRAILERS
    return _with_metadata(_CONTINUE_RESPONSE_TRAILERS, metadata)


def dynamic_metadata(values: DynamicMetadata) -> struct_pb2.Struct:
    """Plugins' metadata (namespace → key → number) as ext_proc's `dynamic_metadata` struct."""
    metadata = struct_pb2.Struct()
    for namespace, fields in values.items():
        target = metadata.fields[namespace].struct_value
        for key, number in fields.items():
            target.fields[key].number_value = number
    return metadata


def _with_metadata(response: pb.ProcessingResponse, metadata: DynamicMetadata) -> pb.ProcessingResponse:
    """A copy of `response` that also sets `metadata` (Envoy applies it whatever the phase)."""
    answer = pb.ProcessingResponse()
    answer.CopyFrom(response)
    answer.dynamic_metadata.CopyFrom(dynamic_metadata(metadata))
    return answer


def header_map(headers: base_pb2.HeaderMap) -> dict[str, str]:
    """Envoy's header map as a dict; repeated names are joined with commas, as HTTP allows."""
    result: dict[str, str] = {}
    for h in headers.headers:
        value = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        key = h.key.lower()
        if key in result:
            result[key] = f"{result[key]},{value}"
        else:
            result[key] = value
    return result


def subset_hint(request: pb.ProcessingRequest) -> list[str] | None:
    """The proxy's subset hint (a list of `ip:port`), or None when absent."""
    fields = request.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in fields:
        return None
    value = fields[SUBSET_NAMESPACE].fields.get(SUBSET_KEY)
    if value is None:
        return None
    if value.HasField("list_value"):
        return [v.string_value for v in value.list_value.values if v.string_value]
    if value.HasField("string_value"):  # tolerate a CSV string
        return [s.strip() for s in value.string_value.split(",") if s.strip()]
    return []


def served_endpoint(request: pb.ProcessingRequest) -> str | None:
    """The endpoint that actually served the request, when the proxy reports it."""
    fields = request.metadata_context.filter_metadata
    if LB_NAMESPACE in fields:
        value = fields[LB_NAMESPACE].fields.get(SERVED_KEY)
        if value is not None and value.string_value:
            served: str = value.string_value  # a google.protobuf.Value (the envoy stubs are untyped)
            return served
    return None


def _destination_metadata(destination: str) -> struct_pb2.Struct:
    metadata = struct_pb2.Struct()
    metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value = destination
    return metadata


def _set_header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _routing_common(
    destination: str, content_length: int | None, remove: list[str], body: bytes | None = None
) -> pb.CommonResponse:
    set_headers = [_set_header(DESTINATION_HEADER, destination)]
    if content_length is not None:
        set_headers.append(_set_header("content-length", str(content_length)))
    common = pb.CommonResponse(
        header_mutation=pb.HeaderMutation(set_headers=set_headers, remove_headers=remove),
        clear_route_cache=True,
    )
    if body is not None:
        common.body_mutation.body = body
    return common


def route_in_headers(destination: str, content_length: int | None, remove: list[str]) -> pb.ProcessingResponse:
    """The request-headers answer carrying the pick (duplex/streamed modes, and headers-only requests)."""
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=_routing_common(destination, content_length, remove)),
        dynamic_metadata=_destination_metadata(destination),
    )


def route_in_body(destination: str, remove: list[str], new_body: bytes | None = None) -> pb.ProcessingResponse:
    """The BUFFERED request-body answer carrying the pick (and a replaced body, if any)."""
    length = len(new_body) if new_body is not None else None
    return pb.ProcessingResponse(
        request_body=pb.BodyResponse(response=_routing_common(destination, length, remove, new_body)),
        dynamic_metadata=_destination_metadata(destination),
    )


def streamed_request_body(body: bytes, end_of_stream: bool = True) -> Iterator[pb.ProcessingResponse]:
    """Re-emit a request body in chunks of at most BODY_CHUNK_BYTES (duplex mode)."""
    if not body:
        yield pb.ProcessingResponse(
            request_body=pb.BodyResponse(
                response=pb.CommonResponse(
                    body_mutation=pb.BodyMutation(
                        streamed_response=pb.StreamedBodyResponse(body=b"", end_of_stream=end_of_stream)
                    )
                )
            )
        )
        return
    for start in range(0, len(body), BODY_CHUNK_BYTES):
        chunk = body[start : start + BODY_CHUNK_BYTES]
        last = start + BODY_CHUNK_BYTES >= len(body)
        yield pb.ProcessingResponse(
            request_body=pb.BodyResponse(
                response=pb.CommonResponse(
                    body_mutation=pb.BodyMutation(
                        streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=last and end_of_stream)
                    )
                )
            )
        )


def streamed_response_body(
    chunk: bytes, end_of_stream: bool, metadata: DynamicMetadata | None = None
) -> pb.ProcessingResponse:
    """Pass one response body chunk through unchanged (duplex mode), setting `metadata`."""
    return pb.ProcessingResponse(
        response_body=pb.BodyResponse(
            response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(
                    streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=end_of_stream)
                )
            )
        ),
        dynamic_metadata=None if metadata is None else dynamic_metadata(metadata),
    )


def immediate(status: int, body: bytes) -> pb.ProcessingResponse:
    """Answer the client directly (errors), with a JSON body."""
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=[_set_header("content-type", "application/json")]),
            body=body,
        )
    )
