"""Prefix affinity for late binding: which endpoints hold most of a queued request's prompt.

Under saturation a dispatched request would go to whichever pod just freed a slot. The flow
controller instead lets a request whose prefix holders are all full wait for one of them, for at
most `maxAffinityWait`, while requests behind it that can go now are dispatched.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from picker.datastore.endpoint import EndpointState
from picker.framework.cycle_state import CycleState
from picker.framework.request import InferenceRequest


@dataclass(frozen=True, slots=True)
class Affinity:
    """The endpoints holding the longest cached prefix of a prompt."""

    holders: frozenset[str]


class AffinitySource(ABC):
    """A data producer that can say, before scheduling, where a request's prefix is cached."""

    @abstractmethod
    def affinity(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle_state: CycleState
    ) -> Affinity | None:
        """The request's prefix holders among `candidates` (None: nothing cached anywhere).
        What it computes from the prompt is kept in `cycle_state` for the scheduling that follows."""
