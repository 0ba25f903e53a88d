"""Registers the built-in plugin types (imported by `registry.load_plugin_modules`)."""

from __future__ import annotations

from picker.scheduling.config_plugins import (
    FLOW_CONTROL_POLICY_TYPES,
    CoreMetricsExtractor,
    FlowControlPolicy,
    InFlightLoadProducer,
    MetricsDataSource,
    OpenAIParser,
)
from picker.scheduling.filters import HeaderBasedTestingFilter
from picker.scheduling.pickers import MaxScorePicker, RandomPicker, WeightedRandomPicker
from picker.scheduling.profile_handler import SingleProfileHandler
from picker.scheduling.registry import register
from picker.scheduling.saturation import UtilizationDetector
from picker.scheduling.scorers import (
    KVCacheUtilizationScorer,
    LoraAffinityScorer,
    QueueScorer,
    RunningRequestsSizeScorer,
    TokenLoadScorer,
)

for _plugin in (
    QueueScorer,
    KVCacheUtilizationScorer,
    RunningRequestsSizeScorer,
    LoraAffinityScorer,
    TokenLoadScorer,
    MaxScorePicker,
    RandomPicker,
    WeightedRandomPicker,
    SingleProfileHandler,
    UtilizationDetector,
    HeaderBasedTestingFilter,
    MetricsDataSource,
    CoreMetricsExtractor,
    OpenAIParser,
    InFlightLoadProducer,
):
    register(_plugin.plugin_type, _plugin.create)


for _policy_type in FLOW_CONTROL_POLICY_TYPES:
    register(_policy_type, FlowControlPolicy.factory(_policy_type))
