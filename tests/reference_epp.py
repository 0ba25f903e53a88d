"""The reference EPP v1.5.0's source tree (charts, docs, test data), used by tests as an oracle.

It is the Go module `sigs.k8s.io/gateway-api-inference-extension@v1.5.0`, found (or fetched
once) through the Go module cache, as tools/install-test-binaries.sh fetches Go modules.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

REFERENCE_MODULE = "sigs.k8s.io/gateway-api-inference-extension@v1.5.0"


class ReferenceUnavailableError(RuntimeError):
    pass


@functools.cache
def reference_dir() -> Path:
    """The module's read-only directory in the Go module cache."""
    go = os.environ.get("GO") or shutil.which("go") or "/usr/local/go/bin/go"
    if not os.access(go, os.X_OK):
        raise ReferenceUnavailableError(f"Go is needed to fetch {REFERENCE_MODULE} and is not installed")
    with tempfile.TemporaryDirectory() as outside_any_module:
        result = subprocess.run(
            [go, "mod", "download", "-json", REFERENCE_MODULE],
            cwd=outside_any_module,
            env={**os.environ, "GOFLAGS": ""},
            capture_output=True,
            text=True,
            check=False,
            timeout=600,
        )
    if result.returncode != 0:
        raise ReferenceUnavailableError(f"go mod download {REFERENCE_MODULE} failed:\n{result.stdout}{result.stderr}")
    return Path(json.loads(result.stdout)["Dir"])
