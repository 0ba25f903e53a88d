#!/usr/bin/env python3
"""Prints the requirements of pyproject.toml, one a line: the project's dependencies and those of
each extra asked for. The Dockerfile installs them in a layer of their own that depends on
pyproject.toml alone, so a change to picker's source rebuilds only the small layers after it.

    tools/pyproject-requirements.py PYPROJECT [EXTRAS]   (EXTRAS: comma-separated, may be empty)

Standard library only: it runs on the base image's Python before any venv exists."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def requirements(pyproject: dict[str, object], extras: str) -> list[str]:
    """The dependencies of `pyproject` (parsed) and of the comma-separated `extras`."""
    project = pyproject.get("project")
    if not isinstance(project, dict):
        raise ValueError("pyproject.toml has no [project] table")
    optional: dict[str, list[str]] = project.get("optional-dependencies", {})
    wanted = [extra.strip() for extra in extras.split(",") if extra.strip()]
    unknown = [extra for extra in wanted if extra not in optional]
    if unknown:
        raise ValueError(f"unknown extra {', '.join(unknown)}; pyproject.toml has {', '.join(sorted(optional))}")
    found: list[str] = list(project.get("dependencies", []))
    for extra in wanted:
        found += optional[extra]
    return found


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(f"usage: {argv[0]} PYPROJECT [EXTRAS]", file=sys.stderr)
        return 2
    try:
        found = requirements(tomllib.loads(Path(argv[1]).read_text()), argv[2] if len(argv) == 3 else "")
    except (OSError, tomllib.TOMLDecodeError, ValueError) as error:
        print(f"{argv[0]}: {error}", file=sys.stderr)
        return 1
    print("\n".join(found))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
