"""llm-d's form of `precise-prefix-cache-scorer`'s parameters, in the picker's terms.

llm-d (v0.4.0, with its kv-cache manager v0.4.0) configures the scorer with `indexerConfig` (the
indexer: how requests are tokenized and hashed, where block keys are kept, how device tiers
weigh) and `kvEventsConfig` (the ZMQ subscriber). `translate` turns them into the picker's flat
parameters of the same meaning, refuses what the picker cannot mean the same way, and says in
notes what it accepts without acting on.

- `tokenProcessorConfig.blockSize` (16) is `blockSizeTokens`; `hashSeed` ("") is `hashSeed`, and
  llm-d keys blocks by vLLM's `sha256_cbor` hashes: `prefixCachingHashAlgo: sha256_cbor`.
- `kvCacheBackendConfigs` (`[{name, weight}]`) is `tierWeights`; a tier it does not list weighs
  1, as in llm-d.
- `kvEventsConfig.zmqEndpoint` ("tcp://*:5557") is `kvEventsBindAddress`: the picker binds it and
  the engines connect to it, as to llm-d's; `topicFilter` is `topicFilter`; `concurrency` is
  accepted (the picker applies each engine's events in order).
- Accepted, with a note: `prefixStoreConfig` (llm-d's cache of tokenized prompts; the picker's is
  the prefix producer's `tokenCacheTokens`), `kvBlockIndexConfig.inMemoryConfig` (the picker
  bounds its index per endpoint, `capacityPerEndpoint`), `enableMetrics` and
  `metricsLoggingInterval` (the picker's index metrics are always on its /metrics).
- `tokenizersPoolConfig.local.modelTokenizerMap` (model: a `tokenizer.json`) configures the
  prefix producer the loader adds for the scorer (`tokenizers`: model: the file's directory):
  the picker tokenizes each request once, there. `hf` (Hugging Face downloads, on by default in
  llm-d), `workersCount` and `minPrefixOverlapRatio` are accepted, not used (noted).
- Refused: the Redis, Valkey and cost-aware index backends, `uds` tokenizers and the local
  tokenizers' auto-discovery.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import PurePath
from typing import Any

from picker.framework.parameters import Parameters, PluginConfigError
from picker.kvevents.vllm_hash import SHA256_CBOR

LLMD_KEYS = ("indexerConfig", "kvEventsConfig")
LLMD_HASH_SEED = ""  # tokenProcessorConfig.hashSeed's default: llm-d's first parent is sha256(CBOR(""))
LLMD_BIND_ADDRESS = "tcp://*:5557"  # kvEventsConfig.zmqEndpoint's default

LLMD_TOKENIZER_NOTE = (
    "llm-d tokenizes requests with the model's Hugging Face tokenizer (by default); the picker matches "
    "token blocks for the models with a local tokenizer only (tokenizersPoolConfig.local.modelTokenizerMap, "
    "or approx-prefix-cache-producer's `tokenizers`)"
)


@dataclass(frozen=True, slots=True)
class Translated:
    """The scorer's parameters in the picker's form, the notes on what was accepted without
    effect, and the parameters for the prefix producer the loader adds (`tokenizers`)."""

    parameters: dict[str, Any]
    notes: tuple[str, ...] = ()
    producer_parameters: dict[str, Any] = field(default_factory=dict)


def translate(raw: Mapping[str, Any]) -> Translated:
    """`raw` with llm-d's `indexerConfig` and `kvEventsConfig` replaced by the picker's
    parameters of the same meaning; `raw` itself when it has neither. A parameter given both
    ways is an error; with the llm-d form,
    `prefixCachingHashAlgo`, `hashSeed` and, unless `kvEventsPort` is given,
    `kvEventsBindAddress` default to llm-d's (`sha256_cbor`, "", "tcp://*:5557")."""
    if not any(key in raw for key in LLMD_KEYS):
        return Translated(dict(raw))
    given: dict[str, Any] = {}
    producer: dict[str, Any] = {}
    notes = [LLMD_TOKENIZER_NOTE]
    outer = Parameters({key: raw[key] for key in LLMD_KEYS if key in raw})
    indexer = outer.mapping("indexerConfig")
    events = outer.mapping("kvEventsConfig")
    _within("indexerConfig", lambda: _indexer(indexer, given, producer, notes))
    _within("kvEventsConfig", lambda: _events(events, given))
    for key in given:
        if key in raw:
            raise PluginConfigError(f"{key}: give either it or llm-d's {_SOURCES[key]}, not both")
    defaults: dict[str, Any] = {"prefixCachingHashAlgo": SHA256_CBOR, "hashSeed": LLMD_HASH_SEED}
    if "kvEventsPort" not in raw:  # the picker's own way to the publishers, else llm-d's
        defaults["kvEventsBindAddress"] = LLMD_BIND_ADDRESS
    rest = {key: value for key, value in raw.items() if key not in LLMD_KEYS}
    return Translated({**defaults, **rest, **given}, tuple(notes), producer)


