//! The stream state machine, message by message, with Python's part played by the test: each
//! body mode, headers-only requests, the body limit, trailers, the response path, and what is
//! asked of Python and what is answered.

use std::collections::{HashMap, VecDeque};
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation::Mutation, processing_request::Request, processing_response::Response, BodyResponse, CommonResponse,
    HttpBody, HttpHeaders, HttpTrailers, ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use super::{Settings, StreamState};
use crate::bridge::{Answer, Bridge};
use crate::events::Event;
use crate::messages::{self as m, BUFFERED, FULL_DUPLEX_STREAMED, STREAMED};

/// How long a test waits for what the stream should do before it fails (never reached when
/// the stream behaves).
const PATIENCE: Duration = Duration::from_secs(5);
const DESTINATION: &str = "10.0.0.1:8000";
const PAYLOAD: &[u8] = br#"{"model":"m","prompt":"p"}"#;

fn settings() -> Settings {
    Settings {
        max_body_bytes: 1 << 20,
        honour_subset_hint: true,
        // Past PATIENCE: a stream whose exchange is over ends when the test closes it.
        close_wait: PATIENCE * 2,
    }
}

/// The next event Python gets, which must be a `$kind`.
macro_rules! next_event {
    ($harness:expr, $kind:ident) => {
        match $harness.event().await {
            Event::$kind(event) => event,
            _ => panic!(concat!("expected ", stringify!($kind))),
        }
    };
}

/// One stream of the state machine, Envoy's side and Python's side both held by the test.
struct Harness {
    /// The bridge's descriptor, watched as the asyncio loop does (dropped before the bridge).
    wake: AsyncFd<RawFd>,
    bridge: Arc<Bridge>,
    /// Events taken from the bridge and not yet looked at.
    events: VecDeque<Event>,
    inbound: Option<mpsc::Sender<Result<ProcessingRequest, Status>>>,
    answers: mpsc::Receiver<Result<ProcessingResponse, Status>>,
    stream: JoinHandle<()>,
}

impl Harness {
    fn start(settings: Settings) -> Self {
        let bridge = Arc::new(Bridge::new().unwrap());
        let (inbound, requests) = mpsc::channel(16);
        let (out, answers) = mpsc::channel(16);
        let state = StreamState::new(bridge.clone(), settings, out);
        let stream = tokio::spawn(state.run(ReceiverStream::new(requests)));
        Self {
            // SAFETY: the bridge's eventfd stays open while the harness holds the bridge, which
            // it drops after this registration.
            wake: unsafe { AsyncFd::register_with_interest(bridge.wake_fd(), Interest::READABLE) }.unwrap(),
            bridge,
            events: VecDeque::new(),
            inbound: Some(inbound),
            answers,
            stream,
        }
    }

    /// Envoy sends `message`.
    async fn send(&self, message: Request) {
        self.send_request(ProcessingRequest {
            request: Some(message),
            ..Default::default()
        })
        .await;
    }

    async fn send_request(&self, request: ProcessingRequest) {
        let inbound = self.inbound.as_ref().expect("the proxy's side is open");
        inbound.send(Ok(request)).await.expect("the stream reads its messages");
    }

    /// Envoy half-closes its side of the stream.
    fn half_close(&mut self) {
        self.inbound = None;
    }

    /// Envoy closes the stream (or resets it): nobody sends or reads any more.
    fn close(&mut self) {
        self.inbound = None;
        self.answers.close();
    }

    /// The next answer Envoy gets.
    async fn answer(&mut self) -> ProcessingResponse {
        let answer = tokio::time::timeout(PATIENCE, self.answers.recv()).await;
        answer.expect("an answer in time").expect("the stream is open").unwrap()
    }

    /// The next event Python gets, woken by the bridge's descriptor as the asyncio loop is.
    async fn event(&mut self) -> Event {
        while self.events.is_empty() {
            self.events.extend(self.bridge.take());
            if self.events.is_empty() {
                let mut ready = tokio::time::timeout(PATIENCE, self.wake.readable())
                    .await
                    .expect("an event in time")
                    .unwrap();
                ready.clear_ready();
            }
        }
        self.events.pop_front().unwrap()
    }

    /// Python answers the stream's question.
    fn reply(&self, id: u64, answer: Answer) -> bool {
        self.bridge.answer(id, answer)
    }

