# The picker image: `picker serve` as a non-root user, fit for a read-only root filesystem.
# `make image` builds it as ghcr.io/picker-inference/picker:<charts/picker appVersion>, the image
# the chart runs (docker or podman), with the tokenizer extra for token-exact prefix hashing;
# `--build-arg EXTRAS=` leaves that out (smaller, character-block prefix hashing).
# BASE_IMAGE: any Debian bookworm image whose `python` is Python 3.11 with venv and pip (where
# Docker Hub is out of reach, tools/build-base-image.sh makes one from Debian's packages).
# Layer order: the dependencies install in a stage that depends on pyproject.toml alone, picker
# itself is built as a wheel after it, so a change to picker's source reuses the slow layers.
# The ext_proc core (native/extproc, Rust) builds in a stage of its own that depends on its
# source alone; the final stage installs its wheel and picker's in one pip call.
ARG BASE_IMAGE=python:3.11-slim-bookworm

# The ext_proc core's wheel, from source, with the toolchain tools/install-rust.sh pins (gcc
# is its linker).
FROM ${BASE_IMAGE} AS core
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/root/.cargo/bin:$PATH
COPY tools/install-rust.sh /tmp/
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && /tmp/install-rust.sh \
 && python -m venv /opt/build
WORKDIR /src/native/extproc
# The crates download in a layer that changes only with the lock file.
COPY native/extproc/Cargo.toml native/extproc/Cargo.lock ./
RUN mkdir src && touch src/lib.rs && cargo fetch --locked && rm -r src
COPY native/extproc ./
RUN /opt/build/bin/pip wheel --no-deps --wheel-dir /wheels .

# The venv with picker's dependencies only (PyPI downloads: the slow part of the build).
FROM ${BASE_IMAGE} AS deps
ARG EXTRAS=tokenizers
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml ./
COPY tools/pyproject-requirements.py tools/restore-opentelemetry-proto.sh ./tools/
RUN python tools/pyproject-requirements.py pyproject.toml "$EXTRAS" > requirements.txt \
 && python -m venv /opt/picker \
 && /opt/picker/bin/pip install -r requirements.txt \
 && tools/restore-opentelemetry-proto.sh /opt/picker/bin \
 && /opt/picker/bin/python -m compileall -q /opt/picker

# picker as a wheel, without its dependencies: the product's source alone (the simulator, sim/,
# and the bench, bench/, are distributions of their own that .dockerignore leaves out).
FROM deps AS wheel
COPY README.md ./
COPY picker ./picker
RUN /opt/picker/bin/pip wheel --no-deps --wheel-dir /wheels .

FROM ${BASE_IMAGE}
COPY --from=deps /opt/picker /opt/picker
# Copied, not mounted: podman 4.3 mounts a cached stage empty (podman#16281). The wheels
# (picker's under 1 MB, the core's about 2 MB) stay in that layer. pip check fails the build
# when the dependencies installed differ from those picker asks for.
COPY --from=wheel /wheels /tmp/wheels
COPY --from=core /wheels /tmp/wheels
RUN PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    /opt/picker/bin/pip install --no-deps --no-index /tmp/wheels/*.whl \
 && /opt/picker/bin/pip check \
 && rm -r /tmp/wheels
# The picker version (make image passes the chart's appVersion, which is pyproject's version).
ARG VERSION
LABEL org.opencontainers.image.title=picker \
      org.opencontainers.image.version=$VERSION
# The root filesystem is read-only in the chart: no .pyc writes, caches under /tmp (an emptyDir).
ENV PATH=/opt/picker/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/tmp/hf \
    HOME=/tmp
USER 65532:65532
EXPOSE 9002 9003 9090
ENTRYPOINT ["picker"]
CMD ["serve", "--help"]
