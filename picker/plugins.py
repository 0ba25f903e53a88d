"""Every built-in plugin type, in one list: what a config's `type:` may name.

A new plugin type is added here (and nowhere else): its implementation lives with its concern
(scheduling, prefix, latency, kvevents, datalayer, request) and knows nothing of this list.
Types of the optional concerns (latency prediction, KV events, disaggregation) are registered by
name and imported when a config names them (`DeferredFactory`): their modules cost the start a
fifth of its imports otherwise.
The reference EPP's types the picker does not have are listed too, with the reason a config
naming one is refused (`UNSUPPORTED_REFERENCE_TYPES`); llm-d v0.4.0's types are all here.
"""

from __future__ import annotations

from picker.datalayer.plugins import CoreMetricsExtractor, InFlightLoadProducer, MetricsDataSource
from picker.flowcontrol.policies import POLICY_FACTORIES
from picker.framework.registry import DeferredFactory, Registration, Registry
from picker.prefix.narrowing import CandidateNarrowingFilter
from picker.prefix.no_hit_lru import NoHitLruScorer
from picker.prefix.plugins import (
    PREFIX_MATCH_KEY,
    PROMPT_BLOCKS_KEY,
    ApproxPrefixCacheProducer,
    CacheFitScorer,
    PrefixCacheScorer,
    TtftCostScorer,
)
from picker.prefix.session import SessionAffinityScorer
from picker.request.attribute_reporter import RequestAttributeReporter
from picker.request.parser import OpenAIParser
from picker.request.passthrough import PassthroughParser
from picker.request.vllm_grpc import VllmGrpcParser
from picker.scheduling.active_requests import ActiveRequestScorer
from picker.scheduling.concurrency import ConcurrencyDetector
from picker.scheduling.filters import HeaderBasedTestingFilter
from picker.scheduling.labels import ByLabel, ByLabelSelector, DecodeFilter, PrefillFilter
from picker.scheduling.pickers import MaxScorePicker, RandomPicker, WeightedRandomPicker
from picker.scheduling.profile_handler import SingleProfileHandler
from picker.scheduling.saturation import UtilizationDetector
from picker.scheduling.scorers import (
    KVCacheUtilizationScorer,
    LoadAwareScorer,
    LoraAffinityScorer,
    QueueScorer,
    RunningRequestsSizeScorer,
    TokenLoadScorer,
)


def _deferred(module: str, *types: tuple[str, str]) -> list[Registration]:
    """Registrations of (plugin type, class name) pairs of `module`, imported when first used
    (tests/unit/test_plugin_registry.py checks each type is its class's)."""
    return [Registration(plugin_type, DeferredFactory(module, class_name)) for plugin_type, class_name in types]


