"""Every built-in plugin type, in one list: what a config's `type:` may name.

A new plugin type is added here (and nowhere else): its implementation lives with its concern
(scheduling, prefix, kvevents, datalayer, request, requestcontrol) and knows nothing of this list.
"""

from __future__ import annotations

from picker.datalayer.plugins import CoreMetricsExtractor, InFlightLoadProducer, MetricsDataSource
from picker.flowcontrol.policies import FLOW_CONTROL_POLICY_TYPES, FlowControlPolicy
from picker.framework.registry import Registration, Registry
from picker.kvevents.plugins import PreciseScorer
from picker.prefix.plugins import (
    PREFIX_MATCH_KEY,
    PROMPT_BLOCKS_KEY,
    ApproxPrefixCacheProducer,
    CacheFitScorer,
    PrefixCacheScorer,
    TtftCostScorer,
)
from picker.prefix.session import SessionAffinityScorer
from picker.request.parser import OpenAIParser
from picker.scheduling.filters import HeaderBasedTestingFilter
from picker.scheduling.pickers import MaxScorePicker, RandomPicker, WeightedRandomPicker
from picker.scheduling.profile_handler import SingleProfileHandler
from picker.scheduling.saturation import UtilizationDetector
from picker.scheduling.scorers import (
    KVCacheUtilizationScorer,
    LoraAffinityScorer,
    QueueScorer,
    RunningRequestsSizeScorer,
    TokenLoadScorer,
)

REGISTRY = Registry(
    [
        # scheduling: scorers, filters, pickers, profile handlers, saturation detectors
        Registration(QueueScorer.plugin_type, QueueScorer.create),
        Registration(KVCacheUtilizationScorer.plugin_type, KVCacheUtilizationScorer.create),
        Registration(RunningRequestsSizeScorer.plugin_type, RunningRequestsSizeScorer.create),
        Registration(LoraAffinityScorer.plugin_type, LoraAffinityScorer.create),
        Registration(TokenLoadScorer.plugin_type, TokenLoadScorer.create),
        Registration(HeaderBasedTestingFilter.plugin_type, HeaderBasedTestingFilter.create),
        Registration(MaxScorePicker.plugin_type, MaxScorePicker.create),
        Registration(RandomPicker.plugin_type, RandomPicker.create),
        Registration(WeightedRandomPicker.plugin_type, WeightedRandomPicker.create),
        Registration(SingleProfileHandler.plugin_type, SingleProfileHandler.create),
        Registration(UtilizationDetector.plugin_type, UtilizationDetector.create),
        # prefix: the approximate index, its scorers and the TTFT cost model
        Registration(
            ApproxPrefixCacheProducer.plugin_type,
            ApproxPrefixCacheProducer.create,
            default_producer_for=frozenset({PREFIX_MATCH_KEY.name, PROMPT_BLOCKS_KEY.name}),
        ),
        Registration(PrefixCacheScorer.plugin_type, PrefixCacheScorer.create),
        Registration(CacheFitScorer.plugin_type, CacheFitScorer.create),
        Registration(TtftCostScorer.plugin_type, TtftCostScorer.create),
        Registration(SessionAffinityScorer.plugin_type, SessionAffinityScorer.create),
        # kvevents: the precise index fed by the engines' KV-cache events
        Registration(PreciseScorer.plugin_type, PreciseScorer.create),
        # datalayer: what to scrape and read
        Registration(MetricsDataSource.plugin_type, MetricsDataSource.create),
        Registration(CoreMetricsExtractor.plugin_type, CoreMetricsExtractor.create),
        Registration(InFlightLoadProducer.plugin_type, InFlightLoadProducer.create),
        # request: parsing
        Registration(OpenAIParser.plugin_type, OpenAIParser.create),
        # requestcontrol: flow-control policies
        *(Registration(t, FlowControlPolicy.factory(t)) for t in FLOW_CONTROL_POLICY_TYPES),
    ]
)
