"""`session-affinity-scorer`: a conversation's turns follow each other, softly and per tenant."""

from __future__ import annotations

from typing import Any

import pytest

from picker.config.runtime import Runtime, RuntimeHolder
from picker.datastore.endpoint import Endpoint, EndpointState
from picker.datastore.store import Datastore
from picker.framework.cycle_state import CycleState
from picker.framework.handle import Handle
from picker.framework.parameters import PluginConfigError
from picker.framework.plugin import ProfileRunResult, SchedulingResult
from picker.framework.request import Api, InferenceRequest
from picker.plugins import REGISTRY
from picker.prefix.plugins import PREFIX_MATCH_KEY, PrefixMatch
from picker.prefix.prompt_blocks import TOKENS, PromptBlocks
from picker.prefix.session import SessionAffinityScorer, SessionTable
from tests.routing import CHAT, Router, chat
from tests.unit.test_scheduling_plugins import state


def turn(body: dict[str, Any], tenant: str | None = None, headers: dict[str, str] | None = None) -> InferenceRequest:
    return InferenceRequest(
        "r", Api.CHAT_COMPLETIONS, "m", "m", body={"model": "m", **body}, headers=headers or {}, tenant=tenant
    )


def scorer(**parameters: Any) -> SessionAffinityScorer:
    registration = REGISTRY.lookup("session-affinity-scorer")
    assert registration is not None
    plugin = registration.factory("session-affinity-scorer", parameters, Handle())
    assert isinstance(plugin, SessionAffinityScorer)
    return plugin


def routed(plugin: SessionAffinityScorer, request: InferenceRequest, target: EndpointState) -> None:
    result = SchedulingResult({"default": ProfileRunResult((target,))}, "default", CycleState())
    plugin.pre_request(request, result)


def test_the_next_turn_scores_the_endpoint_of_the_last_one() -> None:
    plugin = scorer()
    pods = [state(1), state(2), state(3)]
    first = turn({"prompt_cache_key": "conv-1"})
    assert plugin.score(first, CycleState(), pods) == [0.0, 0.0, 0.0]
    routed(plugin, first, pods[1])
    assert plugin.score(turn({"prompt_cache_key": "conv-1"}), CycleState(), pods) == [0.0, 1.0, 0.0]
    assert plugin.score(turn({"prompt_cache_key": "conv-2"}), CycleState(), pods) == [0.0, 0.0, 0.0]
    routed(plugin, turn({"prompt_cache_key": "conv-1"}), pods[2])  # shed elsewhere: it follows
    assert plugin.score(turn({"prompt_cache_key": "conv-1"}), CycleState(), pods) == [0.0, 0.0, 1.0]


def test_user_and_a_configured_header_name_sessions_too() -> None:
    plugin = scorer(header="X-Session")
    pods = [state(1), state(2)]
    routed(plugin, turn({"user": "u-7"}), pods[0])
    assert plugin.score(turn({"user": "u-7"}), CycleState(), pods) == [1.0, 0.0]
    routed(plugin, turn({}, headers={"x-session": "s-1"}), pods[1])
    # The header wins over the body's fields.
    assert plugin.score(turn({"user": "u-7"}, headers={"x-session": "s-1"}), CycleState(), pods) == [0.0, 1.0]
    assert scorer(fields=["prompt_cache_key"]).session(turn({"user": "u-7"})) is None


def test_tenants_and_models_never_share_a_session() -> None:
    plugin = scorer()
    pods = [state(1), state(2)]
    routed(plugin, turn({"prompt_cache_key": "same"}, tenant="a"), pods[0])
    assert plugin.score(turn({"prompt_cache_key": "same"}, tenant="b"), CycleState(), pods) == [0.0, 0.0]
    assert plugin.score(turn({"prompt_cache_key": "same"}, tenant="a"), CycleState(), pods) == [1.0, 0.0]
    other_model = InferenceRequest("r", Api.CHAT_COMPLETIONS, "m2", "m2", body={"prompt_cache_key": "same"}, tenant="a")
    assert plugin.score(other_model, CycleState(), pods) == [0.0, 0.0]


def test_a_busy_holder_loses_the_affinity_past_the_load_bound() -> None:
    plugin = scorer(maxLoadFactor=1.5)
    request = turn({"prompt_cache_key": "conv"})
    routed(plugin, request, state(1))
    # Mean load 4, bound 1.5 x (4 + 1) = 7.5: the holder at 10 in flight is past it.
    busy = [state(1, in_flight=10), state(2, in_flight=1), state(3, in_flight=1)]
    assert plugin.score(request, CycleState(), busy) == [0.0, 0.0, 0.0]
    calm = [state(1, in_flight=3), state(2, in_flight=2), state(3, in_flight=1)]
    assert plugin.score(request, CycleState(), calm) == [1.0, 0.0, 0.0]
    assert scorer(maxLoadFactor=0).score(request, CycleState(), busy) == [0.0, 0.0, 0.0]  # a new table


