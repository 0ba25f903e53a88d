"""`candidate-narrowing-filter`: scheduling cost flat in pool size (issue 29). It lives with the
prefix plugins because the prompt's prefix holders are what it must never narrow away.

Every scorer costs a little per candidate; at hundreds of endpoints that is most of a decision.
Above `maxCandidates` (64) candidates, this filter keeps, in one cheap pass:

- the `prefixHolders` (16) endpoints holding the longest cached prefix of the prompt (the prefix
  producer's match, and what the engines reported when KV events feed the config), so affinity
  is never narrowed away;
- the `leastLoaded` (16) endpoints by the figures the load scorers read (effective waiting
  requests, then KV-cache usage), ties taken from a random place in the pool so an idle pool
  does not always offer the same ones;
- `exploration` (4) endpoints at random, so an endpoint no figure favours still gets tried.

The scorers and the picker then see at most `prefixHolders + leastLoaded + exploration`
candidates, in pool order. At or below `maxCandidates` candidates the filter returns them
unchanged, so small pools decide exactly as without it; `maxCandidates: 0` never narrows.
Each narrowing is explained in the decision log (`narrowed_candidates`: from how many to how
many). A profile that does not name this filter narrows with its defaults after its own filters
(`picker.config.runtime`). The session and LoRA affinity scorers are not consulted: a config
that relies on them in a pool larger than `maxCandidates` raises it or sets it to 0.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from itertools import compress
from typing import Any

from picker.datastore.endpoint import EndpointState
from picker.framework.cycle_state import CycleState
from picker.framework.handle import Handle
from picker.framework.parameters import Parameters, PluginConfigError
from picker.framework.plugin import Filter
from picker.framework.request import InferenceRequest
from picker.prefix.plugins import ENGINE_CACHED_TOKENS_KEY, PREFIX_MATCH_KEY

NARROWED_CANDIDATES = "narrowed_candidates"  # explain topic: [{filter, from, to}] per narrowing


class CandidateNarrowingFilter(Filter):
    """`candidate-narrowing-filter`: see the module docstring."""

    plugin_type = "candidate-narrowing-filter"

    def __init__(
        self,
        name: str,
        max_candidates: int = 64,
        prefix_holders: int = 16,
        least_loaded: int = 16,
        exploration: int = 4,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(name)
        self.max_candidates = max_candidates
        self.prefix_holders = prefix_holders
        self.least_loaded = least_loaded
        self.exploration = exploration
        self._random = rng or random.Random()

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> CandidateNarrowingFilter:
        params = Parameters(parameters)
        narrowing = cls(
            name,
            max_candidates=params.integer("maxCandidates", 64, at_least=0),
            prefix_holders=params.integer("prefixHolders", 16, at_least=0),
            least_loaded=params.integer("leastLoaded", 16, at_least=1),
            exploration=params.integer("exploration", 4, at_least=0),
        )
        kept = narrowing.prefix_holders + narrowing.least_loaded + narrowing.exploration
        if narrowing.max_candidates and kept > narrowing.max_candidates:
            raise PluginConfigError(
                f"prefixHolders + leastLoaded + exploration ({kept}) must not exceed maxCandidates "
                f"({narrowing.max_candidates}): narrowing would keep more than it narrows from"
            )
        narrowing.parameters = params.finish()
        return narrowing

    def filter(
        self, request: InferenceRequest, cycle_state: CycleState, candidates: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        count = len(candidates)
        if not self.max_candidates or count <= self.max_candidates:
            return candidates
        kept = set(self._holders(cycle_state, candidates))
        kept.update(self._least_loaded(candidates))
        if self.exploration:
            kept.update(self._random.sample(range(count), self.exploration))
        narrowed = [candidates[i] for i in sorted(kept)]
        cycle_state.explain().setdefault(NARROWED_CANDIDATES, []).append(
            {"filter": self.name, "from": count, "to": len(narrowed)}
        )
        return narrowed

    def _holders(self, cycle_state: CycleState, candidates: Sequence[EndpointState]) -> list[int]:
        """Positions of the `prefix_holders` candidates holding the most of the prompt."""
        held: Mapping[str, float] | None = None
        match = cycle_state.read(PREFIX_MATCH_KEY)
        if match is not None and match.matched:
            held = match.matched  # in blocks
        engine_cached = cycle_state.read(ENGINE_CACHED_TOKENS_KEY)
        if engine_cached and match is not None:  # the engines' tokens in the match's blocks
            block_tokens = match.blocks.block_tokens
            held = dict(held or {})
            for address, tokens in engine_cached.items():
                held[address] = max(held.get(address, 0), tokens / block_tokens)
        elif engine_cached:
            held = engine_cached
        if not held or not self.prefix_holders:
            return []
        # Read for each candidate: by the producer when it saw this same list (as the first
        # filter does), else here (a slot read in a comprehension: in Python 3.11 faster than an
        # attrgetter mapped in C).
        depths: Sequence[float]
        if match is not None and held is match.matched and match.candidates is candidates:
            depths = match.held
        else:
            depth_of = held.get
            depths = [depth_of(c.address, 0) for c in candidates]
        # A sort only when more hold some of it than are kept.
        holders = list(compress(range(len(candidates)), depths))
        if len(holders) > self.prefix_holders:
            holders.sort(key=depths.__getitem__, reverse=True)
            del holders[self.prefix_holders :]
        return holders

    def _least_loaded(self, candidates: Sequence[EndpointState]) -> list[int]:
        """Positions of the `least_loaded` candidates with the fewest waiting requests, then
        the least KV-cache usage (below 1, it only orders equal queues); ties in pool order
        from a random starting place. One read per candidate, then a sort in C."""
        count = len(candidates)
        loads = [c.load_rank for c in candidates]
        start = self._random.randrange(count)
        order = [*range(start, count), *range(start)]
        order.sort(key=loads.__getitem__)  # stable: the rotation breaks ties
        return order[: self.least_loaded]
