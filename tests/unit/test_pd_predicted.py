"""`pd-profile-handler` with `decision: predicted`: disaggregate when the predicted remote prefill
(prefill pod's TTFT + KV transfer + a second hop) beats the local one (decode pod's TTFT + the
stall it imposes on the requests running there); and the prefill work counted where it runs."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from picker.config.loader import build, parse_text
from picker.config.runtime import RuntimeHolder
from picker.config.schema import ConfigError
from picker.datastore.endpoint import Endpoint, EndpointMetrics
from picker.datastore.store import Datastore
from picker.disaggregation.handlers import PD_DECISION, PredictedPdProfileHandler
from picker.framework.request import ResponseOutcome, Usage
from picker.prefix.plugins import ApproxPrefixCacheProducer
from picker.prefix.ttft import TtftModel
from picker.requestcontrol.director import Director
from picker.scheduling.labels import ROLE_LABEL
from tests.unit.test_llmd_configs import prefill_pick, route

PREFILL_PODS = [Endpoint(f"10.0.1.{i}", 8000, f"prefill-{i}", labels={ROLE_LABEL: "prefill"}) for i in (1, 2)]
DECODE_PODS = [Endpoint(f"10.0.2.{i}", 8000, f"decode-{i}", labels={ROLE_LABEL: "decode"}) for i in (1, 2)]
# 40,000 characters, ~10,000 tokens: 2 s of prefill at the model's prior 5,000 tokens/s, 0.04 s of
# transfer at the default 250,000 tokens/s. Distinct words so no two prompts share a prefix.
LONG = 40_000


def prompt(tag: str, chars: int = LONG) -> str:
    return "".join(f"{tag}{i:07d} " for i in range(chars // 12))[:chars]


def config(**handler: Any) -> str:
    profile = [{"pluginRef": "ttft-cost-scorer"}, {"pluginRef": "prefix-cache-scorer"}]
    return yaml.safe_dump(
        {
            "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
            "kind": "EndpointPickerConfig",
            "plugins": [
                {"type": "approx-prefix-cache-producer"},
                {"type": "ttft-cost-scorer"},
                {"type": "prefix-cache-scorer"},
                {"type": "prefill-filter"},
                {"type": "decode-filter"},
                {"type": "max-score-picker"},
                {"type": "prefill-header-handler"},
                {"type": "pd-profile-handler", "parameters": {"decision": "predicted", **handler}},
            ],
            "schedulingProfiles": [
                {"name": "prefill", "plugins": [{"pluginRef": "prefill-filter"}, *profile]},
                {"name": "decode", "plugins": [{"pluginRef": "decode-filter"}, *profile]},
            ],
        }
    )


class Fleet:
    """A director over P/D pods whose scraped load the test sets."""

    def __init__(self, text: str, endpoints: list[Endpoint] = PREFILL_PODS + DECODE_PODS) -> None:
        self.store = Datastore()
        self.store.set_endpoints(endpoints)
        self.runtimes = RuntimeHolder(self.store)
        self.runtime = self.runtimes.load_text(text)
        self.director = Director(self.store, self.runtimes)

    def load(self, endpoints: list[Endpoint], running: int = 0, waiting: int = 0) -> None:
        for e in endpoints:
            self.store.set_metrics(
                e.address, EndpointMetrics(waiting_queue_size=waiting, running_requests_size=running)
            )

    async def decide(self, text: str) -> tuple[str | None, dict[str, Any]]:
        """The prefill pick (None: decode-only) and the handler's predicted costs."""
        routed = await route(self.director, text)
        assert routed.result is not None
        return prefill_pick(routed), routed.result.cycle_state.explain().get(PD_DECISION, {})

    @property
    def producer(self) -> ApproxPrefixCacheProducer:
        (producer,) = (p for p in self.runtime.plugins.values() if isinstance(p, ApproxPrefixCacheProducer))
        return producer

    @property
    def model(self) -> TtftModel:
        return self.producer.ttft

    def backlog(self, endpoint: Endpoint) -> float:
        return self.model.backlog(endpoint.address)


async def test_an_idle_decode_pod_prefills_a_cold_prompt_itself() -> None:
    # Nothing runs there to stall: the transfer and the second hop only add to the TTFT.
    pick, decision = await Fleet(config()).decide(prompt("a"))
    assert pick is None
    assert decision["disaggregated"] is False and decision["remote_seconds"] > decision["local_seconds"]


async def test_a_busy_decode_pod_hands_the_prefill_over_and_the_backlog_goes_with_it() -> None:
    fleet = Fleet(config())
    fleet.load(DECODE_PODS, running=2)  # 2 s of prefill would stall 2 running requests: ~6 s local
    pick, decision = await fleet.decide(prompt("b"))
    assert pick in {e.address for e in PREFILL_PODS}
    assert decision["disaggregated"] is True and decision["remote_seconds"] < decision["local_seconds"]
    # The TTFT model queues the prefill work on the prefill pod, not on the decode pod.
    (prefill_pod,) = (e for e in PREFILL_PODS if e.address == pick)
    assert fleet.backlog(prefill_pod) > 0
    assert all(fleet.backlog(e) == 0 for e in DECODE_PODS)


