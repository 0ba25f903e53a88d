"""Which config is in force: `picker_config_info`, the load-time gauge, `GET /config` on the
metrics port (a real aiohttp server on 127.0.0.1) and `picker config show --live`."""

from __future__ import annotations

import asyncio
import hashlib
from datetime import datetime

import pytest
import yaml
from aiohttp import web
from prometheus_client import REGISTRY

from picker.config import cli
from picker.config.loader import to_document, to_yaml
from picker.config.runtime import RuntimeHolder
from picker.telemetry.http import metrics_app, start_metrics_server
from picker_bench.process import free_port

HEADER = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
BY_QUEUE = HEADER + "featureGates: [dataLayer]\nplugins: [{type: queue-scorer}]\n"
INVALID = HEADER + "plugins: [{type: no-such-scorer}]\n"


def info_series() -> dict[tuple[str, str], float]:
    """picker_config_info's series: (hash, source) → value."""
    (family,) = [m for m in REGISTRY.collect() if m.name == "picker_config_info"]
    return {(s.labels["hash"], s.labels["source"]): s.value for s in family.samples}


def loaded_at() -> float | None:
    return REGISTRY.get_sample_value("picker_config_last_reload_success_timestamp_seconds")


def test_the_config_in_force_is_named_by_its_hash_source_and_load_time() -> None:
    holder = RuntimeHolder()
    default_hash = hashlib.sha256(to_yaml(holder.current.config).encode()).hexdigest()
    assert holder.source.origin == "default" and holder.source.sha256 == default_hash
    assert info_series() == {(default_hash[:16], "default"): 1.0}

    holder.load_text(BY_QUEUE, "ConfigMap ns/picker")
    sha = hashlib.sha256(BY_QUEUE.encode()).hexdigest()
    assert info_series() == {(sha[:16], "ConfigMap ns/picker"): 1.0}  # one series: the config in force
    assert loaded_at() == holder.source.loaded_at
    described = holder.describe()
    assert described["origin"] == "ConfigMap ns/picker" and described["sha256"] == sha
    assert datetime.fromisoformat(described["loadedAt"]).timestamp() == pytest.approx(holder.source.loaded_at)
    assert described["config"] == to_document(holder.current.config)
    assert described["notes"] == [
        'featureGates: "dataLayer" is obsolete: the data layer is always on (as in the reference)'
    ]

    before = holder.source
    assert not holder.reload(INVALID.encode(), "ConfigMap ns/picker")  # rejected: the old one stays in force
    assert holder.source == before and info_series() == {(sha[:16], "ConfigMap ns/picker"): 1.0}


async def test_get_config_and_config_show_live(capsys: pytest.CaptureFixture[str]) -> None:
    holder = RuntimeHolder()
    holder.load_text(BY_QUEUE, "/etc/picker/config.yaml")
    port = free_port()
    runner: web.AppRunner = await start_metrics_server(metrics_app(config=holder.describe), "127.0.0.1", port)
    base = f"http://127.0.0.1:{port}"
    try:
        assert await asyncio.to_thread(cli.main, ["show", "--live", base]) == 0
        shown = capsys.readouterr().out
        assert f"# sha256: {holder.source.sha256}\n" in shown
        assert "# source: /etc/picker/config.yaml\n" in shown and '# note: featureGates: "dataLayer"' in shown
        assert yaml.safe_load(shown) == to_document(holder.current.config)
        assert await asyncio.to_thread(cli.main, ["show", "--live", base + "/config"]) == 0
    finally:
        await runner.cleanup()
    assert await asyncio.to_thread(cli.main, ["show", "--live", base]) == 1  # nothing listens now
    assert "cannot read the live config from" in capsys.readouterr().err
