"""llm-d's form of `precise-prefix-cache-scorer`'s parameters (`indexerConfig`,
`kvEventsConfig`): each field llm-d v0.4.0 reads, as the picker's parameter of the same meaning,
accepted with a note, or refused naming it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from picker.config.loader import LoadedConfig, build, parse_text
from picker.config.schema import ConfigError
from picker.kvevents.plugins import PreciseScorer
from picker.kvevents.precise import TierWeights
from picker_bench.llmd_epp import write_builtin_tokenizer


def load(parameters: dict[str, Any]) -> LoadedConfig:
    plugin = {"type": "precise-prefix-cache-scorer", "name": "precise", "parameters": parameters}
    document = {"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig", "plugins": [plugin]}
    return build(parse_text(yaml.safe_dump(document)))


def scorer(parameters: dict[str, Any]) -> PreciseScorer:
    plugin = load(parameters).plugins["precise"]
    assert isinstance(plugin, PreciseScorer)
    return plugin


def refusal(parameters: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as error:
        load(parameters)
    (message,) = error.value.errors
    return message


def test_the_token_processor_is_the_block_size_and_vllms_sha256_cbor_with_the_seed() -> None:
    indexer = {"tokenProcessorConfig": {"blockSize": 64, "hashSeed": "42"}}
    config = scorer({"indexerConfig": indexer}).config
    assert (config.block_size, config.hash_algorithm, config.hash_seed) == (64, "sha256_cbor", "42")
    # llm-d's defaults: vLLM's block size and the empty seed.
    config = scorer({"indexerConfig": {}}).config
    assert (config.block_size, config.hash_algorithm, config.hash_seed) == (16, "sha256_cbor", "")
    # The picker's own parameters beside llm-d's form keep their meaning ...
    assert scorer({"indexerConfig": {}, "prefixCachingHashAlgo": "own"}).config.hash_algorithm == "own"
    # ... but one given both ways is ambiguous.
    assert refusal({"indexerConfig": indexer, "blockSizeTokens": 16}) == (
        "plugins[0].parameters.blockSizeTokens: give either it or llm-d's "
        "indexerConfig.tokenProcessorConfig.blockSize, not both"
    )


def test_backend_configs_are_the_tier_weights_an_unlisted_tier_weighing_one() -> None:
    backends = [{"name": "gpu", "weight": 1.0}, {"name": "cpu", "weight": 0.5}]
    assert scorer({"indexerConfig": {"kvCacheBackendConfigs": backends}}).config.weights == TierWeights(1.0, 0.5)
    only_gpu = [{"name": "gpu", "weight": 0.9}]
    assert scorer({"indexerConfig": {"kvCacheBackendConfigs": only_gpu}}).config.weights == TierWeights(0.9, 1.0)
    disk = [{"name": "disk", "weight": 0.1}]
    assert "tierWeights.disk: unknown tier" in refusal({"indexerConfig": {"kvCacheBackendConfigs": disk}})


def test_the_events_config_binds_its_endpoint_with_its_topic() -> None:
    config = scorer({"kvEventsConfig": {"topicFilter": "kv@pool", "concurrency": 8}}).config
    # llm-d binds its subscriber (by default on tcp://*:5557) and the engines connect to it.
    assert config.subscriber.topic_filter == "kv@pool" and config.subscriber.bind_address == "tcp://*:5557"
    config = scorer({"kvEventsConfig": {"zmqEndpoint": "tcp://127.0.0.1:6000"}}).config
    assert config.subscriber.bind_address == "tcp://127.0.0.1:6000"
    # The picker's own way to the publishers, beside llm-d's form, is kept.
    assert scorer({"indexerConfig": {}, "kvEventsPort": 5600}).config.subscriber.bind_address is None
    assert refusal({"kvEventsConfig": {"zmqEndpoint": "tcp://*:5557"}, "kvEventsPort": 5600}) == (
        "plugins[0].parameters.kvEventsPort: not used with kvEventsBindAddress (the engines connect to it)"
    )
    assert "kvEventsBindAddress: must be a ZMQ endpoint" in refusal({"kvEventsBindAddress": "5557"})
    assert refusal({"kvEventsConfig": {"concurrency": 0}}) == (
        "plugins[0].parameters.kvEventsConfig.concurrency: must be >= 1, got 0"
    )


def test_accepted_without_effect_with_a_note() -> None:
    indexer = {
        "prefixStoreConfig": {"cacheSize": 500000, "blockSize": 256},
        "kvBlockIndexConfig": {
            "inMemoryConfig": {"size": 100000000, "podCacheSize": 10},
            "enableMetrics": True,
            "metricsLoggingInterval": 60000000000,
        },
    }
    notes = "\n".join(load({"indexerConfig": indexer}).notes)
    for field in (
        "prefixStoreConfig: accepted",
        "inMemoryConfig: accepted",
        "enableMetrics and metricsLoggingInterval accepted",
    ):
        assert field in notes, field
    assert "Hugging Face tokenizer" in notes


@pytest.mark.parametrize(
    ("parameters", "error"),
    [
        ({"kvEventsConfig": {"zmqEndpoint": 5557}}, "kvEventsConfig.zmqEndpoint: must be a string"),
        ({"indexerConfig": {"kvBlockIndexConfig": {"redisConfig": {"address": "redis:6379"}}}}, "--state-store"),
        ({"indexerConfig": {"tokenizersPoolConfig": {"uds": {"socketFile": "/t.sock"}}}}, "tokenizersPoolConfig.uds:"),
        (
            {"indexerConfig": {"tokenizersPoolConfig": {"local": {"autoDiscoveryDir": "/models"}}}},
            "local.autoDiscoveryDir: the picker loads the tokenizers it is given",
        ),
        (
            {"indexerConfig": {"tokenizersPoolConfig": {"local": {"modelTokenizerMap": {"m": "/t/vocab.txt"}}}}},
            "modelTokenizerMap.m: must be the path of a tokenizer.json",
        ),
        ({"indexerConfig": {"tokenizersPoolConfig": {"hf": {"enabled": "yes"}}}}, "hf.enabled: must be true or false"),
        ({"indexerConfig": {"tokenProcessorConfig": {"blockSize": 0}}}, "tokenProcessorConfig.blockSize: must be >= 1"),
        ({"indexerConfig": {"tokenProcessorConfig": {"hashSeed": 42}}}, "tokenProcessorConfig.hashSeed: must be a"),
        ({"indexerConfig": {"tokenProcessorConfig": {"seed": "42"}}}, "tokenProcessorConfig.seed: unknown parameter"),
        ({"indexerConfig": {"kvBlockIndexConfig": {"inMemoryConfig": {"sise": 1}}}}, "inMemoryConfig.sise: unknown"),
        ({"indexerConfig": {"tokenizer": {}}}, "indexerConfig.tokenizer: unknown parameter"),
    ],
)
def test_refused_naming_the_field(parameters: dict[str, Any], error: str) -> None:
    message = refusal(parameters)
    assert message.startswith("plugins[0].parameters.") and error in message, message


def test_the_local_tokenizer_map_configures_the_producer_added_for_the_scorer(tmp_path: Path) -> None:
    tokenizer = write_builtin_tokenizer(tmp_path / "sim-model")  # tokenizer.json + its chat template
    pool = {"local": {"modelTokenizerMap": {"sim-model": str(tokenizer)}}, "hf": {"enabled": True}, "workersCount": 8}
    loaded = load({"indexerConfig": {"tokenizersPoolConfig": pool}})
    producer = {p.name: p for p in loaded.config.plugins}["approx-prefix-cache-producer"]
    assert producer.parameters["tokenizers"] == {"sim-model": str(tmp_path / "sim-model")}
    notes = "\n".join(loaded.notes)
    assert 'it gives the "approx-prefix-cache-producer" added for it its tokenizers' in notes
    assert "tokenizersPoolConfig: workersCount accepted, not used" in notes
    # A producer configured in the file would not get them: refused rather than lost.
    plugin = {"type": "precise-prefix-cache-scorer", "parameters": {"indexerConfig": {"tokenizersPoolConfig": pool}}}
    document = {
        "apiVersion": "llm-d.ai/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [{"type": "approx-prefix-cache-producer"}, plugin],
    }
    with pytest.raises(ConfigError) as error:
        build(parse_text(yaml.safe_dump(document)))
    assert error.value.errors == [
        'plugins[1] "precise-prefix-cache-scorer": its tokenizers would configure the producer added for it, '
        "and one is configured: give them to that one"
    ]
