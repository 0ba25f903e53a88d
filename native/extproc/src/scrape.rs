//! The metrics scraper: every endpoint's /metrics page fetched on its own thread, off the
//! asyncio loop and the GIL, with only what changed handed to Python.
//!
//! One current-thread tokio runtime runs one task per endpoint: a timer (random phase, then the
//! interval ±10%, woken on ticks of a tenth of the interval so one wake-up serves every scrape
//! due in it), one kept-alive HTTP/1.1 connection (plain http), the request under a timeout and
//! the page under a size cap. A page identical to the last one (`content_hash`, ~1 µs) is not
//! scanned again; otherwise it is scanned for the sample lines of the families the endpoint's
//! engine spec reads (a line that starts with a wanted name followed by `{`, a space or a tab:
//! the Python scanner's rule), and only when those lines differ from the last scrape's do they
//! cross to Python (`Outcome::Changed`), where `parse_page` reads them. Anything else crosses as
//! a time stamp (`Outcome::Same`), so the Python cost is one restamp per scrape and one parse
//! per change. Python drains the outcomes in batches (`Scraper::drain`) once per interval.
//!
//! Cost on this 2-core machine (`python -m picker_bench.datalayer --endpoints 256`, static
//! pages): about 20 µs of this thread's CPU per scrape, kernel included; state per endpoint
//! about 1 KB (the task, its socket, two hashes, the target), the read buffer only during a read.
//!
//! Failures carry the collector's reasons: timeout, connect, disconnect, http_status,
//! page_too_large, error (no_metrics is Python's verdict on the lines).

use std::collections::HashMap;
use std::io::ErrorKind;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Semaphore};
use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::stream::monotonic;

/// The most a response head may take (status line and headers).
const MAX_HEAD_BYTES: usize = 64 * 1024;
/// The first read's buffer: a real vLLM page (about 21 KB) fits in one.
const FIRST_READ_BYTES: usize = 32 * 1024;

/// What one endpoint's scrape gave, in the order the scrapes finished.
pub enum Outcome {
    /// The wanted lines differ from the last scrape's (or this is the first scrape).
    Changed {
        id: u64,
        lines: Vec<u8>,
        page_bytes: usize,
        at: f64,
        took: f64,
    },
    /// The same wanted lines as the last scrape: only the time stamp is new.
    Same { id: u64, at: f64, took: f64 },
    Failed {
        id: u64,
        reason: &'static str,
        detail: String,
    },
}

/// One endpoint to scrape.
pub struct Target {
    pub id: u64,
    pub ip: String,
    pub port: u16,
    /// The whole GET request, made once.
    pub request: Vec<u8>,
    /// Family names the engine spec reads.
    pub families: Vec<Vec<u8>>,
}

impl Target {
    pub fn new(id: u64, ip: String, port: u16, path: &str, families: Vec<Vec<u8>>) -> Self {
        let host = if ip.contains(':') {
            format!("[{ip}]:{port}")
        } else {
            format!("{ip}:{port}")
        };
        // Plain text, uncompressed: gzip would cost CPU on both sides of a LAN hop.
        let request = format!(
            "GET {path} HTTP/1.1\r\nHost: {host}\r\nAccept: text/plain;version=0.0.4\r\n\
             Accept-Encoding: identity\r\nUser-Agent: picker\r\n\r\n"
        )
        .into_bytes();
        Self {
            id,
            ip,
            port,
            request,
            families,
        }
    }
}

#[derive(Clone, Copy)]
pub struct Settings {
    pub interval: Duration,
    pub timeout: Duration,
    pub max_page_bytes: usize,
}

enum Command {
    Add(Target),
    Remove(u64),
}

/// The scraper thread and the outcomes it queued for Python.
pub struct Scraper {
    commands: mpsc::UnboundedSender<Command>,
    outcomes: Arc<Mutex<Vec<Outcome>>>,
    thread: Option<JoinHandle<()>>,
}

