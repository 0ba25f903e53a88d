"""`single-profile-handler`: run the one profile; its result is primary."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from picker.framework.cycle_state import CycleState
from picker.framework.handle import Handle
from picker.framework.parameters import Parameters
from picker.framework.plugin import ProfileHandler, ProfileRunResult, SchedulingResult
from picker.framework.request import InferenceRequest
from picker.request.errors import RequestError


class SingleProfileHandler(ProfileHandler):
    """Runs the single configured profile once (the config loader rejects more than one)."""

    plugin_type = "single-profile-handler"

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> SingleProfileHandler:
        Parameters(parameters).finish()
        return cls(name)

    def pick_profiles(
        self,
        request: InferenceRequest,
        cycle_state: CycleState,
        profiles: Sequence[str],
        results: Mapping[str, ProfileRunResult | None],
    ) -> Sequence[str]:
        return () if results else profiles[:1]

    def process_results(
        self, request: InferenceRequest, cycle_state: CycleState, results: Mapping[str, ProfileRunResult | None]
    ) -> SchedulingResult:
        ((name, result),) = results.items()
        if result is None or not result.targets:
            raise RequestError("ResourceExhausted", "failed to find a target endpoint: no candidate passed the filters")
        return SchedulingResult(results, name, cycle_state)