async def test_queued_prefill_pods_keep_the_prefill_local() -> None:
    fleet = Fleet(config())
    fleet.load(DECODE_PODS, running=2)
    fleet.load(PREFILL_PODS, waiting=50)  # ~25,000 tokens queued on each: ~5 s before it starts
    pick, decision = await fleet.decide(prompt("c"))
    assert pick is None and decision["remote_seconds"] > decision["local_seconds"]
    fleet.load(PREFILL_PODS, waiting=0)
    assert (await fleet.decide(prompt("d")))[0] is not None  # the same load otherwise disaggregates


async def test_the_interference_weight_and_transfer_rate_move_the_decision() -> None:
    # Without the stall in the local cost, a busy decode pod still prefills locally.
    fleet = Fleet(config(interferenceWeight=0))
    fleet.load(DECODE_PODS, running=2)
    assert (await fleet.decide(prompt("e")))[0] is None
    # A slow link (1,000 tokens/s: 10 s for this prompt) is worth no stall of 4 s.
    fleet = Fleet(config(kvTransferTokensPerSecond=1000))
    fleet.load(DECODE_PODS, running=2)
    assert (await fleet.decide(prompt("f")))[0] is None


async def test_the_second_hop_costs_the_learnt_overhead() -> None:
    # The decode pod's first step after the transfer: what a request with nothing queued or
    # prefilled takes, as learnt (the same the producer takes off a disaggregated TTFT).
    fleet = Fleet(config())
    now = [0.0]
    fleet.model.clock = lambda: now[0]
    _, before = await fleet.decide(prompt("n"))
    now[0] += 60.0  # the first prompt's backlog has drained
    fleet.model.overhead_seconds = 0.2
    _, after = await fleet.decide(prompt("o"))
    assert after["remote_seconds"] - before["remote_seconds"] == pytest.approx(0.2 - 0.01)
    assert after["local_seconds"] == pytest.approx(before["local_seconds"])


async def test_the_prefill_pod_holding_the_prefix_is_chosen_and_makes_the_remote_side_cheap() -> None:
    fleet = Fleet(config())
    now = [0.0]
    fleet.model.clock = lambda: now[0]
    fleet.load(DECODE_PODS, running=2)
    shared = prompt("g")
    first, cold = await fleet.decide(shared)
    assert first is not None
    now[0] += 60.0  # long done: the prefill pod's backlog has drained
    # New decode pods, which hold nothing; the prefill pod that computed the prompt holds it
    # (the other does not): same long prefix, new tail, and the remote side skips the prefix's
    # prefill (up to the index's match cap) while the local side cannot.
    fresh = [Endpoint(f"10.0.3.{i}", 8000, f"decode-new-{i}", labels={ROLE_LABEL: "decode"}) for i in (1, 2)]
    fleet.store.set_endpoints(PREFILL_PODS + fresh)
    fleet.load(fresh, running=2)
    second, decision = await fleet.decide(shared + prompt("h", 400))
    assert second == first
    assert decision["remote_seconds"] < 0.6 * cold["remote_seconds"]
    assert decision["local_seconds"] >= cold["local_seconds"]


async def test_the_threshold_is_a_floor_below_which_the_prefill_profile_does_not_run() -> None:
    fleet = Fleet(config(threshold=LONG * 2))
    fleet.load(DECODE_PODS, running=2)
    pick, decision = await fleet.decide(prompt("i"))
    assert pick is None and decision == {}  # no prediction was made


async def test_with_no_prefill_pod_every_request_is_decode_only() -> None:
    fleet = Fleet(config(), DECODE_PODS)
    fleet.load(DECODE_PODS, running=4)
    pick, decision = await fleet.decide(prompt("j"))
    assert pick is None and decision == {}


def test_parameters_and_their_defaults() -> None:
    handler = build(parse_text(config())).plugins["pd-profile-handler"]
    assert isinstance(handler, PredictedPdProfileHandler)
    assert (handler.interference_weight, handler.transfer_tokens_per_second) == (1.0, 250_000.0)
    assert handler.parameters["decision"] == "predicted"
    for parameters, error in (
        ({"decision": "always"}, "decision: must be one of"),
        ({"kvTransferTokensPerSecond": 0}, "kvTransferTokensPerSecond: must be > 0"),
        ({"interferenceWeight": -1}, "interferenceWeight: must be >= 0"),
    ):
        with pytest.raises(ConfigError) as refused:
            build(parse_text(config(**parameters)))
        assert error in str(refused.value), refused.value
    # The predicted decision's own parameters mean nothing to llm-d's threshold rule.
    with pytest.raises(ConfigError) as refused:
        build(parse_text(config(decision="threshold", interferenceWeight=1)))
    assert "interferenceWeight" in str(refused.value)