    /// The stream is over: its task ended and nothing more is queued for Python.
    async fn ended(mut self) {
        tokio::time::timeout(PATIENCE, &mut self.stream)
            .await
            .expect("the stream to end in time")
            .unwrap();
        self.events.extend(self.bridge.take());
        assert!(self.events.is_empty(), "no more events for Python");
    }

    /// The stream waits (for Envoy or for Python): it has not answered or asked anything more.
    async fn waits(&mut self) {
        // Every task that is ready runs before a yielding one resumes: these turns let the
        // stream act on all it was sent.
        for _ in 0..16 {
            tokio::task::yield_now().await;
        }
        self.events.extend(self.bridge.take());
        assert!(self.events.is_empty(), "no event for Python");
        assert!(self.answers.try_recv().is_err(), "no answer for Envoy");
    }
}

fn route_answer() -> Answer {
    routing(None, false, false)
}

/// Python's pick: `DESTINATION`, with a replaced body, or asking for response chunks or metadata.
fn routing(body: Option<Vec<u8>>, chunks: bool, metadata: bool) -> Answer {
    Answer::Route {
        destination: Some(DESTINATION.into()),
        body,
        headers: Vec::new(),
        chunks,
        metadata,
    }
}

fn header_map(pairs: &[(&str, &str)]) -> HeaderMap {
    let headers = pairs
        .iter()
        .map(|(key, value)| HeaderValue {
            key: (*key).into(),
            raw_value: value.as_bytes().to_vec(),
            ..Default::default()
        })
        .collect();
    HeaderMap { headers }
}

fn request_headers(mode: i32, end_of_stream: bool) -> ProcessingRequest {
    headers_with_config(
        ProtocolConfiguration {
            request_body_mode: mode,
            response_body_mode: FULL_DUPLEX_STREAMED,
            send_body_without_waiting_for_header_response: false,
        },
        end_of_stream,
    )
}

fn headers_with_config(config: ProtocolConfiguration, end_of_stream: bool) -> ProcessingRequest {
    let pairs = [
        (":path", "/v1/completions"),
        (":method", "POST"),
        ("Content-Type", "application/json"),
        ("x-gateway-model-name-rewrite", "other"),
    ];
    ProcessingRequest {
        request: Some(Request::RequestHeaders(HttpHeaders {
            headers: Some(header_map(&pairs)),
            end_of_stream,
            ..Default::default()
        })),
        protocol_config: Some(config),
        ..Default::default()
    }
}

fn http_body(body: &[u8], end_of_stream: bool) -> HttpBody {
    HttpBody {
        body: body.to_vec(),
        end_of_stream,
        ..Default::default()
    }
}

fn request_body(body: &[u8], end_of_stream: bool) -> Request {
    Request::RequestBody(http_body(body, end_of_stream))
}

fn response_headers(end_of_stream: bool) -> Request {
    Request::ResponseHeaders(HttpHeaders {
        headers: Some(header_map(&[(":status", "200"), ("content-type", "text/event-stream")])),
        end_of_stream,
        ..Default::default()
    })
}

fn response_body(body: &[u8], end_of_stream: bool) -> Request {
    Request::ResponseBody(http_body(body, end_of_stream))
}

fn string(value: &Value) -> &str {
    match &value.kind {
        Some(Kind::StringValue(s)) => s,
        other => panic!("not a string: {other:?}"),
    }
}

/// The destination an answer carries: header, and `envoy.lb` metadata (which must agree).
fn destination(answer: &ProcessingResponse, common: &CommonResponse) -> String {
    let mutation = common.header_mutation.as_ref().expect("a header mutation");
    let header = mutation
        .set_headers
        .iter()
        .map(|h| h.header.as_ref().unwrap())
        .find(|h| h.key == m::DESTINATION_HEADER)
        .expect("the destination header");
    let lb = &answer.dynamic_metadata.as_ref().expect("dynamic metadata").fields["envoy.lb"];
    let Some(Kind::StructValue(lb)) = &lb.kind else {
        panic!("envoy.lb is not a struct")
    };
    let from_metadata = string(&lb.fields[m::DESTINATION_HEADER]);
    assert_eq!(header.raw_value, from_metadata.as_bytes());
    from_metadata.to_owned()
}

fn set_header<'a>(common: &'a CommonResponse, key: &str) -> Option<&'a [u8]> {
    let mutation = common.header_mutation.as_ref()?;
    let header = mutation
        .set_headers
        .iter()
        .map(|h| h.header.as_ref().unwrap())
        .find(|h| h.key == key)?;
    Some(&header.raw_value)
}

