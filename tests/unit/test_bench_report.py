"""Bench numbers and outputs: percentiles, summaries, histogram reading, results.json, plots, CLI errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from picker.config.builtin_configs import BUILTIN_DIR
from picker_bench import cli, demo, report
from picker_bench.attribution import Attribution
from picker_bench.loadgen import RequestResult
from picker_bench.stats import histogram_decision_time, percentile, summarize
from picker_bench.systems import parse_systems


def result(
    due: float,
    ttft: float | None,
    pod: str | None,
    error: str | None = None,
    prompt: int = 100,
    cached: int = 50,
    output: int = 10,
) -> RequestResult:
    return RequestResult(
        0, 0, due, ttft, None if error else ttft * 2 if ttft else None, prompt, cached, output, pod, error
    )


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile(list(range(101)), 90) == pytest.approx(90)


def test_summarize_counts_hits_errors_and_spread() -> None:
    results = [
        result(0.0, 0.1, "sim-0"),
        result(0.5, 0.2, "sim-0"),
        result(1.0, 0.3, "sim-1"),
        result(1.5, None, None, error="HTTP 503: no healthy upstream"),
    ]
    s = summarize(results, num_pods=2)
    assert (s.requests, s.errors) == (3, 1)
    assert s.hit_ratio == pytest.approx(0.5)
    assert s.ttft_p50_s == pytest.approx(0.2)
    assert s.pods == {"sim-0": {"requests": 2, "prompt_tokens": 200}, "sim-1": {"requests": 1, "prompt_tokens": 100}}
    assert s.hotspot == pytest.approx(2 * 2 / 3)
    assert s.error_kinds == {"HTTP 503": 1}
    # 30 output tokens between the first due time (0) and the last finish (1.0 + 0.6).
    assert s.output_tokens_per_s == pytest.approx(30 / 1.6)


METRICS = """# HELP inference_extension_scheduler_e2e_duration_seconds x
# TYPE inference_extension_scheduler_e2e_duration_seconds histogram
inference_extension_scheduler_e2e_duration_seconds_bucket{le="0.0001"} 10.0
inference_extension_scheduler_e2e_duration_seconds_bucket{le="0.0002"} 90.0
inference_extension_scheduler_e2e_duration_seconds_bucket{le="0.0005"} 99.0
inference_extension_scheduler_e2e_duration_seconds_bucket{le="0.001"} 100.0
inference_extension_scheduler_e2e_duration_seconds_bucket{le="+Inf"} 100.0
inference_extension_scheduler_e2e_duration_seconds_sum 0.015
inference_extension_scheduler_e2e_duration_seconds_count 100.0
other_metric 5
"""


def test_decision_time_from_histogram() -> None:
    d = histogram_decision_time(METRICS, "inference_extension_scheduler_e2e_duration_seconds")
    assert d is not None
    assert (d.count, d.p50_s, d.p99_s) == (100, 0.0002, 0.0005)
    assert d.mean_s == pytest.approx(0.00015)
    assert histogram_decision_time("other_metric 1\n", "inference_extension_scheduler_e2e_duration_seconds") is None


def test_results_json_report_and_plots(tmp_path: Path) -> None:
    bench = report.BenchReport("shared-prefix", 0.8, {"pods": 2}, fleet_bound_hit_ratio=0.75, lru_bound_hit_ratio=0.625)
    where = Attribution(
        requests=2,
        prompt_tokens=200,
        tokens={
            "hit": 100,
            "model_only": 0,
            "other_pod": 60,
            "evicted_chosen": 10,
            "evicted_everywhere": 0,
            "never_seen": 30,
        },
        model_hit_tokens=96,
        model_exact=0.5,
        other_pod_requests=1,
        holder_busier=1.0,
        in_flight_gap_p50=3,
    )
    bench.systems["round-robin"] = dataclasses.replace(
        summarize([result(0.0, 0.1, "sim-0"), result(0.1, 0.4, "sim-1")], 2), attribution=where
    )
    bench.systems["picker"] = summarize([result(0.0, 0.05, "sim-0", cached=90), result(0.1, 0.06, "sim-0")], 2)
    bench.failures["vllm-router-cache-aware"] = "exited early"
    plots = report.write(bench, tmp_path)
    data = json.loads((tmp_path / "results.json").read_text())
    assert (data["bound_hit_ratio"], data["fleet_bound_hit_ratio"], data["lru_bound_hit_ratio"]) == (0.8, 0.75, 0.625)
    assert data["systems"]["round-robin"]["attribution"]["tokens"]["other_pod"] == 60
    assert data["systems"]["picker"]["attribution"] is None
    keys = {
        "ttft_p50_s",
        "ttft_p90_s",
        "ttft_p99_s",
        "e2e_p50_s",
        "output_tokens_per_s",
        "hit_ratio",
        "requests",
        "errors",
    }
    assert keys <= set(data["systems"]["picker"]) and data["systems"]["picker"]["hit_ratio"] == pytest.approx(0.7)
    assert data["failures"] == {"vllm-router-cache-aware": "exited early"}
    for name in plots.values():
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(plots) == set(report.PLOTS)
    md = (tmp_path / "report.md").read_text()
    assert "| picker |" in md and "80.0%" in md and "ttft_cdf.png" in md
    assert "LRU fleet: **62.5%**" in md and "### round-robin" in md and "### picker" not in md
    assert "| on another pod | 60 | 30.0% |" in md and "in 100.0% of them (median difference +3)" in md
    table = report.terminal_table(bench)
    assert "round-robin" in table and "failed: exited early" in table and "LRU fleet" in table
    (line,) = report.attribution_lines(bench)
    assert line.startswith(
        "round-robin: 50.0% hit (model 48.0%, exact on 50% of requests); missed: 30.0% on another pod"
    )


def test_parse_systems() -> None:
    specs = parse_systems(
        ["round-robin", "picker:approx", "sglang-cache-aware", "external:http://10.0.0.1:80/"],
        {"approx": Path("/x.yaml")},
    )
    assert [s.kind for s in specs] == ["round-robin", "picker", "sglang-cache-aware", "external"]
    assert specs[1].config_file == Path("/x.yaml") and specs[3].url == "http://10.0.0.1:80"
    assert (specs[1].replicas, specs[1].shared_state) == (1, False)
    replicated = parse_systems(["picker@3", "picker:approx@3+store", "picker:approx@2"], {"approx": Path("/x.yaml")})
    assert [(s.name, s.config_file, s.replicas, s.shared_state) for s in replicated] == [
        ("picker@3", None, 3, False),
        ("picker:approx@3+store", Path("/x.yaml"), 3, True),
        ("picker:approx@2", Path("/x.yaml"), 2, False),
    ]
    (reference,) = parse_systems(["reference-epp"], {}, Path("/bin/epp"), Path("/ref.yaml"))
    assert (reference.kind, reference.binary, reference.config_file) == (
        "reference-epp",
        Path("/bin/epp"),
        Path("/ref.yaml"),
    )
    for bad, message in [
        (["nginx"], "unknown system"),
        (["picker:nolabel"], "no --picker-config"),
        (["external:ftp://x"], "need a URL"),
        (["round-robin:3"], "take an argument"),
        (["round-robin", "round-robin"], "named twice"),
        (["round-robin@3"], "only picker systems"),
        (["picker@0"], "replicas must be 1 to 16"),
        (["picker:nolabel@3+store"], "no --picker-config"),
        (["reference-epp"], "no --reference-epp PATH"),
        (["reference-epp:x"], "take an argument"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_systems(bad, {})


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--systems", "bogus", "--workload", "shared-prefix"], "unknown system"),
        (["--systems", "round-robin", "--workload", "/no/such/trace.jsonl"], "not a trace file"),
        (["--systems", "round-robin", "--workload", "shared-prefix", "--pods", "0"], "--pods"),
        (["--systems", "round-robin", "--workload", "shared-prefix", "--rate", "-1"], "--rate"),
        (["--systems", "round-robin", "--workload", "shared-prefix", "--groups", "0"], "--groups"),
        (["--systems", "round-robin", "--workload", "multi-turn", "--duration", "0"], "--duration"),
        (["--systems", "picker:a", "--workload", "shared-prefix", "--picker-config", "a=/no/file"], "no such file"),
        (["--systems", "picker:a", "--workload", "shared-prefix", "--picker-config", "a=nope.yaml"], "nor a built-in"),
        (["--workload", "shared-prefix"], "--systems is required"),
        (["--systems", "reference-epp", "--workload", "shared-prefix"], "no --reference-epp PATH"),
        (
            ["--systems", "reference-epp", "--workload", "shared-prefix", "--reference-epp", "/no/epp"],
            "not an executable",
        ),
        (
            [
                "--systems",
                "reference-epp",
                "--workload",
                "shared-prefix",
                "--reference-epp",
                "/bin/true",
                "--pods",
                "9",
            ],
            "--pods 9: the reference-epp system takes at most 8 pods",
        ),
        (
            ["--systems", "reference-epp", "--workload", "shared-prefix", "--reference-epp", "/bin/true"]
            + ["--reference-config", "/no/file"],
            "--reference-config /no/file: no such file",
        ),
    ],
)
def test_cli_rejects_bad_input_without_a_traceback(argv: list[str], message: str, capsys, tmp_path: Path) -> None:
    assert cli.main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "pids").exists()  # nothing was started


def test_bounds_only_prints_what_no_router_can_beat_and_starts_nothing(capsys, tmp_path: Path) -> None:
    argv = [
        "--bounds-only",
        "--workload",
        "shared-prefix",
        "--groups",
        "4",
        "--duration",
        "5",
        "--pods",
        "2",
        "--num-gpu-blocks",
        "64",
        "--out",
        str(tmp_path),
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "infinite-cache bound" in out and "fleet-cache bound" in out and "TTFT floor p50/p90/p99" in out
    assert "LRU fleet" in out
    assert not list(tmp_path.iterdir())  # nothing was started or written


def test_demo_runs_a_valid_plan_and_summarizes_it(tmp_path: Path) -> None:
    plan = cli.plan_from_args(cli.build_parser().parse_args(demo.demo_argv(tmp_path, 40)))
    assert [s.name for s in plan.systems] == ["round-robin", "picker"]
    assert plan.fleet.pods == 4 and plan.workload == "shared-prefix"
    text = demo.summary(
        {
            "bound_hit_ratio": 0.9,
            "systems": {
                "round-robin": {"hit_ratio": 0.35, "ttft_p50_s": 0.4, "ttft_p99_s": 1.2},
                "picker": {"hit_ratio": 0.85, "ttft_p50_s": 0.05, "ttft_p99_s": 0.3},
            },
        }
    )
    assert "picker 85.0%, round robin 35.0% (infinite-cache bound 90.0%)" in text
    assert "TTFT p50: picker 50 ms, round robin 400 ms" in text


def test_picker_configs_take_built_in_names_as_picker_serve_does() -> None:
    assert cli.parse_picker_configs(["best=picker-best.yaml"]) == {"best": BUILTIN_DIR / "picker-best.yaml"}
