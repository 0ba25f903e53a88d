"""`picker demo`: a two-minute shared-prefix comparison of Envoy round robin and Envoy + picker.

Four simulated Llama-3-8B/H100 pods, each with a KV cache that holds about half of the 32 shared
system prompts: round robin makes every pod cache every prompt (and evict them in turn), while a
prefix-aware picker can give each pod its own share. The load keeps round-robin pods busy enough
that recomputing prefixes shows up as queueing in the time to first token.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from picker_bench import cli

DEMO_ARGS = [
    "--systems",
    "round-robin,picker",
    "--workload",
    "shared-prefix",
    "--pods",
    "4",
    "--profile",
    "llama3-8b-h100",
    "--num-gpu-blocks",
    "2048",
    "--max-num-seqs",
    "16",
    "--groups",
    "32",
    "--system-prompt-len",
    "2048",
    "--question-len",
    "128",
    "--output-len",
    "32",
    "--rate",
    "28",
    "--drain-timeout",
    "30",
]


def demo_argv(out: Path, duration: float) -> list[str]:
    """The `picker bench` arguments the demo runs."""
    return [*DEMO_ARGS, "--duration", f"{duration:g}", "--out", str(out)]


def summary(results: dict[str, Any]) -> str:
    """One paragraph: the picker's hit ratio and TTFT beside round robin's."""
    rr, picker = results["systems"]["round-robin"], results["systems"]["picker"]
    lines = [
        (
            f"prefix hit ratio: picker {picker['hit_ratio']:.1%}, round robin {rr['hit_ratio']:.1%} "
            f"(infinite-cache bound {results['bound_hit_ratio']:.1%})"
        ),
    ]
    for key, label in (("ttft_p50_s", "TTFT p50"), ("ttft_p99_s", "TTFT p99")):
        if picker[key] and rr[key]:
            lines.append(
                f"{label}: picker {picker[key] * 1000:.0f} ms, round robin {rr[key] * 1000:.0f} ms "
                f"(round robin / picker = {rr[key] / picker[key]:.1f}x)"
            )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Entry point of `picker demo` (what `make demo` runs)."""
    p = argparse.ArgumentParser(prog="picker demo", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("demo-out"), help="output directory (default demo-out)")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of load per system (default 40)")
    args = p.parse_args(argv)
    bench_argv = demo_argv(args.out, args.duration)
    print("picker demo: picker bench " + " ".join(bench_argv), flush=True)
    code = cli.main(bench_argv)
    if code == 0:
        print("\n" + summary(json.loads((args.out / "results.json").read_text())))
        print(f"Open {args.out / 'report.md'} for the full report and the plots beside it.")
    else:
        print("picker demo: the comparison did not complete; logs are in " + str(args.out / "logs"), file=sys.stderr)
    return code