/// The routing answer in a request-headers response (duplex, streamed, headers-only).
fn routed_in_headers(answer: &ProcessingResponse) -> &CommonResponse {
    let Some(Response::RequestHeaders(headers)) = &answer.response else {
        panic!("not a request-headers answer: {answer:?}")
    };
    let common = headers.response.as_ref().expect("a common response");
    assert_eq!(destination(answer, common), DESTINATION);
    assert!(common.clear_route_cache);
    // The control header the picker consumes is not forwarded upstream.
    let removed = &common.header_mutation.as_ref().unwrap().remove_headers;
    assert_eq!(removed, &["x-gateway-model-name-rewrite".to_owned()]);
    common
}

fn request_body_answer(answer: &ProcessingResponse) -> &BodyResponse {
    match &answer.response {
        Some(Response::RequestBody(body)) => body,
        _ => panic!("not a request-body answer: {answer:?}"),
    }
}

/// The body chunk (and its end_of_stream) of a streamed body answer.
fn streamed(body: &BodyResponse) -> (&[u8], bool) {
    let mutation = body.response.as_ref().and_then(|c| c.body_mutation.as_ref());
    match mutation.and_then(|b| b.mutation.as_ref()) {
        Some(Mutation::StreamedResponse(chunk)) => (&chunk.body, chunk.end_of_stream),
        other => panic!("not a streamed body: {other:?}"),
    }
}

fn is_continue(body: &BodyResponse) -> bool {
    body.response.is_none()
}

/// Expect a Route event for `body`; its stream id.
async fn expect_route(harness: &mut Harness, body: &[u8]) -> u64 {
    match harness.event().await {
        Event::Route(route) => {
            assert_eq!(route.body, body);
            let headers: HashMap<_, _> = route.headers.iter().cloned().collect();
            assert_eq!(headers[":path"], "/v1/completions");
            assert_eq!(headers["content-type"], "application/json"); // names lower-cased
            assert_eq!(route.subset, None);
            route.id
        }
        _ => panic!("expected Route"),
    }
}

/// Route a FULL_DUPLEX_STREAMED request and read its answers; its stream id.
async fn routed_duplex(harness: &mut Harness) -> u64 {
    harness.send_request(request_headers(FULL_DUPLEX_STREAMED, false)).await;
    harness.send(request_body(PAYLOAD, true)).await;
    let id = expect_route(harness, PAYLOAD).await;
    assert!(harness.reply(id, route_answer()));
    routed_in_headers(&harness.answer().await);
    harness.answer().await; // the body, re-emitted
    id
}

/// Route a headers-only request with Python's `answer`, then start its response (headers
/// passed and reported); its stream id.
async fn responding_without_body(harness: &mut Harness, answer: Answer) -> u64 {
    harness.send_request(request_headers(FULL_DUPLEX_STREAMED, true)).await;
    let route = next_event!(harness, RouteWithoutBody);
    assert!(harness.reply(route.id, answer));
    routed_in_headers(&harness.answer().await);
    harness.send(response_headers(false)).await;
    harness.answer().await;
    next_event!(harness, ResponseHeaders);
    route.id
}

// -- request path --------------------------------------------------------------------------

#[tokio::test]
async fn buffered_mode_continues_the_headers_then_routes_in_the_body_answer() {
    let mut harness = Harness::start(settings());
    harness.send_request(request_headers(BUFFERED, false)).await;
    let Some(Response::RequestHeaders(headers)) = harness.answer().await.response else {
        panic!("a request-headers answer")
    };
    assert!(headers.response.is_none(), "the headers pass unchanged");
    harness.waits().await; // nothing is asked before the body
    harness.send(request_body(PAYLOAD, true)).await;
    let id = expect_route(&mut harness, PAYLOAD).await;
    assert!(harness.reply(id, route_answer()));
    let answer = harness.answer().await;
    let common = request_body_answer(&answer).response.as_ref().unwrap();
    assert_eq!(destination(&answer, common), DESTINATION);
    assert!(common.body_mutation.is_none(), "the body passes unchanged");
    assert_eq!(set_header(common, "content-length"), None);
}

