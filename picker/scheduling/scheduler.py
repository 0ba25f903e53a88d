"""The scheduler: runs the profiles (filters → weighted scorers → picker) of one request.

Data producers have run before (the director prepares the request's CycleState); the scheduler
only chooses among candidates.

Every plugin call is timed with `time.perf_counter` into the reference's
`inference_extension_plugin_duration_seconds`, and the whole cycle into
`inference_extension_scheduler_e2e_duration_seconds`; histogram children are bound once at
construction so a decision pays only for `observe`. The same readings become the plugin's span
when the request is traced (`--tracing`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from time import perf_counter
from typing import TYPE_CHECKING, Any

from prometheus_client import Histogram

from picker.datastore.endpoint import EndpointState
from picker.framework.cycle_state import CycleState
from picker.framework.plugin import (
    Filter,
    Picker,
    Plugin,
    ProfileHandler,
    ProfileRunResult,
    SchedulingResult,
    Scorer,
)
from picker.framework.request import InferenceRequest
from picker.request.errors import RequestError
from picker.telemetry import tracing
from picker.telemetry.metrics import PLUGIN_DURATION, SCHEDULER_ATTEMPTS, SCHEDULER_E2E

if TYPE_CHECKING:
    from picker.telemetry.decisions import DecisionLog

log = logging.getLogger(__name__)


# Plugin timings cost a histogram observation per plugin per request, more than many plugins
# themselves; one request in PLUGIN_TIMING_SAMPLE is timed (the end-to-end time always is).
PLUGIN_TIMING_SAMPLE = 8


class PluginTimer:
    """Times one plugin at one extension point, for timed cycles: its child of the
    plugin-duration histogram (bound once) and, when the request is traced, its span."""

    __slots__ = ("extension_point", "histogram", "name", "plugin_type")

    def __init__(self, extension_point: str, plugin: Plugin) -> None:
        self.extension_point = extension_point
        self.plugin_type = plugin.plugin_type
        self.name = plugin.name
        self.histogram: Histogram = PLUGIN_DURATION.labels(extension_point, plugin.plugin_type, plugin.name)

    def done(self, started: float, seconds: float | None = None) -> None:
        """The call that began at `started` (a perf_counter reading) ended now; `seconds`, when
        given, is the plugin's own time within that span (the profile handler's calls)."""
        ended = perf_counter()
        self.histogram.observe(ended - started if seconds is None else seconds)
        trace = tracing.active()
        if trace is not None:
            trace.plugin(self.extension_point, self.plugin_type, self.name, started, ended)


def plugin_timer(extension_point: str, plugin: Plugin) -> PluginTimer:
    """`plugin`'s timer at `extension_point`."""
    return PluginTimer(extension_point, plugin)


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    """A scorer with its weight in one profile."""

    scorer: Scorer
    weight: float


class SchedulerProfile:
    """One named profile: filters in order, weighted scorers, one picker."""

    def __init__(self, name: str, filters: Sequence[Filter], scorers: Sequence[WeightedScorer], picker: Picker) -> None:
        self.name = name
        self.filters = tuple(filters)
        self.scorers = tuple(scorers)
        self.picker = picker
        self._filter_steps = tuple((f, plugin_timer("Filter", f)) for f in self.filters)
        self._scorer_steps = tuple((s.scorer, s.weight, plugin_timer("Scorer", s.scorer)) for s in self.scorers)
        self._weights = {s.scorer.name: s.weight for s in self.scorers}
        self._picker_timer = plugin_timer("Picker", picker)

    def run(
        self,
        request: InferenceRequest,
        cycle_state: CycleState,
        candidates: Sequence[EndpointState],
        timed: bool = True,
    ) -> ProfileRunResult | None:
        """The profile's targets, or None when the filters leave no candidate; `timed`
        records each plugin's duration."""
        for filter_, timer in self._filter_steps:
            started = perf_counter()
            candidates = filter_.filter(request, cycle_state, candidates)
            if timed:
                timer.done(started)
            if not candidates:
                return None
        candidates = tuple(candidates)
        totals = [0.0] * len(candidates)
        scores: dict[str, Sequence[float]] = {}
        for scorer, weight, timer in self._scorer_steps:
            started = perf_counter()
            raw = scorer.score(request, cycle_state, candidates)
            if timed:
                timer.done(started)
            if len(raw) != len(candidates):
                raise RuntimeError(
                    f"scorer {scorer.name!r} returned {len(raw)} scores for {len(candidates)} candidates"
                )
            scores[scorer.name] = raw
            totals = [
                total + (0.0 if score < 0.0 else 1.0 if score > 1.0 else score) * weight
                for total, score in zip(totals, raw)
            ]
        started = perf_counter()
        targets = self.picker.pick(cycle_state, candidates, totals)
        if timed:
            self._picker_timer.done(started)
        return ProfileRunResult(targets, candidates, scores, self._weights, totals)


