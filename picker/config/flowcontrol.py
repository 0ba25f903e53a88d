"""The `flowControl` feature gate and section turned into `FlowControlSettings`, with the
reference's defaults."""

from __future__ import annotations

from collections.abc import Mapping

from picker.config.schema import EndpointPickerConfig, PriorityBandSpec
from picker.flowcontrol.policies import (
    FairnessPolicy,
    FcfsOrderingPolicy,
    GlobalStrictFairnessPolicy,
    OrderingPolicy,
    StaticUsageLimitPolicy,
)
from picker.flowcontrol.settings import DEFAULT_MAX_AFFINITY_WAIT, BandSettings, FlowControlSettings
from picker.framework.durations import parse_duration
from picker.framework.plugin import Plugin

FEATURE_GATE = "flowControl"
# The reference's per-band byte limit when a band sets none (or 0): 1 GB.
DEFAULT_BAND_MAX_BYTES = 1_000_000_000


def flow_control_settings(config: EndpointPickerConfig, plugins: Mapping[str, Plugin]) -> FlowControlSettings | None:
    """The settings of a built config, or None when the `flowControl` gate is off (the section
    is then ignored, as in the reference). The loader has checked every policy reference."""
    if FEATURE_GATE not in config.feature_gates:
        return None
    spec = config.flow_control
    fairness = GlobalStrictFairnessPolicy(GlobalStrictFairnessPolicy.plugin_type)
    ordering = FcfsOrderingPolicy(FcfsOrderingPolicy.plugin_type)

    def band(band_spec: PriorityBandSpec | None) -> BandSettings:
        band_spec = band_spec or PriorityBandSpec()
        band_fairness = plugins[band_spec.fairness_policy_ref] if band_spec.fairness_policy_ref else fairness
        band_ordering = plugins[band_spec.ordering_policy_ref] if band_spec.ordering_policy_ref else ordering
        assert isinstance(band_fairness, FairnessPolicy) and isinstance(band_ordering, OrderingPolicy)
        return BandSettings(
            max_bytes=band_spec.max_bytes or DEFAULT_BAND_MAX_BYTES,
            max_requests=band_spec.max_requests or 0,
            fairness=band_fairness,
            ordering=band_ordering,
        )

    usage_limit = 1.0
    if spec is not None and spec.usage_limit_policy_plugin_ref:
        policy = plugins[spec.usage_limit_policy_plugin_ref]
        assert isinstance(policy, StaticUsageLimitPolicy)
        usage_limit = policy.threshold
    ttl = parse_duration(spec.default_request_ttl) if spec is not None and spec.default_request_ttl else 0.0
    affinity_wait = (
        parse_duration(spec.max_affinity_wait)
        if spec is not None and spec.max_affinity_wait
        else DEFAULT_MAX_AFFINITY_WAIT
    )
    return FlowControlSettings(
        max_bytes=(spec.max_bytes or 0) if spec else 0,
        max_requests=(spec.max_requests or 0) if spec else 0,
        default_ttl=ttl or None,
        usage_limit=usage_limit,
        default_band=band(spec.default_priority_band if spec else None),
        bands={b.priority: band(b) for b in (spec.priority_bands if spec else ()) if b.priority is not None},
        max_affinity_wait=affinity_wait,
    )
