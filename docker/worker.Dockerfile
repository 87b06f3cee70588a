# syntax=docker/dockerfile:1.7
# The kvtopo worker image (ghcr.io/kvtopo/worker): the emulated engine `kvtopo-worker` (a torch
# KV cache, the authenticated control API on port 8975, the NIXL push data path) that
# examples/ and drills run in place of an inference engine. In production the worker library
# runs inside the engine's own image instead. Build from the repository root:
#
#   docker build -f docker/worker.Dockerfile -t ghcr.io/kvtopo/worker:0.1.0 .
#
# CPU torch by default (a small image; the emulated KV cache lives in host memory). For a
# CUDA KV cache (--device cuda) build with --build-arg TORCH_INDEX_URL=https://pypi.org/simple
# (torch's CUDA wheels, several GB). nixl's wheels bundle UCX.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/kvtopo
ENV PATH=/opt/kvtopo/bin:$PATH
# torch first, from the chosen index, so the [worker] extra finds it satisfied.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch>=2.2"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/ operator/
COPY worker/ worker/
COPY bench/ bench/
COPY kvtopo/ kvtopo/
RUN pip install ".[worker]" \
 && python -c "import kvtopo_worker.emulated, nixl"

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kvtopo-worker" \
      org.opencontainers.image.description="kvtopo emulated engine: worker control API and NIXL push data path" \
      org.opencontainers.image.source="https://github.com/kvtopo/kvtopo" \
      org.opencontainers.image.licenses="Apache-2.0"
# nixl's UCX plugins link OpenMP's runtime, which the slim base image lacks.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/kvtopo /opt/kvtopo
ENV PATH=/opt/kvtopo/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp
USER 65532:65532
WORKDIR /tmp
# The control API (the KVTopology's controlPort; name the container port kvtopo-control).
EXPOSE 8975
ENTRYPOINT ["kvtopo-worker"]
CMD ["--help"]