async def test_a_locally_prefilled_answer_teaches_the_decode_pod() -> None:
    fleet = Fleet(config())
    routed = await route(fleet.director, prompt("k"))
    assert routed.result is not None and prefill_pick(routed) is None
    tokens = fleet.model.rates(routed.destination).typical_prompt_tokens
    outcome = ResponseOutcome(routed.destination, 200, ttft_seconds=1.5, usage=Usage(prompt_tokens=7500))
    fleet.producer.response_complete(routed.request, routed.result, outcome)
    assert fleet.model.rates(routed.destination).prefill_samples == 1
    assert fleet.model.rates(routed.destination).typical_prompt_tokens != tokens


async def test_a_disaggregated_answer_teaches_the_prefill_pod_its_share_of_the_ttft() -> None:
    # The client's TTFT spans both pods and the answer's cached tokens count the transferred
    # blocks: the prefill pod learns the TTFT less the transfer and the decode pod's first step.
    fleet = Fleet(config())
    fleet.load(DECODE_PODS, running=2)
    routed = await route(fleet.director, prompt("l"))
    assert routed.result is not None
    prefill_pod = prefill_pick(routed)
    assert prefill_pod is not None
    model = fleet.model
    transfer, overhead = 7_500 / 250_000, model.overhead_seconds
    ttft = overhead + 7_500 / 12_000 + transfer + overhead
    usage = Usage(prompt_tokens=7_500, cached_tokens=7_488)
    fleet.producer.response_complete(
        routed.request, routed.result, ResponseOutcome(routed.destination, 200, ttft, usage=usage)
    )
    assert model.rates(routed.destination).prefill_samples == 0
    assert model.rates(prefill_pod).prefill_samples == 1
    assert model.rates(prefill_pod).prefill_tokens_per_second == pytest.approx(12_000, rel=0.01)


async def test_a_short_disaggregated_answer_teaches_no_overhead() -> None:
    # A prefill pod's share of a disaggregated TTFT is the client's less a predicted transfer and
    # second hop, after a queue the picker barely sees there: for a short prompt, that is no
    # measure of the per-request overhead (it would teach the queue wait as overhead).
    fleet = Fleet(config())
    fleet.load(DECODE_PODS, running=200)  # a short prompt's stall is then worth a transfer
    routed = await route(fleet.director, prompt("p", 200))
    assert routed.result is not None and prefill_pick(routed) is not None
    outcome = ResponseOutcome(routed.destination, 200, 0.6, usage=Usage(prompt_tokens=40, cached_tokens=32))
    fleet.producer.response_complete(routed.request, routed.result, outcome)
    assert fleet.model.overhead_samples == 0 and fleet.model.overhead_seconds == 0.01
    assert fleet.model.pool.prefill_samples == 0


async def test_prefill_pods_are_predicted_at_their_own_rate_after_disaggregated_answers() -> None:
    # Short chats on the decode pods taught the pool a fast rate; the prefill pods, which answer
    # only through disaggregated requests, take 7,500-token prompts at 12,000 tokens/s.
    fleet = Fleet(config())
    model = fleet.model
    now = [0.0]
    model.clock = lambda: now[0]
    for decode_pod in DECODE_PODS:
        for _ in range(20):
            model.observe(decode_pod.address, 0.01 + 4000 / 48_000, 4000, 0, 0.0)
    assert model.prefill_rate(PREFILL_PODS[0].address) == pytest.approx(48_000, rel=0.05)
    fleet.load(DECODE_PODS, running=2)
    answered: set[str] = set()
    for n in range(20):
        now[0] += 60.0  # the previous prompt's prefill is long done: nothing queued
        routed = await route(fleet.director, prompt(f"m{n}"))
        assert routed.result is not None
        prefill_pod = prefill_pick(routed)
        assert prefill_pod is not None
        answered.add(prefill_pod)
        ttft = 7_500 / 12_000 + 7_500 / 250_000 + 2 * model.overhead_seconds
        outcome = ResponseOutcome(routed.destination, 200, ttft, usage=Usage(prompt_tokens=7_500, cached_tokens=7_488))
        fleet.producer.response_complete(routed.request, routed.result, outcome)
    assert answered
    for address in answered:
        assert model.prefill_rate(address) == pytest.approx(12_000, rel=0.1)
        (state,) = fleet.store.snapshot([address])
        estimate = model.estimate(state, 7_500, 0)
        assert estimate.prefill_seconds == pytest.approx(7_500 / 12_000, rel=0.1)
