"""`active-request-scorer` (llm-d): prefer endpoints with fewer requests this scorer has seen
sent there and not yet seen end.

The counts are the scorer's own, as in llm-d: each request counts once at the first pick of every
profile that picked (a P/D request at its prefill pod and its decode pod) from `PreRequest`, and
stops counting when its response has ended, or `requestTimeout` after the pick when no end is
seen (llm-d's guard against leaked counts). Unlike llm-d, which removes at the end only the entry
of the pod that answered, the end of a request removes all of its entries: its prefill pod's
work for it ended before the answer did.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from picker.datastore.endpoint import EndpointState
from picker.framework.cycle_state import CycleState
from picker.framework.handle import Handle
from picker.framework.parameters import Parameters, PluginConfigError
from picker.framework.plugin import PreRequest, ResponseComplete, SchedulingResult, Scorer, ScorerCategory
from picker.framework.request import InferenceRequest, ResponseOutcome

DEFAULT_REQUEST_TIMEOUT_S = 120.0  # llm-d's default, 2m


class ActiveRequestScorer(Scorer, PreRequest, ResponseComplete):
    """Scores `(most − count) / most`, where `count` is the candidate's active requests and
    `most` the highest count of any endpoint (candidate or not), as llm-d does; an endpoint
    with none scores 1. Parameter: `requestTimeout` (a duration, "2m"): how long a request
    counts when its end is never seen; it must be positive (llm-d logs a bad value and uses
    the default)."""

    plugin_type = "active-request-scorer"
    category = ScorerCategory.DISTRIBUTION

    def __init__(
        self,
        name: str,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(name)
        self.request_timeout_s = request_timeout_s
        self._clock = clock
        # request id → (when it was picked, the endpoints it counts at); oldest first, as every
        # entry lives equally long
        self._requests: OrderedDict[str, tuple[float, tuple[str, ...]]] = OrderedDict()
        self._counts: Counter[str] = Counter()

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> ActiveRequestScorer:
        p = Parameters(parameters)
        given = (parameters or {}).get("requestTimeout")
        if given is not None and not isinstance(given, str):  # llm-d's is a string: a number is refused
            raise PluginConfigError(f'requestTimeout: must be a duration such as "2m", got {given!r}')
        timeout = p.duration("requestTimeout", DEFAULT_REQUEST_TIMEOUT_S)
        if timeout <= 0:
            raise PluginConfigError(f"requestTimeout: must be positive, got {parameters['requestTimeout']!r}")
        scorer = cls(name, timeout)
        scorer.parameters = p.finish()
        return scorer

    def active(self, address: str) -> int:
        """The requests counted at the endpoint `address` now."""
        self._expire()
        return self._counts[address]

    def score(
        self, request: InferenceRequest, cycle_state: CycleState, candidates: Sequence[EndpointState]
    ) -> list[float]:
        self._expire()
        counts = self._counts
        most = max(counts.values(), default=0)
        if most == 0:
            return [1.0] * len(candidates)
        return [(most - counts[c.address]) / most for c in candidates]

    def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        self._expire()
        targets = tuple(
            dict.fromkeys(run.targets[0].address for run in result.profile_results.values() if run and run.targets)
        )
        if not targets:
            return
        self._forget(request.request_id)  # a request id seen again counts once
        self._requests[request.request_id] = (self._clock(), targets)
        self._counts.update(targets)

    def response_complete(self, request: InferenceRequest, result: SchedulingResult, outcome: ResponseOutcome) -> None:
        self._forget(request.request_id)

    def _forget(self, request_id: str) -> None:
        entry = self._requests.pop(request_id, None)
        if entry is not None:
            self._uncount(entry[1])

    def _uncount(self, addresses: tuple[str, ...]) -> None:
        self._counts.subtract(addresses)
        for address in addresses:
            if self._counts[address] <= 0:
                del self._counts[address]

    def _expire(self) -> None:
        deadline = self._clock() - self.request_timeout_s
        requests = self._requests
        while requests:
            request_id, (picked, addresses) = next(iter(requests.items()))
            if picked > deadline:
                return
            del requests[request_id]
            self._uncount(addresses)
