"""`picker bench`'s P/D systems on a `--pd 1:1` fleet: real `picker sim` pods, Envoy and llm-d's
pd-sidecar in front of the decode pod, with the picker and a P/D config (picker:pd) or llm-d's
scheduler with its own P/D config (llmd-pd, over a real kube-apiserver)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from picker.config.builtin_configs import BUILTIN_DIR
from picker_bench import workloads
from picker_bench.loadgen import LoadOptions, run_load
from picker_bench.systems import (
    FleetOptions,
    FleetPod,
    Gateway,
    Launcher,
    parse_systems,
    start_fleet,
    start_system,
)
from picker_bench.workloads import Prompt
from tests.sim_fixtures import pod_metrics

# Documents far above the config's 8192-character threshold, chat prompts far below it.
SPEC = workloads.PdMixSpec(
    long_share=0.5,
    document_len=2500,
    long_output_len=12,
    applications=1,
    system_prompt_len=48,
    question_len=16,
    output_len=6,
)


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    started = Launcher(tmp_path / "logs", tmp_path / "pids")
    started.log_dir.mkdir()
    try:
        yield started
    finally:
        started.stop()


def prompt_tokens_by_source(pod: FleetPod) -> dict[str, float]:
    """The pod's vLLM `prompt_tokens_by_source` counter, by source (`tests.sim_fixtures.pod_metrics`)."""

    async def read() -> dict[str, float]:
        async with aiohttp.ClientSession() as http:
            return await pod_metrics(http, pod.address)

    prefix = "vllm:prompt_tokens_by_source_total{"
    return {name[len(prefix) : -1]: value for name, value in asyncio.run(read()).items() if name.startswith(prefix)}


def start_pd_fleet(launcher: Launcher, tag: str) -> tuple[FleetOptions, FleetPod, FleetPod]:
    """A cold `--pd 1:1` fleet: its options, its prefill pod and its decode pod."""
    fleet = FleetOptions(pods=2, prefill_pods=1, profile="tiny", num_gpu_blocks=2048, max_model_len=8192)
    _, (prefill, decode) = start_fleet(fleet, launcher, tag)
    assert (prefill.role, decode.role) == ("prefill", "decode")
    return fleet, prefill, decode


def play_pd_mix(gateway: Gateway, fleet: FleetOptions, prefill: FleetPod, decode: FleetPod) -> list[Prompt]:
    """Play the pd-mix sessions through `gateway`; check that every request was answered in full by
    the decode pod, that exactly the documents were prefilled on the prefill pod, and that their
    KV blocks reached the decode pod; return the documents."""
    sessions = workloads.pd_mix(SPEC, rate=8, duration_s=2, seed=1)
    prompts = list(workloads.all_prompts(sessions))
    documents = [p for p in prompts if p.max_tokens == SPEC.long_output_len]
    assert documents and len(documents) < len(prompts)

    results = asyncio.run(run_load(sessions, LoadOptions(gateway.url, fleet.model, drain_timeout_s=20)))

    assert [r.error for r in results] == [None] * len(prompts)
    assert {r.pod for r in results} == {decode.name}  # every answer decoded on the decode pod
    assert sorted(r.output_tokens for r in results) == sorted(p.max_tokens for p in prompts)
    # The prefill pod computed exactly the documents (each new to it), none of the chat prompts:
    # they are below the threshold and were prefilled where they decoded.
    at_prefill = prompt_tokens_by_source(prefill)
    assert at_prefill.get("local_compute") == sum(len(p.token_ids()) for p in documents)
    # The decode pod received the documents' full blocks instead of computing them.
    at_decode = prompt_tokens_by_source(decode)
    full_blocks = sum(len(p.token_ids()) // fleet.block_size * fleet.block_size for p in documents)
    assert at_decode.get("external_kv_transfer") == full_blocks
    # ... and saw every prompt: computed, found cached, or received.
    assert sum(at_decode.values()) == sum(len(p.token_ids()) for p in prompts)
    return documents


def test_pd_picker_system_has_long_prompts_prefilled_on_the_prefill_pod(
    launcher: Launcher, sidecar_binary: Path
) -> None:
    fleet, prefill, decode = start_pd_fleet(launcher, "pd")
    (spec,) = parse_systems(["picker:pd"], {"pd": BUILTIN_DIR / "picker-pd.yaml"}, pd_sidecar=sidecar_binary)
    play_pd_mix(start_system(spec, [prefill, decode], launcher, "pd"), fleet, prefill, decode)


@pytest.mark.timeout(3600)  # a fresh machine builds llm-d's scheduler first (llmd_binary)
def test_llmd_pd_system_has_llm_d_prefill_long_prompts_on_the_prefill_pod(
    launcher: Launcher, sidecar_binary: Path, llmd_binary: Path
) -> None:
    """llm-d's scheduler with its P/D sample config (picker-pd.yaml's threshold), its Pods at
    addresses of their own with their roles' labels, the sidecar in front of the decode pod."""
    fleet, prefill, decode = start_pd_fleet(launcher, "llmd-pd")
    (spec,) = parse_systems(["llmd-pd"], {}, llmd_epp=llmd_binary, pd_sidecar=sidecar_binary)
    gateway = start_system(spec, [prefill, decode], launcher, "llmd-pd", fleet=fleet)

    documents = play_pd_mix(gateway, fleet, prefill, decode)

    # llm-d itself decided so: one prefill-decode decision per document, decode-only for the rest.
    page = gateway.metrics_page()
    assert page is not None
    decisions = {
        sample.labels["decision_type"]: sample.value
        for family in text_string_to_metric_families(page)
        for sample in family.samples
        if sample.name == "llm_d_inference_scheduler_pd_decision_total"
    }
    assert decisions.get("prefill-decode") == len(documents)
    assert decisions.get("decode-only", 0) > 0
