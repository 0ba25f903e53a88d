//! Building and reading ext_proc messages: the EPP protocol's wire details (gie-epp.md §1.2).

use std::collections::HashMap;

use envoy_types::pb::envoy::config::core::v3::{
    header_value_option::HeaderAppendAction, HeaderMap, HeaderValue, HeaderValueOption,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation::Mutation, processing_response::Response, BodyMutation, BodyResponse, CommonResponse, HeaderMutation,
    HeadersResponse, ImmediateResponse, ProcessingRequest, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};

pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
const LB_NAMESPACE: &str = "envoy.lb";
const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// Envoy's reference limit for one streamed body message.
pub const BODY_CHUNK_BYTES: usize = 62000;

/// Control headers the picker consumes; never forwarded upstream (content-length is reset, not removed).
const SYSTEM_OWNED_HEADERS: [&str; 6] = [
    "x-gateway-inference-fairness-id",
    "x-gateway-inference-objective",
    "x-gateway-model-name-rewrite",
    SUBSET_KEY,
    DESTINATION_HEADER,
    SERVED_KEY,
];

/// ProcessingMode.BodySendMode values.
pub const STREAMED: i32 = 1;
pub const BUFFERED: i32 = 2;
pub const BUFFERED_PARTIAL: i32 = 3;
pub const FULL_DUPLEX_STREAMED: i32 = 4;

/// Envoy's header map in arrival order of first occurrence; repeated names are joined with
/// commas, as HTTP allows. Names are lower-cased; `raw_value` wins over `value` when set.
pub fn header_map(headers: Option<&HeaderMap>) -> Vec<(String, String)> {
    let mut result: Vec<(String, String)> = Vec::new();
    let Some(headers) = headers else { return result };
    for h in &headers.headers {
        let value = if h.raw_value.is_empty() {
            h.value.clone()
        } else {
            String::from_utf8_lossy(&h.raw_value).into_owned()
        };
        let key = h.key.to_lowercase();
        match result.iter_mut().find(|(k, _)| *k == key) {
            Some((_, existing)) => {
                existing.push(',');
                existing.push_str(&value);
            }
            None => result.push((key, value)),
        }
    }
    result
}

pub fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

/// The system-owned headers the request carried, to be removed upstream.
pub fn removed_headers(headers: &[(String, String)]) -> Vec<String> {
    headers
        .iter()
        .filter(|(k, _)| SYSTEM_OWNED_HEADERS.contains(&k.as_str()))
        .map(|(k, _)| k.clone())
        .collect()
}

fn filter_struct<'a>(request: &'a ProcessingRequest, namespace: &str) -> Option<&'a Struct> {
    request.metadata_context.as_ref()?.filter_metadata.get(namespace)
}

/// The proxy's subset hint (a list of `ip:port`), or None when absent.
pub fn subset_hint(request: &ProcessingRequest) -> Option<Vec<String>> {
    let value = filter_struct(request, SUBSET_NAMESPACE)?.fields.get(SUBSET_KEY)?;
    Some(match &value.kind {
        Some(Kind::ListValue(list)) => list
            .values
            .iter()
            .filter_map(|v| match &v.kind {
                Some(Kind::StringValue(s)) if !s.is_empty() => Some(s.clone()),
                _ => None,
            })
            .collect(),
        // tolerate a CSV string
        Some(Kind::StringValue(csv)) => csv
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect(),
        _ => Vec::new(),
    })
}

/// The endpoint that actually served the request, when the proxy reports it.
pub fn served_endpoint(request: &ProcessingRequest) -> Option<String> {
    match &filter_struct(request, LB_NAMESPACE)?.fields.get(SERVED_KEY)?.kind {
        Some(Kind::StringValue(s)) if !s.is_empty() => Some(s.clone()),
        _ => None,
    }
}

fn string_value(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_owned())),
    }
}

