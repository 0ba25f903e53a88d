"""llm-d's scheduler (`llmd-epp-v0.4.0`, `llmd.llmd_epp_binary()`) as a bench system.

It is a GIE v1.2.0 runner, so it runs as the reference EPP does (`ReferenceEpp`: a throwaway
control plane, an InferencePool, Pods Ready at the fleet's addresses), plus what it needs more:

- the InferenceObjective CRD (it exits without it; `manifests/crds` has it) and
  `--kv-cache-usage-percentage-metric vllm:kv_cache_usage_perc` (its default names vLLM's old
  `vllm:gpu_cache_usage_perc`, which the sim does not serve);
- approximate (`llmd`): its sample config `deploy/config/epp-config.yaml` (prefix-cache-scorer),
  or the file given;
- precise (`llmd-precise`): its `deploy/config/epp-precise-prefix-cache-config.yaml` with what a
  deployment fills in: `tokenProcessorConfig.blockSize` set to the fleet's block size (the sample
  says 64; it "must match vLLM block size", and the fleet's is 16, vLLM's default), `hashSeed` kept
  (42; the fleet is started with that `--hash-seed`), the ZMQ subscriber bound on a free port
  (its default `tcp://*:5557` would clash between runs) that every sim pod connects to
  (`--kv-events-endpoint`), and a local tokenizer. Its scores are keyed by Pod IP and events by
  the topic's IP (`kv@<ip>@<model>`), so the fleet needs one address per pod (`--distinct-hosts`);
- prefill/decode (`llmd-pd`): its `deploy/config/pd-epp-config.yaml` (prefill-filter /
  decode-filter on the `llm-d.ai/role` label, prefix-cache-scorer, pd-profile-handler,
  prefill-header-handler) with the threshold of picker's `picker-pd.yaml` (8192 characters)
  instead of the sample's 0 (every request disaggregated), so both decide alike which prompts
  go to a prefill pod; `picker_bench.systems.start_llmd_pd_pool` lays out its pods.

The local tokenizer (`write_builtin_tokenizer`) is a Hugging Face `tokenizer.json` that gives the
simulator's built-in tokenizer's ids for the bench's words and chat markup (a WordLevel model
over the bench's vocabulary, split as the built-in splits), plus a `tokenizer_config.json` with
the built-in chat template: llm-d tokenizes the prompts as the engines do, so its
`sha256_cbor` block keys are the engines'. llm-d loads the chat template through its embedded
Python (`transformers.AutoTokenizer.from_pretrained(<model name>)`): it runs with its working
directory holding `<model>/`, the module's `render_jinja_template_wrapper.py` and this
interpreter's site-packages (transformers, picker's `tokenizers` extra) on `PYTHONPATH`, and
`add_generation_prompt` as the request says (unset: false, where vLLM's default is true), so
its last partial block differs from the engine's and is not hashed anyway.
"""

from __future__ import annotations

import json
import site
from pathlib import Path
from typing import Any

import yaml

from picker.config.builtin_configs import BUILTIN_DIR
from picker.disaggregation.handlers import PdProfileHandler
from picker.prefix.builtin_tokenizer import encode
from picker_bench.gobuild import GoModule
from picker_bench.llmd import LLMD
from picker_bench.workloads import VOCAB

APPROXIMATE_CONFIG = "epp-config.yaml"
PD_CONFIG = "pd-epp-config.yaml"
PICKER_PD_CONFIG = BUILTIN_DIR / "picker-pd.yaml"
PRECISE_CONFIG = "epp-precise-prefix-cache-config.yaml"
KV_CACHE_USAGE_METRIC = "vllm:kv_cache_usage_perc"
# The built-in chat template (`builtin_tokenizer.render_chat`) in Jinja, as transformers renders it.
BUILTIN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CHAT_PIECES = ("<", "|", ">", "system", "user", "assistant")
UNKNOWN = "[UNK]"  # id 0: the built-in tokenizer never produces ids below 256
# The kv-cache manager llm-d's scheduler v0.4.0 builds on: its chat-template wrapper is Python.
KV_CACHE_MANAGER = GoModule("github.com/llm-d/llm-d-kv-cache-manager", "v0.4.0")


def llmd_config(name: str) -> Path:
    """One of llm-d's reference configs (`deploy/config/NAME` in its module)."""
    return LLMD.source_dir() / "deploy" / "config" / name


