//! What a stream tells Python: one Python class per event kind (`picker_extproc_core.pyi` types
//! them), built by the streams without the GIL and handed over by `Core.drain` as they are.
//!
//! Numbers, flags and short strings are read by attribute; bytes and the header dict are made at
//! the attribute's read (once per event in `picker/extproc/server.py`), so a stream's thread
//! never touches Python objects.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

/// Pick for this body: answer with `Core.route` or `Core.reject`.
#[pyclass(frozen, module = "picker_extproc_core")]
pub struct Route {
    #[pyo3(get)]
    pub id: u64,
    pub body: Vec<u8>,
    pub headers: Vec<(String, String)>,
    #[pyo3(get)]
    pub subset: Option<Vec<String>>,
}

#[pymethods]
impl Route {
    /// The request body (a new bytes object at each read).
    #[getter]
    fn body<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.body)
    }

    /// The request headers, lower-case names (a new dict at each read).
    #[getter]
    fn headers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let map = PyDict::new(py);
        for (name, value) in &self.headers {
            map.set_item(name, value)?;
        }
        Ok(map)
    }
}

/// Pick without a body (headers-only requests, STREAMED mode without the early body): answer
/// with `Core.route` or `Core.reject`.
#[pyclass(frozen, get_all, module = "picker_extproc_core")]
pub struct RouteWithoutBody {
    pub id: u64,
    pub subset: Option<Vec<String>>,
}

/// The stream broke the protocol (or a limit): answer with `Core.reject` (its error body).
#[pyclass(frozen, get_all, module = "picker_extproc_core")]
pub struct Fail {
    pub id: u64,
    pub code: &'static str,
    pub message: String,
}

/// The response's headers: its status (0 when not digits), the endpoint that served it.
#[pyclass(frozen, get_all, module = "picker_extproc_core")]
pub struct ResponseHeaders {
    pub id: u64,
    pub status: u32,
    pub served: Option<String>,
    pub content_type: String,
    pub end_of_stream: bool,
}

/// Response body bytes since the last such event (chunks coalesced unless `Core.route` asked
/// for each); `asks`: answer with `Core.metadata` (the stream's answer to this chunk waits).
#[pyclass(frozen, module = "picker_extproc_core")]
pub struct ResponseBody {
    #[pyo3(get)]
    pub id: u64,
    pub data: Vec<u8>,
    #[pyo3(get)]
    pub end_of_stream: bool,
    #[pyo3(get)]
    pub served: Option<String>,
    #[pyo3(get)]
    pub first_byte_at: Option<f64>,
    #[pyo3(get)]
    pub asks: bool,
}

#[pymethods]
impl ResponseBody {
    /// The body bytes (a new bytes object at each read).
    #[getter]
    fn data<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.data)
    }
}

/// The response's trailers passed (its end); `asks` as for `ResponseBody`.
#[pyclass(frozen, get_all, module = "picker_extproc_core")]
pub struct ResponseTrailers {
    pub id: u64,
    pub asks: bool,
}

/// The stream ended before its response did: `error` None (the proxy half-closed) or "cancelled".
#[pyclass(frozen, get_all, module = "picker_extproc_core")]
pub struct Closed {
    pub id: u64,
    pub error: Option<&'static str>,
}

/// A line for Python's log (`level` as Python's logging levels).
#[pyclass(frozen, get_all, module = "picker_extproc_core")]
pub struct Log {
    pub level: u8,
    pub message: String,
}

/// Any event, as the streams queue them.
pub enum Event {
    Route(Route),
    RouteWithoutBody(RouteWithoutBody),
    Fail(Fail),
    ResponseHeaders(ResponseHeaders),
    ResponseBody(ResponseBody),
    ResponseTrailers(ResponseTrailers),
    Closed(Closed),
    Log(Log),
}

impl Event {
    /// The event as its Python object (the Rust value moves in; nothing is converted yet).
    pub fn into_py(self, py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        Ok(match self {
            Event::Route(e) => Bound::new(py, e)?.into_any(),
            Event::RouteWithoutBody(e) => Bound::new(py, e)?.into_any(),
            Event::Fail(e) => Bound::new(py, e)?.into_any(),
            Event::ResponseHeaders(e) => Bound::new(py, e)?.into_any(),
            Event::ResponseBody(e) => Bound::new(py, e)?.into_any(),
            Event::ResponseTrailers(e) => Bound::new(py, e)?.into_any(),
            Event::Closed(e) => Bound::new(py, e)?.into_any(),
            Event::Log(e) => Bound::new(py, e)?.into_any(),
        })
    }

    /// The classes, for the module.
    pub fn register(module: &Bound<'_, PyModule>) -> PyResult<()> {
        module.add_class::<Route>()?;
        module.add_class::<RouteWithoutBody>()?;
        module.add_class::<Fail>()?;
        module.add_class::<ResponseHeaders>()?;
        module.add_class::<ResponseBody>()?;
        module.add_class::<ResponseTrailers>()?;
        module.add_class::<Closed>()?;
        module.add_class::<Log>()
    }
}
