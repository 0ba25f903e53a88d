"""Built-in filters that are not also something else (the utilization detector is in `saturation`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from picker.datastore.endpoint import EndpointState
from picker.framework.cycle_state import CycleState
from picker.framework.handle import Handle
from picker.framework.parameters import Parameters
from picker.framework.plugin import Filter
from picker.framework.request import InferenceRequest

TEST_ENDPOINT_SELECTION_HEADER = "test-epp-endpoint-selection"


class HeaderBasedTestingFilter(Filter):
    """`header-based-testing-filter` (conformance tests): keep the endpoints the request names.

    The header `test-epp-endpoint-selection` lists IPs or `ip:port`s, comma separated; a
    request without it keeps no endpoint, as in the reference.
    """

    plugin_type = "header-based-testing-filter"

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> HeaderBasedTestingFilter:
        Parameters(parameters).finish()
        return cls(name)

    def filter(
        self, request: InferenceRequest, cycle_state: CycleState, candidates: Sequence[EndpointState]
    ) -> list[EndpointState]:
        value = request.headers.get(TEST_ENDPOINT_SELECTION_HEADER, "")
        wanted = {part.strip() for part in value.split(",") if part.strip()}
        return [c for c in candidates if c.endpoint.ip in wanted or c.address in wanted]
