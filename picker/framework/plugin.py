"""The plugin interfaces: what a plugin may implement, and the values scheduling exchanges.

A plugin is one object with a `plugin_type` (its registry key) and a `name` (unique within a
config). It takes part by subclassing one or more interfaces below; the director and the
scheduler find them with `isinstance`, so one instance may be, say, a DataProducer and a Scorer.

Order of calls for one request (`picker.requestcontrol.director.Director` runs them):

1. `Parser.parse` turns the body into an `InferenceRequest`.
2. Admission (the configured `SaturationDetector`), or with the `flowControl` gate the queue:
   `DataProducer.prepare_async` runs first and an `AffinitySource` names the prompt's prefix
   holders, so the request can wait for one of them when dispatched (late binding).
3. `DataProducer.prepare_async` (slow work off the event loop), then `DataProducer.prepare` for
   every producer in dependency order, writing per-request data into the `CycleState`; then
   every `Admitter` may deny the request on that data.
4. The scheduler: the `ProfileHandler` chooses profiles; each profile runs its Filters in order,
   then its Scorers (total = sum of clamp(score, 0, 1) * weight, not normalised), then its Picker.
5. `PreRequest.pre_request` after the pick.
6. `ResponseReceived` on the response headers, `ResponseStreaming` on each response chunk,
   `ResponseMetadata` with the usage the response reported (its dynamic metadata goes back to
   the proxy), `ResponseComplete` once when the response has ended.

What a plugin's failure does (the failure policy; `picker.requestcontrol.hooks` applies it):

- Logged and skipped, the request goes on and the hook's other plugins still run: a
  `DataProducer` (`prepare_async`, whose total is also bounded by 400 ms, `prepare`, an
  `AffinitySource`'s `affinity`; its consumers then find no data), `PreRequest`,
  `ResponseReceived`, `ResponseStreaming`, `ResponseMetadata` (it reports nothing) and
  `ResponseComplete`.
- Fails the request: an `Admitter` that denies or raises (500 "request cannot be admitted",
  as the reference answers a denial); the `Parser`, the `SaturationDetector` and the
  scheduler's `ProfileHandler`, `Filter`, `Scorer` and `Picker`, with the `RequestError` they
  raise (e.g. the parser's 400, the profile handler's 429) or, for any other exception, 500
  Internal, logged with its traceback.
- Once the response is under way nothing fails it: a `Parser`'s `response_usage` that raises
  is logged, the response passes untouched and its request ends with Internal
  (`picker.extproc.server` applies this).

Scorers return one score per candidate, aligned with the candidate sequence they were given
(a list is cheaper than a dict keyed by address, and the candidates are already ordered).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from picker.datastore.endpoint import EndpointState
from picker.framework.cycle_state import CycleState, StateKey
from picker.framework.request import InferenceRequest, ResponseOutcome, Usage

# Dynamic metadata for the proxy: namespace → key → number (Envoy's filter metadata).
DynamicMetadata = Mapping[str, Mapping[str, float]]


class Plugin(ABC):
    """Base of every plugin: a registry type and an instance name.

    `consumes` lists the CycleState data keys the plugin reads (see `DataProducer`).
    `parameters` are the effective parameters, defaults included, as `picker config show`
    prints them; a factory sets it (e.g. from `Parameters.finish()`), else the raw ones show.
    `notes` say what the operator should know of how the parameters were read (something
    accepted that the plugin does not act on); the loader adds them to the config's notes.
    `producer_parameters` are parameters its own parameters give the default producer the
    loader adds for the data it consumes (llm-d's precise scorer names its tokenizers so).
    """

    plugin_type: str  # a class attribute in every plugin class (one class may serve several types)
    consumes: ClassVar[frozenset[StateKey[Any]]] = frozenset()

    def __init__(self, name: str) -> None:
        self.name = name
        self.parameters: Mapping[str, Any] = {}
        self.notes: tuple[str, ...] = ()
        self.producer_parameters: Mapping[str, Any] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(type={self.plugin_type!r}, name={self.name!r})"


class Filter(Plugin):
    """Narrows the candidates. Returning an empty sequence fails the profile."""

    @abstractmethod
    def filter(
        self, request: InferenceRequest, cycle_state: CycleState, candidates: Sequence[EndpointState]
    ) -> Sequence[EndpointState]: ...


class Parser(Plugin):
    """Turns a request body into an `InferenceRequest` (the reference's request parser).

    A parser whose responses are not OpenAI-style JSON sets `reads_response_usage` and reads
    the usage of a whole (not event-stream) response body with `response_usage`.
    """

    reads_response_usage: ClassVar[bool] = False

    def response_usage(self, body: bytes) -> Usage | None:
        """The usage a whole response body reports (only asked when `reads_response_usage`)."""
        return None

    @abstractmethod
    def parse(
        self, body: bytes, headers: Mapping[str, str], request_id: str, tenant_header: str | None
    ) -> InferenceRequest:
        """Parse `body` (headers have lower-case names); raise `RequestError` (400) if invalid."""

    @abstractmethod
    def rewrite_model(self, request: InferenceRequest) -> bytes:
        """The body to forward when the request's `target_model` differs from its `model`."""


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
    # When set, the proxy sends the request to this port of the targets' pods (a data-parallel
    # pod's primary port); the targets stay the chosen ranks, where load and prefixes are counted.
    destination_port: int = 0

    @property
    def targets(self) -> tuple[EndpointState, ...]:
        """The primary profile's targets, best first (what goes into the destination header)."""
        primary = self.profile_results.get(self.primary_profile)
        return primary.targets if primary is not None else ()


UPSTREAM_HEADERS_KEY = StateKey("UpstreamRequestHeaders", dict)
"""Request headers for the model server that this request's plugins set (name → value; an empty
value clears a header of that name the client sent): a profile handler in `process_results` or a
`PreRequest` hook (e.g. llm-d's P/D header naming the prefill pick) writes them with
`set_upstream_header`, and the picker's answer to the proxy sets them next to the destination."""


def set_upstream_header(cycle_state: CycleState, name: str, value: str) -> None:
    """Have the request reach the model server with header `name: value` (lower-case name)."""
    headers = cycle_state.read(UPSTREAM_HEADERS_KEY)
    if headers is None:
        headers = {}
        cycle_state[UPSTREAM_HEADERS_KEY] = headers
    headers[name] = value


def upstream_headers(cycle_state: CycleState) -> Mapping[str, str]:
    """The request headers this request's plugins set for the model server (empty if none)."""
    return cycle_state.read(UPSTREAM_HEADERS_KEY) or {}


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
    `prepare_async` is for slow work (e.g. tokenizing) done off the event loop: the director
    awaits every producer's (bounded in total), then runs every `prepare`.
    """

    produces: ClassVar[frozenset[StateKey[Any]]] = frozenset()

    async def prepare_async(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle_state: CycleState
    ) -> None:
        """Slow preparation off the event loop; nothing by default."""

    @abstractmethod
    def prepare(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle_state: CycleState
    ) -> None: ...


class Admitter(Plugin):
    """Admits or denies a request once its data is prepared, before scheduling (the
    reference's AdmissionPlugin). A denial fails the request as the reference does: 500,
    "request cannot be admitted"."""

    @abstractmethod
    def admit(
        self,
        request: InferenceRequest,
        priority: int,
        candidates: Sequence[EndpointState],
        cycle_state: CycleState,
    ) -> str | None:
        """None to admit; else why the request is denied (logged). `priority` is the request's
        InferenceObjective priority."""


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


class ResponseReceived(Plugin):
    """Runs when the response headers arrive from the model server."""

    @abstractmethod
    def response_received(self, request: InferenceRequest, result: SchedulingResult, status: int) -> None: ...


class ResponseStreaming(Plugin):
    """Runs on each chunk of the response body as it passes (keep it cheap: every streamed
    token event of a completion crosses it). A plugin whose parameters leave it nothing to do
    sets `streams_responses` False, and the director does not call it."""

    @property
    def streams_responses(self) -> bool:
        """Whether this instance wants the response chunks."""
        return True

    @abstractmethod
    def response_streaming(
        self, request: InferenceRequest, result: SchedulingResult, chunk: bytes, end_of_stream: bool
    ) -> None: ...


class ResponseMetadata(Plugin):
    """Reports values to the proxy as dynamic metadata, computed from what the response
    reported (the reference's ResponseBody hook writing `Response.DynamicMetadata`).

    Called with the usage read so far (zeros before any) on every response-body message of an
    event-stream response, and once when any other response has ended; what it returns is set
    on the picker's answer to that message. It must depend on `usage` alone: the director
    calls it again only when the usage changes and reuses the last answer otherwise.
    """

    @abstractmethod
    def response_metadata(self, request: InferenceRequest, usage: Usage) -> DynamicMetadata:
        """Namespace → key → number to set; empty when there is nothing to report."""


class BackgroundWork(Plugin):
    """A plugin with work of its own beside requests (e.g. subscribing to KV-cache events).

    The config holder starts it once its config is installed on a running event loop, so it is
    warm before the first request, and stops it when a new config no longer has it or the server
    stops. Work shared by several configs lives in a persistent object (`Handle.persistent`),
    whose release stops it; `start` and `stop` then only attach and detach.
    """

    @abstractmethod
    def start(self) -> None:
        """Begin the work on the running loop; a second call does nothing."""

    @abstractmethod
    async def stop(self) -> None:
        """End the work and wait until it has ended; a second call does nothing."""


class SaturationDetector(Plugin):
    """Measures how saturated the candidates are; >= 1.0 means saturated."""

    @abstractmethod
    def saturation(self, candidates: Sequence[EndpointState]) -> float: ...


@dataclass(frozen=True, slots=True)
class Affinity:
    """The endpoints holding the longest cached prefix of a prompt."""

    holders: frozenset[str]


class AffinitySource(ABC):
    """A data producer that can say, before scheduling, where a request's prefix is cached: flow
    control's late binding lets a request whose holders are all full wait for one of them (its
    turn at most `maxAffinityWait` away, or while no pod idles) instead of taking whichever pod
    frees a slot first."""

    @abstractmethod
    def affinity(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle_state: CycleState
    ) -> Affinity | None:
        """The request's prefix holders among `candidates` (None: nothing cached anywhere).
        What it computes from the prompt is kept in `cycle_state` for the scheduling that follows."""