def llmd_flags() -> list[str]:
    """The flags llm-d's EPP needs beside the reference's."""
    return ["--kv-cache-usage-percentage-metric", KV_CACHE_USAGE_METRIC]


def llmd_env() -> dict[str, str]:
    """Its embedded Python's path: llm-d's chat-template wrapper, then this interpreter's packages;
    offline, as the machine is."""
    wrapper = KV_CACHE_MANAGER.source_dir() / "pkg" / "preprocessing" / "chat_completions"
    paths = [str(wrapper), *site.getsitepackages()]
    return {"PYTHONPATH": ":".join(paths), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def write_builtin_tokenizer(directory: Path) -> Path:
    """A Hugging Face tokenizer directory that tokenizes the bench's prompts as the simulator's
    built-in tokenizer does (see the module docstring); returns its `tokenizer.json`."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {UNKNOWN: 0} | {piece: encode(piece)[0] for piece in (*CHAT_PIECES, *VOCAB)}
    tokenizer: dict[str, Any] = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        # The built-in split: words (\w+) and single punctuation characters, whitespace dropped.
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "WhitespaceSplit"},
                {"type": "Split", "pattern": {"Regex": r"\w+|[^\w\s]"}, "behavior": "Isolated", "invert": False},
            ],
        },
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": UNKNOWN},
    }
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": UNKNOWN,
        "chat_template": BUILTIN_CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory / "tokenizer.json"


def precise_config(block_size: int, zmq_endpoint: str, model: str) -> dict[str, Any]:
    """llm-d's precise-prefix-cache sample config with what the fleet needs filled in (see the
    module docstring), for a process whose working directory holds `<model>/`
    (`write_builtin_tokenizer`); its `hashSeed` stays the sample's (`precise_hash_seed`)."""
    config: dict[str, Any] = yaml.safe_load(llmd_config(PRECISE_CONFIG).read_text())
    (scorer,) = [p for p in config["plugins"] if p["type"] == "precise-prefix-cache-scorer"]
    parameters = scorer.setdefault("parameters", {})
    indexer = parameters.setdefault("indexerConfig", {})
    indexer.setdefault("tokenProcessorConfig", {})["blockSize"] = block_size
    # The local provider encodes (llm-d's tokenizers library reads the file); the chat template
    # comes from the HF provider, whose Python loads `<model>` as a directory. The local one asks
    # its Python for the template of the file's path: relative, that loads as a bare tokenizer
    # (no template: its render fails at once, and llm-d falls back to the next provider), where
    # an absolute path fails anew every request in huggingface_hub's repo-id check (~70 ms).
    indexer["tokenizersPoolConfig"] = {
        "local": {"modelTokenizerMap": {model: f"{model}/tokenizer.json"}},
        "hf": {"enabled": True, "tokenizersCacheDir": "hf-cache"},
    }
    parameters["kvEventsConfig"] = {"zmqEndpoint": zmq_endpoint, "topicFilter": "kv@"}
    return config


def pd_handler_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """The parameters of the config's pd-profile-handler (set in place: created if absent)."""
    (handler,) = [p for p in config["plugins"] if p["type"] == PdProfileHandler.plugin_type]
    parameters: dict[str, Any] = handler.setdefault("parameters", {})
    return parameters


def pd_config() -> dict[str, Any]:
    """llm-d's P/D sample config with the P/D threshold of picker's `picker-pd.yaml` (see the
    module docstring)."""
    picker: dict[str, Any] = yaml.safe_load(PICKER_PD_CONFIG.read_text())
    config: dict[str, Any] = yaml.safe_load(llmd_config(PD_CONFIG).read_text())
    pd_handler_parameters(config)["threshold"] = pd_handler_parameters(picker)["threshold"]
    return config


def precise_hash_seed() -> str:
    """The `hashSeed` of llm-d's precise sample config: the seed the fleet's engines must use."""
    config: dict[str, Any] = yaml.safe_load(llmd_config(PRECISE_CONFIG).read_text())
    (scorer,) = [p for p in config["plugins"] if p["type"] == "precise-prefix-cache-scorer"]
    return str(scorer["parameters"]["indexerConfig"]["tokenProcessorConfig"]["hashSeed"])