class Scheduler:
    """Runs one scheduling cycle per request over a fixed set of plugins."""

    def __init__(
        self,
        profile_handler: ProfileHandler,
        profiles: Sequence[SchedulerProfile],
        decision_log: DecisionLog | None = None,
    ) -> None:
        self.profile_handler = profile_handler
        self.profiles = {p.name: p for p in profiles}
        self.decision_log = decision_log
        self._profile_names = tuple(self.profiles)
        self._handler_timer = plugin_timer("ProfileHandler", profile_handler)
        self._attempts: dict[tuple[str, str], Any] = {}  # (status, model) → counter child
        self._cycles = 0

    def _count_attempt(self, status: str, model: str) -> None:
        key = (status, model)
        child = self._attempts.get(key)
        if child is None:
            child = self._attempts[key] = SCHEDULER_ATTEMPTS.labels(status, model)
        child.inc()

    def next_cycle_timed(self) -> bool:
        """Whether the next cycle's plugin durations are recorded (one in PLUGIN_TIMING_SAMPLE);
        the director asks once per request, so its hooks are timed for the same requests."""
        self._cycles += 1
        return self._cycles % PLUGIN_TIMING_SAMPLE == 0

    def schedule(
        self,
        request: InferenceRequest,
        candidates: Sequence[EndpointState],
        cycle_state: CycleState,
        timed: bool = False,
    ) -> SchedulingResult:
        """Choose targets for `request` among `candidates`; `timed` records each plugin's time.

        Raises `RequestError`: ServiceUnavailable (503) when there are no candidates at all,
        ResourceExhausted (429) when the filters leave none; a plugin's own exception passes
        through (the director fails the request with it). Either counts a failed attempt.
        """
        started = perf_counter()
        try:
            if not candidates:
                raise RequestError("ServiceUnavailable", "no endpoints available to serve the request")
            result = self._run_profiles(request, cycle_state, candidates, timed)
        except Exception:
            self._count_attempt("failure", request.target_model)
            raise
        SCHEDULER_E2E.observe(perf_counter() - started)
        self._count_attempt("success", request.target_model)
        if self.decision_log is not None:
            self.decision_log.record(request, result)
        return result

    def _run_profiles(
        self, request: InferenceRequest, cycle_state: CycleState, candidates: Sequence[EndpointState], timed: bool
    ) -> SchedulingResult:
        handler = self.profile_handler
        results: dict[str, ProfileRunResult | None] = {}
        handler_seconds = 0.0
        first_started = perf_counter()
        while True:
            started = perf_counter()
            chosen = [
                name
                for name in handler.pick_profiles(request, cycle_state, self._profile_names, results)
                if name not in results
            ]
            handler_seconds += perf_counter() - started
            if not chosen:
                break
            for name in chosen:
                results[name] = self.profiles[name].run(request, cycle_state, candidates, timed)
        started = perf_counter()
        result = handler.process_results(request, cycle_state, results)
        if timed:  # its span covers the profile runs it chose; its histogram only its own time
            self._handler_timer.done(first_started, handler_seconds + perf_counter() - started)
            result = replace(result, timed=True)
        return result
