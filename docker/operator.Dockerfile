# syntax=docker/dockerfile:1.7
# The kvtopo operator image (ghcr.io/kvtopo/operator): kopf + the kubernetes client, no torch,
# no nixl, installed exactly as uv.lock pins them. Build from the repository root (the build
# context):
#
#   docker build -f docker/operator.Dockerfile -t ghcr.io/kvtopo/operator:0.1.0 .
#
# `make images` builds it with buildah on a Debian base of its own (docker/README.md).
# operator.Dockerfile.dockerignore (next to this file) keeps the context to what uv needs.
# Runs as uid/gid 65532 (non-root) and writes nothing but /tmp, so the chart's
# readOnlyRootFilesystem, runAsNonRoot and dropped capabilities hold.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.13.9

FROM ${UV_IMAGE} AS uv

FROM ${PYTHON_IMAGE} AS deps
COPY --from=uv /uv /usr/local/bin/uv
# A CA bundle for builds behind a TLS-intercepting proxy (mount it, pass its path).
ARG SSL_CERT_FILE
# The venv in /opt/kvtopo, on the image's own python 3.11; wheels copied out of uv's cache.
ENV UV_PROJECT_ENVIRONMENT=/opt/kvtopo \
    UV_PYTHON=python3.11 \
    UV_PYTHON_DOWNLOADS=never \
    UV_LINK_MODE=copy \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# The locked dependencies first: this layer changes only with uv.lock.
COPY pyproject.toml uv.lock ./
RUN uv sync --frozen --no-install-project
# Every folder pyproject's package-dir maps must be present for the build.

# The project on top: its own files are all that change from one commit to the next.
FROM deps AS build
ARG SSL_CERT_FILE
COPY README.md ./
COPY operator/ operator/
COPY worker/ worker/
COPY bench/ bench/
COPY kvtopo/ kvtopo/
# The base install only: the operator imports the worker's wire protocol, never torch or nixl.
RUN uv sync --frozen --no-editable \
 && /opt/kvtopo/bin/python -c "import kvtopo_operator.main, kvtopo_worker.protocol" \
 && ! /opt/kvtopo/bin/python -c "import torch" 2>/dev/null \
 && mkdir /project && cd /opt/kvtopo \
 && cp -a --parents lib/python3.11/site-packages/kvtopo* bin/kvtopo* /project/

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kvtopo-operator" \
      org.opencontainers.image.description="kvtopo operator: keeps prefill/decode KV-cache transfer topologies connected" \
      org.opencontainers.image.source="https://github.com/kvtopo/kvtopo" \
      org.opencontainers.image.licenses="Apache-2.0"
# Two layers: the locked dependencies (the same digest until uv.lock changes, so a node that
# has them pulls only the second) and the project's own packages, dist-info and scripts.
COPY --from=deps /opt/kvtopo /opt/kvtopo
COPY --from=build /project/ /opt/kvtopo/
ENV PATH=/opt/kvtopo/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp
# Numeric user and group (no /etc/passwd entry needed), so runAsNonRoot can verify them.
USER 65532:65532
WORKDIR /tmp
# 8080: /metrics (--metrics-port), 8081: kopf's /healthz (--liveness); the chart's defaults.
EXPOSE 8080 8081
ENTRYPOINT ["kvtopo-operator"]
CMD ["--help"]
