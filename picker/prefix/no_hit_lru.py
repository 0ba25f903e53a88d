"""`no-hit-lru-scorer` (llm-d): spread prompts no endpoint has seen over the least recently
used endpoints, so new prefixes do not pile onto one pod."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from picker.datastore.endpoint import EndpointState
from picker.framework.cycle_state import CycleState, StateKey
from picker.framework.handle import Handle
from picker.framework.parameters import Parameters
from picker.framework.plugin import PreRequest, SchedulingResult, Scorer, ScorerCategory
from picker.framework.request import InferenceRequest
from picker.prefix.plugins import PREFIX_MATCH_KEY

DEFAULT_LRU_SIZE = 1024


class NoHitLruScorer(Scorer, PreRequest):
    """For a cold request (no endpoint holds any of its prefix): endpoints that never served a
    cold request score highest, in candidate order (1 down to ...), then the others from least
    to most recently used, down to 0; a request with a prefix hit scores 0.5 everywhere. The
    endpoint a cold request went to becomes the most recently used (`lruSize` (1024) remembered;
    <= 0 means the default, as in llm-d). `prefixPluginName` is accepted: the picker has one
    prefix match per request."""

    plugin_type = "no-hit-lru-scorer"
    category = ScorerCategory.DISTRIBUTION
    consumes = frozenset({PREFIX_MATCH_KEY})

    def __init__(self, name: str, lru_size: int = DEFAULT_LRU_SIZE) -> None:
        super().__init__(name)
        self.lru_size = lru_size
        self._used: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._cold_key = StateKey(f"{self.plugin_type}/{name}/cold", bool)

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> NoHitLruScorer:
        p = Parameters(parameters)
        p.string("prefixPluginName", "prefix-cache-scorer")
        lru_size = p.integer("lruSize", DEFAULT_LRU_SIZE)
        scorer = cls(name, lru_size if lru_size > 0 else DEFAULT_LRU_SIZE)
        scorer.parameters = p.finish()
        return scorer

    def score(
        self, request: InferenceRequest, cycle_state: CycleState, candidates: Sequence[EndpointState]
    ) -> list[float]:
        match = cycle_state.read(PREFIX_MATCH_KEY)
        cold = match is None or not any(match.matched.values())
        cycle_state[self._cold_key] = cold
        if not cold:
            return [0.5] * len(candidates)
        if len(candidates) == 1:
            return [1.0]
        last = len(candidates) - 1
        positions = {address: i for i, address in enumerate(self._used)}
        never_used = [c for c in candidates if c.address not in positions]
        ranks = {c.address: i for i, c in enumerate(never_used)}
        scores = []
        for candidate in candidates:
            rank = ranks.get(candidate.address)
            if rank is None:
                rank = len(never_used) + positions[candidate.address]
            scores.append(max(0.0, 1.0 - rank / last))
        return scores

    def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        if not result.cycle_state.read(self._cold_key) or not result.targets:
            return
        address = result.targets[0].address
        self._used[address] = None
        self._used.move_to_end(address)
        if len(self._used) > self.lru_size:
            self._used.popitem(last=False)
