# syntax=docker/dockerfile:1.7
# The kvtopo worker image (ghcr.io/kvtopo/worker): the emulated engine `kvtopo-worker` (a torch
# KV cache, the authenticated control API on port 8975, the NIXL push data path) that
# examples/ and drills run in place of an inference engine. In production the worker library
# runs inside the engine's own image instead. Build from the repository root:
#
#   docker build -f docker/worker.Dockerfile -t ghcr.io/kvtopo/worker:0.1.0 .
#
# `make images` builds it with buildah on a Debian base of its own (docker/README.md).
# The [worker] extra exactly as uv.lock pins it: PyPI's torch (the CUDA build; on a machine
# without a GPU the emulated KV cache lives in host memory, --device cpu) and nixl, whose
# wheels bundle UCX.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.13.9

FROM ${UV_IMAGE} AS uv

FROM ${PYTHON_IMAGE} AS deps
COPY --from=uv /uv /usr/local/bin/uv
# A CA bundle for builds behind a TLS-intercepting proxy (mount it, pass its path).
ARG SSL_CERT_FILE
ENV UV_PROJECT_ENVIRONMENT=/opt/kvtopo \
    UV_PYTHON=python3.11 \
    UV_PYTHON_DOWNLOADS=never \
    UV_LINK_MODE=copy \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# The locked dependencies first (several GB): this layer changes only with uv.lock.
COPY pyproject.toml uv.lock ./
RUN uv sync --frozen --extra worker --no-install-project

# The project on top: its own files are all that change from one commit to the next.
FROM deps AS build
ARG SSL_CERT_FILE
COPY README.md ./
COPY operator/ operator/
COPY worker/ worker/
COPY bench/ bench/
COPY kvtopo/ kvtopo/
RUN uv sync --frozen --extra worker --no-editable \
 && /opt/kvtopo/bin/python -c "import kvtopo_worker.emulated, nixl" \
 && mkdir /project && cd /opt/kvtopo \
 && cp -a --parents lib/python3.11/site-packages/kvtopo* bin/kvtopo* /project/

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kvtopo-worker" \
      org.opencontainers.image.description="kvtopo emulated engine: worker control API and NIXL push data path" \
      org.opencontainers.image.source="https://github.com/kvtopo/kvtopo" \
      org.opencontainers.image.licenses="Apache-2.0"
# nixl's UCX plugins link OpenMP's runtime, which the slim base image lacks.
RUN if ! ldconfig -p | grep -q 'libgomp\.so\.1'; then \
      apt-get update \
      && apt-get install -y --no-install-recommends libgomp1 \
      && rm -rf /var/lib/apt/lists/*; \
    fi
# Two layers: the locked dependencies (the same digest until uv.lock changes, so a node that
# has them pulls only the second) and the project's own packages, dist-info and scripts.
COPY --from=deps /opt/kvtopo /opt/kvtopo
COPY --from=build /project/ /opt/kvtopo/
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
