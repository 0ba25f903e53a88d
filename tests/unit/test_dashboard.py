"""The shipped Grafana dashboard: every query is valid PromQL (parsed by promql-parser, a port of
Prometheus's own parser), reads only series and labels the picker exports, is scoped by the
namespace, pool and model variables, and every `picker_*` metric the picker registers has a
panel."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import prometheus_client
import promql_parser
import pytest

import picker.serve.server  # noqa: F401  (registers every metric the serving code exports)
from picker.telemetry.metrics import EndpointDurations

DASHBOARD = Path(__file__).resolve().parents[2] / "charts" / "picker" / "dashboards" / "picker.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",), "info": ("_info",)}
# Labels Prometheus adds when it scrapes (the chart's monitors add inference_pool).
TARGET_LABELS = {"namespace", "inference_pool"}
# Grafana's interval variables are not PromQL; any duration stands in for them when parsing.
GRAFANA_INTERVALS = {"$__rate_interval": "5m", "$__interval": "1m"}


def exported() -> dict[str, set[str]]:
    """Every series name the picker exports, with the label names it carries."""
    series: dict[str, set[str]] = {}
    for collector in picker_collectors():
        labels = set(collector.labelnames if isinstance(collector, EndpointDurations) else collector._labelnames)
        for family in collector.describe():
            for suffix in SUFFIXES.get(family.type, ("",)):
                extra = {"le"} if suffix == "_bucket" else set()
                series[family.name + suffix] = labels | extra
    return series


def picker_collectors() -> list[prometheus_client.metrics.MetricWrapperBase | EndpointDurations]:
    """The default registry's metrics (not the process and platform collectors)."""
    return [
        collector
        for collector in list(prometheus_client.REGISTRY._collector_to_names)
        if isinstance(collector, prometheus_client.metrics.MetricWrapperBase | EndpointDurations)
    ]


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def targets() -> Iterator[tuple[str, dict[str, Any]]]:
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", ()):
            yield panel["title"], target


def parse(expr: str) -> Any:
    for variable, duration in GRAFANA_INTERVALS.items():
        expr = expr.replace(variable, duration)
    return promql_parser.parse(expr)


def walk(node: Any) -> Iterator[Any]:
    """Every node of a parsed expression."""
    yield node
    for attribute in ("lhs", "rhs", "expr", "param", "vector_selector"):
        child = getattr(node, attribute, None)
        if child is not None and hasattr(child, "prettify"):
            yield from walk(child)
    for child in getattr(node, "args", None) or ():
        yield from walk(child)


def selectors(node: Any) -> list[Any]:
    return [n for n in walk(node) if type(n).__name__ == "VectorSelector"]


def matchers(selector: Any) -> dict[str, tuple[str, str]]:
    return {m.name: (str(m.op).rsplit(".", 1)[-1], m.value) for m in selector.matchers.matchers}


def test_every_query_reads_exported_series_and_labels() -> None:
    series = exported()
    assert sum(1 for _ in targets()) >= 30
    for title, target in targets():
        tree = parse(target["expr"])
        found = selectors(tree)
        assert found, (title, target["expr"])
        for selector in found:
            assert selector.name in series, (title, selector.name)
        labels = set().union(*(series[s.name] for s in found)) | TARGET_LABELS
        used = {name for s in found for name in matchers(s)}
        used |= {
            label
            for n in walk(tree)
            if type(n).__name__ == "AggregateExpr" and n.modifier
            for label in n.modifier.labels
        }
        used |= set(re.findall(r"\{\{(\w+)\}\}", target["legendFormat"]))
        assert used <= labels, (title, used - labels)


def test_every_query_follows_the_namespace_pool_and_model_variables() -> None:
    series = exported()
    for title, target in targets():
        for selector in selectors(parse(target["expr"])):
            scope = matchers(selector)
            assert scope.get("namespace") == ("Re", "$namespace"), (title, selector.name)
            assert scope.get("inference_pool") == ("Re", "$pool"), (title, selector.name)
            if "model_name" in series[selector.name]:
                assert scope.get("model_name") == ("Re", "$model"), (title, selector.name)


def test_namespace_pool_and_model_variables_read_exported_labels() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    series = exported()
    for name, label in (("namespace", "namespace"), ("pool", "inference_pool"), ("model", "model_name")):
        variable = variables[name]
        (selector_text, queried) = re.fullmatch(r"label_values\((.*), (\w+)\)", variable["query"]["query"]).groups()
        (selector,) = selectors(parse(selector_text))
        assert selector.name in series and queried == label
        assert variable["includeAll"] and variable["allValue"] == ".*"  # "All" also matches unlabelled series
    assert variables["pool"]["query"]["query"].count("$namespace") == 1
    assert "$pool" in variables["model"]["query"]["query"]


def test_every_picker_metric_has_a_panel() -> None:
    queried = {s.name for _, t in targets() for s in selectors(parse(t["expr"]))}
    families = {
        family.name: family.type
        for collector in picker_collectors()
        for family in collector.describe()
        if family.name.startswith("picker_")
    }
    assert len(families) >= 20
    missing = sorted(
        name for name, kind in families.items() if not {name + s for s in SUFFIXES.get(kind, ("",))} & queried
    )
    assert missing == []


@pytest.mark.parametrize(
    "what, series",
    [
        ("config reloads", {"picker_config_reloads_total"}),
        ("scrape errors", {"picker_scrape_errors_total"}),
        ("token throughput", {"inference_objective_input_tokens_sum", "inference_objective_output_tokens_sum"}),
    ],
)
def test_a_panel_shows(what, series) -> None:
    panels = dashboard()["panels"]
    shown = [{s.name for t in p.get("targets", ()) for s in selectors(parse(t["expr"]))} for p in panels]
    assert any(series <= names for names in shown), what


def test_panels_do_not_overlap() -> None:
    taken: set[tuple[int, int]] = set()
    for panel in dashboard()["panels"]:
        grid = panel["gridPos"]
        cells = {
            (x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & taken, panel["title"]
        taken |= cells