#[tokio::test]
async fn buffered_mode_forwards_the_body_the_director_replaced() {
    let mut harness = Harness::start(settings());
    harness.send_request(request_headers(BUFFERED, false)).await;
    harness.answer().await;
    harness.send(request_body(PAYLOAD, true)).await;
    let id = expect_route(&mut harness, PAYLOAD).await;
    let replaced = b"{\"model\":\"rewritten\"}".to_vec();
    assert!(harness.reply(id, routing(Some(replaced.clone()), false, false)));
    let answer = harness.answer().await;
    let common = request_body_answer(&answer).response.as_ref().unwrap();
    let Some(Mutation::Body(body)) = common.body_mutation.as_ref().and_then(|b| b.mutation.as_ref()) else {
        panic!("a body mutation")
    };
    assert_eq!(body, &replaced);
    assert_eq!(set_header(common, "content-length"), Some(b"21".as_slice()));
}

#[tokio::test]
async fn duplex_mode_routes_at_the_body_end_and_reemits_it_in_chunks() {
    let mut harness = Harness::start(settings());
    let payload = vec![b'x'; m::BODY_CHUNK_BYTES + 1000];
    harness.send_request(request_headers(FULL_DUPLEX_STREAMED, false)).await;
    harness.send(request_body(&payload[..10], false)).await;
    harness.waits().await; // the headers' answer waits for the pick, the pick for the whole body
    harness.send(request_body(&payload[10..], true)).await;
    let id = expect_route(&mut harness, &payload).await;
    assert!(harness.reply(id, route_answer()));
    let answer = harness.answer().await;
    let common = routed_in_headers(&answer);
    let length = payload.len().to_string();
    assert_eq!(set_header(common, "content-length"), Some(length.as_bytes()));
    let first = harness.answer().await;
    let second = harness.answer().await;
    let (chunk, end) = streamed(request_body_answer(&first));
    assert_eq!((chunk, end), (&payload[..m::BODY_CHUNK_BYTES], false));
    let (chunk, end) = streamed(request_body_answer(&second));
    assert_eq!((chunk, end), (&payload[m::BODY_CHUNK_BYTES..], true));
}

#[tokio::test]
async fn duplex_mode_reemits_the_body_the_director_replaced() {
    let mut harness = Harness::start(settings());
    harness.send_request(request_headers(FULL_DUPLEX_STREAMED, false)).await;
    harness.send(request_body(PAYLOAD, true)).await;
    let id = expect_route(&mut harness, PAYLOAD).await;
    assert!(harness.reply(id, routing(Some(b"replaced".to_vec()), false, false)));
    let answer = harness.answer().await;
    assert_eq!(
        set_header(routed_in_headers(&answer), "content-length"),
        Some(b"8".as_slice())
    );
    let answer = harness.answer().await;
    assert_eq!(streamed(request_body_answer(&answer)), (b"replaced".as_slice(), true));
}

#[tokio::test]
async fn trailers_end_the_body_in_duplex_mode() {
    let mut harness = Harness::start(settings());
    harness.send_request(request_headers(FULL_DUPLEX_STREAMED, false)).await;
    harness.send(request_body(PAYLOAD, false)).await;
    harness.send(Request::RequestTrailers(HttpTrailers::default())).await;
    let id = expect_route(&mut harness, PAYLOAD).await;
    assert!(harness.reply(id, route_answer()));
    routed_in_headers(&harness.answer().await);
    // The re-emitted body does not end the stream: the trailers follow it.
    let answer = harness.answer().await;
    assert_eq!(streamed(request_body_answer(&answer)), (PAYLOAD, false));
    let answer = harness.answer().await;
    assert!(matches!(answer.response, Some(Response::RequestTrailers(_))));
}

#[tokio::test]
async fn streamed_mode_without_the_early_body_routes_on_the_headers() {
    let mut harness = Harness::start(settings());
    harness.send_request(request_headers(STREAMED, false)).await;
    let route = next_event!(harness, RouteWithoutBody);
    assert_eq!(route.subset, None);
    assert!(harness.reply(route.id, route_answer()));
    let answer = harness.answer().await;
    assert_eq!(set_header(routed_in_headers(&answer), "content-length"), None);
    // The body passes through as it comes: each chunk answered at once, nothing asked.
    for (chunk, end) in [(&PAYLOAD[..5], false), (&PAYLOAD[5..], true)] {
        harness.send(request_body(chunk, end)).await;
        assert!(is_continue(request_body_answer(&harness.answer().await)));
    }
    harness.waits().await;
}

