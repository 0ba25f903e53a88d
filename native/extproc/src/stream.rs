//! One ext_proc stream per HTTP request, answered in order.
//!
//! Request path: keep the headers; accumulate the body to end_of_stream; ask Python (the
//! director) for the pick; answer with the destination header + `envoy.lb` metadata (in the
//! headers response for duplex and streamed modes, in the body response for BUFFERED), then
//! re-emit the body in duplex mode. Response path: pass everything through and report what
//! passes to Python, coalescing body chunks unless Python asked for each.

use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::{
    external_processor_server::ExternalProcessor, processing_request::Request, HttpBody, HttpHeaders,
    ProcessingRequest, ProcessingResponse,
};
use envoy_types::pb::google::protobuf::Struct;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Status, Streaming};

use crate::bridge::{Answer, Bridge};
use crate::events::{Closed, Event, Fail, ResponseBody, ResponseHeaders, ResponseTrailers, Route, RouteWithoutBody};
use crate::messages::{self as m, BUFFERED, BUFFERED_PARTIAL, FULL_DUPLEX_STREAMED, STREAMED};

/// Response body bytes held before they are reported even if the response goes on.
const REPORT_BYTES: usize = 64 << 10;

#[derive(Clone, Copy)]
pub struct Settings {
    pub max_body_bytes: usize,
    pub honour_subset_hint: bool,
    /// How long a stream whose exchange is over waits for the proxy to close it before ending it.
    pub close_wait: Duration,
}

/// Why a stream stops before its exchange is over.
enum Stop {
    /// The proxy reset the stream (or it went away) while the picker waited.
    Gone,
    /// Answer the client directly and end the exchange.
    Reject(u16, Vec<u8>),
}

type Step = Result<(), Stop>;

fn violation(what: &str) -> (&'static str, String) {
    ("BadRequest", format!("ext_proc protocol violation: {what}"))
}

/// CLOCK_MONOTONIC in seconds: Python's `time.monotonic()` on Linux.
pub(crate) fn monotonic() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes into a valid timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

struct StreamState {
    id: u64,
    bridge: Arc<Bridge>,
    settings: Settings,
    out: mpsc::Sender<Result<ProcessingResponse, Status>>,
    request_mode: i32,
    response_mode: i32,
    send_body_early: bool,
    headers: Vec<(String, String)>,
    subset: Option<Vec<String>>,
    body: Vec<u8>,
    chunks: usize,
    /// Python holds a routed request for this stream (it has the pick).
    routed: bool,
    /// Python's answer carried headers only (no destination): the request's control headers
    /// stay, and Python hears nothing more of the stream.
    header_only: bool,
    /// Python knows the request ended (response end reported, or it rejected it).
    reported_end: bool,
    /// Python asked about this stream: it must hear how it ends.
    asked: bool,
    report_chunks: bool,
    /// Ask Python for the dynamic metadata of every response answer.
    ask_metadata: bool,
    request_ended: bool,
    response_ended: bool,
    pending: Vec<u8>,
    pending_served: Option<String>,
    first_byte_at: Option<f64>,
}

impl StreamState {
    fn new(bridge: Arc<Bridge>, settings: Settings, out: mpsc::Sender<Result<ProcessingResponse, Status>>) -> Self {
        Self {
            id: bridge.new_stream_id(),
            bridge,
            settings,
            out,
            request_mode: BUFFERED,
            response_mode: 0,
            send_body_early: false,
            headers: Vec::new(),
            subset: None,
            body: Vec::new(),
            chunks: 0,
            routed: false,
            header_only: false,
            reported_end: false,
            asked: false,
            report_chunks: false,
            ask_metadata: false,
            request_ended: false,
            response_ended: false,
            pending: Vec::new(),
            pending_served: None,
            first_byte_at: None,
        }
    }

    async fn send(&self, response: ProcessingResponse) -> Step {
        self.out.send(Ok(response)).await.map_err(|_| Stop::Gone)
    }

    /// Ask Python, waiting for its answer unless the proxy goes away meanwhile.
    async fn ask(&mut self, event: Event) -> Result<Answer, Stop> {
        self.asked = true;
        let answer = self.bridge.ask(self.id, event);
        tokio::select! {
            answer = answer => answer.map_err(|_| Stop::Gone),
            _ = self.out.closed() => {
                self.bridge.forget(self.id);
                Err(Stop::Gone)
            }
        }
    }

