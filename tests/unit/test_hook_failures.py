"""The plugin failure policy (`picker.framework.plugin`, applied by `picker.requestcontrol.hooks`),
one test per hook kind through the director: a plugin that raises at an isolated hook is
logged and the request goes on with the hook's other plugins run; one that raises in
admission, parsing or scheduling fails the request with the documented code."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest

from picker.datastore.endpoint import EndpointMetrics, EndpointState
from picker.framework.cycle_state import CycleState, StateKey
from picker.framework.plugin import (
    Admitter,
    Affinity,
    AffinitySource,
    DataProducer,
    DynamicMetadata,
    Filter,
    Picker,
    PreRequest,
    ResponseComplete,
    ResponseMetadata,
    ResponseReceived,
    ResponseStreaming,
    SchedulingResult,
    Scorer,
)
from picker.framework.registry import Registration
from picker.framework.request import InferenceRequest, ResponseOutcome, Usage
from picker.plugins import REGISTRY
from picker.request.errors import RequestError
from picker.request.parser import OpenAIParser
from picker.requestcontrol.hooks import NOT_ADMITTED, PLUGIN_FAILED
from picker.scheduling.pickers import MaxScorePicker
from tests.routing import Router, completion

HEADER = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
ENDPOINT = "10.0.0.1:8000"


class Calls:
    """Which plugin names were called, in order (one list per test)."""

    names: list[str] = []


def _called(plugin: Any) -> None:
    Calls.names.append(plugin.name)
    if plugin.name.startswith("broken"):
        raise RuntimeError(f"{plugin.name} fails on purpose")


class Producer(DataProducer):
    plugin_type = "test-failing-producer"

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.produces = frozenset({StateKey(name, list)})

    def prepare(self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle_state: CycleState) -> None:
        _called(self)


class AsyncProducer(Producer):
    plugin_type = "test-failing-async-producer"

    async def prepare_async(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle_state: CycleState
    ) -> None:
        _called(self)

    def prepare(self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle_state: CycleState) -> None:
        pass


class AffinityProducer(Producer, AffinitySource):
    plugin_type = "test-failing-affinity"

    def affinity(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle_state: CycleState
    ) -> Affinity | None:
        _called(self)
        return None

    def prepare(self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle_state: CycleState) -> None:
        pass


class Hooks(PreRequest, ResponseReceived, ResponseStreaming, ResponseMetadata, ResponseComplete):
    """Every isolated hook after the pick; `failing` names the one whose calls go to `_called`."""

    plugin_type = "test-failing-hooks"
    failing = ""

    def _hook(self, kind: str) -> None:
        if kind == self.failing:
            _called(self)

    def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        self._hook("pre_request")

    def response_received(self, request: InferenceRequest, result: SchedulingResult, status: int) -> None:
        self._hook("response_received")

    def response_streaming(
        self, request: InferenceRequest, result: SchedulingResult, chunk: bytes, end_of_stream: bool
    ) -> None:
        self._hook("response_streaming")

    def response_metadata(self, request: InferenceRequest, usage: Usage) -> DynamicMetadata:
        self._hook("response_metadata")
        return {"test": {self.name: 1.0}}

    def response_complete(self, request: InferenceRequest, result: SchedulingResult, outcome: ResponseOutcome) -> None:
        self._hook("response_complete")


class DenyingAdmitter(Admitter):
    plugin_type = "test-failing-admitter"

    def admit(
        self, request: InferenceRequest, priority: int, candidates: Sequence[EndpointState], cycle_state: CycleState
    ) -> str | None:
        _called(self)
        return "denied on purpose" if self.name.startswith("deny") else None


class BrokenFilter(Filter):
    plugin_type = "test-failing-filter"

    def filter(
        self, request: InferenceRequest, cycle_state: CycleState, candidates: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        raise RuntimeError("filter fails on purpose")


class BrokenScorer(Scorer):
    plugin_type = "test-failing-scorer"

    def score(
        self, request: InferenceRequest, cycle_state: CycleState, candidates: Sequence[EndpointState]
    ) -> Sequence[float]:
        raise RuntimeError("scorer fails on purpose")


class BrokenPicker(Picker):
    plugin_type = "test-failing-picker"

    def pick(
        self, cycle_state: CycleState, candidates: Sequence[EndpointState], totals: Sequence[float]
    ) -> tuple[EndpointState, ...]:
        raise RuntimeError("picker fails on purpose")


class BrokenParser(OpenAIParser):
    plugin_type = "test-failing-parser"

    def parse(
        self, body: bytes, headers: Mapping[str, str], request_id: str, tenant_header: str | None
    ) -> InferenceRequest:
        raise RuntimeError("parser fails on purpose")


def _register(monkeypatch: pytest.MonkeyPatch, cls: type[Any], setup: Callable[[Any], None] = lambda _: None) -> None:
    def create(name: str, parameters: Mapping[str, Any], handle: Any) -> Any:
        plugin = cls(name)
        setup(plugin)
        return plugin

    monkeypatch.setitem(REGISTRY.registrations, cls.plugin_type, Registration(cls.plugin_type, create))


def _router(text: str) -> Router:
    router = Router()
    router.set_endpoints({ENDPOINT: EndpointMetrics(update_time=1.0)})
    router.runtimes.load_text(HEADER + text)
    return router


@pytest.fixture(autouse=True)
def _fresh_calls() -> None:
    Calls.names = []


def _logged_failure(caplog: pytest.LogCaptureFixture, plugin: str) -> bool:
    return any(
        plugin in record.getMessage() and record.exc_info is not None
        for record in caplog.records
        if record.name == "picker.requestcontrol.hooks"
    )


@pytest.mark.parametrize("cls", [Producer, AsyncProducer], ids=["prepare", "prepare_async"])
async def test_a_failing_data_producer_is_logged_and_the_request_goes_on(
    cls: type[Producer], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _register(monkeypatch, cls)
    router = _router(
        f"plugins: [{{type: queue-scorer}}, {{name: broken, type: {cls.plugin_type}}},"
        f" {{name: healthy, type: {cls.plugin_type}}}]\n"
    )
    result = await router.pick(completion("hi"))
    assert [t.address for t in result.targets] == [ENDPOINT]
    assert Calls.names == ["broken", "healthy"]
    assert _logged_failure(caplog, "broken")


async def test_a_failing_affinity_lookup_is_logged_and_the_request_is_routed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _register(monkeypatch, AffinityProducer)
    router = _router(
        "featureGates: [flowControl]\n"
        "plugins: [{type: queue-scorer}, {name: broken, type: test-failing-affinity},"
        " {type: utilization-detector, parameters: {metricsStalenessThreshold: 1000000h}}]\n"
        "saturationDetector: {pluginRef: utilization-detector}\n"  # the endpoint's old metrics leave room
    )
    result = await router.pick(completion("hi"))
    assert [t.address for t in result.targets] == [ENDPOINT]
    assert Calls.names[:1] == ["broken"]
    assert any("affinity lookup of request r1 failed" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "hook", ["pre_request", "response_received", "response_streaming", "response_metadata", "response_complete"]
)
async def test_a_failing_hook_after_the_pick_is_logged_and_the_others_still_run(
    hook: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _register(monkeypatch, Hooks, lambda plugin: setattr(plugin, "failing", hook))
    router = _router(
        "plugins: [{type: queue-scorer}, {name: broken, type: test-failing-hooks},"
        " {name: healthy, type: test-failing-hooks}]\n"
    )
    routed = await router.route(completion("hi", stream=True))
    assert routed.destination == ENDPOINT
    routed.response_headers(200, ENDPOINT, "text/event-stream", end_of_stream=False)
    metadata = routed.response_body(b'data: {"usage": {"prompt_tokens": 1}}\n\n', end_of_stream=True)
    assert routed.done
    assert Calls.names[:2] == ["broken", "healthy"]
    assert _logged_failure(caplog, "broken")
    if hook == "response_metadata":
        assert metadata == {"test": {"healthy": 1.0}}  # what the healthy one reported still goes back


@pytest.mark.parametrize("first", ["deny", "broken"])
async def test_an_admitter_that_denies_or_raises_fails_the_request_with_500(
    first: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _register(monkeypatch, DenyingAdmitter)
    router = _router(
        f"plugins: [{{type: queue-scorer}}, {{name: {first}, type: test-failing-admitter}},"
        " {name: admits, type: test-failing-admitter}]\n"
    )
    with pytest.raises(RequestError) as failed:
        await router.route(completion("hi"))
    assert (failed.value.status, failed.value.message) == (500, NOT_ADMITTED)
    assert Calls.names == [first]  # the first denial decides, as in the reference
    assert router.datastore.in_flight(ENDPOINT) == 0


@pytest.mark.parametrize(
    "cls", [BrokenFilter, BrokenScorer, BrokenPicker, BrokenParser], ids=["filter", "scorer", "picker", "parser"]
)
async def test_a_scheduling_or_parsing_plugin_that_raises_fails_the_request_with_500(
    cls: type[Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _register(monkeypatch, cls)
    if cls is BrokenParser:
        text = (
            "plugins: [{type: queue-scorer}, {name: broken, type: test-failing-parser}]\nparser: {pluginRef: broken}\n"
        )
    else:
        extra = "" if cls is BrokenPicker else f", {{pluginRef: {MaxScorePicker.plugin_type}}}"
        text = (
            f"plugins: [{{name: broken, type: {cls.plugin_type}}}, {{type: {MaxScorePicker.plugin_type}}}]\n"
            f"schedulingProfiles: [{{name: default, plugins: [{{pluginRef: broken}}{extra}]}}]\n"
        )
    router = _router(text)
    with pytest.raises(RequestError) as failed:
        await router.route(completion("hi"))
    assert (failed.value.status, failed.value.message) == (500, PLUGIN_FAILED)
    assert any("routing request r1 failed" in r.getMessage() and r.exc_info for r in caplog.records)
    assert router.datastore.in_flight(ENDPOINT) == 0


async def test_a_request_error_from_a_plugin_is_the_answer() -> None:
    router = _router("plugins: [{type: queue-scorer}]\n")
    with pytest.raises(RequestError) as failed:
        await router.route(b"not json")
    assert failed.value.status == 400  # the parser's, not turned into a 500