def test_sessions_expire_and_the_table_is_bounded() -> None:
    now = [0.0]
    table = SessionTable(capacity=2, idle_timeout_s=10.0, clock=lambda: now[0])
    table.record((None, "m", "a"), "10.0.0.1:8000")
    now[0] = 5.0
    table.record((None, "m", "b"), "10.0.0.2:8000")
    table.record((None, "m", "c"), "10.0.0.3:8000")  # "a" is the least recently used: gone
    assert table.endpoint((None, "m", "a")) is None and len(table) == 2
    now[0] = 14.0
    assert table.endpoint((None, "m", "b")) == "10.0.0.2:8000"
    now[0] = 16.0
    assert table.endpoint((None, "m", "c")) is None  # idle for 11 s > 10 s


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"fields": "user"}, "fields: must be a list of non-empty strings"),
        ({"maxLoadFactor": -1}, "maxLoadFactor: must be >= 0"),
        ({"idleTimeout": "0s"}, "idleTimeout: must be positive"),
        ({"capacity": 0}, "capacity: must be >= 1"),
        ({"ttl": "1m"}, "ttl: unknown parameter"),
    ],
)
def test_bad_parameters_are_named(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(PluginConfigError, match=message):
        scorer(**parameters)


async def test_from_a_config_sessions_survive_a_reload_and_departed_endpoints_are_forgotten() -> None:
    datastore = Datastore()
    pods = [Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.2", 8000)]
    datastore.set_endpoints(pods)
    router = Router(datastore)
    holder = router.runtimes
    body = chat([{"role": "user", "content": "hi"}], prompt_cache_key="conv")
    text = (
        "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
        "plugins: [{type: session-affinity-scorer}, {type: queue-scorer}]\n"
        "schedulingProfiles: [{name: default, plugins: [{pluginRef: session-affinity-scorer, weight: 2},"
        " {pluginRef: queue-scorer}]}]\n"
    )
    await holder.start()
    try:
        holder.load_text(text)
        result = await router.pick(body, "first", path=CHAT)  # its pre-request hook records the session
        chosen = result.targets[0].address
        reloaded = holder.load_text(text + "# reloaded\n")
        await holder.settle()
        again = await router.pick(body, "again", path=CHAT)
        assert again.targets[0].address == chosen
        datastore.set_endpoints([p for p in pods if p.address != chosen])
        plugin = reloaded.plugins["session-affinity-scorer"]
        assert isinstance(plugin, SessionAffinityScorer) and len(plugin.table) == 0
    finally:
        await holder.stop()


def sessions_config(*names: str, parameters: str = "") -> str:
    """A config of session scorers called `names`, each with `parameters` (a flow mapping's body)."""
    entries = ", ".join(
        f"{{name: {name}, type: session-affinity-scorer, parameters: {{{parameters}}}}}" for name in names
    )
    return f"apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\nplugins: [{entries}]\n"


def session_scorer(runtime: Runtime, name: str) -> SessionAffinityScorer:
    plugin = runtime.plugins[name]
    assert isinstance(plugin, SessionAffinityScorer)
    return plugin


async def test_a_reload_that_changes_capacity_or_idle_timeout_keeps_the_sessions() -> None:
    holder = RuntimeHolder(Datastore())
    pods = [state(1), state(2), state(3)]
    plugin = session_scorer(holder.load_text(sessions_config("s", parameters="capacity: 3")), "s")
    await holder.start()
    try:
        for conversation, pod in zip(("c1", "c2", "c3"), pods):
            routed(plugin, turn({"prompt_cache_key": conversation}), pod)
        reloaded = holder.load_text(sessions_config("s", parameters="capacity: 2, idleTimeout: 1h"))
        await holder.settle()
        again = session_scorer(reloaded, "s")
        assert again.table is plugin.table
        assert (again.table.capacity, again.table.idle_timeout_s, len(again.table)) == (2, 3600.0, 2)
        # The least recently used session went; the others still lead to their endpoints.
        scores = [again.score(turn({"prompt_cache_key": c}), CycleState(), pods) for c in ("c1", "c2", "c3")]
        assert scores == [[0.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    finally:
        await holder.stop()


def test_scorers_by_different_names_keep_their_own_sessions() -> None:
    runtime = RuntimeHolder(Datastore()).load_text(sessions_config("first", "second"))  # equal parameters
    first, second = session_scorer(runtime, "first"), session_scorer(runtime, "second")
    pods = [state(1), state(2)]
    routed(first, turn({"prompt_cache_key": "conv"}), pods[0])
    assert first.score(turn({"prompt_cache_key": "conv"}), CycleState(), pods) == [1.0, 0.0]
    assert second.score(turn({"prompt_cache_key": "conv"}), CycleState(), pods) == [0.0, 0.0]


def test_the_affinity_yields_where_the_index_says_the_history_was_evicted() -> None:
    plugin = scorer()
    pods = [state(1), state(2)]
    request = turn({"prompt_cache_key": "conv"})
    routed(plugin, request, pods[0])
    blocks = PromptBlocks(TOKENS, (1, 2, 3), 16, 48, 0)
    evicted, held = CycleState(), CycleState()
    evicted[PREFIX_MATCH_KEY] = PrefixMatch(blocks, {pods[1].address: 3})
    held[PREFIX_MATCH_KEY] = PrefixMatch(blocks, {pods[0].address: 2})
    assert plugin.score(request, evicted, pods) == [0.0, 0.0]
    assert plugin.score(request, held, pods) == [1.0, 0.0]
