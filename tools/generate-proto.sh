#!/usr/bin/env bash
# Generates the Python code of picker's own protobuf schemas (proto/) into OUT (default: the
# repository root, so proto/picker/state/v1/state.proto becomes picker/state/v1/state_pb2.py and
# its .pyi). The generated files are committed; tests/unit/test_state_proto.py runs this into a
# temporary directory and fails when they differ.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-$root/.venv/bin/python}"
out="${1:-$root}"

cd "$root/proto"
"$PYTHON" -m grpc_tools.protoc -I. --python_out="$out" --pyi_out="$out" picker/state/v1/state.proto
