"""How the director calls a hook's plugins, and what a plugin that raises does to its request:
the failure policy (`picker.framework.plugin` states it for plugin authors), in code here only.

- Isolated hooks: data producers (`prepare_async`, `prepare`, an affinity source's `affinity`),
  `PreRequest`, `ResponseReceived`, `ResponseStreaming`, `ResponseMetadata` and
  `ResponseComplete`. A plugin that raises is logged with its traceback and skipped; the
  request goes on and the hook's other plugins still run (`run_isolated`). The reference logs a
  failed PrepareData and goes on; its pre-request and response plugins return no error.
- Admission: an `Admitter` that denies the request, or raises, fails it with 500 "request
  cannot be admitted" (`run_admitters`; the reference: an AdmitRequest error is a denial).
- Everything else on the way to the pick (the parser, the saturation detector, the scheduler's
  profile handler, filters, scorers and picker): a `RequestError` raised is the answer (the
  parser's 400, the scheduler's 429 or 503); any other exception fails the request with 500
  Internal (`request_failed`), as the reference fails a request its scheduler cannot serve.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from time import perf_counter
from typing import TypeVar

from picker.config.runtime import Step
from picker.datastore.endpoint import EndpointState
from picker.framework.cycle_state import CycleState
from picker.framework.plugin import Admitter, Affinity, AffinitySource, Plugin
from picker.framework.request import InferenceRequest
from picker.request.errors import RequestError

log = logging.getLogger(__name__)

P = TypeVar("P", bound=Plugin)
R = TypeVar("R")

NOT_ADMITTED = "request cannot be admitted"  # the reference's answer to a denial (500)
PLUGIN_FAILED = "a plugin of the endpoint picker failed on the request"  # 500, logged with its traceback


def run_isolated(steps: Sequence[Step[P]], call: Callable[[P], R], timed: bool, request: InferenceRequest) -> list[R]:
    """`call` on every plugin of `steps`, in order, and what the calls returned; one that
    raises is logged (and returns nothing), the others still run. `timed`: record each
    plugin's duration."""
    returned = []
    for step in steps:
        started = perf_counter()
        try:
            returned.append(call(step.plugin))
        except Exception:
            _log_failure(step, request)
        if timed:
            step.timer.done(started)
    return returned


async def run_isolated_async(
    steps: Sequence[Step[P]], call: Callable[[P], Awaitable[None]], request: InferenceRequest
) -> None:
    """Await `call` on every plugin of `steps`, in order; one that raises is logged, the
    others still run (a cancellation, e.g. the caller's timeout, ends them all)."""
    for step in steps:
        try:
            await call(step.plugin)
        except Exception:
            _log_failure(step, request)


def run_admitters(
    steps: Sequence[Step[Admitter]],
    call: Callable[[Admitter], str | None],
    timed: bool,
    request: InferenceRequest,
) -> None:
    """Ask every admitter in order (`call` returns its denial or None); the first that denies,
    or raises, fails the request: `RequestError` Internal (500), "request cannot be admitted"."""
    for step in steps:
        started = perf_counter()
        try:
            denial = call(step.plugin)
        except Exception:
            _log_failure(step, request)
            denial = "the admitter failed"
        if timed:
            step.timer.done(started)
        if denial is not None:
            log.debug("request %s not admitted by %s: %s", request.request_id, step.plugin.name, denial)
            raise RequestError("Internal", NOT_ADMITTED)


def ask_affinity(
    source: AffinitySource,
    request: InferenceRequest,
    candidates: Sequence[EndpointState],
    cycle_state: CycleState,
) -> Affinity | None:
    """Where `source` says the request's prefix is cached; as for every producer hook, a
    failure is logged and the request goes on (as if nothing were cached)."""
    try:
        return source.affinity(request, candidates, cycle_state)
    except Exception:
        log.exception("affinity lookup of request %s failed", request.request_id)
        return None


def request_failed(request_id: str) -> RequestError:
    """The answer to a request on which a plugin outside the isolated hooks raised something
    other than a `RequestError` (call it in the `except` clause: the traceback is logged)."""
    log.exception("routing request %s failed", request_id)
    return RequestError("Internal", PLUGIN_FAILED)


def _log_failure(step: Step[P], request: InferenceRequest) -> None:
    log.exception(
        "%s plugin %s failed for request %s", step.timer.extension_point, step.plugin.name, request.request_id
    )
