"""Built-in pickers; each returns up to `maxNumOfEndpoints` targets, best first."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from picker.datastore.endpoint import EndpointState
from picker.framework.cycle_state import CycleState
from picker.framework.handle import Handle
from picker.framework.parameters import Parameters
from picker.framework.plugin import Picker


class _CountedPicker(Picker):
    def __init__(self, name: str, max_num_of_endpoints: int = 1, rng: random.Random | None = None) -> None:
        super().__init__(name)
        self.max_num_of_endpoints = max_num_of_endpoints
        self._random = rng or random.Random()

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> Picker:
        params = Parameters(parameters)
        picker = cls(name, params.integer("maxNumOfEndpoints", 1, at_least=1))
        picker.parameters = params.finish()
        return picker


class MaxScorePicker(_CountedPicker):
    """`max-score-picker`: highest totals first, ties broken uniformly at random.

    Equivalent to the reference's shuffle + stable sort; for a single target it avoids the
    shuffle (max, then a random choice among the tied best).
    """

    plugin_type = "max-score-picker"

    def pick(
        self, cycle_state: CycleState, candidates: Sequence[EndpointState], totals: Sequence[float]
    ) -> tuple[EndpointState, ...]:
        if self.max_num_of_endpoints == 1:
            best = max(totals)
            tied = [c for c, total in zip(candidates, totals) if total == best]
            return (tied[0] if len(tied) == 1 else self._random.choice(tied),)
        order = list(range(len(candidates)))
        self._random.shuffle(order)
        order.sort(key=totals.__getitem__, reverse=True)  # stable: shuffled order breaks ties
        return tuple(candidates[i] for i in order[: self.max_num_of_endpoints])


class RandomPicker(_CountedPicker):
    """`random-picker`: uniform choice, ignoring scores."""

    plugin_type = "random-picker"

    def pick(
        self, cycle_state: CycleState, candidates: Sequence[EndpointState], totals: Sequence[float]
    ) -> tuple[EndpointState, ...]:
        return tuple(self._random.sample(candidates, min(self.max_num_of_endpoints, len(candidates))))


class WeightedRandomPicker(_CountedPicker):
    """`weighted-random-picker`: A-Res weighted sampling without replacement, key = U^(1/score).

    Candidates scoring ≤ 0 get key 0, so they fill the remaining places only after every
    positive one; if no score is positive the choice is uniform.
    """

    plugin_type = "weighted-random-picker"

    def pick(
        self, cycle_state: CycleState, candidates: Sequence[EndpointState], totals: Sequence[float]
    ) -> tuple[EndpointState, ...]:
        count = min(self.max_num_of_endpoints, len(candidates))
        if all(total <= 0 for total in totals):
            return tuple(self._random.sample(candidates, count))
        draw = self._random.random
        keys = [draw() ** (1.0 / total) if total > 0 else 0.0 for total in totals]
        order = sorted(range(len(candidates)), key=keys.__getitem__, reverse=True)
        return tuple(candidates[i] for i in order[:count])
