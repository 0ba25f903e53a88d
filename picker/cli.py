"""The `picker` command: serve | sim | bench | demo | config."""

from __future__ import annotations

import importlib
import sys

# Each subcommand lives with the package it belongs to and exposes `main(argv) -> int`;
# imported lazily so `picker sim` does not pay for the server's imports and vice versa.
_SUBCOMMANDS = {
    "serve": ("picker.serve", "Run the ext_proc endpoint picker."),
    "sim": ("picker_sim.cli", "Run simulated vLLM-compatible model servers."),
    "bench": ("picker_bench.cli", "Compare routers side by side on simulated pods."),
    "demo": ("picker_bench.demo", "A two-minute comparison of round robin and the picker."),
    "config": ("picker.config.cli", "Validate or show an EndpointPickerConfig."),
    "bbr": ("picker.bbr.command", "Body-based routing: the body's model as a routing header (the reference bbr)."),
}
# The distributions of this repository that are not the product (never in its wheel or image):
# import package → the pip arguments that install it from the checkout (the bench needs the sim).
_RIG_DISTRIBUTIONS = {"picker_sim": "-e ./sim", "picker_bench": "-e ./sim -e ./bench"}


def _usage() -> str:
    lines = ["usage: picker COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in _SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in _SUBCOMMANDS:
        print(f"picker: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(_SUBCOMMANDS[name][0])
    except ModuleNotFoundError as error:
        missing = (error.name or "").partition(".")[0]
        if missing not in _RIG_DISTRIBUTIONS:
            raise
        print(
            f"picker {name}: {missing} is not installed; from the checkout: "
            f"pip install {_RIG_DISTRIBUTIONS[missing]} (make install does)",
            file=sys.stderr,
        )
        return 2
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
