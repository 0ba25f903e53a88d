"""Binaries built from published Go modules, cached in the binary cache (`~/.cache/picker/bin`).

The peers the tests and the bench run beside the picker ship as Go modules on the Go module
proxy: the reference EPP (`sigs.k8s.io/gateway-api-inference-extension`) and llm-d's scheduler
and routing sidecar (`github.com/llm-d/llm-d-inference-scheduler`). `GoModule.binary()` fetches
the module and builds one of its commands the first time, as `<name>-<version>`, at the lowest
priority; `build_env` turns cgo on for commands that link C libraries (llm-d's `cmd/epp`).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from picker_bench.kube_cluster import BIN_DIR


class GoModuleUnavailableError(RuntimeError):
    """Go is missing, or fetching or building a module failed (the message has Go's output)."""


def _go() -> str:
    go = os.environ.get("GO") or shutil.which("go") or "/usr/local/go/bin/go"
    if not os.access(go, os.X_OK):
        raise GoModuleUnavailableError("Go is needed to fetch and build Go modules and is not installed")
    return go


def run_niced(argv: Sequence[str], cwd: Path, env: Mapping[str, str], what: str) -> None:
    """Run one build step at the lowest priority; GoModuleUnavailableError with its output if it fails."""
    result = subprocess.run(
        list(argv),
        cwd=cwd,
        env=dict(env),
        capture_output=True,
        text=True,
        check=False,
        timeout=3600,
        preexec_fn=functools.partial(os.nice, 19),
    )
    if result.returncode != 0:
        raise GoModuleUnavailableError(f"{what} in {cwd} failed:\n{result.stdout}{result.stderr}")


@functools.cache
def _module_dir(module_at_version: str) -> Path:
    with tempfile.TemporaryDirectory() as outside_any_module:
        result = subprocess.run(
            [_go(), "mod", "download", "-json", module_at_version],
            cwd=outside_any_module,
            env={**os.environ, "GOFLAGS": ""},
            capture_output=True,
            text=True,
            check=False,
            timeout=600,
        )
    if result.returncode != 0:
        raise GoModuleUnavailableError(f"go mod download {module_at_version} failed:\n{result.stdout}{result.stderr}")
    return Path(json.loads(result.stdout)["Dir"])


@dataclass(frozen=True, slots=True)
class GoModule:
    """A Go module at a release, e.g. `GoModule("github.com/llm-d/llm-d-inference-scheduler", "v0.4.0")`."""

    path: str
    version: str

    def source_dir(self) -> Path:
        """The module's read-only directory in the Go module cache (fetched the first time)."""
        return _module_dir(f"{self.path}@{self.version}")

    def binary(self, package: str, name: str, build_env: Mapping[str, str] | None = None) -> Path:
        """The command `package` (e.g. `./cmd/epp`) as `<name>-<version>` in the binary cache,
        built the first time (a few minutes of CPU on 2 cores, at the lowest priority), with cgo
        off unless `build_env` says otherwise (e.g. `CGO_ENABLED=1` and `CGO_LDFLAGS`)."""
        binary = BIN_DIR / f"{name}-{self.version}"
        if os.access(binary, os.X_OK):
            return binary
        source = self.source_dir()
        BIN_DIR.mkdir(parents=True, exist_ok=True)
        partial = binary.with_name(f"{binary.name}.{os.getpid()}.tmp")  # concurrent builds each rename their own
        # GOWORK=off: a module's go.work may name folders its zip lacks. CGO_ENABLED=0 as the
        # Dockerfiles of the reference and of llm-d's sidecar build their commands.
        env = {**os.environ, "GOFLAGS": "", "GOWORK": "off", "CGO_ENABLED": "0", **(build_env or {})}
        build = ["build", "-trimpath", "-ldflags", "-s -w", "-o", str(partial), package]
        try:
            for args in (["mod", "download"], build):
                run_niced([_go(), *args], source, env, f"go {' '.join(args)}")
        except GoModuleUnavailableError:
            partial.unlink(missing_ok=True)
            raise
        partial.replace(binary)
        return binary


def print_built(build: Callable[[], Path], program: str) -> int:
    """A `python -m` entry point's body: build (or find) a binary with `build`, print its path;
    on failure print why, prefixed with `program`, and return 1."""
    try:
        print(build())
    except GoModuleUnavailableError as e:
        print(f"{program}: {e}", file=sys.stderr)
        return 1
    return 0
