"""llm-d's prefill/decode (P/D) and data-parallel profile handlers, and its P/D request header.

P/D (llm-d v0.4.0's meaning): `pd-profile-handler` runs the decode profile first; then the
prefill profile, unless the part of the prompt the chosen decode pod does not hold in its prefix
cache is shorter than `threshold`. The decode pick is the destination; `prefill-header-handler`
names the prefill pick in the request header `x-prefiller-host-port`, which llm-d's routing
sidecar in the decode pod reads to have the prompt prefilled there first. A request whose
prefill profile finds no pod (or that is below the threshold) goes to the decode pick alone.

Beyond llm-d, `pd-profile-handler` with `decision: predicted` decides per request by predicted
cost instead of the threshold (`PredictedPdProfileHandler`).

Data parallel: `data-parallel-profile-handler` runs its one profile, sends the request to the
pod's `primaryPort` and names the chosen rank (`ip:port`) in `x-data-parallel-host-port`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from picker.datastore.endpoint import EndpointState
from picker.framework.cycle_state import CycleState
from picker.framework.handle import Handle
from picker.framework.parameters import Parameters, PluginConfigError
from picker.framework.plugin import (
    PreRequest,
    ProfileHandler,
    ProfileRunResult,
    SchedulingResult,
    set_upstream_header,
)
from picker.framework.request import InferenceRequest
from picker.prefix.chars import CHARS_PER_TOKEN
from picker.prefix.plugins import (
    KV_TRANSFER_SECONDS_KEY,
    PREFIX_MATCH_KEY,
    ProducerTtftModel,
    expected_cached_tokens,
    prompt_and_cached_tokens,
)
from picker.prefix.ttft import TtftModel
from picker.request.errors import RequestError
from picker.telemetry.metrics import PD_DECISIONS, PD_PREFILL_UNAVAILABLE

log = logging.getLogger(__name__)

_DECODE_ONLY = PD_DECISIONS.labels("decode-only")
_PREFILL_DECODE = PD_DECISIONS.labels("prefill-decode")

PREFILL_HEADER = "x-prefiller-host-port"
PD_DECISION = "pd_decision"  # explain topic: the predicted costs of a `decision: predicted` choice
DECISIONS = ("threshold", "predicted")
# A decode pod pulls a prompt's KV blocks at about this rate: Llama-3-8B's 128 KiB a token over
# one 400 Gb/s NIC (~50 GB/s) is ~380,000 tokens/s; the default leaves room for a slower link.
DEFAULT_KV_TRANSFER_TOKENS_PER_SECOND = 250_000.0
DATA_PARALLEL_HEADER = "x-data-parallel-host-port"


def _primary_port(p: Parameters, default: int) -> int:
    """llm-d's `primaryPort`: 0 (pd-profile-handler's default) or a TCP port."""
    port = p.integer("primaryPort", default, at_least=0)
    if port > 65535:
        raise PluginConfigError(f"primaryPort: must be between 1 and 65535, got {port}")
    return port


class PdProfileHandler(ProfileHandler):
    """`pd-profile-handler` (llm-d): decode first, then prefill when the uncached prompt is long.

    Parameters (llm-d's): `threshold` (0: always disaggregate), `decodeProfile` ("decode"),
    `prefillProfile` ("prefill"), `prefixPluginName` ("prefix-cache-scorer"), `hashBlockSize`
    (64, > 0), `primaryPort` (0: off; else the decode pick is sent to this port of its pod and its
    own `ip:port` goes in `x-data-parallel-host-port`; load and prefixes are counted at the pick).
    The picker's own: `decision` ("threshold": llm-d's rule; "predicted": see
    `PredictedPdProfileHandler`, whose parameters `interferenceWeight` and
    `kvTransferTokensPerSecond` only it takes).

    The uncached part is measured as llm-d measures it, in prompt characters: the prompt's length
    less what the decode pick is expected to hold (the prefix match, in the index's own blocks,
    at 4 characters a token). The picker has one prefix match per request whichever scorer made
    it, so `prefixPluginName` only names it, and `hashBlockSize` (llm-d's size of the prefix
    scorer's blocks) is validated but the match is counted in the index's real block size.
    """

    plugin_type = "pd-profile-handler"
    # Only to learn the prefill pods' rates from a disaggregated TTFT (llm-d's rule takes no rate).
    transfer_tokens_per_second = DEFAULT_KV_TRANSFER_TOKENS_PER_SECOND

    def __init__(self, name: str, threshold: int, decode_profile: str, prefill_profile: str, primary_port: int) -> None:
        super().__init__(name)
        self.threshold = threshold
        self.decode_profile = decode_profile
        self.prefill_profile = prefill_profile
        self.primary_port = primary_port

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> PdProfileHandler:
        p = Parameters(parameters)
        threshold = p.integer("threshold", 0, at_least=0)
        decode_profile = p.string("decodeProfile", "decode")
        prefill_profile = p.string("prefillProfile", "prefill")
        p.string("prefixPluginName", "prefix-cache-scorer")
        p.integer("hashBlockSize", 64, at_least=1)
        primary_port = _primary_port(p, 0)
        plugin: PdProfileHandler
        if "decision" in parameters and p.string("decision", "threshold", choices=DECISIONS) == "predicted":
            interference_weight = p.number("interferenceWeight", 1.0, at_least=0)
            transfer_rate = p.number("kvTransferTokensPerSecond", DEFAULT_KV_TRANSFER_TOKENS_PER_SECOND, above=0)
            plugin = PredictedPdProfileHandler(
                name,
                threshold,
                decode_profile,
                prefill_profile,
                primary_port,
                ProducerTtftModel(handle),
                interference_weight,
                transfer_rate,
            )
        else:
            plugin = cls(name, threshold, decode_profile, prefill_profile, primary_port)
        plugin.parameters = p.finish()
        return plugin

    def pick_profiles(
        self,
        request: InferenceRequest,
        cycle_state: CycleState,
        profiles: Sequence[str],
        results: Mapping[str, ProfileRunResult | None],
    ) -> Sequence[str]:
        if self.decode_profile not in results:
            return (self.decode_profile,) if self.decode_profile in profiles else ()
        decode = results[self.decode_profile]
        if decode is None or self.prefill_profile in results or self.prefill_profile not in profiles:
            return ()
        if self.threshold > 0 and self.uncached_chars(request, cycle_state, decode.targets[0]) < self.threshold:
            return ()
        return (self.prefill_profile,)

    @staticmethod
    def uncached_chars(request: InferenceRequest, cycle_state: CycleState, decode: EndpointState) -> int:
        """Prompt characters `decode` is not expected to hold in its prefix cache."""
        prompt = request.prompt_chars()
        match = cycle_state.read(PREFIX_MATCH_KEY)
        if match is None:
            return prompt
        (cached,) = expected_cached_tokens(match, cycle_state, [decode.address])
        return max(0, prompt - cached * CHARS_PER_TOKEN)

    def process_results(
        self, request: InferenceRequest, cycle_state: CycleState, results: Mapping[str, ProfileRunResult | None]
    ) -> SchedulingResult:
        decode = results.get(self.decode_profile)
        if decode is None or not decode.targets:
            raise RequestError("ResourceExhausted", "failed to find available decode workers")
        final: dict[str, ProfileRunResult | None] = {self.decode_profile: decode}
        if self.primary_port:
            set_upstream_header(cycle_state, DATA_PARALLEL_HEADER, decode.targets[0].address)
        prefill = results.get(self.prefill_profile)
        transfer = None if prefill is None else self.disaggregates(request, cycle_state, decode.targets[0], prefill)
        if prefill is not None and transfer is not None:
            final[self.prefill_profile] = prefill
            cycle_state[KV_TRANSFER_SECONDS_KEY] = transfer  # the prefix producer learns with it
            _PREFILL_DECODE.inc()
        else:
            if prefill is None and self.prefill_profile in results:
                log.info("request %s: no prefill pod passed the filters, decode only", request.request_id)
                PD_PREFILL_UNAVAILABLE.inc()
            _DECODE_ONLY.inc()
        return SchedulingResult(final, self.decode_profile, cycle_state, destination_port=self.primary_port)

    def disaggregates(
        self, request: InferenceRequest, cycle_state: CycleState, decode: EndpointState, prefill: ProfileRunResult
    ) -> float | None:
        """The predicted KV transfer seconds when the prefill profile's pick prefills the request
        (llm-d: whenever it ran), None when the decode pick prefills it."""
        prompt, (decode_cached,) = prompt_and_cached_tokens(request, cycle_state, [decode])
        return self.transfer_seconds(prompt, decode_cached)

    def transfer_seconds(self, prompt_tokens: int, decode_cached_tokens: int) -> float:
        """Predicted seconds the decode pod takes to pull the prompt's KV blocks it lacks."""
        return max(0, prompt_tokens - decode_cached_tokens) / self.transfer_tokens_per_second


class PredictedPdProfileHandler(PdProfileHandler):
    """`pd-profile-handler` with `decision: predicted` (the picker's own): disaggregate a request
    when that is predicted to cost less than prefilling it where it decodes.

    The prefill profile runs for every prompt whose uncached part reaches `threshold` (a floor
    here, 0 by default: every prompt), so its scorers choose the prefill pod (its prefix cache,
    its queue). Then, with the prefix producer's TTFT model (`picker.prefix.ttft`):

    - local: the predicted TTFT on the decode pick (its queue, the prefill of what it does not
      hold) plus the stall that prefill imposes on the requests running there
      (`interferenceWeight` x prefill time x running requests, default weight 1): a prefill
      shares the decode pod's engine steps, and every running request waits for it;
    - remote: the predicted TTFT on the prefill pick (its queue, the prefill of what *it* does not
      hold), plus the KV transfer of the tokens the decode pod lacks at
      `kvTransferTokensPerSecond` (250,000), plus the decode pod's first step (the second hop):
      the model's learnt overhead, a request's TTFT when nothing is queued or prefilled, which
      the prefix producer also takes off a disaggregated TTFT to learn the prefill pod's share.

    The request is disaggregated when remote < local: an idle decode pod prefills a cold prompt
    itself (nothing to stall, no transfer to wait for), a busy one hands it over unless the
    prefill pods are queued deeper than the stall is worth; a prefill pod holding the prefix
    makes the remote side cheap. Both predictions go to the explain map (`pd_decision`).
    The prefill pods' rates are learnt from the disaggregated answers (the prefix producer takes
    the predicted transfer and the decode pod's first step off their TTFT).
    """

    consumes = frozenset({PREFIX_MATCH_KEY})

    def __init__(
        self,
        name: str,
        threshold: int,
        decode_profile: str,
        prefill_profile: str,
        primary_port: int,
        model: Callable[[], TtftModel],
        interference_weight: float,
        transfer_tokens_per_second: float,
    ) -> None:
        super().__init__(name, threshold, decode_profile, prefill_profile, primary_port)
        self._model = model  # the prefix producer's (`ProducerTtftModel`)
        self.interference_weight = interference_weight
        self.transfer_tokens_per_second = transfer_tokens_per_second

    def disaggregates(
        self, request: InferenceRequest, cycle_state: CycleState, decode: EndpointState, prefill: ProfileRunResult
    ) -> float | None:
        if not prefill.targets:
            return None
        prefill_pod = prefill.targets[0]
        prompt, (decode_cached, prefill_cached) = prompt_and_cached_tokens(request, cycle_state, [decode, prefill_pod])
        model = self._model()
        now = model.clock()
        local = model.estimate(decode, prompt, decode_cached, now, self.interference_weight)
        remote = model.estimate(prefill_pod, prompt, prefill_cached, now)
        transfer = self.transfer_seconds(prompt, decode_cached)
        remote_seconds = remote.seconds + transfer + model.overhead_seconds
        disaggregate = remote_seconds < local.cost_seconds
        cycle_state.explain()[PD_DECISION] = {
            "local_seconds": local.cost_seconds,
            "remote_seconds": remote_seconds,
            "disaggregated": disaggregate,
        }
        return transfer if disaggregate else None


class PrefillHeaderHandler(PreRequest):
    """`prefill-header-handler` (llm-d): `x-prefiller-host-port: <prefill pick's ip:port>` when
    the prefill profile ran and picked; otherwise the header a client sent is cleared, so only
    the picker decides where a prompt is prefilled. Parameter `prefillProfile` ("prefill")."""

    plugin_type = "prefill-header-handler"

    def __init__(self, name: str, prefill_profile: str) -> None:
        super().__init__(name)
        self.prefill_profile = prefill_profile

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> PrefillHeaderHandler:
        p = Parameters(parameters)
        plugin = cls(name, p.string("prefillProfile", "prefill"))
        plugin.parameters = p.finish()
        return plugin

    def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        prefill = result.profile_results.get(self.prefill_profile)
        if prefill is not None and prefill.targets:
            set_upstream_header(result.cycle_state, PREFILL_HEADER, prefill.targets[0].address)
        elif PREFILL_HEADER in request.headers:
            set_upstream_header(result.cycle_state, PREFILL_HEADER, "")


class DataParallelProfileHandler(ProfileHandler):
    """`data-parallel-profile-handler` (llm-d): runs every profile once (llm-d means it for one
    profile, and fails a request that ran more); the pick is sent to the pod's `primaryPort`
    (8000) and the chosen rank's `ip:port` goes in `x-data-parallel-host-port`.

    llm-d accepts `primaryPort: 0` and then routes to port 0; the picker refuses it."""

    plugin_type = "data-parallel-profile-handler"

    def __init__(self, name: str, primary_port: int) -> None:
        super().__init__(name)
        self.primary_port = primary_port

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> DataParallelProfileHandler:
        p = Parameters(parameters)
        primary_port = _primary_port(p, 8000)
        if primary_port == 0:
            raise PluginConfigError("primaryPort: must be between 1 and 65535, got 0")
        plugin = cls(name, primary_port)
        plugin.parameters = p.finish()
        return plugin

    def pick_profiles(
        self,
        request: InferenceRequest,
        cycle_state: CycleState,
        profiles: Sequence[str],
        results: Mapping[str, ProfileRunResult | None],
    ) -> Sequence[str]:
        return () if results else profiles

    def process_results(
        self, request: InferenceRequest, cycle_state: CycleState, results: Mapping[str, ProfileRunResult | None]
    ) -> SchedulingResult:
        if len(results) != 1:
            raise RequestError(
                "ResourceExhausted",
                "data parallel profile handler is intended to be used with a single profile, "
                "failed to process multiple profiles",
            )
        ((name, result),) = results.items()
        if result is None or not result.targets:
            raise RequestError("ResourceExhausted", f"failed to run scheduler profile '{name}'")
        set_upstream_header(cycle_state, DATA_PARALLEL_HEADER, result.targets[0].address)
        return SchedulingResult({name: result}, name, cycle_state, destination_port=self.primary_port)