#[tokio::test]
async fn streamed_mode_with_the_early_body_routes_on_it_then_answers_each_chunk() {
    let mut harness = Harness::start(settings());
    let config = ProtocolConfiguration {
        request_body_mode: STREAMED,
        response_body_mode: 0,
        send_body_without_waiting_for_header_response: true,
    };
    harness.send_request(headers_with_config(config, false)).await;
    harness.send(request_body(&PAYLOAD[..5], false)).await;
    harness.send(request_body(&PAYLOAD[5..], true)).await;
    let id = expect_route(&mut harness, PAYLOAD).await;
    assert!(harness.reply(id, route_answer()));
    let answer = harness.answer().await;
    let length = PAYLOAD.len().to_string();
    assert_eq!(
        set_header(routed_in_headers(&answer), "content-length"),
        Some(length.as_bytes())
    );
    for _ in 0..2 {
        assert!(is_continue(request_body_answer(&harness.answer().await)));
    }
    harness.waits().await;
}

/// A headers-only request carrying the proxy's subset hint (`csv`, as a gateway may set it).
fn with_subset_hint(csv: &str) -> ProcessingRequest {
    let hint = Value {
        kind: Some(Kind::StringValue(csv.into())),
    };
    let subset = Struct {
        fields: HashMap::from([(m::SUBSET_KEY.to_owned(), hint)]),
    };
    ProcessingRequest {
        metadata_context: Some(Metadata {
            filter_metadata: HashMap::from([("envoy.lb.subset_hint".to_owned(), subset)]),
            ..Default::default()
        }),
        ..request_headers(BUFFERED, true)
    }
}

#[tokio::test]
async fn a_headers_only_request_is_routed_without_a_body_with_its_subset_hint() {
    let mut harness = Harness::start(settings());
    harness
        .send_request(with_subset_hint("10.0.0.1:8000, 10.0.0.2:8000"))
        .await;
    let route = next_event!(harness, RouteWithoutBody);
    assert_eq!(route.subset, Some(vec!["10.0.0.1:8000".into(), "10.0.0.2:8000".into()]));
    assert!(harness.reply(route.id, route_answer()));
    routed_in_headers(&harness.answer().await);
}

#[tokio::test]
async fn headers_the_plugins_set_go_with_the_destination_and_an_empty_one_is_removed() {
    let mut harness = Harness::start(settings());
    harness.send_request(request_headers(FULL_DUPLEX_STREAMED, true)).await;
    let route = next_event!(harness, RouteWithoutBody);
    let answer = Answer::Route {
        destination: Some(DESTINATION.into()),
        body: None,
        headers: vec![
            ("x-prefiller-host-port".into(), "10.0.0.9:8000".into()),
            ("x-data-parallel-host-port".into(), String::new()),
        ],
        chunks: false,
        metadata: false,
    };
    assert!(harness.reply(route.id, answer));
    let answer = harness.answer().await;
    let Some(Response::RequestHeaders(headers)) = &answer.response else {
        panic!("not a request-headers answer: {answer:?}")
    };
    let common = headers.response.as_ref().expect("a common response");
    assert_eq!(destination(&answer, common), DESTINATION);
    assert_eq!(set_header(common, "x-prefiller-host-port"), Some(&b"10.0.0.9:8000"[..]));
    assert_eq!(set_header(common, "x-data-parallel-host-port"), None);
    let removed = &common.header_mutation.as_ref().unwrap().remove_headers;
    assert!(removed.contains(&"x-data-parallel-host-port".to_owned()));
}

#[tokio::test]
async fn the_subset_hint_is_ignored_when_not_honoured() {
    let mut harness = Harness::start(Settings {
        honour_subset_hint: false,
        ..settings()
    });
    harness.send_request(with_subset_hint("10.0.0.1:8000")).await;
    let route = next_event!(harness, RouteWithoutBody);
    assert_eq!(route.subset, None);
}

// -- failures: what is asked of Python, and the answer Envoy gets ------------------------------

/// Expect a Fail event with `code`, reject it as Python does; the immediate answer's status.
async fn rejected(harness: &mut Harness, code: &str, status: u16) {
    let fail = next_event!(harness, Fail);
    assert_eq!(fail.code, code);
    let body = format!("{{\"error\":{{\"code\":\"{code}\"}}}}").into_bytes();
    assert!(harness.reply(
        fail.id,
        Answer::Reject {
            status,
            body: body.clone()
        }
    ));
    let answer = harness.answer().await;
    let Some(Response::ImmediateResponse(immediate)) = answer.response else {
        panic!("an immediate answer")
    };
    assert_eq!(immediate.status.unwrap().code, i32::from(status));
    assert_eq!(immediate.body, body);
}

