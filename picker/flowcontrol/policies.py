"""Flow-control policy plugins, as the reference names them. The picker does not implement flow
control yet: these validate (no parameters) so reference configs load, and are otherwise inert."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from picker.framework.handle import Handle
from picker.framework.parameters import Parameters
from picker.framework.plugin import Plugin
from picker.framework.registry import PluginFactory


class FlowControlPolicy(Plugin):
    """A flow-control fairness or ordering policy named by `flowControl`. The picker does not
    implement flow control, so these only validate (no parameters) and are otherwise inert."""

    def __init__(self, name: str, policy_type: str) -> None:
        super().__init__(name)
        self.plugin_type = policy_type  # one class serves every policy type

    @staticmethod
    def factory(policy_type: str) -> PluginFactory:
        """The registry factory for `policy_type`."""

        def create(name: str, parameters: Mapping[str, Any], handle: Handle) -> FlowControlPolicy:
            Parameters(parameters).finish()
            return FlowControlPolicy(name, policy_type)

        return create


# The reference's flow-control policy types.
FLOW_CONTROL_POLICY_TYPES = (
    "global-strict-fairness-policy",
    "round-robin-fairness-policy",
    "fcfs-ordering-policy",
    "edf-ordering-policy",
)
