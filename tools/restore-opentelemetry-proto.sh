#!/bin/sh
# xds-protos (Envoy's API) ships its own, older copy of opentelemetry-proto's modules under the
# same paths, so whichever wheel pip unpacked last owns them; the OTLP exporter needs
# opentelemetry-proto's. Reinstall that package (its installed version, no dependencies) last.
# Usage: tools/restore-opentelemetry-proto.sh VENV_BIN
set -eu
bin="$1"
version=$("$bin/python" -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')
"$bin/pip" install --quiet --no-deps --force-reinstall "opentelemetry-proto==$version"
