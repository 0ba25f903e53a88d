"""`picker bench` on prefill/decode fleets: the pd-mix workload, `--pd`, `--pd-sidecar`, which
systems route disaggregated, and TPOT."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from picker.config.builtin_configs import BUILTIN_DIR
from picker_bench import cli, workloads
from picker_bench.loadgen import RequestResult
from picker_bench.runner import BenchPlan
from picker_bench.stats import summarize, time_per_output_token
from picker_bench.systems import FleetOptions, declares_pd, parse_systems

PD_CONFIG = BUILTIN_DIR / "picker-pd.yaml"
BEST_CONFIG = BUILTIN_DIR / "picker-best.yaml"
SMALL = ["--workload", "pd-mix", "--bounds-only", "--duration", "10", "--rate", "5", "--document-len", "300"]


def plan(tmp_path: Path, *flags: str) -> BenchPlan:
    return cli.plan_from_args(cli.build_parser().parse_args([*SMALL, "--out", str(tmp_path), *flags]))


def fake_sidecar(tmp_path: Path) -> Path:
    binary = tmp_path / "pd-sidecar"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    return binary


def test_pd_mix_mixes_fresh_long_documents_with_short_chat_on_shared_system_prompts(tmp_path: Path) -> None:
    result = plan(tmp_path, "--long-share", "0.3", "--applications", "2", "--long-output-len", "40")
    prompts = list(workloads.all_prompts(result.sessions))
    long = [p for p in prompts if p.max_tokens == 40]
    chat = [p for p in prompts if p.max_tokens == cli.DEFAULT_SPECS["pd-mix"].output_len]
    assert len(long) + len(chat) == len(prompts) and long and chat
    assert 0.15 < len(long) / len(prompts) < 0.45  # about 0.3 of 50 arrivals
    assert all(len(p.token_ids()) > 300 for p in long)
    assert len({p.messages[0] for p in long}) == len(long)  # no document twice: no hit skips a prefill
    assert len({p.messages[0] for p in chat}) <= 2 and all(p.messages[0][0] == "system" for p in chat)
    spec = dataclasses.replace(
        cli.DEFAULT_SPECS["pd-mix"], long_share=0.3, applications=2, long_output_len=40, document_len=300
    )
    settings = dict(result.settings)
    assert {k: settings[k] for k in dataclasses.asdict(spec)} == dataclasses.asdict(spec)
    assert settings["rate"] == 5


def test_pd_mix_default_documents_fill_one_engine_step_of_the_default_profile() -> None:
    # The point of the workload (PdMixSpec): one long prefill is one long stall of a decoding pod.
    spec = cli.DEFAULT_SPECS["pd-mix"]
    assert isinstance(spec, workloads.PdMixSpec)
    assert spec.system_prompt_len + spec.question_len < 2000 < spec.document_len <= 8192
    assert spec.long_output_len > spec.output_len


def test_pd_fleet_shape_and_sidecar_flags(tmp_path: Path) -> None:
    sidecar = fake_sidecar(tmp_path)
    flags = ["--systems", "picker,picker:pd", "--picker-config", f"pd={PD_CONFIG}", "--picker-config", str(BEST_CONFIG)]
    result = plan(tmp_path, "--pd", "1:3", "--pd-sidecar", str(sidecar), *flags)
    assert (result.fleet.pods, result.fleet.prefill_pods) == (4, 1)
    assert result.fleet.argv()[-2:] == ["--pd", "1:3"]
    aggregated, disaggregated = result.systems
    assert (aggregated.disaggregated, aggregated.pd_sidecar) == (False, None)
    assert (disaggregated.disaggregated, disaggregated.pd_sidecar) == (True, sidecar.resolve())
    assert plan(tmp_path, "--pd", "2:2", "--pods", "4").fleet.prefill_pods == 2
    assert "--pd" not in FleetOptions(pods=3).argv()
    assert plan(tmp_path).fleet.pods == cli.DEFAULT_PODS


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--pd", "3"], "must be P:D"),
        (["--pd", "0:2"], "at least one prefill and one decode pod"),
        (["--pd", "1:x"], "must be P:D"),
        (["--pd", "1:3", "--pods", "5"], "disagrees with --pd 1:3"),
        (["--pd-sidecar", "/nonexistent/pd-sidecar"], "not an executable file"),
        (["--long-share", "1.5"], "long_share must be between 0 and 1"),
        (["--pd", "1:1", "--systems", "picker:pd", "--picker-config", f"pd={PD_CONFIG}"], "give --pd-sidecar PATH"),
    ],
)
def test_bad_pd_flags_are_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert cli.main([*SMALL, "--out", str(tmp_path), *flags]) == 2
    assert message in capsys.readouterr().err


def test_llmd_pd_needs_the_sidecar_and_a_pd_fleet_on_one_address(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    binary = fake_sidecar(tmp_path)  # stands for both binaries: only checked to be executable
    base = [*SMALL, "--out", str(tmp_path), "--systems", "llmd-pd", "--llmd-epp", str(binary)]
    for flags, message in (
        (["--pd", "1:1"], "no --pd-sidecar"),
        (["--pd-sidecar", str(binary)], "it needs a --pd P:D fleet"),
        (["--pd", "1:1", "--pd-sidecar", str(binary), "--distinct-hosts"], "without --distinct-hosts"),
    ):
        assert cli.main([*base, *flags]) == 2
        assert message in capsys.readouterr().err, flags
    (system,) = parse_systems(["llmd-pd"], {}, llmd_epp=binary, pd_sidecar=binary)
    assert (system.kind, system.binary, system.disaggregated, system.pd_sidecar) == ("llmd-pd", binary, True, binary)


def test_a_pd_config_without_a_pd_fleet_needs_no_sidecar(tmp_path: Path) -> None:
    # On an aggregated fleet the prefill profile finds no pod: every request goes decode-only.
    (system,) = plan(tmp_path, "--systems", "picker:pd", "--picker-config", f"pd={PD_CONFIG}").systems
    assert system.disaggregated and system.pd_sidecar is None


def test_declares_pd_reads_the_plugin_types(tmp_path: Path) -> None:
    assert declares_pd(PD_CONFIG) and declares_pd(PD_CONFIG.with_name("picker-pd-predicted.yaml"))
    assert not declares_pd(BEST_CONFIG)
    for text in ("plugins: [", "- a list", "plugins: {type: pd-profile-handler}", "plugins: [pd-profile-handler]"):
        (tmp_path / "c.yaml").write_text(text)
        assert not declares_pd(tmp_path / "c.yaml"), text
    assert not declares_pd(tmp_path / "missing.yaml")


def result(ttft: float | None, e2e: float | None, output: int, error: str | None = None) -> RequestResult:
    return RequestResult(0, 0, 0.0, ttft, e2e, 10, 0, output, "sim-0", error)


def test_tpot_is_the_time_per_token_after_the_first() -> None:
    assert time_per_output_token(result(0.1, 1.1, 101)) == pytest.approx(0.01)
    assert time_per_output_token(result(0.1, 0.2, 1)) is None  # one token: no gap to measure
    assert time_per_output_token(result(None, None, 0, "HTTP 500")) is None
    summary = summarize([result(0.1, 1.1, 101), result(0.1, 2.1, 101), result(0.1, 0.1, 1)], 1)
    assert summary.tpot_p50_s == pytest.approx(0.015) and summary.tpot_p90_s == pytest.approx(0.019)
    assert summarize([], 1).tpot_p90_s is None
