//! picker's ext_proc transport core: the ext_proc stream state machine on a tokio thread, the
//! decisions (and what the response teaches) in Python. See native/README.md.

mod bridge;
mod events;
mod messages;
mod scrape;
mod server;
mod stream;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use bridge::{Answer, Bridge};
use events::Event;
use server::{Running, ServeOptions, Tls};
use stream::Settings;

/// One ext_proc server: `serve` starts it on its own thread; the asyncio loop watches
/// `wake_fd`, calls `drain` for the events, and answers with `route` / `reject`.
#[pyclass(frozen)]
struct Core {
    bridge: Arc<Bridge>,
    settings: Settings,
    running: Mutex<Option<Running>>,
}

#[pymethods]
impl Core {
    #[new]
    #[pyo3(signature = (max_body_bytes, honour_subset_hint, close_wait_seconds))]
    fn new(max_body_bytes: usize, honour_subset_hint: bool, close_wait_seconds: f64) -> PyResult<Self> {
        let close_wait = Duration::try_from_secs_f64(close_wait_seconds)
            .map_err(|e| PyValueError::new_err(format!("close_wait_seconds: {e}")))?;
        Ok(Self {
            bridge: Arc::new(Bridge::new().map_err(|e| PyOSError::new_err(e.to_string()))?),
            settings: Settings {
                max_body_bytes,
                honour_subset_hint,
                close_wait,
            },
            running: Mutex::new(None),
        })
    }

    /// Bind `address` and serve on a new thread; the bound port. TLS from `tls_key`+`tls_cert`
    /// (PEM) or from `cert_dir` (tls.crt, tls.key; reloaded when they change), else plaintext.
    #[pyo3(signature = (address, *, reuse_port, max_receive_bytes, tls_key=None, tls_cert=None, cert_dir=None, health_services=Vec::new()))]
    #[allow(clippy::too_many_arguments)]
    fn serve(
        &self,
        py: Python<'_>,
        address: String,
        reuse_port: bool,
        max_receive_bytes: usize,
        tls_key: Option<Vec<u8>>,
        tls_cert: Option<Vec<u8>>,
        cert_dir: Option<PathBuf>,
        health_services: Vec<String>,
    ) -> PyResult<u16> {
        let tls = match (tls_key, tls_cert, cert_dir) {
            (Some(key), Some(cert), None) => Some(Tls::Fixed(key, cert)),
            (None, None, Some(dir)) => Some(Tls::Directory(dir)),
            (None, None, None) => None,
            _ => return Err(PyValueError::new_err("TLS: give tls_key and tls_cert, or cert_dir")),
        };
        let mut running = self.running.lock().unwrap();
        if running.is_some() {
            return Err(PyRuntimeError::new_err("already serving"));
        }
        let options = ServeOptions {
            address,
            reuse_port,
            max_receive_bytes,
            tls,
            health_services,
            settings: self.settings,
        };
        let bridge = self.bridge.clone();
        let started = py
            .detach(|| server::serve(options, bridge))
            .map_err(PyOSError::new_err)?;
        let port = started.port;
        *running = Some(started);
        Ok(port)
    }

    /// The descriptor that becomes readable when events wait.
    fn wake_fd(&self) -> i32 {
        self.bridge.wake_fd()
    }

    /// The events queued since the last call, each an instance of its kind's class.
    fn drain<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = self.bridge.take();
        let list = PyList::empty(py);
        for event in events {
            list.append(event.into_py(py)?)?;
        }
        Ok(list)
    }

    /// The pick for stream `id`; `body` when the director replaced it; `chunks`: report each
    /// response chunk; `metadata`: ask for the dynamic metadata of every response answer
    /// (answered with `metadata`); `headers`: request headers to set for the model server beside
    /// the destination (an empty value removes one the client sent). `destination` None: a
    /// header-only answer (body-based routing): `headers` (an empty value set, not removed) and
    /// nothing else, and the response is not reported. False when the stream is gone.
    #[pyo3(signature = (id, destination, body, chunks, metadata, headers=Vec::new()))]
    fn route(
        &self,
        id: u64,
        destination: Option<String>,
        body: Option<Vec<u8>>,
        chunks: bool,
        metadata: bool,
        headers: Vec<(String, String)>,
    ) -> bool {
        self.bridge.answer(
            id,
            Answer::Route {
                destination,
                body,
                headers,
                chunks,
                metadata,
            },
        )
    }

    /// The dynamic metadata (namespace → key → number) to set on stream `id`'s answer to the
    /// response message it reported with `asks`. False when the stream is gone.
    fn metadata(&self, id: u64, values: Option<HashMap<String, HashMap<String, f64>>>) -> bool {
        self.bridge
            .answer(id, Answer::Metadata(values.map(messages::dynamic_metadata)))
    }

    /// Answer stream `id`'s client directly (status, JSON body). False when the stream is gone.
    fn reject(&self, id: u64, status: u16, body: Vec<u8>) -> bool {
        self.bridge.answer(id, Answer::Reject { status, body })
    }

    /// Open ext_proc streams.
    fn streams_active(&self) -> i64 {
        self.bridge.streams_active.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The health service (if any) reports NOT_SERVING from now on.
    fn enter_graceful_shutdown(&self) {
        if let Some(running) = self.running.lock().unwrap().as_ref() {
            running.not_serving();
        }
    }

    /// Stop accepting, give open streams `grace` seconds, then close them all.
    fn stop(&self, py: Python<'_>, grace: f64) -> PyResult<()> {
        let grace = Duration::try_from_secs_f64(grace).map_err(|e| PyValueError::new_err(format!("grace: {e}")))?;
        let running = self.running.lock().unwrap().take();
        if let Some(mut running) = running {
            py.detach(move || running.stop(grace));
        }
        Ok(())
    }
}