    async fn fail(&mut self, (code, message): (&'static str, String)) -> Stop {
        let id = self.id;
        match self.ask(Event::Fail(Fail { id, code, message })).await {
            Ok(Answer::Reject { status, body }) => Stop::Reject(status, body),
            Ok(Answer::Route { .. } | Answer::Metadata(_)) | Err(_) => Stop::Gone,
        }
    }

    /// Report a response message and wait for the dynamic metadata of its answer.
    async fn metadata(&mut self, event: Event) -> Result<Option<Struct>, Stop> {
        match self.ask(event).await? {
            Answer::Metadata(metadata) => Ok(metadata),
            Answer::Reject { status, body } => Err(Stop::Reject(status, body)),
            Answer::Route { .. } => Ok(None),
        }
    }

    /// The pick, or the stop it became.
    async fn route(&mut self, event: Event) -> Result<(m::Pick, Option<Vec<u8>>), Stop> {
        match self.ask(event).await? {
            Answer::Route {
                destination,
                body,
                headers,
                chunks,
                metadata,
            } => {
                self.routed = true;
                self.header_only = destination.is_none();
                // a header-only answer ends what Python holds for the stream
                self.reported_end |= self.header_only;
                self.report_chunks = chunks;
                self.ask_metadata = metadata;
                Ok((m::Pick { destination, headers }, body))
            }
            Answer::Reject { status, body } => Err(Stop::Reject(status, body)),
            Answer::Metadata(_) => Err(Stop::Gone),
        }
    }

    /// The control headers to remove upstream: the EPP's own, unless the answer was header-only
    /// (body-based routing runs before the EPP, which still needs them).
    fn removed_headers(&self) -> Vec<String> {
        if self.header_only {
            Vec::new()
        } else {
            m::removed_headers(&self.headers)
        }
    }

    fn exchange_ended(&self) -> bool {
        self.request_ended && self.response_ended
    }

    // -- request path ---------------------------------------------------------------------

    async fn on_request_headers(&mut self, req: &ProcessingRequest, headers: &HttpHeaders) -> Step {
        if !self.headers.is_empty() {
            return Err(self.fail(violation("request headers arrived twice")).await);
        }
        self.headers = m::header_map(headers.headers.as_ref());
        self.request_ended = headers.end_of_stream;
        if self.settings.honour_subset_hint {
            self.subset = m::subset_hint(req);
        }
        if headers.end_of_stream || (self.request_mode == STREAMED && !self.send_body_early) {
            // No body, or STREAMED mode where Envoy forwards the headers before any body arrives:
            // the pick cannot wait for the body.
            let id = self.id;
            let subset = self.subset.clone();
            let (pick, _) = self
                .route(Event::RouteWithoutBody(RouteWithoutBody { id, subset }))
                .await?;
            return self
                .send(m::route_in_headers(&pick, None, self.removed_headers()))
                .await;
        }
        if self.request_mode == BUFFERED || self.request_mode == BUFFERED_PARTIAL {
            return self.send(m::continue_request_headers()).await;
        }
        Ok(()) // duplex, or STREAMED with the body sent early: answered once the body is seen
    }

    async fn on_request_body(&mut self, body: HttpBody) -> Step {
        self.request_ended = body.end_of_stream;
        if self.routed {
            // routed on headers (STREAMED without the early body)
            return self.send(m::continue_request_body()).await;
        }
        if self.headers.is_empty() {
            return Err(self.fail(violation("request body before request headers")).await);
        }
        self.chunks += 1;
        if self.body.len() + body.body.len() > self.settings.max_body_bytes {
            let limit = self.settings.max_body_bytes;
            let error = (
                "PayloadTooLarge",
                format!("request body exceeds the limit of {limit} bytes"),
            );
            return Err(self.fail(error).await);
        }
        if self.body.is_empty() {
            self.body = body.body;
        } else {
            self.body.extend_from_slice(&body.body);
        }
        if !body.end_of_stream && self.request_mode != BUFFERED_PARTIAL {
            return Ok(());
        }
        self.route_body(false).await
    }

    async fn on_request_trailers(&mut self) -> Step {
        if self.headers.is_empty() {
            return Err(self.fail(violation("request trailers before request headers")).await);
        }
        self.request_ended = true;
        if !self.routed {
            // trailers end the body in duplex mode
            self.route_body(true).await?;
        }
        self.send(m::continue_request_trailers()).await
    }

    async fn route_body(&mut self, trailers_follow: bool) -> Step {
        // Python gets a copy: a duplex stream re-emits this one unless the director replaced it.
        let body = self.body.clone();
        let event = Event::Route(Route {
            id: self.id,
            body,
            headers: self.headers.clone(),
            subset: self.subset.clone(),
        });
        let (pick, new_body) = self.route(event).await?;
        let removed = self.removed_headers();
        if self.request_mode == BUFFERED || self.request_mode == BUFFERED_PARTIAL {
            return self.send(m::route_in_body(&pick, removed, new_body)).await;
        }
        let out_body = new_body.unwrap_or_else(|| std::mem::take(&mut self.body));
        self.send(m::route_in_headers(&pick, Some(out_body.len()), removed))
            .await?;
        if self.request_mode == FULL_DUPLEX_STREAMED {
            let mut responses = Vec::new();
            m::streamed_request_body(&out_body, !trailers_follow, &mut responses);
            for response in responses {
                self.send(response).await?;
            }
        } else {
            // STREAMED, body sent early: each chunk Envoy sent gets its (empty) answer
            for _ in 0..self.chunks {
                self.send(m::continue_request_body()).await?;
            }
        }
        Ok(())
    }

    // -- response path ----------------------------------------------------------------------

    async fn on_response_headers(&mut self, req: &ProcessingRequest, headers: HttpHeaders) -> Step {
        self.response_ended = headers.end_of_stream;
        if self.routed && !self.reported_end {
            let map = m::header_map(headers.headers.as_ref());
            // digits only (no sign), else 0
            let status = m::header(&map, ":status")
                .filter(|s| s.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|s| s.parse::<u32>().ok())
                .unwrap_or(0);
            let served = m::served_endpoint(req).or_else(|| m::header(&map, m::SERVED_KEY).map(String::from));
            let content_type = m::header(&map, "content-type").unwrap_or("").to_owned();
            let end_of_stream = headers.end_of_stream;
            self.reported_end |= end_of_stream;
            self.bridge.push(Event::ResponseHeaders(ResponseHeaders {
                id: self.id,
                status,
                served,
                content_type,
                end_of_stream,
            }));
        }
        self.send(m::continue_response_headers()).await
    }

    /// The body bytes held so far, as an event (`asks`: Python answers with metadata).
    fn body_event(&mut self, end_of_stream: bool, asks: bool) -> Event {
        self.reported_end |= end_of_stream;
        Event::ResponseBody(ResponseBody {
            id: self.id,
            data: std::mem::take(&mut self.pending),
            end_of_stream,
            served: self.pending_served.take(),
            first_byte_at: self.first_byte_at,
            asks,
        })
    }

    fn report_body(&mut self, end_of_stream: bool) {
        let event = self.body_event(end_of_stream, false);
        self.bridge.push(event);
    }

    async fn on_response_body(&mut self, req: &ProcessingRequest, body: HttpBody) -> Step {
        let end = body.end_of_stream;
        self.response_ended = end;
        let mut metadata = None;
        if self.routed && !self.reported_end {
            if self.first_byte_at.is_none() && !body.body.is_empty() {
                self.first_byte_at = Some(monotonic());
            }
            if self.pending_served.is_none() {
                self.pending_served = m::served_endpoint(req);
            }
            self.pending.extend_from_slice(&body.body);
            if self.ask_metadata {
                // response-metadata hooks: the answer to every chunk carries what they report
                let event = self.body_event(end, true);
                metadata = self.metadata(event).await?;
            } else if end || self.report_chunks || self.pending.len() >= REPORT_BYTES {
                self.report_body(end);
            }
        }
        if self.response_mode == FULL_DUPLEX_STREAMED {
            return self.send(m::streamed_response_body(body.body, end, metadata)).await;
        }
        self.send(m::continue_response_body(metadata)).await
    }

    async fn on_response_trailers(&mut self) -> Step {
        self.response_ended = true;
        let mut metadata = None;
        if self.routed && !self.reported_end {
            if !self.pending.is_empty() {
                self.report_body(false);
            }
            self.reported_end = true;
            let (id, asks) = (self.id, self.ask_metadata);
            if asks {
                metadata = self
                    .metadata(Event::ResponseTrailers(ResponseTrailers { id, asks }))
                    .await?;
            } else {
                self.bridge.push(Event::ResponseTrailers(ResponseTrailers { id, asks }));
            }
        }
        self.send(m::continue_response_trailers(metadata)).await
    }

    /// The body modes Envoy states in the stream's first message, whichever phase it is: a
    /// local reply of an earlier filter reaches this one's response path without any request.
    fn apply_protocol_config(&mut self, req: &ProcessingRequest) {
        if let Some(config) = &req.protocol_config {
            self.request_mode = if config.request_body_mode == 0 {
                BUFFERED
            } else {
                config.request_body_mode
            };
            self.response_mode = config.response_body_mode;
            self.send_body_early = config.send_body_without_waiting_for_header_response;
        }
    }

    async fn dispatch(&mut self, mut req: ProcessingRequest) -> Step {
        self.apply_protocol_config(&req);
        match req.request.take() {
            Some(Request::RequestHeaders(headers)) => self.on_request_headers(&req, &headers).await,
            Some(Request::RequestBody(body)) => self.on_request_body(body).await,
            Some(Request::RequestTrailers(_)) => self.on_request_trailers().await,
            Some(Request::ResponseHeaders(headers)) => self.on_response_headers(&req, headers).await,
            Some(Request::ResponseBody(body)) => self.on_response_body(&req, body).await,
            Some(Request::ResponseTrailers(_)) => self.on_response_trailers().await,
            None => Ok(()),
        }
    }

    /// Wait for the proxy to close the stream, at most `close_wait`.
    async fn await_close(&self) {
        tokio::select! {
            _ = self.out.closed() => {}
            _ = tokio::time::sleep(self.settings.close_wait) => {}
        }
    }

    /// Serve the stream's messages (`inbound`: gRPC's request stream) until its exchange is over.
    async fn run(mut self, mut inbound: impl Stream<Item = Result<ProcessingRequest, Status>> + Unpin) {
        let error = loop {
            let message = tokio::select! {
                message = inbound.next() => message,
                _ = self.out.closed() => break Some("cancelled"),
            };
            let req = match message {
                Some(Ok(req)) => req,
                None => break None, // the proxy half-closed
                Some(Err(_)) => break Some("cancelled"),
            };
            match self.dispatch(req).await {
                Ok(()) if self.exchange_ended() => {
                    self.finish(None);
                    self.await_close().await;
                    return;
                }
                Ok(()) => {}
                Err(Stop::Gone) => break Some("cancelled"),
                Err(Stop::Reject(status, body)) => {
                    // Python released the request when it answered; the answer ends the exchange.
                    self.reported_end = true;
                    if self.send(m::immediate(status, body)).await.is_ok() {
                        self.await_close().await;
                    }
                    return;
                }
            }
        };
        self.finish(error);
    }

    /// Tell Python how the stream ended, when it holds anything for it.
    fn finish(&mut self, error: Option<&'static str>) {
        if self.asked && !self.reported_end {
            self.reported_end = true;
            if !self.pending.is_empty() {
                self.report_body(false);
            }
            self.bridge.push(Event::Closed(Closed { id: self.id, error }));
        }
    }
}

/// Counts the stream open while it lives (tonic may drop its task at any await).
struct ActiveGuard(Arc<Bridge>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.streams_active.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

pub struct Service {
    pub bridge: Arc<Bridge>,
    pub settings: Settings,
}

#[tonic::async_trait]
impl ExternalProcessor for Service {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: tonic::Request<Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Self::ProcessStream>, Status> {
        let (out, rx) = mpsc::channel(16);
        let bridge = self.bridge.clone();
        bridge.streams_active.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let guard = ActiveGuard(bridge.clone());
        let state = StreamState::new(bridge, self.settings, out);
        let inbound = request.into_inner();
        tokio::spawn(async move {
            let _guard = guard;
            state.run(inbound).await;
        });
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }
}

#[cfg(test)]
#[path = "stream_tests.rs"]
mod tests;
