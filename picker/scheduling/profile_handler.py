"""`single-profile-handler`: run the one profile; its result is primary."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from picker.request.errors import RequestError
from picker.request.model import InferenceRequest
from picker.scheduling.framework import CycleState, Handle, ProfileHandler, ProfileRunResult, SchedulingResult
from picker.scheduling.parameters import Parameters


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
