# syntax=docker/dockerfile:1.7
# The kvtopo operator image (ghcr.io/kvtopo/operator): kopf + the kubernetes client, no torch,
# no nixl. Build from the repository root (the build context):
#
#   docker build -f docker/operator.Dockerfile -t ghcr.io/kvtopo/operator:0.1.0 .
#
# operator.Dockerfile.dockerignore (next to this file) keeps the context to what pip needs.
# Runs as uid/gid 65532 (non-root) and writes nothing but /tmp, so the chart's
# readOnlyRootFilesystem, runAsNonRoot and dropped capabilities hold.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/kvtopo
ENV PATH=/opt/kvtopo/bin:$PATH
WORKDIR /src
# Every folder pyproject's package-dir maps must be present for the build.
COPY pyproject.toml README.md ./
COPY operator/ operator/
COPY worker/ worker/
COPY bench/ bench/
COPY kvtopo/ kvtopo/
# The base install only: the operator imports the worker's wire protocol, never torch or nixl.
RUN pip install . \
 && python -c "import kvtopo_operator.main, kvtopo_worker.protocol" \
 && ! python -c "import torch" 2>/dev/null

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kvtopo-operator" \
      org.opencontainers.image.description="kvtopo operator: keeps prefill/decode KV-cache transfer topologies connected" \
      org.opencontainers.image.source="https://github.com/kvtopo/kvtopo" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/kvtopo /opt/kvtopo
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
