# kvtopo developer entry points. Everything heavy is cached under $(KVTOPO_CACHE):
#   venv/                 the Python environment (torch, nixl, kopf, dev tools)
#   bin/<product>-<ver>/  control-plane binaries built from Go modules (toolchain/build.sh)
SHELL := /bin/bash
KVTOPO_CACHE ?= $(HOME)/.cache/kvtopo
export KVTOPO_CACHE
VENV := $(KVTOPO_CACHE)/venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvtopo-installed
PYTEST_ARGS ?=

.PHONY: help venv toolchain lint test test-fast demo bench clean-cache

help:
	@echo "make demo    run the rollout churn drill on a local control plane"
	@echo "make test    install what is missing, lint, and run the whole test suite"
	@echo "make bench   run the benchmarks, write bench/results/*.json"
	@echo "make lint    ruff, mypy --strict, import-linter contracts"

# The stamp records the pyproject hash and this checkout's path, so a changed dependency
# list or a fresh clone re-runs the (quick, cached) editable install.
venv:
	@want="$$(sha256sum pyproject.toml | cut -c1-16) $(CURDIR)"; \
	if [ ! -x $(PY) ]; then echo "[make] creating venv in $(VENV)"; python3 -m venv $(VENV); fi; \
	if [ "$$(cat $(STAMP) 2>/dev/null)" != "$$want" ]; then \
	  echo "[make] installing kvtopo[worker,dev] into $(VENV) (first time: torch and nixl, several GB, minutes)"; \
	  $(PY) -m pip install --progress-bar off -q --upgrade pip && \
	  $(PY) -m pip install --progress-bar off -q -e '.[worker,dev]' && echo "$$want" > $(STAMP); \
	fi

toolchain:
	@toolchain/build.sh

# mypy needs the import names: the folders are named for the design (operator/, worker/),
# so a small tree of symlinks maps import names to folders for the type checker.
lint: venv
	$(VENV)/bin/ruff check .
	@mkdir -p .typecheck && ln -sfn ../operator .typecheck/kvtopo_operator && \
	  ln -sfn ../worker .typecheck/kvtopo_worker && ln -sfn ../bench .typecheck/kvtopo_bench && \
	  ln -sfn ../kvtopo .typecheck/kvtopo
	cd .typecheck && MYPYPATH=. $(VENV)/bin/mypy --config-file ../pyproject.toml \
	  -p kvtopo_worker -p kvtopo_operator -p kvtopo_bench -p kvtopo
	$(VENV)/bin/lint-imports

test: venv toolchain lint
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)

test-fast: venv lint
	$(PY) -m pytest -q -ra -m "not cluster" $(PYTEST_ARGS)

# The rollout churn drill on defaults: 3 decode rollouts, a scale down and up, >= 1000
# verified requests, on a local control plane with kwok (a minute or two once installed).
demo: venv toolchain
	@mkdir -p out
	$(VENV)/bin/kvtopo drill --json out/drill.json --plot out/drill.png
	@echo "report: out/drill.json  timeline: out/drill.png"

bench: venv toolchain
	@mkdir -p bench/results
	$(VENV)/bin/kvtopo bench push --json bench/results/push.json
	$(VENV)/bin/kvtopo bench registry --json bench/results/registry.json
	$(VENV)/bin/kvtopo bench operator --json bench/results/operator.json
	@echo
	-$(VENV)/bin/kvtopo bench summary --results bench/results

clean-cache:
	rm -rf $(KVTOPO_CACHE)
