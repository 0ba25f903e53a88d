"""The scheduling framework's extension points and the values they exchange.

A plugin is one object with a `plugin_type` (its registry key) and a `name` (unique within a
config). It takes part in scheduling by subclassing one or more extension points below; the
scheduler finds them with `isinstance`, so one instance may be, say, a Filter and a Scorer.

Order of calls for one request (see `Scheduler.schedule` and `Runtime`):

0. (async, optional) `AsyncPreparer.prepare_async` for producers that have it.
1. `DataProducer.prepare` for every producer, in dependency order (a producer that consumes a
   key runs after the one producing it), writing per-request data into the `CycleState`.
2. The `ProfileHandler` chooses profiles; each profile runs its Filters in order, then its
   Scorers (total = sum of clamp(score, 0, 1) * weight, not normalised), then its Picker.
3. After the pick, the caller runs every `PreRequest.pre_request`.
4. When the response ends, the caller runs every `ResponseComplete.response_complete`.

Scorers return one score per candidate, aligned with the candidate sequence they were given
(a list is cheaper than a dict keyed by address, and the candidates are already ordered).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Protocol, Sequence, TypeVar, runtime_checkable

from picker.datastore.endpoint import EndpointState
from picker.request.model import InferenceRequest, ResponseOutcome

if TYPE_CHECKING:
    from picker.datastore.store import Datastore

T = TypeVar("T")


EXPLAIN_KEY = "Explain"


class CycleState(dict[str, Any]):
    """Per-request key/value store shared by the plugins of one scheduling cycle.

    Producers write under the data keys they declare in `produces`; consumers read them. It
    travels with the `SchedulingResult`, so PreRequest and ResponseComplete hooks see it too.
    """

    __slots__ = ()

    def explain(self) -> dict[str, Any]:
        """What plugins want `/debug/decisions` to show about this decision, by topic (JSON-ready
        values or named tuples, converted only when the log is read). Created on first use."""
        explain: dict[str, Any] = self.setdefault(EXPLAIN_KEY, {})
        return explain


class Plugin(ABC):
    """Base of every plugin: a registry type and an instance name.

    `consumes` lists the CycleState data keys the plugin reads (see `DataProducer`).
    `parameters` are the effective parameters, defaults included, as `picker config show`
    prints them; a factory sets it (e.g. from `Parameters.finish()`), else the raw ones show.
    """

    plugin_type: ClassVar[str]
    consumes: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, name: str) -> None:
        self.name = name
        self.parameters: Mapping[str, Any] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(type={self.plugin_type!r}, name={self.name!r})"


class Filter(Plugin):
    """Narrows the candidates. Returning an empty sequence fails the profile."""

    @abstractmethod
    def filter(
        self, request: InferenceRequest, cycle_state: CycleState, candidates: Sequence[EndpointState]
    ) -> Sequence[EndpointState]: ...


class ScorerCategory:
    """Informational scorer categories, as in the reference."""

    AFFINITY = "Affinity"
    DISTRIBUTION = "Distribution"
    BALANCE = "Balance"


class Scorer(Plugin):
    """Scores each candidate in [0, 1] (higher is better); values outside are clamped."""

    category: ClassVar[str] = ScorerCategory.DISTRIBUTION

    @abstractmethod
    def score(
        self, request: InferenceRequest, cycle_state: CycleState, candidates: Sequence[EndpointState]
    ) -> Sequence[float]:
        """One score per candidate, in the candidates' order."""


class Picker(Plugin):
    """Chooses the targets among scored candidates, best first."""

    @abstractmethod
    def pick(
        self, cycle_state: CycleState, candidates: Sequence[EndpointState], totals: Sequence[float]
    ) -> tuple[EndpointState, ...]:
        """`totals[i]` is the weighted score of `candidates[i]`; return at least one target."""


@dataclass(frozen=True, slots=True)
class ProfileRunResult:
    """What one profile run produced, with what the explain log needs.

    `candidates` are the endpoints left after the filters; `scores` maps each scorer's name
    to its raw (unclamped, unweighted) scores aligned with `candidates`; `totals` are the
    weighted sums; `targets` the picker's choice, best first.
    """

    targets: tuple[EndpointState, ...]
    candidates: tuple[EndpointState, ...] = ()
    scores: Mapping[str, Sequence[float]] = field(default_factory=dict)
    weights: Mapping[str, float] = field(default_factory=dict)
    totals: Sequence[float] = ()


