"""`picker config validate FILE` and `picker config show [--config-file F | --config-text T | --live URL]`.

`show` prints the effective config as YAML, the loader's notes first as comments (so the output
still loads), then what every profile implies without naming it (the default narrowing filter);
`--live` asks a running picker's metrics port (`GET /config`) for the config in force, with where
it came from, its hash and when it was loaded. FILE may name a built-in config
(`picker-best.yaml`): picker/config/builtin_configs.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

import yaml

from picker.config.builtin_configs import resolve_config_path
from picker.config.loader import build, default_config, parse_file, parse_text, to_yaml
from picker.config.runtime import narrows_by_default
from picker.config.schema import ConfigError, EndpointPickerConfig
from picker.plugins import NARROWING_FILTER_TYPE, default_narrowing_filter

LIVE_TIMEOUT_SECONDS = 5.0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="picker config", description="Validate or show an EndpointPickerConfig.")
    commands = parser.add_subparsers(dest="command", required=True)
    validate = commands.add_parser("validate", help="check a config file; prints 'valid' or the errors")
    validate.add_argument("file", help="a config file, or a built-in config's name (picker-best.yaml, ...)")
    show = commands.add_parser("show", help="print the effective config with every default filled in")
    source = show.add_mutually_exclusive_group()
    source.add_argument(
        "--config-file",
        help="config file, or a built-in config's name such as picker-best.yaml (default: the reference default)",
    )
    source.add_argument("--config-text", help="config as inline YAML")
    source.add_argument(
        "--live",
        metavar="URL",
        help="the config in force in a running picker: its metrics port (http://HOST:9090) or its /config URL",
    )
    show.add_argument(
        "--token",
        default=os.environ.get("PICKER_TOKEN"),
        help="with --live: a bearer token for a picker with --metrics-endpoint-auth (default: $PICKER_TOKEN)",
    )
    return parser


def _comments(lines: Sequence[str]) -> str:
    return "".join(f"# {line}\n" for line in lines)


def _show_live(url: str, token: str | None) -> int:
    if not url.rstrip("/").endswith("/config"):
        url = url.rstrip("/") + "/config"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=LIVE_TIMEOUT_SECONDS) as response:
            live: dict[str, Any] = json.loads(response.read())
        header = [
            f"live config of {url}",
            f"source: {live['origin']}",
            f"sha256: {live['sha256']}",
            f"loaded at: {live['loadedAt']}",
            *(f"note: {note}" for note in live["notes"]),
        ]
        config = yaml.safe_dump(live["config"], sort_keys=False)
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError) as error:
        print(f"cannot read the live config from {url}: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    sys.stdout.write(_comments(header) + config)
    return 0


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.command == "show" and args.live:
        return _show_live(args.live, args.token)
    try:
        config: EndpointPickerConfig
        if args.command == "validate":
            config = parse_file(resolve_config_path(args.file))
        elif args.config_file:
            config = parse_file(resolve_config_path(args.config_file))
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
        sys.stdout.write(_comments([f"note: {n}" for n in loaded.notes]))
        print("valid")
    else:
        implied = [
            f'schedulingProfiles "{profile.name}" ends with a "{NARROWING_FILTER_TYPE}" at its defaults '
            f"(it narrows above {default_narrowing_filter().max_candidates} candidates; name one in the "
            "profile to tune it, maxCandidates: 0 never narrows)"
            for profile in loaded.config.scheduling_profiles
            if narrows_by_default(profile.plugins, loaded.plugins)
        ]
        notes = [f"note: {n}" for n in loaded.notes] + [f"implied: {line}" for line in implied]
        sys.stdout.write(_comments(notes) + to_yaml(loaded.config))
    return 0
