"""What the bench gives llm-d's scheduler: a tokenizer that matches the engines', the pool's
addresses, and the system names and flags it takes."""

from __future__ import annotations

from pathlib import Path

import pytest

from picker.prefix.builtin_tokenizer import encode, render_chat
from picker_bench.llmd_epp import pd_config, write_builtin_tokenizer
from picker_bench.systems import FleetOptions, FleetPod, SystemSpec, parse_systems, pool_addresses, system_fleet
from picker_bench.workloads import SharedPrefixSpec, shared_prefix


def test_the_written_tokenizer_gives_the_simulators_token_ids(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    write_builtin_tokenizer(tmp_path / "sim-model")
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "sim-model"))
    (session,) = shared_prefix(SharedPrefixSpec(groups=2, system_prompt_len=64, question_len=8), 1, 1.5, seed=3)[:1]
    messages = [{"role": role, "content": content} for role, content in session.turns[0].messages]
    for generation_prompt in (True, False):  # vLLM adds it; llm-d only when the request asks
        rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        assert rendered == render_chat(messages, add_generation_prompt=generation_prompt)
        assert hf.encode(rendered, add_special_tokens=False) == encode(rendered)
    assert len(encode(render_chat(messages))) == 64 + 8 + 3 * 5  # three role markers `< | role | >`


def pods(*addresses: str) -> list[FleetPod]:
    return [FleetPod(f"sim-{i}", address) for i, address in enumerate(addresses)]


def test_pool_addresses_one_ip_with_a_port_per_pod_or_an_ip_per_pod() -> None:
    assert pool_addresses(pods("127.0.0.1:8000", "127.0.0.1:8001")) == (["127.0.0.1"], [8000, 8001])
    assert pool_addresses(pods("127.0.0.1:9000", "127.0.0.2:9000")) == (["127.0.0.1", "127.0.0.2"], [9000])
    with pytest.raises(RuntimeError, match="an IP per pod at one port"):
        pool_addresses(pods("127.0.0.1:9000", "127.0.0.2:9001"))


def test_llmd_systems_need_its_binary_and_precise_gets_a_fleet_that_connects(tmp_path: Path) -> None:
    binary = tmp_path / "llmd-epp"
    with pytest.raises(ValueError, match="--llmd-epp"):
        parse_systems(["llmd-precise"], {})
    specs = parse_systems(["llmd", "llmd-precise", "reference-epp"], {}, binary, None, binary, tmp_path / "c.yaml", 4)
    assert [(s.kind, s.config_file, s.log_verbosity) for s in specs] == [
        ("llmd", tmp_path / "c.yaml", 4),
        ("llmd-precise", None, 4),
        ("reference-epp", None, 4),
    ]
    fleet = FleetOptions(pods=2, distinct_hosts=True)
    assert system_fleet(specs[0], fleet) == fleet
    precise = system_fleet(SystemSpec("llmd-precise", "llmd-precise", binary=binary), fleet)
    argv = precise.argv()
    assert argv[argv.index("--kv-events-endpoint") + 1].startswith("tcp://127.0.0.1:")
    assert "--kv-events-base-port" not in argv and "--distinct-hosts" in argv
    assert argv[argv.index("--hash-seed") + 1] == "42"  # llm-d's precise sample config's hashSeed


def test_llmd_pd_runs_llm_ds_pd_sample_config_at_picker_pds_threshold() -> None:
    config = pd_config()
    types = [plugin["type"] for plugin in config["plugins"]]
    assert {"prefill-filter", "decode-filter", "prefill-header-handler", "prefix-cache-scorer"} <= set(types)
    (handler,) = [plugin for plugin in config["plugins"] if plugin["type"] == "pd-profile-handler"]
    assert handler["parameters"] == {"threshold": 8192}  # picker-pd.yaml's; the sample has none (0)
    assert [profile["name"] for profile in config["schedulingProfiles"]] == ["prefill", "decode"]
