"""Every file of llm-d v0.4.0's `deploy/config/` (copies in tests/data/llmd_configs/, naming
where each comes from): accepted with llm-d's plugin types, or refused as llm-d refuses it
(tests/e2e/test_llmd_config_table.py checks each against llm-d's own binary); and the P/D and data-parallel ones route as llm-d does,
through the director: the decode pick is the destination, a prompt whose uncached part reaches
the threshold also gets a prefill pick, named in `x-prefiller-host-port`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from picker.config.loader import build, parse_file
from picker.config.runtime import RuntimeHolder
from picker.config.schema import ConfigError
from picker.datastore.endpoint import Endpoint
from picker.datastore.store import Datastore
from picker.disaggregation.handlers import DATA_PARALLEL_HEADER, PREFILL_HEADER
from picker.framework.plugin import upstream_headers
from picker.requestcontrol.director import Director, RoutedRequest
from picker.scheduling.labels import ROLE_LABEL
from tests.unit.test_extproc_stream import BUFFERED, exchange, serving
from tests.unit.test_extproc_stream import body as stream_body
from tests.unit.test_extproc_stream import headers as stream_headers

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "llmd_configs"
SOURCE_LINE = "# Source: llm-d-inference-scheduler v0.4.0, deploy/config/"

# llm-d's deploy scripts fill `${PRIMARY_PORT}` in with envsubst; as committed, llm-d refuses it
# too (a string where its parameter is an integer).
PRIMARY_PORT_PLACEHOLDER = "${PRIMARY_PORT}"


@dataclass(frozen=True)
class Accepted:
    """The config loads; `types` are the plugin types it configures (by name)."""

    types: frozenset[str]


@dataclass(frozen=True)
class Refused:
    """The picker refuses it, as llm-d does; the error names the parameter."""

    error: str


PD_TYPES = frozenset(
    {"prefill-header-handler", "prefix-cache-scorer", "prefill-filter", "decode-filter", "max-score-picker"}
)
DECODE_ONLY = frozenset({"prefix-cache-scorer", "decode-filter", "max-score-picker", "single-profile-handler"})
CASES: dict[str, Accepted | Refused] = {
    "dp-epp-config.yaml": Accepted(
        frozenset({"prefix-cache-scorer", "decode-filter", "max-score-picker", "data-parallel-profile-handler"})
    ),
    "epp-config.yaml": Accepted(DECODE_ONLY),
    "sim-epp-config.yaml": Accepted(DECODE_ONLY),
    "pd-epp-config.yaml": Accepted(PD_TYPES | {"pd-profile-handler"}),
    "sim-pd-epp-config.yaml": Refused("plugins[5].parameters.primaryPort: must be an integer, got '${PRIMARY_PORT}'"),
    "epp-estimate-prefix-cache-config.yaml": Accepted(
        frozenset({"single-profile-handler", "decode-filter", "prefix-cache-scorer", "load-aware-scorer"})
    ),
    "sim-epp-no-hit-lru.yaml": Accepted(DECODE_ONLY | {"no-hit-lru-scorer"}),
    # llm-d's form of the precise scorer's parameters (picker.kvevents.llmd_form).
    "epp-precise-prefix-cache-config.yaml": Accepted(
        frozenset({"precise-prefix-cache-scorer", "kv-cache-utilization-scorer", "queue-scorer", "decode-filter"})
    ),
    # A later llm-d's cache_tracking form of prefix-cache-scorer, which v0.4.0 ignores, as the picker does.
    "sim-epp-kvcache-config.yaml": Accepted(DECODE_ONLY),
}


def test_every_llmd_config_names_its_source_and_has_a_row() -> None:
    files = sorted(path.name for path in CONFIGS.glob("*.yaml"))
    assert files == sorted(CASES)
    for name in files:
        assert (CONFIGS / name).read_text().startswith(SOURCE_LINE + name), name


@pytest.mark.parametrize("name", sorted(n for n, case in CASES.items() if isinstance(case, Accepted)))
def test_accepted_with_llmd_plugin_types(name: str) -> None:
    expected = CASES[name]
    assert isinstance(expected, Accepted)
    types = {plugin.plugin_type for plugin in build(parse_file(CONFIGS / name)).plugins.values()}
    assert expected.types <= types, types


@pytest.mark.parametrize("name", sorted(n for n, case in CASES.items() if isinstance(case, Refused)))
def test_refused_naming_what_is_missing(name: str) -> None:
    expected = CASES[name]
    assert isinstance(expected, Refused)
    with pytest.raises(ConfigError) as error:
        build(parse_file(CONFIGS / name))
    assert error.value.errors == [expected.error]  # and no error that follows from it


PREFILL_PODS = [Endpoint(f"10.0.1.{i}", 8000, f"prefill-{i}", labels={ROLE_LABEL: "prefill"}) for i in (1, 2)]
DECODE_PODS = [Endpoint(f"10.0.2.{i}", 8000, f"decode-{i}", labels={ROLE_LABEL: "decode"}) for i in (1, 2)]
# 1,280 characters: 20 whole prefix blocks (16 tokens of 4 characters), so once a decode pod
# holds it the uncached part is 0 (below sim-pd's threshold of 10), and before it is 1,280.
LONG_PROMPT = "0123456789abcdef" * 80


def sim_pd_config(primary_port: int) -> str:
    return (CONFIGS / "sim-pd-epp-config.yaml").read_text().replace(PRIMARY_PORT_PLACEHOLDER, str(primary_port))


def director(config: str, endpoints: list[Endpoint]) -> Director:
    store = Datastore()
    store.set_endpoints(endpoints)
    runtimes = RuntimeHolder(store)
    runtimes.load_text(config)
    return Director(store, runtimes)


async def route(d: Director, prompt: str, headers: dict[str, str] | None = None) -> RoutedRequest:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 8}).encode()
    routed = await d.route(body, {":path": "/v1/completions", **(headers or {})}, None)
    routed.finish()
    return routed


def prefill_pick(routed: RoutedRequest) -> str | None:
    assert routed.result is not None
    return upstream_headers(routed.result.cycle_state).get(PREFILL_HEADER)


async def test_sim_pd_config_prefills_an_uncached_prompt_and_not_a_cached_one() -> None:
    d = director(sim_pd_config(0), PREFILL_PODS + DECODE_PODS)
    first = await route(d, LONG_PROMPT)
    assert first.targets[0] in {e.address for e in DECODE_PODS}  # the decode pick is the destination
    assert prefill_pick(first) in {e.address for e in PREFILL_PODS}
    assert first.result is not None and first.result.primary_profile == "decode"
    # The same prompt again: its decode pod now holds all of it, below the threshold.
    second = await route(d, LONG_PROMPT)
    assert second.targets == first.targets
    assert prefill_pick(second) is None
    assert second.result is not None and set(second.result.profile_results) == {"decode"}


async def test_a_short_prompt_stays_below_the_threshold() -> None:
    d = director(sim_pd_config(0), PREFILL_PODS + DECODE_PODS)
    assert prefill_pick(await route(d, "hi there")) is None  # 8 characters < 10


def decisions(decision_type: str) -> float:
    return (
        REGISTRY.get_sample_value("llm_d_inference_scheduler_pd_decision_total", {"decision_type": decision_type})
        or 0.0
    )


async def test_pd_config_without_threshold_always_prefills_and_clears_a_client_header() -> None:
    d = director((CONFIGS / "pd-epp-config.yaml").read_text(), PREFILL_PODS + DECODE_PODS)
    before = decisions("prefill-decode"), decisions("decode-only")
    unavailable = REGISTRY.get_sample_value("picker_pd_prefill_unavailable_total") or 0.0
    assert prefill_pick(await route(d, "hi")) in {e.address for e in PREFILL_PODS}
    no_prefill = director((CONFIGS / "pd-epp-config.yaml").read_text(), DECODE_PODS)
    # No prefill pod: decode only (counted so), and a client's own prefill header does not reach the pod.
    routed = await route(no_prefill, "hi", {PREFILL_HEADER: "10.9.9.9:8000"})
    assert routed.targets[0] in {e.address for e in DECODE_PODS}
    assert prefill_pick(routed) == ""
    assert (decisions("prefill-decode"), decisions("decode-only")) == (before[0] + 1, before[1] + 1)
    # ... and counted apart from the requests below the threshold.
    assert REGISTRY.get_sample_value("picker_pd_prefill_unavailable_total") == unavailable + 1


async def test_unlabelled_endpoints_are_decode_pods() -> None:
    unlabelled = [Endpoint("10.0.3.1", 8000), Endpoint("10.0.3.2", 8000)]
    d = director((CONFIGS / "pd-epp-config.yaml").read_text(), unlabelled)
    routed = await route(d, LONG_PROMPT)
    assert routed.targets[0] in {e.address for e in unlabelled}
    assert prefill_pick(routed) is None


async def test_sim_pd_primary_port_sends_the_decode_pick_to_it_naming_the_rank() -> None:
    d = director(sim_pd_config(8200), DECODE_PODS)
    routed = await route(d, "hi")
    assert routed.result is not None
    rank = upstream_headers(routed.result.cycle_state)[DATA_PARALLEL_HEADER]
    assert routed.targets == [rank] and rank in {e.address for e in DECODE_PODS}
    assert routed.destination == rank.replace(":8000", ":8200")


async def test_dp_config_sends_to_the_primary_port_naming_the_rank() -> None:
    ranks = [Endpoint("10.0.4.1", port, "dp-pod") for port in (8001, 8002)]  # behind primary port 8000
    d = director((CONFIGS / "dp-epp-config.yaml").read_text(), ranks)
    routed = await route(d, LONG_PROMPT)
    assert routed.result is not None
    rank = upstream_headers(routed.result.cycle_state)[DATA_PARALLEL_HEADER]
    assert routed.targets == [rank] and rank in {e.address for e in ranks}
    assert routed.destination == "10.0.4.1:8000"
    # The prefix is counted at the rank that computed it: the same prompt finds it there.
    again = await route(d, LONG_PROMPT)
    assert again.targets == [rank] and again.result is not None
    run = again.result.profile_results["default"]
    assert run is not None
    prefix_scores = dict(zip((c.address for c in run.candidates), run.scores["prefix-cache-scorer"], strict=True))
    assert prefix_scores[rank] == 1.0


async def test_the_prefill_pick_reaches_the_proxy_in_the_header_mutation() -> None:
    """Through the compiled ext_proc core: the answer that carries the decode destination also
    sets `x-prefiller-host-port` (duplex), or removes a client's copy when nothing was prefilled
    (buffered)."""
    payload = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 8}).encode()
    pd_config = (CONFIGS / "pd-epp-config.yaml").read_text()
    async with serving(director(pd_config, PREFILL_PODS + DECODE_PODS)) as stub:
        _, (routed, _) = await exchange(stub, [stream_headers(), stream_body(payload, True)], 2)
    mutation = routed.request_headers.response.header_mutation
    values = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
    assert values["x-gateway-destination-endpoint"] in {e.address for e in DECODE_PODS}
    assert values[PREFILL_HEADER] in {e.address for e in PREFILL_PODS}

    client_header = stream_headers(mode=BUFFERED, extra={PREFILL_HEADER: "10.9.9.9:8000"})
    async with serving(director(pd_config, DECODE_PODS)) as stub:
        _, (_, routed) = await exchange(stub, [client_header, stream_body(payload, True)], 2)
    mutation = routed.request_body.response.header_mutation
    assert PREFILL_HEADER not in {h.header.key for h in mutation.set_headers}
    assert PREFILL_HEADER in mutation.remove_headers