# The picker's parameter → the llm-d field that gives it.
_SOURCES = {
    "blockSizeTokens": "indexerConfig.tokenProcessorConfig.blockSize",
    "hashSeed": "indexerConfig.tokenProcessorConfig.hashSeed",
    "tierWeights": "indexerConfig.kvCacheBackendConfigs",
    "topicFilter": "kvEventsConfig.topicFilter",
    "kvEventsBindAddress": "kvEventsConfig.zmqEndpoint",
}


def _indexer(raw: Mapping[str, Any], given: dict[str, Any], producer: dict[str, Any], notes: list[str]) -> None:
    p = Parameters(raw)
    processor, store, index = (
        p.mapping(key) for key in ("tokenProcessorConfig", "prefixStoreConfig", "kvBlockIndexConfig")
    )
    _within("tokenProcessorConfig", lambda: _token_processor(processor, given))
    place, reason = "indexerConfig.prefixStoreConfig", "the picker caches tokenized prompts in the prefix producer"
    _within("prefixStoreConfig", lambda: _unused_sizes(store, ("cacheSize", "blockSize"), place, reason, notes))
    _within("kvBlockIndexConfig", lambda: _block_index(index, notes))
    backends = p.mappings("kvCacheBackendConfigs")
    if backends:
        given["tierWeights"] = {"gpu": 1.0, "cpu": 1.0} | _tier_weights(backends)
    pool = p.mapping("tokenizersPoolConfig")
    _within("tokenizersPoolConfig", lambda: _tokenizers_pool(pool, producer, notes))
    p.finish()


def _tokenizers_pool(raw: Mapping[str, Any], producer: dict[str, Any], notes: list[str]) -> None:
    p = Parameters(raw)
    if p.mapping("uds"):
        raise PluginConfigError("uds: the picker tokenizes in its own process: give local.modelTokenizerMap")
    local, hf = p.mapping("local"), p.mapping("hf")
    _within("local", lambda: _local_tokenizers(local, producer))
    _within("hf", lambda: _hf_tokenizers(hf))
    p.integer("workersCount", 1, at_least=1)
    p.number("minPrefixOverlapRatio", 0.0, at_least=0, at_most=1)
    p.finish()
    reason = "the picker tokenizes each request once, off the event loop, reusing tokenized prefixes"
    _note_unused(raw, ("workersCount", "minPrefixOverlapRatio"), "indexerConfig.tokenizersPoolConfig", reason, notes)


def _local_tokenizers(raw: Mapping[str, Any], producer: dict[str, Any]) -> None:
    """`modelTokenizerMap` (model: a tokenizer.json file) as the producer's `tokenizers` (model:
    the directory holding it, whose tokenizer_config.json gives the chat template)."""
    p = Parameters(raw)
    for key in ("autoDiscoveryDir", "autoDiscoveryTokenizerFileName"):
        if p.deprecated(key) is not None:
            raise PluginConfigError(
                f"{key}: the picker loads the tokenizers it is given: list them in modelTokenizerMap"
            )
    models = p.mapping("modelTokenizerMap")
    p.finish()
    tokenizers = {}
    for model, path in models.items():
        if not isinstance(path, str) or PurePath(path).name != "tokenizer.json":
            raise PluginConfigError(f"modelTokenizerMap.{model}: must be the path of a tokenizer.json, got {path!r}")
        tokenizers[str(model)] = str(PurePath(path).parent)
    if tokenizers:
        producer["tokenizers"] = tokenizers


