//! The crossing between the tokio streams and Python's asyncio loop.
//!
//! Streams push events into one queue and wake the loop (an eventfd it watches with
//! `add_reader`) only when the queue goes non-empty, so a busy loop drains many events per
//! wake-up. Python answers a stream's question (route, or the error body of a failure) by
//! calling back in, which completes the stream's oneshot.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;

use envoy_types::pb::google::protobuf::Struct;
use tokio::sync::oneshot;

use crate::events::Event;

/// Python's answer to a `Route`, `RouteWithoutBody` or `Fail` event, or to a response event
/// that `asks`.
pub enum Answer {
    /// `body`: the body to forward when the director replaced it; `chunks`: report every
    /// response chunk as it passes (response-streaming hooks need them); `metadata`: ask for
    /// the dynamic metadata of the answer to every response chunk and to the trailers
    /// (response-metadata hooks); `headers`: request headers plugins set for the model server
    /// (an empty value removes the header). `destination` None: a header-only answer, which
    /// leaves the request's control headers alone and whose response is not reported.
    Route {
        destination: Option<String>,
        body: Option<Vec<u8>>,
        headers: Vec<(String, String)>,
        chunks: bool,
        metadata: bool,
    },
    Reject {
        status: u16,
        body: Vec<u8>,
    },
    /// The dynamic metadata to set on the answer to a response message (None: nothing).
    Metadata(Option<Struct>),
}

pub struct Bridge {
    events: Mutex<Vec<Event>>,
    answers: Mutex<HashMap<u64, oneshot::Sender<Answer>>>,
    wake: OwnedFd,
    next_id: AtomicU64,
    pub streams_active: AtomicI64,
}

impl Bridge {
    pub fn new() -> std::io::Result<Self> {
        // SAFETY: eventfd returns a new descriptor we own, or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self {
            events: Mutex::new(Vec::new()),
            answers: Mutex::new(HashMap::new()),
            // SAFETY: fd is valid and owned by nothing else.
            wake: unsafe { OwnedFd::from_raw_fd(fd) },
            next_id: AtomicU64::new(1),
            streams_active: AtomicI64::new(0),
        })
    }

    pub fn wake_fd(&self) -> i32 {
        self.wake.as_raw_fd()
    }

    pub fn new_stream_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    pub fn push(&self, event: Event) {
        let was_empty = {
            let mut events = self.events.lock().unwrap();
            events.push(event);
            events.len() == 1
        };
        if was_empty {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a valid u64 to our eventfd; a full counter cannot happen.
            unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
    }

    /// Push `event` and register for its answer.
    pub fn ask(&self, id: u64, event: Event) -> oneshot::Receiver<Answer> {
        let (tx, rx) = oneshot::channel();
        self.answers.lock().unwrap().insert(id, tx);
        self.push(event);
        rx
    }

    /// Forget a question whose stream is gone.
    pub fn forget(&self, id: u64) {
        self.answers.lock().unwrap().remove(&id);
    }

    /// Deliver Python's answer; false when the stream no longer waits for one.
    pub fn answer(&self, id: u64, answer: Answer) -> bool {
        match self.answers.lock().unwrap().remove(&id) {
            Some(tx) => tx.send(answer).is_ok(),
            None => false,
        }
    }

    /// Everything queued, after clearing the wake-up (cleared first: an event pushed meanwhile
    /// is taken now or wakes the loop again).
    pub fn take(&self) -> Vec<Event> {
        let mut counter: u64 = 0;
        // SAFETY: reads 8 bytes into a valid u64 from our non-blocking eventfd.
        unsafe { libc::read(self.wake.as_raw_fd(), (&mut counter as *mut u64).cast(), 8) };
        std::mem::take(&mut *self.events.lock().unwrap())
    }
}