#[tokio::test]
async fn a_body_over_the_limit_is_refused_with_413() {
    let mut harness = Harness::start(Settings {
        max_body_bytes: PAYLOAD.len() - 1,
        ..settings()
    });
    harness.send_request(request_headers(FULL_DUPLEX_STREAMED, false)).await;
    harness.send(request_body(&PAYLOAD[..5], false)).await;
    harness.send(request_body(&PAYLOAD[5..], true)).await;
    rejected(&mut harness, "PayloadTooLarge", 413).await;
    // The answer ends the exchange: the stream ends when the proxy closes it, with no Closed
    // event (Python released the request when it answered).
    harness.close();
    harness.ended().await;
}

#[tokio::test]
async fn a_body_at_the_limit_is_routed() {
    let mut harness = Harness::start(Settings {
        max_body_bytes: PAYLOAD.len(),
        ..settings()
    });
    harness.send_request(request_headers(BUFFERED, false)).await;
    harness.answer().await;
    harness.send(request_body(PAYLOAD, true)).await;
    expect_route(&mut harness, PAYLOAD).await;
}

#[tokio::test]
async fn a_body_before_the_headers_breaks_the_protocol() {
    let mut harness = Harness::start(settings());
    harness.send(request_body(PAYLOAD, true)).await;
    rejected(&mut harness, "BadRequest", 400).await;
}

#[tokio::test]
async fn headers_twice_break_the_protocol() {
    let mut harness = Harness::start(settings());
    harness.send_request(request_headers(FULL_DUPLEX_STREAMED, false)).await;
    harness.send_request(request_headers(FULL_DUPLEX_STREAMED, false)).await;
    rejected(&mut harness, "BadRequest", 400).await;
}

#[tokio::test]
async fn a_route_python_rejects_is_answered_directly() {
    let mut harness = Harness::start(settings());
    harness.send_request(request_headers(FULL_DUPLEX_STREAMED, true)).await;
    let route = next_event!(harness, RouteWithoutBody);
    let body = b"{\"error\":{\"code\":\"ServiceUnavailable\"}}".to_vec();
    assert!(harness.reply(
        route.id,
        Answer::Reject {
            status: 503,
            body: body.clone()
        }
    ));
    let Some(Response::ImmediateResponse(immediate)) = harness.answer().await.response else {
        panic!("an immediate answer")
    };
    assert_eq!((immediate.status.unwrap().code, immediate.body), (503, body));
    harness.close();
    harness.ended().await;
}

#[tokio::test]
async fn a_stream_reset_while_python_picks_is_reported_closed_and_its_answer_refused() {
    let mut harness = Harness::start(settings());
    harness.send_request(request_headers(FULL_DUPLEX_STREAMED, false)).await;
    harness.send(request_body(PAYLOAD, true)).await;
    let id = expect_route(&mut harness, PAYLOAD).await;
    harness.close(); // the proxy resets the stream
    let closed = next_event!(harness, Closed);
    assert_eq!((closed.id, closed.error), (id, Some("cancelled")));
    assert!(!harness.reply(id, route_answer()), "the stream no longer waits");
    harness.ended().await;
}

// -- response path -------------------------------------------------------------------------

#[tokio::test]
async fn a_response_passes_through_and_is_reported_with_its_body_coalesced() {
    let mut harness = Harness::start(settings());
    let id = routed_duplex(&mut harness).await;
    harness.send(response_headers(false)).await;
    assert!(matches!(
        harness.answer().await.response,
        Some(Response::ResponseHeaders(_))
    ));
    let headers = next_event!(harness, ResponseHeaders);
    assert_eq!(headers.id, id);
    assert_eq!(
        (headers.status, headers.content_type.as_str()),
        (200, "text/event-stream")
    );
    assert!(!headers.end_of_stream);
    let chunks: [&[u8]; 3] = [b"data: a\n\n", b"data: b\n\n", b"data: [DONE]\n\n"];
    for (i, chunk) in chunks.iter().enumerate() {
        let end = i == chunks.len() - 1;
        harness.send(response_body(chunk, end)).await;
        // Each chunk passes at once, unchanged (duplex).
        let answer = harness.answer().await;
        let Some(Response::ResponseBody(body)) = &answer.response else {
            panic!("a response-body answer")
        };
        assert_eq!(streamed(body), (*chunk, end));
        assert!(answer.dynamic_metadata.is_none());
    }
    // Python hears of the body once, at its end.
    let body = next_event!(harness, ResponseBody);
    assert_eq!(body.data, chunks.concat());
    assert!(body.end_of_stream && !body.asks);
    assert!(body.first_byte_at.is_some());
    // The exchange is over: the stream ends when the proxy closes it, with no Closed event.
    harness.close();
    harness.ended().await;
}