def _hf_tokenizers(raw: Mapping[str, Any]) -> None:
    """Hugging Face downloads (on by default in llm-d): accepted; the picker loads local
    tokenizers only (`LLMD_TOKENIZER_NOTE`)."""
    p = Parameters(raw)
    p.boolean("enabled", True)
    p.string("huggingFaceToken", "")
    p.string("tokenizersCacheDir", "")
    p.finish()


def _token_processor(raw: Mapping[str, Any], given: dict[str, Any]) -> None:
    p = Parameters(raw)
    if "blockSize" in raw:
        given["blockSizeTokens"] = p.integer("blockSize", 16, at_least=1)
    if "hashSeed" in raw:
        given["hashSeed"] = p.string("hashSeed", LLMD_HASH_SEED)
    p.finish()


def _unused_sizes(raw: Mapping[str, Any], names: tuple[str, ...], place: str, reason: str, notes: list[str]) -> None:
    """A section of positive integers that the picker accepts and does not use (noted, with why)."""
    p = Parameters(raw)
    for name in names:
        p.integer(name, 1, at_least=1)
    p.finish()
    if raw:
        notes.append(f"{place}: accepted, not used: {reason}")


def _block_index(raw: Mapping[str, Any], notes: list[str]) -> None:
    p = Parameters(raw)
    for backend in ("redisConfig", "valkeyConfig", "costAwareMemoryConfig"):
        if p.mapping(backend):
            raise PluginConfigError(
                f"{backend}: the picker's precise index is in memory, bounded per endpoint "
                "(capacityPerEndpoint); pickers share what they learn with --state-store"
            )
    memory = p.mapping("inMemoryConfig")
    place, reason = "indexerConfig.kvBlockIndexConfig.inMemoryConfig", "the picker bounds its index per endpoint"
    _within("inMemoryConfig", lambda: _unused_sizes(memory, ("size", "podCacheSize"), place, reason, notes))
    p.boolean("enableMetrics", False)
    p.integer("metricsLoggingInterval", 0, at_least=0)  # nanoseconds, as Go's time.Duration in JSON
    p.finish()
    reason = "the picker's precise-index metrics are always on its /metrics"
    _note_unused(raw, ("enableMetrics", "metricsLoggingInterval"), "indexerConfig.kvBlockIndexConfig", reason, notes)


def _note_unused(raw: Mapping[str, Any], keys: tuple[str, ...], place: str, reason: str, notes: list[str]) -> None:
    """Note the fields of `keys` given in `raw`, accepted without effect, and why."""
    given = [key for key in keys if key in raw]
    if given:
        notes.append(f"{place}: {' and '.join(given)} accepted, not used: {reason}")


def _events(raw: Mapping[str, Any], given: dict[str, Any]) -> None:
    p = Parameters(raw)
    if "zmqEndpoint" in raw:
        given["kvEventsBindAddress"] = p.string("zmqEndpoint", LLMD_BIND_ADDRESS)
    if "topicFilter" in raw:
        given["topicFilter"] = p.string("topicFilter", "kv@")
    p.integer("concurrency", 4, at_least=1)
    p.finish()


def _tier_weights(backends: tuple[Mapping[str, Any], ...]) -> dict[str, float]:
    weights: dict[str, float] = {}
    for i, backend in enumerate(backends):
        _within(f"kvCacheBackendConfigs[{i}]", partial(_tier, backend, weights))
    return weights


def _tier(raw: Mapping[str, Any], weights: dict[str, float]) -> None:
    p = Parameters(raw)
    weights[p.string("name", "")] = p.number("weight", 0.0)
    p.finish()


def _within(place: str, read: Callable[[], object]) -> None:
    """`read()`, naming `place` in front of its error."""
    try:
        read()
    except PluginConfigError as error:
        raise PluginConfigError(f"{place}.{error}") from None
