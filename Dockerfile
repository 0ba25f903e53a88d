# The picker image: `picker serve` as a non-root user, fit for a read-only root filesystem.
# `make image` builds it as ghcr.io/picker-inference/picker:<charts/picker appVersion>, the image
# the chart runs (docker or podman), with the tokenizer extra for token-exact prefix hashing;
# `--build-arg EXTRAS=` leaves that out (smaller, character-block prefix hashing).
# BASE_IMAGE: any Debian bookworm image whose `python` is Python 3.11 with venv and pip (where
# Docker Hub is out of reach, tools/build-base-image.sh makes one from Debian's packages).
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE} AS build
ARG EXTRAS=tokenizers
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY picker ./picker
COPY tools/restore-opentelemetry-proto.sh ./tools/
RUN python -m venv /opt/picker \
 && /opt/picker/bin/pip install ".${EXTRAS:+[$EXTRAS]}" \
 && tools/restore-opentelemetry-proto.sh /opt/picker/bin \
 && /opt/picker/bin/python -m compileall -q /opt/picker

FROM ${BASE_IMAGE}
# The picker version (make image passes the chart's appVersion, which is pyproject's version).
ARG VERSION
LABEL org.opencontainers.image.title=picker \
      org.opencontainers.image.version=$VERSION
COPY --from=build /opt/picker /opt/picker
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
