"""`picker serve` with static endpoints reaches SERVING without importing the heavy libraries that
only other setups need (Kubernetes discovery, Hugging Face tokenizers, tracing): their imports
would cost the start seconds on a busy node.

The check is on what the real process had imported once it served (its `sys.modules`, written
when it exits), not on how long it took: a time bound would be fragile on a shared machine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from picker_bench.process import ManagedProcess, free_port, port_open
from tests.stack import serving

# Top-level packages a static-endpoints picker never needs.
HEAVY = (
    "kubernetes",
    "transformers",
    "tokenizers",
    "jinja2",
    "opentelemetry",
    "matplotlib",
    "numpy",
    "torch",
    "cel_expr_python",  # request-attribute-reporter's CEL
    "smg_grpc_proto",  # vllmgrpc-parser's messages
    "zmq",  # the KV-events subscriber of precise-prefix-cache-scorer
)

# `python -m picker.cli ARGS` that writes its sys.modules to the file named by argv[1] at exit.
_RUN_RECORDING_MODULES = """
import atexit, json, runpy, sys
out = sys.argv.pop(1)
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(sys.modules))))
runpy.run_module("picker.cli", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plaintext"])
def test_static_endpoints_serve_without_heavy_imports(tmp_path: Path, tls: bool) -> None:
    grpc_port, health, metrics = free_port(), free_port(), free_port()
    modules_file = tmp_path / "modules.json"
    argv = [sys.executable, "-c", _RUN_RECORDING_MODULES, str(modules_file), "serve"]
    argv += ["--endpoints", "127.0.0.1:8000,127.0.0.1:8001", "--bind-address", "127.0.0.1"]
    argv += ["--grpc-port", str(grpc_port), "--grpc-health-port", str(health), "--metrics-port", str(metrics)]
    argv += [f"--secure-serving={str(tls).lower()}"]
    picker = ManagedProcess("picker", argv, tmp_path).start()
    try:
        picker.wait_ready(lambda: serving(health) and port_open("127.0.0.1", grpc_port), timeout=60)
    finally:
        picker.stop()
    modules = set(json.loads(modules_file.read_text()))
    assert {"picker.serve", "picker.extproc.server", "grpc"} <= modules  # the record is the server's
    assert sorted(m for m in modules if m.split(".")[0] in HEAVY) == []
