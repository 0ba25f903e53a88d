"""The data layer's plugins: where to scrape (`metrics-data-source`) and what to read from each
engine's page (`core-metrics-extractor`). `picker.datalayer.collector` is built from them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from picker.datalayer.engines import EngineCatalog
from picker.framework.handle import Handle
from picker.framework.parameters import Parameters, PluginConfigError
from picker.framework.plugin import Plugin


class MetricsDataSource(Plugin):
    """`metrics-data-source`: where to scrape each endpoint's Prometheus page. Parameters it
    was given (`given`) override the `--model-server-metrics-*` flags, which override the
    built-in defaults, as in the reference."""

    plugin_type = "metrics-data-source"

    def __init__(
        self,
        name: str,
        scheme: str = "http",
        path: str = "/metrics",
        insecure_skip_verify: bool = True,
        given: frozenset[str] = frozenset(),
    ):
        super().__init__(name)
        self.scheme = scheme
        self.path = path
        self.insecure_skip_verify = insecure_skip_verify
        self.given = given

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> MetricsDataSource:
        params = Parameters(parameters)
        scheme = params.string("scheme", "http", choices=("http", "https"))
        path = params.string("path", "/metrics")
        if not path.startswith("/"):
            raise PluginConfigError(f"path: must start with '/', got {path!r}")
        given = frozenset(key for key in ("scheme", "path", "insecureSkipVerify") if parameters and key in parameters)
        source = cls(name, scheme, path, params.boolean("insecureSkipVerify", True), given)
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


class InFlightLoadProducer(Plugin):
    """`inflight-load-producer`: accepted so reference configs naming it keep loading. The
    picker's in-flight counts always come from the datastore (`EndpointState.in_flight_*`)."""

    plugin_type = "inflight-load-producer"

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> InFlightLoadProducer:
        Parameters(parameters).finish()
        return cls(name)


@dataclass(frozen=True, slots=True)
class DataSource:
    """One configured metrics source and its extractors (the config's `dataLayer.sources[i]`)."""

    source: MetricsDataSource
    extractors: tuple[CoreMetricsExtractor, ...]


@dataclass(frozen=True, slots=True)
class ScrapeSettings:
    """What the collector scrapes and reads, as the installed config describes it."""

    path: str = "/metrics"
    scheme: str = "http"
    insecure_skip_verify: bool = True
    engines: EngineCatalog | None = None  # None: the built-in engine specs
    port: int = 0  # --model-server-metrics-port; 0: each endpoint's own port


def scrape_settings(
    sources: tuple[DataSource, ...] | None, defaults: ScrapeSettings = ScrapeSettings()
) -> ScrapeSettings | None:
    """The collector's settings for a config's data sources: None when `sources: []` turns
    collection off; `defaults` (the `--model-server-metrics-*` flags) for the legacy metrics
    path (no `dataLayer`, `sources` None) and for what the source's parameters leave out.
    The loader admits at most one source with at most one extractor."""
    if sources is None:
        return defaults
    if not sources:
        return None
    (data_source,) = sources
    source = data_source.source
    return ScrapeSettings(
        path=source.path if "path" in source.given else defaults.path,
        scheme=source.scheme if "scheme" in source.given else defaults.scheme,
        insecure_skip_verify=(
            source.insecure_skip_verify if "insecureSkipVerify" in source.given else defaults.insecure_skip_verify
        ),
        engines=data_source.extractors[0].catalog if data_source.extractors else defaults.engines,
        port=defaults.port,
    )
