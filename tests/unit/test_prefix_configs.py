"""The EndpointPickerConfig files the project ships for prefix-cache-aware routing load and
mean what their names say (they are the baselines and the tuned config of BENCHMARKS.md)."""

from __future__ import annotations

from typing import Any

import pytest

from picker.config.builtin_configs import BUILTIN_DIR
from picker.config.loader import LoadedConfig, build, parse_file, parse_text, to_yaml
from picker.kvevents.plugins import PreciseScorer
from picker.prefix.plugins import ApproxPrefixCacheProducer


def _weights(loaded: LoadedConfig) -> dict[str, float]:
    (profile,) = loaded.config.scheduling_profiles
    return {ref.plugin_ref: ref.weight for ref in profile.plugins if ref.plugin_ref != "max-score-picker"}


def _parameters(loaded: LoadedConfig, name: str) -> dict[str, Any]:
    (plugin,) = (p for p in loaded.config.plugins if p.name == name)
    return dict(plugin.parameters)


def test_reference_approx_is_the_reference_default_on_character_blocks() -> None:
    loaded = build(parse_file(BUILTIN_DIR / "reference-approx.yaml"))
    assert _weights(loaded) == {"queue-scorer": 2.0, "kv-cache-utilization-scorer": 2.0, "prefix-cache-scorer": 3.0}
    producer = _parameters(loaded, "approx-prefix-cache-producer")
    assert "tokenizers" not in producer  # character blocks, as the reference hashes
    assert producer["maxLoadFactor"] == 0  # the reference has no hot-spot bound
    assert (producer["blockSizeTokens"], producer["maxPrefixBlocksToMatch"]) == (16, 256)


def test_picker_best_predicts_ttft_on_token_exact_blocks() -> None:
    loaded = build(parse_file(BUILTIN_DIR / "picker-best.yaml"))
    assert _weights(loaded) == {
        "ttft-cost-scorer": 3.0,
        "prefix-cache-scorer": 2.0,
        "queue-scorer": 1.0,
        "cache-fit-scorer": 3.0,
    }
    assert _parameters(loaded, "approx-prefix-cache-producer")["tokenizers"] == {"*": "builtin"}
    producers = [p for p in loaded.plugins.values() if isinstance(p, ApproxPrefixCacheProducer)]
    assert len(producers) == 1 and producers[0].config.max_load_factor == 0
    assert _parameters(loaded, "ttft-cost-scorer")["interferenceWeight"] == 1  # misses go to quiet pods


def test_picker_precise_scores_prefixes_from_kv_events_of_the_discovered_publishers() -> None:
    loaded = build(parse_file(BUILTIN_DIR / "picker-precise.yaml"))
    assert _weights(loaded) == {
        "ttft-cost-scorer": 3.0,
        "precise-prefix-cache-scorer": 2.0,
        "queue-scorer": 1.0,
        "cache-fit-scorer": 3.0,
    }
    assert _parameters(loaded, "approx-prefix-cache-producer")["tokenizers"] == {"*": "builtin"}
    assert _parameters(loaded, "ttft-cost-scorer")["interferenceWeight"] == 1
    (scorer,) = (p for p in loaded.plugins.values() if isinstance(p, PreciseScorer))
    config = scorer.runtime.config
    assert config.block_size == 16  # picker sim's KV block size: the producer's hashes are used as they are
    assert config.subscriber.port is None  # only endpoints whose entry names a kvEventsAddress


def test_picker_e2e_is_picker_best_plus_the_completion_time_cost() -> None:
    best = build(parse_file(BUILTIN_DIR / "picker-best.yaml"))
    loaded = build(parse_file(BUILTIN_DIR / "picker-e2e.yaml"))
    assert _weights(loaded) == {**_weights(best), "e2e-cost-scorer": 3.0}
    for name in ("approx-prefix-cache-producer", "ttft-cost-scorer"):
        assert _parameters(loaded, name) == _parameters(best, name)
    assert _parameters(loaded, "e2e-cost-scorer")["harmWeight"] == 1


@pytest.mark.parametrize(
    "name",
    [
        "reference-approx.yaml",
        "picker-best.yaml",
        "picker-precise.yaml",
        "picker-conversation.yaml",
        "picker-e2e.yaml",
        "picker-pd.yaml",
        "picker-pd-predicted.yaml",
    ],
)
def test_config_show_prints_every_effective_parameter_and_loads_back_the_same(name: str) -> None:
    loaded = build(parse_file(BUILTIN_DIR / name))
    shown = to_yaml(loaded.config)  # what `picker config show` prints
    assert build(parse_text(shown)).config == loaded.config
    producer = _parameters(loaded, "approx-prefix-cache-producer")
    assert producer["blockSizeTokens"] == 16 and "reuseWindowSeconds" in producer and "blockSize" not in producer
    if name != "reference-approx.yaml":
        assert _parameters(loaded, "ttft-cost-scorer")["prefillTokensPerSecond"] == 5000.0
    if name == "picker-precise.yaml":
        precise = _parameters(loaded, "precise-prefix-cache-scorer")
        assert precise["kvEventsPort"] is None and precise["kvEventsReplayPort"] is None  # null: none, as configured
