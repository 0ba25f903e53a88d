"""Flow-control policy plugins, as the reference names them. The picker does not implement flow
control yet: these validate their parameters so reference configs load, and are otherwise inert."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from picker.framework.handle import Handle
from picker.framework.parameters import Parameters
from picker.framework.plugin import Plugin
from picker.framework.registry import PluginFactory


class FlowControlPolicy(Plugin):
    """A flow-control fairness, ordering or usage-limit policy named by `flowControl`. The picker
    does not implement flow control, so these only validate their parameters (the static
    usage-limit policy's `threshold`, the others none) and are otherwise inert."""

    def __init__(self, name: str, policy_type: str) -> None:
        super().__init__(name)
        self.plugin_type = policy_type  # one class serves every policy type

    @staticmethod
    def factory(policy_type: str) -> PluginFactory:
        """The registry factory for `policy_type`."""

        def create(name: str, parameters: Mapping[str, Any], handle: Handle) -> FlowControlPolicy:
            params = Parameters(parameters)
            if policy_type == STATIC_USAGE_LIMIT_POLICY:
                params.number("threshold", 1.0)  # the reference's fixed ceiling (1.0: no gating)
            policy = FlowControlPolicy(name, policy_type)
            policy.parameters = params.finish()
            return policy

        return create


STATIC_USAGE_LIMIT_POLICY = "static-usage-limit-policy"
# The policies the reference uses where flowControl names none, always present by these names.
DEFAULT_POLICIES = ("fcfs-ordering-policy", "global-strict-fairness-policy", STATIC_USAGE_LIMIT_POLICY)

# The reference's flow-control policy types.
FLOW_CONTROL_POLICY_TYPES = (
    "global-strict-fairness-policy",
    "round-robin-fairness-policy",
    "fcfs-ordering-policy",
    "edf-ordering-policy",
    "slo-deadline-ordering-policy",
    STATIC_USAGE_LIMIT_POLICY,
)
