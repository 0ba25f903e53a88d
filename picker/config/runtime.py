"""The scheduling runtime built from one config, and the holder that swaps it on reload.

The request path reads `holder.current` once per request and uses that `Runtime` throughout,
so a reload never mixes two configs within one request. Swapping is a single attribute
assignment on the event loop, hence atomic.

Per request (the Director's view)::

    runtime = holder.current
    runtime.admit(request, candidates)   # = priority < 0 and saturation >= 1.0 → RequestError 429
    await runtime.prepare_async(request, candidates)   # optional async producer work
    result = runtime.scheduler.schedule(request, candidates)
    runtime.pre_request(request, result)
    ...
    runtime.response_complete(request, result, outcome)
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from picker.config.loader import DEFAULT_SCORER_WEIGHT, LoadedConfig, build, default_config, parse_text
from picker.config.schema import ConfigError, EndpointPickerConfig, ProfilePluginRef
from picker.datastore.endpoint import EndpointState
from picker.datastore.store import Datastore
from picker.request.errors import RequestError
from picker.request.model import InferenceRequest, ResponseOutcome
from picker.scheduling.config_plugins import CoreMetricsExtractor, MetricsDataSource
from picker.scheduling.decisions import DecisionLog
from picker.scheduling.framework import (
    AsyncPreparer,
    Filter,
    Handle,
    Picker,
    Plugin,
    PreRequest,
    ProfileHandler,
    ResponseComplete,
    SaturationDetector,
    Scorer,
    SchedulingResult,
)
from picker.scheduling.scheduler import Scheduler, SchedulerProfile, WeightedScorer
from picker.telemetry.metrics import CONFIG_LAST_RELOAD, CONFIG_RELOADS, PLUGIN_DURATION

log = logging.getLogger(__name__)

WATCH_INTERVAL_SECONDS = 0.5
# The reference bounds all PrepareData work of one request by 400 ms.
PREPARE_TIMEOUT_SECONDS = 0.4


@dataclass(frozen=True, slots=True)
class DataSource:
    """One configured metrics source and its extractors, for the data layer's collector."""

    source: MetricsDataSource
    extractors: tuple[CoreMetricsExtractor, ...]


class Runtime:
    """Everything a request needs from one effective config.

    - `scheduler`: `schedule(request, candidates) -> SchedulingResult`.
    - `data_sources`: what the data layer should scrape (None with `enableLegacyMetrics` and
      no `dataLayer` section; empty when `dataLayer.sources: []` turns collection off).
    - `feature_gates`, `config` (effective, every default filled in), `plugins` by name.
    """

    def __init__(
        self,
        loaded: LoadedConfig,
        objectives: Mapping[str, int | None] | None = None,
        decision_log: DecisionLog | None = None,
    ) -> None:
        config = loaded.config
        plugins = loaded.plugins
        self.config: EndpointPickerConfig = config
        self.plugins: Mapping[str, Plugin] = MappingProxyType(dict(plugins))
        self.feature_gates = frozenset(config.feature_gates)
        self.objectives: Mapping[str, int | None] = objectives or {}
        handler = next(p for p in plugins.values() if isinstance(p, ProfileHandler))
        self.scheduler = Scheduler(
            handler,
            [_profile(spec.name, spec.plugins, plugins) for spec in config.scheduling_profiles],
            loaded.producers,
            decision_log,
        )
        assert config.saturation_detector is not None  # filled in by the loader
        detector = plugins[config.saturation_detector.plugin_ref]
        assert isinstance(detector, SaturationDetector)
        self.saturation_detector = detector
        self.data_sources: tuple[DataSource, ...] | None = None
        if config.data_layer is not None:
            self.data_sources = tuple(
                DataSource(
                    plugins[s.plugin_ref],  # type: ignore[arg-type]
                    tuple(plugins[e.plugin_ref] for e in s.extractors),  # type: ignore[misc]
                )
                for s in config.data_layer.sources
            )
        self._async_preparers = tuple(p for p in loaded.producers if isinstance(p, AsyncPreparer))
        self._pre_request = tuple(
            (p, PLUGIN_DURATION.labels("PreRequest", p.plugin_type, p.name))
            for p in plugins.values()
            if isinstance(p, PreRequest)
        )
        self._response_complete = tuple(
            (p, PLUGIN_DURATION.labels("ResponseComplete", p.plugin_type, p.name))
            for p in plugins.values()
            if isinstance(p, ResponseComplete)
        )

    async def prepare_async(self, request: InferenceRequest, candidates: Sequence[EndpointState]) -> None:
        """Await the producers' async preparation (bounded by 400 ms in total); call it before
        `scheduler.schedule`. A timeout or failure is logged: `prepare` then works without it."""
        if not self._async_preparers:
            return
        try:
            async with asyncio.timeout(PREPARE_TIMEOUT_SECONDS):
                for preparer in self._async_preparers:
                    await preparer.prepare_async(request, candidates)
        except TimeoutError:
            log.warning("async data preparation for request %s timed out", request.request_id)
        except Exception:
            log.exception("async data preparation failed for request %s", request.request_id)

    def priority(self, request: InferenceRequest) -> int:
        """The request's InferenceObjective priority; no objective, unknown or unset → 0."""
        if request.objective is None:
            return 0
        return self.objectives.get(request.objective) or 0

    def admit(self, request: InferenceRequest, candidates: Sequence[EndpointState]) -> None:
        """The reference's legacy admission: shed a sheddable request (priority < 0) with
        ResourceExhausted (429) when the candidates are saturated; others always pass."""
        if self.priority(request) < 0 and self.saturation(candidates) >= 1.0:
            raise RequestError("ResourceExhausted", "the pool is saturated and the request is sheddable")

    def saturation(self, candidates: Sequence[EndpointState]) -> float:
        """The configured detector's saturation of `candidates` (>= 1.0 means saturated)."""
        return self.saturation_detector.saturation(candidates)

    def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        """Run every PreRequest plugin; one failing is logged and does not stop the others."""
        for plugin, timer in self._pre_request:
            started = perf_counter()
            try:
                plugin.pre_request(request, result)
            except Exception:
                log.exception("PreRequest plugin %s failed for request %s", plugin.name, request.request_id)
            if result.timed:
                timer.observe(perf_counter() - started)

    def response_complete(self, request: InferenceRequest, result: SchedulingResult, outcome: ResponseOutcome) -> None:
        """Run every ResponseComplete plugin; failures are logged."""
        for plugin, timer in self._response_complete:
            started = perf_counter()
            try:
                plugin.response_complete(request, result, outcome)
            except Exception:
                log.exception("ResponseComplete plugin %s failed for request %s", plugin.name, request.request_id)
            if result.timed:
                timer.observe(perf_counter() - started)