#[tokio::test]
async fn each_response_chunk_is_reported_when_python_asks_for_chunks() {
    let mut harness = Harness::start(settings());
    responding_without_body(&mut harness, routing(None, true, false)).await;
    for (chunk, end) in [(b"one".as_slice(), false), (b"two".as_slice(), true)] {
        harness.send(response_body(chunk, end)).await;
        harness.answer().await;
        let body = next_event!(harness, ResponseBody);
        assert_eq!((body.data.as_slice(), body.end_of_stream), (chunk, end));
    }
}

#[tokio::test]
async fn response_trailers_end_the_response() {
    let mut harness = Harness::start(settings());
    let id = routed_duplex(&mut harness).await;
    harness.send(response_headers(false)).await;
    harness.answer().await;
    harness.event().await;
    harness.send(response_body(b"partial", false)).await;
    harness.answer().await;
    harness.send(Request::ResponseTrailers(HttpTrailers::default())).await;
    let answer = harness.answer().await;
    assert!(matches!(answer.response, Some(Response::ResponseTrailers(_))));
    assert!(answer.dynamic_metadata.is_none());
    // What was held is reported (not as the end), then the trailers end the response.
    let body = next_event!(harness, ResponseBody);
    assert_eq!(
        (body.data.as_slice(), body.end_of_stream),
        (b"partial".as_slice(), false)
    );
    let trailers = next_event!(harness, ResponseTrailers);
    assert_eq!((trailers.id, trailers.asks), (id, false));
    harness.close();
    harness.ended().await;
}

#[tokio::test]
async fn with_metadata_asked_each_response_answer_waits_for_what_python_reports() {
    let mut harness = Harness::start(settings());
    responding_without_body(&mut harness, routing(None, false, true)).await;
    harness.send(response_body(b"chunk", false)).await;
    let body = next_event!(harness, ResponseBody);
    assert!(body.asks && body.data == b"chunk");
    harness.waits().await; // the chunk's answer waits for Python's
    let reported = HashMap::from([("ns".to_owned(), HashMap::from([("tokens".to_owned(), 3.0)]))]);
    assert!(harness.reply(body.id, Answer::Metadata(Some(m::dynamic_metadata(reported)))));
    let answer = harness.answer().await;
    let metadata = answer.dynamic_metadata.expect("the metadata Python reported");
    let Some(Kind::StructValue(ns)) = &metadata.fields["ns"].kind else {
        panic!("a struct")
    };
    assert_eq!(ns.fields["tokens"].kind, Some(Kind::NumberValue(3.0)));
    // Trailers end the response; their answer waits for Python's too (None: no metadata).
    harness.send(Request::ResponseTrailers(HttpTrailers::default())).await;
    let trailers = next_event!(harness, ResponseTrailers);
    assert!(trailers.asks);
    harness.waits().await;
    assert!(harness.reply(trailers.id, Answer::Metadata(None)));
    let answer = harness.answer().await;
    assert!(matches!(answer.response, Some(Response::ResponseTrailers(_))));
    assert!(answer.dynamic_metadata.is_none());
}

#[tokio::test]
async fn a_stream_half_closed_before_its_response_ends_is_reported_closed() {
    let mut harness = Harness::start(settings());
    let id = routed_duplex(&mut harness).await;
    harness.send(response_headers(false)).await;
    harness.answer().await;
    harness.event().await;
    harness.send(response_body(b"held", false)).await;
    harness.answer().await;
    harness.half_close();
    // What was held is reported, then how the stream ended (no error: the proxy half-closed).
    let body = next_event!(harness, ResponseBody);
    assert_eq!((body.data.as_slice(), body.end_of_stream), (b"held".as_slice(), false));
    let closed = next_event!(harness, Closed);
    assert_eq!((closed.id, closed.error), (id, None));
    harness.ended().await;
}

#[tokio::test]
async fn a_stream_never_routed_ends_without_telling_python() {
    let mut harness = Harness::start(settings());
    harness.send_request(request_headers(BUFFERED, false)).await;
    harness.answer().await;
    harness.half_close();
    harness.ended().await;
}

