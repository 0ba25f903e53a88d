#!/usr/bin/env bash
# Installs the Rust toolchain that builds the ext_proc core (native/extproc) with rustup, into
# $CARGO_HOME (default ~/.cargo). Debian bookworm's own rustc (1.63) is older than the core's
# crates (pyo3, tonic) need. `make install` runs it when no cargo is found; the Dockerfile's
# core stage too. Python fetches rustup-init: curl may be missing where Python is not.
set -euo pipefail
RUST_VERSION=1.95.0
python="${PYTHON:-python3}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$python" -c 'import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])' \
  "https://static.rust-lang.org/rustup/dist/$(uname -m)-unknown-linux-gnu/rustup-init" "$tmp/rustup-init"
chmod +x "$tmp/rustup-init"
# clippy and rustfmt: `make check` runs them on the core.
"$tmp/rustup-init" -y --no-modify-path --profile minimal --default-toolchain "$RUST_VERSION" \
  --component clippy,rustfmt
