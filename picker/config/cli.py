"""`picker config validate FILE` and `picker config show [--config-file F | --config-text T]`."""

from __future__ import annotations

import argparse
import sys

from picker.config.loader import build, default_config, parse_file, parse_text, to_yaml
from picker.config.schema import ConfigError, EndpointPickerConfig


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="picker config", description="Validate or show an EndpointPickerConfig.")
    commands = parser.add_subparsers(dest="command", required=True)
    validate = commands.add_parser("validate", help="check a config file; prints 'valid' or the errors")
    validate.add_argument("file")
    show = commands.add_parser("show", help="print the effective config with every default filled in")
    source = show.add_mutually_exclusive_group()
    source.add_argument("--config-file", help="config file (default: the built-in default config)")
    source.add_argument("--config-text", help="config as inline YAML")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        config: EndpointPickerConfig
        if args.command == "validate":
            config = parse_file(args.file)
        elif args.config_file:
            config = parse_file(args.config_file)
        elif args.config_text:
            config = parse_text(args.config_text)
        else:
            config = default_config()
        loaded = build(config)
    except ConfigError as error:
        for message in error.errors:
            print(message, file=sys.stderr)
        return 1
    if args.command == "validate":
        print("valid")
    else:
        sys.stdout.write(to_yaml(loaded.config))
    return 0