@dataclass(frozen=True, slots=True)
class SchedulingResult:
    """The outcome of one scheduling cycle: every profile's run and which one is primary."""

    profile_results: Mapping[str, ProfileRunResult | None]
    primary_profile: str
    cycle_state: CycleState = field(default_factory=CycleState, compare=False)
    timed: bool = False  # whether this request's plugin durations are recorded (a sample)

    @property
    def targets(self) -> tuple[EndpointState, ...]:
        """The primary profile's targets, best first (what goes into the destination header)."""
        primary = self.profile_results.get(self.primary_profile)
        return primary.targets if primary is not None else ()


class ProfileHandler(Plugin):
    """Decides which profiles run, in rounds, and which result is primary."""

    @abstractmethod
    def pick_profiles(
        self,
        request: InferenceRequest,
        cycle_state: CycleState,
        profiles: Sequence[str],
        results: Mapping[str, ProfileRunResult | None],
    ) -> Sequence[str]:
        """Names (among `profiles`) of the profiles to run next; empty ends the cycle."""

    @abstractmethod
    def process_results(
        self,
        request: InferenceRequest,
        cycle_state: CycleState,
        results: Mapping[str, ProfileRunResult | None],
    ) -> SchedulingResult:
        """Build the final result; raise `RequestError` if there is no usable target."""


class DataProducer(Plugin):
    """Computes per-request data before the scheduler runs (the reference's PrepareData).

    `produces` / `consumes` are data keys; they order producers and let the config loader
    create a key's default producer when a consumer is configured without one.
    """

    produces: ClassVar[frozenset[str]] = frozenset()

    @abstractmethod
    def prepare(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle_state: CycleState
    ) -> None: ...


@runtime_checkable
class AsyncPreparer(Protocol):
    """Optional async half of a DataProducer: slow work (e.g. tokenizing) done off the event
    loop before scheduling; `Runtime.prepare_async` awaits it, then `prepare` runs as usual.
    Matched structurally, so a DataProducer only needs to define the method."""

    async def prepare_async(self, request: InferenceRequest, candidates: Sequence[EndpointState]) -> None: ...


class PreRequest(Plugin):
    """Runs after the pick, before the request is forwarded (e.g. to record prefix ownership)."""

    @abstractmethod
    def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None: ...


class ResponseComplete(Plugin):
    """Runs once when the response has ended (successfully or not)."""

    @abstractmethod
    def response_complete(
        self, request: InferenceRequest, result: SchedulingResult, outcome: ResponseOutcome
    ) -> None: ...


class BackgroundWork(Plugin):
    """A plugin with work of its own beside requests (e.g. subscribing to KV-cache events);
    the server starts it once its event loop runs, so it is warm before the first request."""

    @abstractmethod
    def start(self) -> None: ...


class SaturationDetector(Plugin):
    """Measures how saturated the candidates are; >= 1.0 means saturated."""

    @abstractmethod
    def saturation(self, candidates: Sequence[EndpointState]) -> float: ...


class Handle:
    """What a plugin factory gets besides its parameters.

    - `datastore`: the pool's endpoints, metrics and in-flight counters (None in offline tools
      such as `picker config validate`).
    - `plugin(name)`: another plugin of the same config by name. Plugins are built in config
      order, so look up plugins defined later lazily (on first use), not in the factory.
    - `persistent(key, create)`: an object that survives config reloads (e.g. a prefix index),
      created on first request; later configs get the same object for the same key.
    """

    def __init__(
        self,
        datastore: Datastore | None = None,
        persistent_store: dict[str, Any] | None = None,
    ) -> None:
        self.datastore = datastore
        self._plugins: dict[str, Plugin] = {}
        self._persistent = persistent_store if persistent_store is not None else {}

    def plugin(self, name: str) -> Plugin:
        """The plugin instance called `name`; KeyError if there is none."""
        return self._plugins[name]

    def plugins(self) -> Mapping[str, Plugin]:
        """All plugins built so far, by name."""
        return self._plugins

    def add_plugin(self, plugin: Plugin) -> None:
        self._plugins[plugin.name] = plugin

    def persistent(self, key: str, create: Callable[[], T]) -> T:
        """The object stored under `key`, created by `create()` the first time."""
        if key not in self._persistent:
            self._persistent[key] = create()
        return self._persistent[key]
