"""Hot-spot protection: bounded load for prefix affinity.

A popular prefix would otherwise pin all of its traffic to the one endpoint that first cached
it. An endpoint keeps its prefix affinity for a request only while taking that request leaves
its load within `max_load_factor × (mean load + 1)` (consistent hashing with bounded loads,
the +1 keeping an idle pool from tripping it). Past the bound its match counts as zero, the
request goes where the other scorers send it, and the prefix is then recorded there too:
the hot prefix replicates onto a second endpoint, then a third, as long as load demands.

Load is what the picker knows best: its own in-flight requests, or the scraped running +
waiting when that is larger (other routers share the pool).
"""

from __future__ import annotations

from collections.abc import Sequence

from picker.datastore.endpoint import EndpointState


def load_limit(loads: Sequence[int], max_load_factor: float) -> float:
    """The load above which one more request takes a candidate past the bound (load + 1 >
    bound), given every candidate's `load` (not empty) and a `max_load_factor` above 0."""
    return max_load_factor * (sum(loads) / len(loads) + 1.0) - 1.0


def over_bound(candidates: Sequence[EndpointState], max_load_factor: float) -> list[bool]:
    """For each candidate, whether one more request would take it past the bound (0 = off)."""
    if max_load_factor <= 0 or not candidates:
        return [False] * len(candidates)
    # Read for every candidate of a decision: a slot read in a comprehension beats a function
    # call per candidate (and, in Python 3.11, an attrgetter mapped in C).
    loads = [c.load for c in candidates]
    limit = load_limit(loads, max_load_factor)
    return [load > limit for load in loads]