def _profile(name: str, refs: Sequence[ProfilePluginRef], plugins: Mapping[str, Plugin]) -> SchedulerProfile:
    filters, scorers, pickers = [], [], []
    for ref in refs:
        plugin = plugins[ref.plugin_ref]
        if isinstance(plugin, Filter):
            filters.append(plugin)
        if isinstance(plugin, Scorer):
            weight = ref.weight if ref.weight is not None else DEFAULT_SCORER_WEIGHT
            scorers.append(WeightedScorer(plugin, weight))
        if isinstance(plugin, Picker):
            pickers.append(plugin)
    return SchedulerProfile(name, filters, scorers, pickers[0])


class RuntimeHolder:
    """Holds the current `Runtime`; loads, reloads and watches the config.

    State that must outlive a reload is kept here: the objectives, the decision log and the
    plugins' persistent objects (`Handle.persistent`).
    """

    def __init__(self, datastore: Datastore | None = None, decision_log: DecisionLog | None = None) -> None:
        self.datastore = datastore
        self.decision_log = decision_log
        self._objectives: Mapping[str, int | None] = MappingProxyType({})
        self._persistent: dict[str, Any] = {}
        self._source_hash: bytes | None = None
        self.current: Runtime = self.build(default_config())

    def build(self, config: EndpointPickerConfig) -> Runtime:
        """A Runtime for `config` (defaults applied); raises ConfigError. Does not install it."""
        loaded = build(config, Handle(self.datastore, self._persistent))
        return Runtime(loaded, self._objectives, self.decision_log)

    def install(self, runtime: Runtime) -> None:
        if "dataLayer" in runtime.feature_gates:
            log.info("the dataLayer feature gate is obsolete: the data layer is always on")
        if "flowControl" in runtime.feature_gates:
            log.warning(
                "the flowControl feature gate is set, but the picker does not implement flow control; "
                "sheddable requests use saturation-based admission"
            )
        self.current = runtime
        CONFIG_LAST_RELOAD.set(time.time())

    def load_text(self, text: str) -> Runtime:
        """Parse, build and install `text`; raises ConfigError and keeps the old runtime."""
        runtime = self.build(parse_text(text))
        self.install(runtime)
        self._source_hash = hashlib.sha256(text.encode()).digest()
        return runtime

    def load_file(self, path: str | Path) -> Runtime:
        """Like `load_text` for a file; an unreadable file is a ConfigError."""
        try:
            data = Path(path).read_bytes()
        except OSError as error:
            raise ConfigError([f"cannot read {path}: {error}"]) from None
        return self._load_bytes(data)

    def _load_bytes(self, data: bytes) -> Runtime:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ConfigError([f"the config is not UTF-8: {error}"]) from None
        return self.load_text(text)

    def reload(self, data: bytes, source: str) -> bool:
        """Install `data` if it changed and is valid; an invalid config is logged and counted
        once, and the old one stays. Returns whether a new config was installed."""
        digest = hashlib.sha256(data).digest()
        if digest == self._source_hash:
            return False
        try:
            self._load_bytes(data)
        except Exception as error:  # a reload must survive any bad config, and keep the old one
            self._source_hash = digest  # report this content once, not every poll
            CONFIG_RELOADS.labels("failure").inc()
            if isinstance(error, ConfigError):
                log.error("config from %s rejected, keeping the previous one:\n%s", source, error)
            else:
                log.exception("config from %s could not be loaded, keeping the previous one", source)
            return False
        CONFIG_RELOADS.labels("success").inc()
        log.info("config from %s reloaded", source)
        return True

    def set_objectives(self, objectives: Mapping[str, int | None]) -> None:
        """Replace the InferenceObjective priorities (`{name: priority}`, None = unset = 0)."""
        self._objectives = MappingProxyType(dict(objectives))
        self.current.objectives = self._objectives

    async def watch(self, path: str | Path, interval: float = WATCH_INTERVAL_SECONDS) -> None:
        """Reload `path` whenever its content changes, until cancelled.

        Compares content hashes, not modification times: a ConfigMap update swaps a symlink
        and may keep the mtime. A valid new config is installed; an invalid one is logged and
        counted, and the old config stays until the content changes again.
        """
        path = Path(path)
        while True:
            await asyncio.sleep(interval)
            try:
                data = await asyncio.to_thread(path.read_bytes)
            except OSError as error:
                log.debug("config file %s is not readable right now: %s", path, error)
                continue
            self.reload(data, str(path))