REGISTRY = Registry(
    [
        # scheduling: scorers, filters, pickers, profile handlers, saturation detectors
        Registration(QueueScorer.plugin_type, QueueScorer.create),
        Registration(KVCacheUtilizationScorer.plugin_type, KVCacheUtilizationScorer.create),
        Registration(RunningRequestsSizeScorer.plugin_type, RunningRequestsSizeScorer.create),
        Registration(LoraAffinityScorer.plugin_type, LoraAffinityScorer.create),
        Registration(TokenLoadScorer.plugin_type, TokenLoadScorer.create),
        Registration(LoadAwareScorer.plugin_type, LoadAwareScorer.create),
        Registration(ActiveRequestScorer.plugin_type, ActiveRequestScorer.create),
        Registration(HeaderBasedTestingFilter.plugin_type, HeaderBasedTestingFilter.create),
        Registration(CandidateNarrowingFilter.plugin_type, CandidateNarrowingFilter.create),
        Registration(MaxScorePicker.plugin_type, MaxScorePicker.create),
        Registration(RandomPicker.plugin_type, RandomPicker.create),
        Registration(WeightedRandomPicker.plugin_type, WeightedRandomPicker.create),
        Registration(SingleProfileHandler.plugin_type, SingleProfileHandler.create),
        Registration(UtilizationDetector.plugin_type, UtilizationDetector.create),
        Registration(ConcurrencyDetector.plugin_type, ConcurrencyDetector.create),
        # llm-d's label filters and its prefill/decode and data-parallel handling
        Registration(ByLabel.plugin_type, ByLabel.create),
        Registration(ByLabelSelector.plugin_type, ByLabelSelector.create),
        Registration(PrefillFilter.plugin_type, PrefillFilter.create),
        Registration(DecodeFilter.plugin_type, DecodeFilter.create),
        *_deferred(
            "picker.disaggregation.handlers",
            ("pd-profile-handler", "PdProfileHandler"),
            ("prefill-header-handler", "PrefillHeaderHandler"),
            ("data-parallel-profile-handler", "DataParallelProfileHandler"),
        ),
        # prefix: the approximate index, its scorers and the TTFT cost model
        Registration(
            ApproxPrefixCacheProducer.plugin_type,
            ApproxPrefixCacheProducer.create,
            default_producer_for=frozenset({PREFIX_MATCH_KEY.name, PROMPT_BLOCKS_KEY.name}),
        ),
        Registration(PrefixCacheScorer.plugin_type, PrefixCacheScorer.create, configures_default_producer=True),
        Registration(CacheFitScorer.plugin_type, CacheFitScorer.create),
        Registration(TtftCostScorer.plugin_type, TtftCostScorer.create),
        Registration(SessionAffinityScorer.plugin_type, SessionAffinityScorer.create),
        Registration(NoHitLruScorer.plugin_type, NoHitLruScorer.create),
        # latency: the reference's latency-predictor plugins, on the picker's TTFT and TPOT models, and
        # the picker's completion-time cost
        *_deferred(
            "picker.latency.plugins",
            ("predicted-latency-producer", "PredictedLatencyProducer"),
            ("latency-scorer", "LatencyScorer"),
            ("prefix-cache-affinity-filter", "PrefixCacheAffinityFilter"),
            ("slo-headroom-tier-filter", "SloHeadroomTierFilter"),
            ("latency-slo-admitter", "LatencySloAdmitter"),
            ("e2e-cost-scorer", "E2eCostScorer"),
        ),
        # kvevents: the precise index fed by the engines' KV-cache events
        *_deferred("picker.kvevents.plugins", ("precise-prefix-cache-scorer", "PreciseScorer")),
        # datalayer: what to scrape and read
        Registration(MetricsDataSource.plugin_type, MetricsDataSource.create),
        Registration(CoreMetricsExtractor.plugin_type, CoreMetricsExtractor.create),
        Registration(InFlightLoadProducer.plugin_type, InFlightLoadProducer.create),
        # request: parsing
        Registration(OpenAIParser.plugin_type, OpenAIParser.create),
        Registration(PassthroughParser.plugin_type, PassthroughParser.create),
        Registration(VllmGrpcParser.plugin_type, VllmGrpcParser.create),
        # request: what the response's usage reports back to the proxy
        Registration(RequestAttributeReporter.plugin_type, RequestAttributeReporter.create),
        # flowcontrol: fairness, ordering and usage-limit policies
        *(Registration(t, create) for t, create in POLICY_FACTORIES),
    ]
)


# Plugin types the reference EPP v1.5.0 registers that the picker does not have, and why: a
# config naming one fails with this reason rather than as an unknown type.
UNSUPPORTED_REFERENCE_TYPES = {
    "predicted-latency-scorer": (
        "the reference's all-in-one latency-predictor scorer, which asks the prediction sidecars itself; the "
        "picker has the split form the reference's chart configures: predicted-latency-producer with "
        "latency-scorer and the SLO filters"
    ),
    "k8s-notification-source": "it feeds extractors compiled into a custom reference build; the picker has none",
    "endpoint-notification-source": "it feeds extractors compiled into a custom reference build; the picker has none",
    "destination-endpoint-served-verifier": "a conformance-test plugin of the reference",
}


NARROWING_FILTER_TYPE = CandidateNarrowingFilter.plugin_type


def default_narrowing_filter() -> CandidateNarrowingFilter:
    """The `candidate-narrowing-filter` with its defaults, which ends every scheduling profile
    that names none (it changes nothing at or below its bound: `picker.prefix.narrowing`)."""
    return CandidateNarrowingFilter(NARROWING_FILTER_TYPE)
