"""The shipped Grafana dashboard queries only metrics, and labels, that the picker exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.metrics import MetricWrapperBase

from picker.telemetry import metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "charts" / "picker" / "dashboards" / "picker.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported() -> dict[str, set[str]]:
    """Every series name the picker exports, with the label names it carries."""
    series: dict[str, set[str]] = {}
    for metric in vars(metrics).values():
        if isinstance(metric, MetricWrapperBase):
            for family in metric.describe():
                for suffix in SUFFIXES[family.type]:
                    series[family.name + suffix] = set(metric._labelnames) | ({"le"} if suffix == "_bucket" else set())
    return series


def test_every_panel_queries_exported_series_and_labels() -> None:
    series = exported()
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert len(panels) >= 10
    for panel in panels:
        for target in panel["targets"]:
            expr = target["expr"]
            names = set(re.findall(r"\b((?:inference|picker)_[a-z0-9_]+)\b", expr))
            assert names, (panel["title"], expr)
            for name in names:
                assert name in series, (panel["title"], name)
            labels = set().union(*(series[n] for n in names))
            used = set(re.findall(r"by \(([^)]*)\)", expr))
            used = {label.strip() for group in used for label in group.split(",")}
            used |= set(re.findall(r"\{(\w+)=", expr)) | set(re.findall(r"\{\{(\w+)\}\}", target["legendFormat"]))
            assert used <= labels, (panel["title"], used - labels)
