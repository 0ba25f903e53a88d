"""One FailOpen/FailClose default everywhere the project ships one: the chart, the example pool,
the Envoy configs (failure_mode_allow) and README, which says why."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]


def ext_proc_filters(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        if node.get("name") == "envoy.filters.http.ext_proc":
            yield node["typed_config"]
        for value in node.values():
            yield from ext_proc_filters(value)
    elif isinstance(node, list):
        for value in node:
            yield from ext_proc_filters(value)


def test_chart_examples_envoy_and_readme_agree_on_fail_close() -> None:
    chart = yaml.safe_load((ROOT / "charts" / "picker" / "values.yaml").read_text())
    assert chart["inferenceExtension"]["failureMode"] == "FailClose"
    (pool,) = yaml.safe_load_all((ROOT / "manifests" / "examples" / "inferencepool.yaml").read_text())
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"
    for config in sorted((ROOT / "manifests" / "envoy").glob("*.yaml")):
        filters = list(ext_proc_filters(yaml.safe_load(config.read_text())))
        assert filters and all(f["failure_mode_allow"] is False for f in filters), config.name
    readme = (ROOT / "README.md").read_text()
    why = readme[readme.index("**Failure mode.**") :].split("\n\n", 1)[0]
    assert "**FailClose**" in why and "FailOpen" in why