#[tokio::test]
async fn an_exchange_over_ends_the_stream_after_the_close_wait_when_the_proxy_keeps_it_open() {
    let mut harness = Harness::start(Settings {
        close_wait: Duration::from_millis(10),
        ..settings()
    });
    harness.send_request(request_headers(FULL_DUPLEX_STREAMED, true)).await;
    let route = next_event!(harness, RouteWithoutBody);
    assert!(harness.reply(route.id, route_answer()));
    harness.answer().await;
    harness.send(response_headers(true)).await; // a response without a body ends the exchange
    harness.answer().await;
    let headers = next_event!(harness, ResponseHeaders);
    assert!(headers.end_of_stream);
    harness.ended().await; // the proxy's side is still open
}

// -- header-only answers (body-based routing) ----------------------------------------------

/// A header-only answer: the headers Python set, no destination, nothing removed.
fn header_only(headers: Vec<(String, String)>) -> Answer {
    Answer::Route {
        destination: None,
        body: None,
        headers,
        chunks: false,
        metadata: false,
    }
}

#[tokio::test]
async fn a_header_only_answer_sets_its_headers_keeps_the_control_ones_and_hears_nothing_more() {
    let mut harness = Harness::start(settings());
    harness.send_request(request_headers(FULL_DUPLEX_STREAMED, false)).await;
    harness.send(request_body(PAYLOAD, true)).await;
    let id = expect_route(&mut harness, PAYLOAD).await;
    let model = vec![
        ("X-Gateway-Model-Name".to_owned(), "llama".to_owned()),
        ("X-Gateway-Base-Model-Name".to_owned(), String::new()),
    ];
    assert!(harness.reply(id, header_only(model)));
    let answer = harness.answer().await;
    let Some(Response::RequestHeaders(headers)) = &answer.response else {
        panic!("not a request-headers answer: {answer:?}")
    };
    let common = headers.response.as_ref().expect("a common response");
    assert!(common.clear_route_cache);
    assert!(answer.dynamic_metadata.is_none(), "no destination metadata");
    assert_eq!(set_header(common, "X-Gateway-Model-Name"), Some(b"llama".as_slice()));
    assert_eq!(set_header(common, "X-Gateway-Base-Model-Name"), Some(b"".as_slice()));
    assert_eq!(set_header(common, m::DESTINATION_HEADER), None);
    assert!(common.header_mutation.as_ref().unwrap().remove_headers.is_empty());
    assert_eq!(streamed(request_body_answer(&harness.answer().await)), (PAYLOAD, true));
    harness.send(response_headers(false)).await;
    harness.answer().await;
    harness.send(response_body(b"done", true)).await;
    harness.answer().await;
    harness.close();
    harness.ended().await; // no response event, no Closed
}

#[tokio::test]
async fn a_header_only_answer_in_buffered_mode_goes_in_the_body_answer() {
    let mut harness = Harness::start(settings());
    harness.send_request(request_headers(BUFFERED, false)).await;
    harness.answer().await;
    harness.send(request_body(PAYLOAD, true)).await;
    let id = expect_route(&mut harness, PAYLOAD).await;
    assert!(harness.reply(id, header_only(vec![("x-gateway-model-name".into(), "m".into())])));
    let answer = harness.answer().await;
    let common = request_body_answer(&answer).response.as_ref().unwrap();
    assert!(common.clear_route_cache && answer.dynamic_metadata.is_none());
    assert_eq!(set_header(common, "x-gateway-model-name"), Some(b"m".as_slice()));
    assert_eq!(set_header(common, m::DESTINATION_HEADER), None);
}

#[tokio::test]
async fn a_local_reply_of_an_earlier_filter_passes_in_the_mode_its_first_message_states() {
    // An earlier filter (the body-based router rejecting a body) answered the client itself: this
    // stream starts at the response, and its first message carries the protocol configuration.
    let mut harness = Harness::start(settings());
    harness
        .send_request(ProcessingRequest {
            request: Some(response_headers(false)),
            protocol_config: Some(ProtocolConfiguration {
                request_body_mode: FULL_DUPLEX_STREAMED,
                response_body_mode: FULL_DUPLEX_STREAMED,
                send_body_without_waiting_for_header_response: false,
            }),
            ..Default::default()
        })
        .await;
    let Some(Response::ResponseHeaders(_)) = harness.answer().await.response else {
        panic!("a response-headers answer")
    };
    harness.send(response_body(b"{\"error\":{}}", true)).await;
    let answer = harness.answer().await;
    let Some(Response::ResponseBody(body)) = &answer.response else {
        panic!("a response-body answer: {answer:?}")
    };
    assert_eq!(streamed(body), (b"{\"error\":{}}".as_slice(), true));
    harness.waits().await; // nothing was asked of Python
}
