"""The runtime built from one config, and the holder that installs, swaps and retires runtimes.

A `Runtime` is what one effective config turned into: its plugins sorted by the hooks they
implement, its scheduler and its data-layer settings. It runs nothing itself: the director
(`picker.requestcontrol`) runs the hooks per request. The request path reads `holder.current`
once per request and uses that runtime throughout, so a reload never mixes two configs within
one request; swapping is one attribute assignment on the event loop, hence atomic. A runtime is
immutable once built; the InferenceObjective priorities and the InferenceModelRewrite rules are
values of their own (`RuntimeHolder.objectives`, `RuntimeHolder.model_rewrites`), swapped the
same way, that the request path reads beside it.

A reload builds the new runtime completely (a failed build changes nothing), installs it, then
starts its background work, stops the old runtime's and releases the persistent objects the new
config no longer uses (`Handle.persistent`), with their datastore listeners.

Which config is in force, where it came from and when it was loaded (`ConfigSource`) is what
`picker_config_info` and the metrics port's `GET /config` report (`RuntimeHolder.describe`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from picker.config.flowcontrol import flow_control_settings
from picker.config.loader import DEFAULT_SCORER_WEIGHT, build, default_config, parse_text, to_document, to_yaml
from picker.config.model_rewrites import ModelRewrites
from picker.config.objectives import Objectives
from picker.config.schema import ConfigError, EndpointPickerConfig, ProfilePluginRef
from picker.datalayer.plugins import CoreMetricsExtractor, DataSource, MetricsDataSource
from picker.datastore.store import Datastore
from picker.flowcontrol.settings import FlowControlSettings
from picker.framework.handle import Handle, PersistentObjects
from picker.framework.plugin import (
    Admitter,
    AffinitySource,
    BackgroundWork,
    DataProducer,
    Filter,
    Parser,
    Picker,
    Plugin,
    PreRequest,
    ProfileHandler,
    ResponseComplete,
    ResponseMetadata,
    ResponseReceived,
    ResponseStreaming,
    SaturationDetector,
    Scorer,
)
from picker.plugins import NARROWING_FILTER_TYPE, default_narrowing_filter
from picker.scheduling.scheduler import PluginTimer, Scheduler, SchedulerProfile, WeightedScorer, plugin_timer
from picker.telemetry.decisions import DecisionLog
from picker.telemetry.metrics import CONFIG_INFO, CONFIG_LAST_RELOAD, CONFIG_RELOADS

if TYPE_CHECKING:
    from picker.state.sync import StateSync

log = logging.getLogger(__name__)

WATCH_INTERVAL_SECONDS = 0.5
DEFAULT_ORIGIN = "default"  # the built-in default config, no text given
HASH_LABEL_CHARS = 16  # of the sha256 hex in picker_config_info's `hash` label


@dataclass(frozen=True, slots=True)
class ConfigSource:
    """Where the config in force came from: `origin` (a file path, `--config-text`, `ConfigMap
    ns/name` or `default`), the sha256 of its text (of its YAML for the default) and the Unix
    time it was installed."""

    origin: str
    sha256: str
    loaded_at: float


P = TypeVar("P", bound=Plugin)


@dataclass(frozen=True, slots=True)
class Step(Generic[P]):
    """A plugin at one extension point, with its timer for the plugin-duration histogram."""

    plugin: P
    timer: PluginTimer


def _steps(plugins: Sequence[P], extension_point: str) -> tuple[Step[P], ...]:
    return tuple(Step(p, plugin_timer(extension_point, p)) for p in plugins)


@dataclass(frozen=True, slots=True, eq=False)
class Runtime:
    """Everything a request needs from one effective config; immutable once built (`build`).

    - `config` (effective, every default filled in), `plugins` by name, `feature_gates`;
    - `parser`, `saturation_detector`, `scheduler`; `flow_control`: the resolved `flowControl`
      settings, None while the feature gate is off;
    - the hooks by extension point, in the order the director runs them: `producers` (in
      dependency order; `async_producers` those with async work; `affinity_source` the first
      that names a prompt's prefix holders, for flow control's late binding), `admitters`,
      `pre_request`, `response_received`, `response_streaming`, `response_metadata`,
      `response_complete`;
    - `background`: plugins with work of their own, started when installed;
    - `data_sources`: what the data layer scrapes (None with `enableLegacyMetrics` and no
      `dataLayer` section; empty when `dataLayer.sources: []` turns collection off);
    - `persistent_keys`: the persistent objects (`Handle.persistent`) this config uses;
    - `notes`: the loader's notes on the config (logged when installed).
    """

    config: EndpointPickerConfig
    notes: tuple[str, ...]
    plugins: Mapping[str, Plugin]
    feature_gates: frozenset[str]
    persistent_keys: frozenset[str]
    scheduler: Scheduler
    parser: Parser
    saturation_detector: SaturationDetector
    flow_control: FlowControlSettings | None
    data_sources: tuple[DataSource, ...] | None
    producers: tuple[Step[DataProducer], ...]
    async_producers: tuple[Step[DataProducer], ...]
    affinity_source: AffinitySource | None
    admitters: tuple[Step[Admitter], ...]
    pre_request: tuple[Step[PreRequest], ...]
    response_received: tuple[Step[ResponseReceived], ...]
    response_streaming: tuple[Step[ResponseStreaming], ...]
    response_metadata: tuple[Step[ResponseMetadata], ...]
    response_complete: tuple[Step[ResponseComplete], ...]
    background: tuple[BackgroundWork, ...]

    @classmethod
    def build(
        cls,
        config: EndpointPickerConfig,
        plugins: Mapping[str, Plugin],
        producers: Sequence[DataProducer],
        persistent_keys: frozenset[str],
        decision_log: DecisionLog | None = None,
        notes: Sequence[str] = (),
    ) -> Runtime:
        """The runtime of a config the loader built: `plugins` by name, `producers` in
        dependency order."""
        handler = next(p for p in plugins.values() if isinstance(p, ProfileHandler))
        scheduler = Scheduler(
            handler,
            [_profile(spec.name, spec.plugins, plugins) for spec in config.scheduling_profiles],
            decision_log,
        )
        assert config.parser is not None and config.saturation_detector is not None  # the loader fills them
        parser = plugins[config.parser.plugin_ref]
        detector = plugins[config.saturation_detector.plugin_ref]
        assert isinstance(parser, Parser) and isinstance(detector, SaturationDetector)
        data_sources: tuple[DataSource, ...] | None = None
        if config.data_layer is not None:
            data_sources = tuple(
                DataSource(
                    _plugin(plugins, s.plugin_ref, MetricsDataSource),
                    tuple(_plugin(plugins, e.plugin_ref, CoreMetricsExtractor) for e in s.extractors),
                )
                for s in config.data_layer.sources
            )
        everything = list(plugins.values())
        producer_steps = _steps(producers, "PrepareData")
        return cls(
            config=config,
            notes=tuple(notes),
            plugins=MappingProxyType(dict(plugins)),
            feature_gates=frozenset(config.feature_gates),
            persistent_keys=persistent_keys,
            scheduler=scheduler,
            parser=parser,
            saturation_detector=detector,
            flow_control=flow_control_settings(config, plugins),  # None: the gate is off
            data_sources=data_sources,
            producers=producer_steps,
            async_producers=tuple(
                s for s in producer_steps if type(s.plugin).prepare_async is not DataProducer.prepare_async
            ),
            affinity_source=next((p for p in producers if isinstance(p, AffinitySource)), None),
            admitters=_steps([p for p in everything if isinstance(p, Admitter)], "AdmitRequest"),
            pre_request=_steps([p for p in everything if isinstance(p, PreRequest)], "PreRequest"),
            response_received=_steps([p for p in everything if isinstance(p, ResponseReceived)], "ResponseReceived"),
            response_streaming=_steps(
                [p for p in everything if isinstance(p, ResponseStreaming) and p.streams_responses],
                "ResponseStreaming",
            ),
            # The reference times its ResponseBody plugins (this hook) as ResponseStreaming.
            response_metadata=_steps([p for p in everything if isinstance(p, ResponseMetadata)], "ResponseStreaming"),
            response_complete=_steps([p for p in everything if isinstance(p, ResponseComplete)], "ResponseComplete"),
            background=tuple(p for p in everything if isinstance(p, BackgroundWork)),
        )


def _plugin(plugins: Mapping[str, Plugin], name: str, kind: type[P]) -> P:
    plugin = plugins[name]
    assert isinstance(plugin, kind)  # the loader checked every reference's type
    return plugin


def _profile(name: str, refs: Sequence[ProfilePluginRef], plugins: Mapping[str, Plugin]) -> SchedulerProfile:
    filters: list[Filter] = []
    scorers: list[WeightedScorer] = []
    pickers: list[Picker] = []
    for ref in refs:
        plugin = plugins[ref.plugin_ref]
        if isinstance(plugin, Filter):
            filters.append(plugin)
        if isinstance(plugin, Scorer):
            weight = ref.weight if ref.weight is not None else DEFAULT_SCORER_WEIGHT
            scorers.append(WeightedScorer(plugin, weight))
        if isinstance(plugin, Picker):
            pickers.append(plugin)
    if narrows_by_default(refs, plugins):
        filters.append(default_narrowing_filter())
    return SchedulerProfile(name, filters, scorers, pickers[0])


def narrows_by_default(refs: Sequence[ProfilePluginRef], plugins: Mapping[str, Plugin]) -> bool:
    """Whether a profile of these plugins ends with the default `candidate-narrowing-filter`:
    every profile that names none does, so large pools narrow (it changes nothing at or below
    its bound)."""
    return not any(plugins[ref.plugin_ref].plugin_type == NARROWING_FILTER_TYPE for ref in refs)


InstallListener = Callable[[Runtime], Awaitable[None]]


class RuntimeHolder:
    """Holds the current `Runtime`; builds, installs, reloads and watches configs.

    State that must outlive a reload is kept here: the objectives (`objectives`, swapped whole
    by `set_objectives`), the model rewrites (`model_rewrites`, by `set_model_rewrites`), the
    decision log and the plugins' persistent objects. Background work runs only between
    `start()` and `stop()` (on the server's event loop); `on_install` runs after each installed
    runtime's activation (the data layer follows the config through it).
    """

    def __init__(
        self,
        datastore: Datastore | None = None,
        decision_log: DecisionLog | None = None,
        on_install: InstallListener | None = None,
        state_sync: StateSync | None = None,
    ) -> None:
        self.datastore = datastore
        self.state_sync = state_sync
        self.decision_log = decision_log
        self.on_install = on_install
        self.objects = PersistentObjects()
        self.objectives = Objectives()  # read by the request path with `current`, once per request
        self.model_rewrites = ModelRewrites()  # likewise
        self._source_hash: bytes | None = None
        self._started = False
        self._activations: set[asyncio.Task[None]] = set()
        self._activation_lock = asyncio.Lock()
        self._active: Runtime | None = None  # the runtime whose background work runs
        self.current: Runtime = self.build(default_config())
        self.source = self._record_source(DEFAULT_ORIGIN, to_yaml(self.current.config).encode())

    # -- building and installing -------------------------------------------------------------

    def build(self, config: EndpointPickerConfig) -> Runtime:
        """A Runtime for `config` (defaults applied); raises ConfigError. Does not install it;
        persistent objects a failed build created are released by the next activation."""
        handle = Handle(self.datastore, self.objects, self.state_sync)
        try:
            loaded = build(config, handle)
        except ConfigError:
            self._activate_later()
            raise
        return Runtime.build(
            loaded.config, loaded.plugins, loaded.producers, frozenset(handle.used), self.decision_log, loaded.notes
        )

    def install(self, runtime: Runtime, origin: str, text: bytes) -> None:
        """Make `runtime` (built from `text`, read from `origin`) current; its background work
        starts and the old one's stops (at once when started on a loop, else at `start`)."""
        for note in runtime.notes:
            log.info("config from %s: %s", origin, note)
        self.current = runtime
        self.source = self._record_source(origin, text)
        self._activate_later()

    @staticmethod
    def _record_source(origin: str, text: bytes) -> ConfigSource:
        """The source of a config just installed, also set in the config metrics."""
        source = ConfigSource(origin, hashlib.sha256(text).hexdigest(), time.time())
        CONFIG_LAST_RELOAD.set(source.loaded_at)
        CONFIG_INFO.clear()  # one series: the config in force
        CONFIG_INFO.labels(source.sha256[:HASH_LABEL_CHARS], origin).set(1)
        return source

    def describe(self) -> dict[str, Any]:
        """The config in force for `GET /config`: where from, its hash, when it was loaded,
        the loader's notes and the effective config (`picker config show --live` prints it)."""
        source = self.source
        return {
            "origin": source.origin,
            "sha256": source.sha256,
            "loadedAt": datetime.fromtimestamp(source.loaded_at, UTC).isoformat(),
            "loadedAtUnix": source.loaded_at,
            "notes": list(self.current.notes),
            "config": to_document(self.current.config),
        }

    def _activate_later(self) -> None:
        if not self._started:
            return
        task = asyncio.get_running_loop().create_task(self._activate(), name="config-activate")
        self._activations.add(task)
        task.add_done_callback(self._activations.discard)

    async def _activate(self) -> None:
        """Bring background work and persistent objects in line with the current runtime
        (one activation at a time, each for whatever is current when it runs)."""
        async with self._activation_lock:
            runtime = self.current
            if runtime is not self._active:
                for plugin in runtime.background:
                    plugin.start()
                old, self._active = self._active, runtime
                if old is not None:
                    await _stop_all(old.background)
            await self.objects.retain(runtime.persistent_keys)
            if self.on_install is not None:
                await self.on_install(runtime)

    async def settle(self) -> None:
        """Wait until every install so far has been activated."""
        while self._activations:
            await asyncio.gather(*list(self._activations), return_exceptions=True)

    async def start(self) -> None:
        """Start the current runtime's background work (call on the serving loop)."""
        self._started = True
        self._activate_later()
        await self.settle()

    async def stop(self) -> None:
        """Stop every plugin's background work and release every persistent object."""
        self._started = False
        await self.settle()
        if self._active is not None:
            await _stop_all(self._active.background)
            self._active = None
        await self.objects.release_all()

    # -- loading ------------------------------------------------------------------------------

    def load_text(self, text: str, origin: str = "--config-text") -> Runtime:
        """Parse, build and install `text` (read from `origin`); raises ConfigError and keeps
        the old runtime."""
        data = text.encode()
        runtime = self.build(parse_text(text))
        self.install(runtime, origin, data)
        self._source_hash = hashlib.sha256(data).digest()
        return runtime

    def load_file(self, path: str | Path) -> Runtime:
        """Like `load_text` for a file; an unreadable file is a ConfigError."""
        try:
            data = Path(path).read_bytes()
        except OSError as error:
            raise ConfigError([f"cannot read {path}: {error}"]) from None
        return self._load_bytes(data, str(path))

    def _load_bytes(self, data: bytes, origin: str) -> Runtime:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ConfigError([f"the config is not UTF-8: {error}"]) from None
        return self.load_text(text, origin)

    def reload(self, data: bytes, source: str) -> bool:
        """Install `data` if it changed and is valid; an invalid config is logged and counted
        once, and the old one stays. Returns whether a new config was installed."""
        digest = hashlib.sha256(data).digest()
        if digest == self._source_hash:
            return False
        try:
            self._load_bytes(data, source)
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
        """Replace the InferenceObjective priorities (`{name: priority}`, None = unset = 0):
        a new `objectives` value, swapped in as a runtime is; the runtimes are not touched."""
        self.objectives = Objectives.of(objectives)

    def set_model_rewrites(self, resources: Sequence[Mapping[str, Any]]) -> None:
        """Replace the InferenceModelRewrite rules with those of `resources` (this pool's, as
        decoded JSON), merged into a new `model_rewrites` value swapped in whole."""
        self.model_rewrites = ModelRewrites.of(resources)
        log.info("InferenceModelRewrites: %d in force", len(resources))

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
            if self.reload(data, str(path)):
                await self.settle()


async def _stop_all(plugins: Sequence[BackgroundWork]) -> None:
    for plugin in plugins:
        try:
            await plugin.stop()
        except Exception:
            log.exception("stopping plugin %s failed", plugin.name)
