"""`picker bench` flags of the conversation workload and of session keys."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from picker_bench import cli, workloads
from picker_bench.runner import BenchPlan

SMALL = ["--workload", "conversation", "--bounds-only", "--duration", "5", "--rate", "4", "--system-prompt-len", "16"]


def plan(tmp_path: Path, *flags: str) -> BenchPlan:
    return cli.plan_from_args(cli.build_parser().parse_args([*SMALL, "--out", str(tmp_path), *flags]))


def test_flags_shape_the_conversation_workload(tmp_path: Path) -> None:
    flags = ("--applications", "2", "--max-turns", "3", "--one-off-share", "0", "--question-len", "9")
    result = plan(tmp_path, *flags, "--output-len", "7", "--think-scale", "0", "--turns-exponent", "0")
    settings = dict(result.settings)
    expected = dataclasses.replace(
        cli.DEFAULT_SPECS["conversation"],
        applications=2,
        max_turns=3,
        one_off_share=0.0,
        user_len=9,
        answer_len=7,
        think_scale=0.0,
        turns_exponent=0.0,
        system_prompt_len=16,
    )
    assert {k: settings[k] for k in dataclasses.asdict(expected)} == dataclasses.asdict(expected)
    assert settings["rate"] == 4 and settings["session_keys"] is True
    assert result.workload == "conversation" and result.fleet.num_gpu_blocks == cli.GENERATED_NUM_GPU_BLOCKS
    assert all(1 <= len(s.turns) <= 3 and s.think_s == (0.0,) * (len(s.turns) - 1) for s in result.sessions)
    assert len({s.turns[0].messages[0] for s in result.sessions}) <= 2
    assert all(p.session_key is not None for p in workloads.all_prompts(result.sessions))  # no one-offs


def test_no_max_tokens_leaves_answer_lengths_unannounced(tmp_path: Path) -> None:
    assert plan(tmp_path).announce_lengths is True
    bare = plan(tmp_path, "--no-max-tokens")
    assert bare.announce_lengths is False and dict(bare.settings)["max_tokens"] is False


def test_no_session_keys_sends_the_same_prompts_without_keys(tmp_path: Path) -> None:
    keyed = plan(tmp_path)
    bare = plan(tmp_path, "--no-session-keys")
    assert dict(bare.settings)["session_keys"] is False
    assert [s.start_s for s in bare.sessions] == [s.start_s for s in keyed.sessions]
    pairs = list(zip(workloads.all_prompts(keyed.sessions), workloads.all_prompts(bare.sessions), strict=True))
    assert any(k.session_key for k, _ in pairs)
    assert all(b == dataclasses.replace(k, session_key=None) for k, b in pairs)


@pytest.mark.parametrize(
    "flags,message",
    [(["--one-off-share", "1.5"], "one_off_share"), (["--max-turns", "0"], "--max-turns must be positive")],
)
def test_bad_conversation_flags_are_rejected(tmp_path: Path, capsys, flags: list[str], message: str) -> None:
    assert cli.main([*SMALL, "--out", str(tmp_path), *flags]) == 2
    assert message in capsys.readouterr().err


def test_bounds_only_reports_the_conversation_workload(tmp_path: Path, capsys) -> None:
    assert cli.main([*SMALL, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("conversation: ") and "infinite-cache bound" in out
