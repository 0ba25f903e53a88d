"""The `picker` command: serve | sim | bench | demo | config."""

from __future__ import annotations

import importlib
import sys

# Each subcommand lives with the package it belongs to and exposes `main(argv) -> int`;
# imported lazily so `picker sim` does not pay for the server's imports and vice versa.
_SUBCOMMANDS = {
    "serve": ("picker.serve", "Run the ext_proc endpoint picker."),
    "sim": ("picker.sim.cli", "Run simulated vLLM-compatible model servers."),
    "bench": ("picker.bench.cli", "Compare routers side by side on simulated pods."),
    "demo": ("picker.bench.demo", "A two-minute comparison of round robin and the picker."),
    "config": ("picker.config.cli", "Validate or show an EndpointPickerConfig."),
}


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
    module = importlib.import_module(_SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