/// The metrics scraper (src/scrape.rs): one thread scraping every target's page; Python adds
/// and removes targets and drains what the scrapes gave.
#[pyclass(frozen)]
struct Scraper {
    inner: Mutex<scrape::Scraper>,
}

/// `(changed, same, failed)`: `(id, lines, page_bytes, at, took)`, `(id, at, took)`,
/// `(id, reason, detail)`.
type Drained<'py> = (
    Vec<(u64, Bound<'py, PyBytes>, usize, f64, f64)>,
    Vec<(u64, f64, f64)>,
    Vec<(u64, &'static str, String)>,
);

#[pymethods]
impl Scraper {
    #[new]
    #[pyo3(signature = (*, interval, timeout, max_concurrency, max_page_bytes))]
    fn new(interval: f64, timeout: f64, max_concurrency: usize, max_page_bytes: usize) -> PyResult<Self> {
        let seconds = |name: &str, value: f64| match Duration::try_from_secs_f64(value) {
            Ok(duration) if !duration.is_zero() => Ok(duration),
            _ => Err(PyValueError::new_err(format!(
                "{name} must be a positive number of seconds"
            ))),
        };
        let settings = scrape::Settings {
            interval: seconds("interval", interval)?,
            timeout: seconds("timeout", timeout)?,
            max_page_bytes,
        };
        let inner =
            scrape::Scraper::start(settings, max_concurrency.max(1)).map_err(|e| PyOSError::new_err(e.to_string()))?;
        Ok(Self {
            inner: Mutex::new(inner),
        })
    }

    /// Scrape `http://ip:port{path}` as target `id` (replacing an earlier `id`), reading the
    /// sample lines of `families`.
    fn add(&self, id: u64, ip: String, port: u16, path: &str, families: Vec<Vec<u8>>) {
        self.inner
            .lock()
            .unwrap()
            .add(scrape::Target::new(id, ip, port, path, families));
    }

    /// Stop scraping target `id` (a scrape in flight is abandoned).
    fn remove(&self, id: u64) {
        self.inner.lock().unwrap().remove(id);
    }

    /// What the scrapes finished since the last call gave.
    fn drain<'py>(&self, py: Python<'py>) -> Drained<'py> {
        let outcomes = self.inner.lock().unwrap().take();
        let (mut changed, mut same, mut failed) = (Vec::new(), Vec::with_capacity(outcomes.len()), Vec::new());
        for outcome in outcomes {
            match outcome {
                scrape::Outcome::Changed {
                    id,
                    lines,
                    page_bytes,
                    at,
                    took,
                } => changed.push((id, PyBytes::new(py, &lines), page_bytes, at, took)),
                scrape::Outcome::Same { id, at, took } => same.push((id, at, took)),
                scrape::Outcome::Failed { id, reason, detail } => failed.push((id, reason, detail)),
            }
        }
        (changed, same, failed)
    }

    /// End every scrape and the thread (waits for it); idempotent.
    fn stop(&self, py: Python<'_>) {
        let inner = &self.inner;
        py.detach(|| inner.lock().unwrap().stop());
    }
}

/// The sample lines of `families` in `page`, as the scraper picks them (for tests and benches).
#[pyfunction]
fn wanted_lines<'py>(py: Python<'py>, page: &[u8], families: Vec<Vec<u8>>) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &scrape::wanted_lines(page, &families))
}

#[pymodule]
fn picker_extproc_core(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<Core>()?;
    module.add_class::<Scraper>()?;
    module.add_function(wrap_pyfunction!(wanted_lines, module)?)?;
    Event::register(module)
}