impl Scraper {
    /// Start the scraper thread; `max_concurrency` scrapes run at once at most.
    pub fn start(settings: Settings, max_concurrency: usize) -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let (commands, received) = mpsc::unbounded_channel();
        let outcomes = Arc::new(Mutex::new(Vec::new()));
        let queue = outcomes.clone();
        let thread = std::thread::Builder::new()
            .name("picker-scrape".into())
            .spawn(move || runtime.block_on(follow(received, queue, settings, max_concurrency)))?;
        Ok(Self {
            commands,
            outcomes,
            thread: Some(thread),
        })
    }

    pub fn add(&self, target: Target) {
        let _ = self.commands.send(Command::Add(target));
    }

    pub fn remove(&self, id: u64) {
        let _ = self.commands.send(Command::Remove(id));
    }

    pub fn take(&self) -> Vec<Outcome> {
        std::mem::take(&mut *self.outcomes.lock().unwrap())
    }

    /// End every scrape (connections closed) and the thread; waits for it.
    pub fn stop(&mut self) {
        let (closed, _) = mpsc::unbounded_channel();
        self.commands = closed; // the last sender gone: `follow` returns, dropping the runtime's tasks
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Scraper {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Start and end scrape tasks as the commands say, until the sender is gone.
async fn follow(
    mut commands: mpsc::UnboundedReceiver<Command>,
    outcomes: Arc<Mutex<Vec<Outcome>>>,
    settings: Settings,
    max_concurrency: usize,
) {
    let slots = Arc::new(Semaphore::new(max_concurrency));
    let epoch = Instant::now();
    let mut tasks: HashMap<u64, AbortHandle> = HashMap::new();
    while let Some(command) = commands.recv().await {
        match command {
            Command::Add(target) => {
                let id = target.id;
                let task = tokio::spawn(scrape_forever(target, outcomes.clone(), settings, slots.clone(), epoch));
                if let Some(old) = tasks.insert(id, task.abort_handle()) {
                    old.abort();
                }
            }
            Command::Remove(id) => {
                if let Some(task) = tasks.remove(&id) {
                    task.abort();
                }
            }
        }
    }
    for task in tasks.values() {
        task.abort();
    }
}

/// xorshift64*: jitter needs no better randomness.
struct Jitter(u64);

impl Jitter {
    fn new(seed: u64) -> Self {
        Self(seed | 1)
    }

    /// Uniform in [0, 1).
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// `due` rounded up to the next tick after `epoch`: the thread wakes once a tick for all the
/// scrapes due in it (a tenth of the interval) rather than once per scrape.
fn on_tick(due: Instant, epoch: Instant, tick: Duration) -> Instant {
    let ticks = due
        .saturating_duration_since(epoch)
        .as_nanos()
        .div_ceil(tick.as_nanos());
    epoch + Duration::from_nanos((ticks * tick.as_nanos()) as u64)
}

async fn scrape_forever(
    target: Target,
    outcomes: Arc<Mutex<Vec<Outcome>>>,
    settings: Settings,
    slots: Arc<Semaphore>,
    epoch: Instant,
) {
    let interval = settings.interval.as_secs_f64();
    let tick = (settings.interval / 10).max(Duration::from_millis(1));
    let mut jitter = Jitter::new(target.id.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ monotonic().to_bits());
    // A random phase, then ±10% jitter, so endpoints added together never scrape in lockstep.
    let mut due = Instant::now() + Duration::from_secs_f64(interval * jitter.next());
    let mut connection: Option<TcpStream> = None;
    let (mut last_page_hash, mut last_lines_hash): (Option<u64>, Option<u64>) = (None, None);
    loop {
        tokio::time::sleep_until(on_tick(due, epoch, tick)).await;
        let started = Instant::now();
        let fetched = {
            let _slot = slots.acquire().await;
            tokio::time::timeout(
                settings.timeout,
                fetch(&mut connection, &target, settings.max_page_bytes),
            )
            .await
        };
        let outcome = match fetched {
            Err(_) => {
                connection = None;
                Outcome::Failed {
                    id: target.id,
                    reason: "timeout",
                    detail: format!("no answer within {}s", settings.timeout.as_secs_f64()),
                }
            }
            Ok(Err(failure)) => {
                connection = None;
                Outcome::Failed {
                    id: target.id,
                    reason: failure.reason,
                    detail: failure.detail,
                }
            }
            Ok(Ok((buffer, start))) => {
                let page = &buffer[start..];
                let (at, took) = (monotonic(), started.elapsed().as_secs_f64());
                let page_hash = content_hash(page);
                // Most pages repeat byte for byte when idle; a changed page often changes only
                // families this spec does not read.
                let lines = (last_page_hash != Some(page_hash)).then(|| wanted_lines(page, &target.families));
                last_page_hash = Some(page_hash);
                match lines {
                    Some(lines) if last_lines_hash != Some(content_hash(&lines)) => {
                        last_lines_hash = Some(content_hash(&lines));
                        Outcome::Changed {
                            id: target.id,
                            lines,
                            page_bytes: page.len(),
                            at,
                            took,
                        }
                    }
                    _ => Outcome::Same {
                        id: target.id,
                        at,
                        took,
                    },
                }
            }
        };
        outcomes.lock().unwrap().push(outcome);
        // A scrape slower than the interval skips the ticks it missed instead of bursting.
        let step = Duration::from_secs_f64(interval * (0.9 + 0.2 * jitter.next()));
        due = (due + step).max(Instant::now());
    }
}

/// A fast 64-bit hash of `bytes` for change detection (FxHash's step, four lanes of 8-byte
/// words): every step is a bijection of the lane, so a page that differs in one word always
/// hashes differently; a collision between two real pages would keep stale values for one
/// scrape at most until the next change. About 1 µs for a 29 KB page, where SipHash takes ~15.
pub fn content_hash(bytes: &[u8]) -> u64 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let step = |hash: u64, word: u64| (hash.rotate_left(5) ^ word).wrapping_mul(K);
    let word = |chunk: &[u8]| {
        let mut word = [0u8; 8];
        word[..chunk.len()].copy_from_slice(chunk);
        u64::from_le_bytes(word)
    };
    let mut lanes = [1u64, 2, 3, 4];
    let blocks = bytes.chunks_exact(32);
    let rest = blocks.remainder();
    for block in blocks {
        for (lane, chunk) in lanes.iter_mut().zip(block.chunks_exact(8)) {
            *lane = step(*lane, word(chunk));
        }
    }
    let mut hash = bytes.len() as u64;
    for chunk in rest.chunks(8) {
        hash = step(hash, word(chunk));
    }
    lanes.into_iter().fold(hash, step)
}

/// The sample lines of `families` in `page`, each with its newline: a line counts when it
/// starts with a family name followed by `{`, a space or a tab (so longer names sharing a
/// prefix are not confused).
pub fn wanted_lines(page: &[u8], families: &[Vec<u8>]) -> Vec<u8> {
    let mut first_bytes = [false; 256];
    for family in families {
        if let Some(&byte) = family.first() {
            first_bytes[byte as usize] = true;
        }
    }
    let is_wanted = |line: &[u8]| {
        // The separator byte first: it rules out most lines without comparing names.
        families
            .iter()
            .any(|family| matches!(line.get(family.len()), Some(b'{' | b' ' | b'\t')) && line.starts_with(family))
    };
    let mut lines = Vec::new();
    let mut start = 0;
    for end in memchr::memchr_iter(b'\n', page).chain(std::iter::once(page.len())) {
        let line = &page[start..end];
        if line.first().is_some_and(|&byte| first_bytes[byte as usize]) && is_wanted(line) {
            lines.extend_from_slice(line);
            lines.push(b'\n');
        }
        start = end + 1;
    }
    lines
}

/// Why a fetch failed: one of the collector's reasons and a detail for the log.
struct Failure {
    reason: &'static str,
    detail: String,
}

impl Failure {
    fn new(reason: &'static str, detail: impl Into<String>) -> Self {
        Self {
            reason,
            detail: detail.into(),
        }
    }

    fn io(error: std::io::Error) -> Self {
        let reason = match error.kind() {
            ErrorKind::ConnectionReset
            | ErrorKind::ConnectionAborted
            | ErrorKind::BrokenPipe
            | ErrorKind::UnexpectedEof => "disconnect",
            _ => "error",
        };
        Self::new(reason, error.to_string())
    }
}

/// GET the page over the kept-alive connection (a new one when there is none, or when the
/// kept one turns out closed before any answer); the connection stays only if the response
/// allows it.
async fn fetch(connection: &mut Option<TcpStream>, target: &Target, limit: usize) -> Result<(Vec<u8>, usize), Failure> {
    let reused = connection.is_some();
    let attempt = exchange(connection, target, limit).await;
    match attempt {
        Err(Exchange::ClosedBeforeAnswer) if reused => {
            *connection = None;
            exchange(connection, target, limit)
                .await
                .map_err(Exchange::into_failure)
        }
        other => other.map_err(Exchange::into_failure),
    }
}

enum Exchange {
    /// The server closed the connection without a byte of answer (a kept-alive connection it
    /// timed out: worth one retry on a new connection).
    ClosedBeforeAnswer,
    Failed(Failure),
}

impl Exchange {
    fn into_failure(self) -> Failure {
        match self {
            Exchange::ClosedBeforeAnswer => {
                Failure::new("disconnect", "server closed the connection without an answer")
            }
            Exchange::Failed(failure) => failure,
        }
    }
}

impl From<Failure> for Exchange {
    fn from(failure: Failure) -> Self {
        Exchange::Failed(failure)
    }
}

/// The body: a buffer and where the page starts in it.
async fn exchange(
    connection: &mut Option<TcpStream>,
    target: &Target,
    limit: usize,
) -> Result<(Vec<u8>, usize), Exchange> {
    if connection.is_none() {
        let stream = TcpStream::connect((target.ip.as_str(), target.port))
            .await
            .map_err(|e| {
                Failure::new(
                    "connect",
                    format!("cannot connect to {}:{}: {e}", target.ip, target.port),
                )
            })?;
        stream.set_nodelay(true).map_err(Failure::io)?;
        *connection = Some(stream);
    }
    let stream = connection.as_mut().expect("connected above");
    match stream.write_all(&target.request).await {
        Ok(()) => {}
        Err(e) if matches!(e.kind(), ErrorKind::BrokenPipe | ErrorKind::ConnectionReset) => {
            return Err(Exchange::ClosedBeforeAnswer)
        }
        Err(e) => return Err(Failure::io(e).into()),
    }
    let mut buffer: Vec<u8> = Vec::with_capacity(FIRST_READ_BYTES);
    let head = loop {
        let searched = buffer.len().saturating_sub(3);
        if read_more(stream, &mut buffer).await? == 0 {
            return Err(if buffer.is_empty() {
                Exchange::ClosedBeforeAnswer
            } else {
                Failure::new("disconnect", "connection closed inside the response head").into()
            });
        }
        if let Some(end) = memchr::memmem::find(&buffer[searched..], b"\r\n\r\n") {
            break parse_head(&buffer[..searched + end + 4])?;
        }
        if buffer.len() > MAX_HEAD_BYTES {
            return Err(Failure::new("error", "response head too large").into());
        }
    };
    if head.status != 200 {
        *connection = None;
        return Err(Failure::new(
            "http_status",
            format!("HTTP {} from {}:{}", head.status, target.ip, target.port),
        )
        .into());
    }
    let body = match head.framing {
        Framing::Length(length) => {
            if length > limit {
                return Err(Failure::new("page_too_large", format!("page of {length} bytes exceeds {limit}")).into());
            }
            let wanted = head.length + length;
            buffer.reserve(wanted.saturating_sub(buffer.len()));
            while buffer.len() < wanted {
                if read_more(stream, &mut buffer).await? == 0 {
                    return Err(Failure::new(
                        "disconnect",
                        format!(
                            "connection closed after {} of {length} body bytes",
                            buffer.len() - head.length
                        ),
                    )
                    .into());
                }
            }
            if buffer.len() > wanted {
                *connection = None; // bytes beyond the response: never reuse such a connection
            }
            buffer.truncate(wanted);
            (buffer, head.length)
        }
        Framing::Chunked => (read_chunked(stream, buffer, head.length, limit).await?, 0),
        Framing::UntilClose => {
            loop {
                if buffer.len() - head.length > limit {
                    return Err(Failure::new("page_too_large", format!("page exceeds {limit} bytes")).into());
                }
                if read_more(stream, &mut buffer).await? == 0 {
                    break;
                }
            }
            (buffer, head.length)
        }
    };
    if !head.keep_alive || matches!(head.framing, Framing::UntilClose) {
        *connection = None;
    }
    Ok(body)
}

async fn read_more(stream: &mut TcpStream, buffer: &mut Vec<u8>) -> Result<usize, Failure> {
    if buffer.capacity() - buffer.len() < 4096 {
        buffer.reserve(buffer.capacity().max(FIRST_READ_BYTES));
    }
    stream.read_buf(buffer).await.map_err(Failure::io)
}

enum Framing {
    Length(usize),
    Chunked,
    UntilClose,
}

struct Head {
    status: u16,
    /// Bytes of the head, blank line included.
    length: usize,
    framing: Framing,
    keep_alive: bool,
}

fn parse_head(bytes: &[u8]) -> Result<Head, Failure> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut response = httparse::Response::new(&mut headers);
    let length = match response.parse(bytes) {
        Ok(httparse::Status::Complete(length)) => length,
        Ok(httparse::Status::Partial) => return Err(Failure::new("error", "incomplete response head")),
        Err(e) => return Err(Failure::new("error", format!("malformed response head: {e}"))),
    };
    let mut framing = Framing::UntilClose;
    let mut keep_alive = response.version == Some(1);
    for header in response.headers.iter() {
        let value = String::from_utf8_lossy(header.value).to_ascii_lowercase();
        if header.name.eq_ignore_ascii_case("content-length") {
            let length = value
                .trim()
                .parse()
                .map_err(|_| Failure::new("error", format!("bad Content-Length {value:?}")))?;
            if !matches!(framing, Framing::Chunked) {
                framing = Framing::Length(length);
            }
        } else if header.name.eq_ignore_ascii_case("transfer-encoding") && value.contains("chunked") {
            framing = Framing::Chunked;
        } else if header.name.eq_ignore_ascii_case("connection") {
            keep_alive = if value.contains("close") {
                false
            } else {
                keep_alive || value.contains("keep-alive")
            };
        } else if header.name.eq_ignore_ascii_case("content-encoding") && value.trim() != "identity" {
            return Err(Failure::new("error", format!("unsupported Content-Encoding {value:?}")));
        }
    }
    Ok(Head {
        status: response.code.unwrap_or(0),
        length,
        framing,
        keep_alive,
    })
}

/// Decode a chunked body that starts at `buffer[start..]`, reading more as needed.
async fn read_chunked(
    stream: &mut TcpStream,
    mut buffer: Vec<u8>,
    start: usize,
    limit: usize,
) -> Result<Vec<u8>, Failure> {
    let mut body = Vec::with_capacity(FIRST_READ_BYTES);
    let mut at = start;
    loop {
        // The size line.
        let line_end = loop {
            if let Some(offset) = memchr::memmem::find(&buffer[at..], b"\r\n") {
                break at + offset;
            }
            if buffer.len() - at > 1024 {
                return Err(Failure::new("error", "chunk size line too long"));
            }
            if read_more(stream, &mut buffer).await? == 0 {
                return Err(Failure::new("disconnect", "connection closed inside a chunked body"));
            }
        };
        let line = String::from_utf8_lossy(&buffer[at..line_end]);
        let digits = line.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(digits, 16)
            .map_err(|_| Failure::new("error", format!("bad chunk size {digits:?}")))?;
        at = line_end + 2;
        if size == 0 {
            // Trailers, if any, end with an empty line.
            loop {
                if let Some(offset) = memchr::memmem::find(&buffer[at..], b"\r\n") {
                    let empty = offset == 0;
                    at += offset + 2;
                    if empty {
                        return Ok(body);
                    }
                    continue;
                }
                if read_more(stream, &mut buffer).await? == 0 {
                    return Err(Failure::new("disconnect", "connection closed inside chunked trailers"));
                }
            }
        }
        if body.len() + size > limit {
            return Err(Failure::new("page_too_large", format!("page exceeds {limit} bytes")));
        }
        while buffer.len() < at + size + 2 {
            if read_more(stream, &mut buffer).await? == 0 {
                return Err(Failure::new("disconnect", "connection closed inside a chunked body"));
            }
        }
        body.extend_from_slice(&buffer[at..at + size]);
        at += size + 2;
        // Drop what was decoded, so the raw buffer holds at most one chunk.
        buffer.drain(..at);
        at = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wanted_lines_match_the_family_and_a_separator_only() {
        let page = b"a{x=\"1\"} 1\n# HELP a\nab 2\na 3\r\nb\t4\nc 5\na";
        let families = vec![b"a".to_vec(), b"b".to_vec()];
        assert_eq!(wanted_lines(page, &families), b"a{x=\"1\"} 1\na 3\r\nb\t4\n".to_vec());
    }

    #[test]
    fn content_hash_tells_pages_apart() {
        let page = b"vllm:num_requests_waiting 3\nvllm:num_requests_running 12\n".repeat(40);
        let mut changed = page.clone();
        changed[700] = b'4';
        assert_eq!(content_hash(&page), content_hash(&page.clone()));
        assert_ne!(content_hash(&page), content_hash(&changed));
        assert_ne!(content_hash(&page), content_hash(&page[..page.len() - 1]));
        assert_ne!(content_hash(b""), content_hash(b"\0"));
    }

    #[test]
    fn head_framing_and_keep_alive() {
        let head = parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n")
            .ok()
            .unwrap();
        assert!(matches!(head.framing, Framing::Length(12)) && head.keep_alive && head.status == 200);
        let head = parse_head(b"HTTP/1.0 404 No\r\nTransfer-Encoding: chunked\r\n\r\n")
            .ok()
            .unwrap();
        assert!(matches!(head.framing, Framing::Chunked) && !head.keep_alive && head.status == 404);
        let head = parse_head(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
            .ok()
            .unwrap();
        assert!(matches!(head.framing, Framing::UntilClose) && !head.keep_alive);
    }
}