/// The `envoy.lb` metadata naming the destination (none for a header-only answer).
fn destination_metadata(pick: &Pick) -> Option<Struct> {
    let destination = pick.destination.as_deref()?;
    let inner = Struct {
        fields: HashMap::from([(DESTINATION_HEADER.to_owned(), string_value(destination))]),
    };
    Some(Struct {
        fields: HashMap::from([(
            LB_NAMESPACE.to_owned(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]),
    })
}

fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            raw_value: value.as_bytes().to_vec(),
            ..Default::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

/// Python's pick: the destination (the ordered fallback list) and the request headers its
/// plugins set for the model server (an empty value removes the header). No destination: the
/// answer carries the headers only, empty values set as such (body-based routing sets headers
/// the routes match on).
pub struct Pick {
    pub destination: Option<String>,
    pub headers: Vec<(String, String)>,
}

fn routing_common(
    pick: &Pick,
    content_length: Option<usize>,
    mut remove: Vec<String>,
    body: Option<Vec<u8>>,
) -> CommonResponse {
    let mut set_headers: Vec<HeaderValueOption> = pick
        .destination
        .iter()
        .map(|destination| set_header(DESTINATION_HEADER, destination))
        .collect();
    if let Some(length) = content_length {
        set_headers.push(set_header("content-length", &length.to_string()));
    }
    for (key, value) in &pick.headers {
        // a header-only answer sets what it names, empty or not (as the reference BBR does)
        if value.is_empty() && pick.destination.is_some() {
            remove.push(key.clone());
        } else {
            set_headers.push(set_header(key, value));
        }
    }
    CommonResponse {
        header_mutation: Some(HeaderMutation {
            set_headers,
            remove_headers: remove,
        }),
        body_mutation: body.map(|b| BodyMutation {
            mutation: Some(Mutation::Body(b)),
        }),
        clear_route_cache: true,
        ..Default::default()
    }
}

fn with_response(response: Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(response),
        ..Default::default()
    }
}

pub fn continue_request_headers() -> ProcessingResponse {
    with_response(Response::RequestHeaders(HeadersResponse::default()))
}

pub fn continue_response_headers() -> ProcessingResponse {
    with_response(Response::ResponseHeaders(HeadersResponse::default()))
}

pub fn continue_request_body() -> ProcessingResponse {
    with_response(Response::RequestBody(BodyResponse::default()))
}

pub fn continue_response_body(metadata: Option<Struct>) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ResponseBody(BodyResponse::default())),
        dynamic_metadata: metadata,
        ..Default::default()
    }
}

pub fn continue_request_trailers() -> ProcessingResponse {
    with_response(Response::RequestTrailers(TrailersResponse::default()))
}

pub fn continue_response_trailers(metadata: Option<Struct>) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ResponseTrailers(TrailersResponse::default())),
        dynamic_metadata: metadata,
        ..Default::default()
    }
}

/// Plugins' metadata (namespace → key → number) as ext_proc's `dynamic_metadata` struct.
pub fn dynamic_metadata(values: HashMap<String, HashMap<String, f64>>) -> Struct {
    let fields = values
        .into_iter()
        .map(|(namespace, numbers)| {
            let inner = numbers
                .into_iter()
                .map(|(key, number)| {
                    (
                        key,
                        Value {
                            kind: Some(Kind::NumberValue(number)),
                        },
                    )
                })
                .collect();
            (
                namespace,
                Value {
                    kind: Some(Kind::StructValue(Struct { fields: inner })),
                },
            )
        })
        .collect();
    Struct { fields }
}

/// The request-headers answer carrying the pick (duplex/streamed modes, and headers-only requests).
pub fn route_in_headers(pick: &Pick, content_length: Option<usize>, remove: Vec<String>) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::RequestHeaders(HeadersResponse {
            response: Some(routing_common(pick, content_length, remove, None)),
        })),
        dynamic_metadata: destination_metadata(pick),
        ..Default::default()
    }
}

/// The BUFFERED request-body answer carrying the pick (and a replaced body, if any).
pub fn route_in_body(pick: &Pick, remove: Vec<String>, new_body: Option<Vec<u8>>) -> ProcessingResponse {
    let length = new_body.as_ref().map(Vec::len);
    ProcessingResponse {
        response: Some(Response::RequestBody(BodyResponse {
            response: Some(routing_common(pick, length, remove, new_body)),
        })),
        dynamic_metadata: destination_metadata(pick),
        ..Default::default()
    }
}

fn streamed_body(body: Vec<u8>, end_of_stream: bool) -> BodyResponse {
    BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(Mutation::StreamedResponse(StreamedBodyResponse {
                    body,
                    end_of_stream,
                    ..Default::default()
                })),
            }),
            ..Default::default()
        }),
    }
}

/// Re-emit a request body in chunks of at most BODY_CHUNK_BYTES (duplex mode).
pub fn streamed_request_body(body: &[u8], end_of_stream: bool, out: &mut Vec<ProcessingResponse>) {
    if body.is_empty() {
        out.push(with_response(Response::RequestBody(streamed_body(
            Vec::new(),
            end_of_stream,
        ))));
        return;
    }
    let count = body.len().div_ceil(BODY_CHUNK_BYTES);
    for (i, chunk) in body.chunks(BODY_CHUNK_BYTES).enumerate() {
        let last = i + 1 == count;
        out.push(with_response(Response::RequestBody(streamed_body(
            chunk.to_vec(),
            last && end_of_stream,
        ))));
    }
}

/// Pass one response body chunk through unchanged (duplex mode), setting `metadata`.
pub fn streamed_response_body(chunk: Vec<u8>, end_of_stream: bool, metadata: Option<Struct>) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ResponseBody(streamed_body(chunk, end_of_stream))),
        dynamic_metadata: metadata,
        ..Default::default()
    }
}

/// Answer the client directly (errors), with a JSON body.
pub fn immediate(status: u16, body: Vec<u8>) -> ProcessingResponse {
    with_response(Response::ImmediateResponse(ImmediateResponse {
        status: Some(HttpStatus {
            code: i32::from(status),
        }),
        headers: Some(HeaderMutation {
            set_headers: vec![set_header("content-type", "application/json")],
            remove_headers: vec![],
        }),
        body,
        ..Default::default()
    }))
}
