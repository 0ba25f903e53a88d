"""The `flowControl` section resolved: limits as numbers, the TTL in seconds, policies as plugins,
every reference default filled in (`picker.config.flowcontrol` builds it once per config); the
controller reads it per request."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from picker.flowcontrol.policies import FairnessPolicy, OrderingPolicy

# How far a request's turn at its full prefix holders may be before it goes to an idle pod
# instead, by default (seconds; the most it waits when the holders' rates are unknown). 8 s kept
# the hit ratio of flow control off at 120% load on shared prefixes and the multi-tenant goodput
# at 97% of off (3 s: 1.4 points of hit ratio lost).
DEFAULT_MAX_AFFINITY_WAIT = 8.0


@dataclass(frozen=True, slots=True)
class BandSettings:
    """One priority band: its limits (0: none) and policies."""

    max_bytes: int
    max_requests: int
    fairness: FairnessPolicy
    ordering: OrderingPolicy


@dataclass(frozen=True, slots=True)
class FlowControlSettings:
    """Global limits (0: none), the default TTL (None: wait until dispatched or cancelled), the
    saturation ceiling, explicit bands by priority and the template for any other priority;
    `max_affinity_wait` (the picker's `maxAffinityWait`): how far the turn of a request whose
    prefix holders are full may be before it goes to an idle pod instead (0: never waits;
    `picker.flowcontrol.controller`)."""

    max_bytes: int
    max_requests: int
    default_ttl: float | None
    usage_limit: float
    default_band: BandSettings
    bands: Mapping[int, BandSettings] = field(default_factory=dict)
    max_affinity_wait: float = DEFAULT_MAX_AFFINITY_WAIT

    def band(self, priority: int) -> BandSettings:
        """The settings of `priority`'s band (the template when it is not configured)."""
        return self.bands.get(priority, self.default_band)
