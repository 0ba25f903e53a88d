"""Plugins that carry configuration for other parts of the picker and take no part in scheduling.

The data layer's source and extractor, the request parser and the flow-control policies are
named in an EndpointPickerConfig like any plugin; here they are validated strictly and hold
their typed parameters, which the serving code hands to the part that uses them.
"""

from __future__ import annotations

from typing import Any, Mapping

from picker.datalayer.engines import EngineCatalog
from picker.scheduling.framework import Handle, Plugin
from picker.scheduling.parameters import Parameters
from picker.scheduling.registry import PluginConfigError, PluginFactory


class MetricsDataSource(Plugin):
    """`metrics-data-source`: where to scrape each endpoint's Prometheus page."""

    plugin_type = "metrics-data-source"

    def __init__(self, name: str, scheme: str = "http", path: str = "/metrics", insecure_skip_verify: bool = True):
        super().__init__(name)
        self.scheme = scheme
        self.path = path
        self.insecure_skip_verify = insecure_skip_verify

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> MetricsDataSource:
        params = Parameters(parameters)
        scheme = params.string("scheme", "http", choices=("http", "https"))
        path = params.string("path", "/metrics")
        if not path.startswith("/"):
            raise PluginConfigError(f"path: must start with '/', got {path!r}")
        source = cls(name, scheme, path, params.boolean("insecureSkipVerify", True))
        source.parameters = params.finish()
        return source


class CoreMetricsExtractor(Plugin):
    """`core-metrics-extractor`: which metric names to read per engine (`engineConfigs`,
    `defaultEngine`, `engineLabelKey`), validated by the data layer's `EngineCatalog`."""

    plugin_type = "core-metrics-extractor"

    def __init__(self, name: str, catalog: EngineCatalog) -> None:
        super().__init__(name)
        self.catalog = catalog

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> CoreMetricsExtractor:
        if parameters is not None and not isinstance(parameters, Mapping):
            raise PluginConfigError(f"parameters: must be a mapping, got {type(parameters).__name__}")
        try:
            catalog = EngineCatalog.from_parameters(parameters)
        except ValueError as error:
            raise PluginConfigError(str(error).removeprefix("core-metrics-extractor: ")) from None
        extractor = cls(name, catalog)
        extractor.parameters = {
            "defaultEngine": catalog.default_engine,
            "engineLabelKey": catalog.label_key,
            **(
                {"engineConfigs": parameters["engineConfigs"]} if parameters and parameters.get("engineConfigs") else {}
            ),
        }
        return extractor


class OpenAIParser(Plugin):
    """`openai-parser`: the default request parser (OpenAI-style bodies); no parameters."""

    plugin_type = "openai-parser"

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> OpenAIParser:
        Parameters(parameters).finish()
        return cls(name)


class InFlightLoadProducer(Plugin):
    """`inflight-load-producer`: accepted so reference configs naming it keep loading. The
    picker's in-flight counts always come from the datastore (`EndpointState.in_flight_*`)."""

    plugin_type = "inflight-load-producer"

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> InFlightLoadProducer:
        Parameters(parameters).finish()
        return cls(name)


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
