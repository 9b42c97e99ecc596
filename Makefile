# Two entry points for users: `make demo` (the main job) and `make test` (the whole suite).
# Both create .venv and install graphdist into it on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench bench-full clean

$(VENV)/.installed: setup.cfg setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,ray]'
	@# Graphviz renders placement pictures; installed where we may (root with apt), else .dot only.
	@command -v dot >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { apt-get install -y -q graphviz >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q graphviz >/dev/null 2>&1; }; }; } || \
	  echo "note: Graphviz 'dot' is not installed; placement pictures can only be written as .dot"
	touch $@

demo: $(VENV)/.installed
	TF_CPP_MIN_LOG_LEVEL=2 $(BIN)/graphdist demo

lint: $(VENV)/.installed
	$(BIN)/ruff check graphdist tests examples benchmarks
	$(BIN)/ruff format --check graphdist
	$(BIN)/mypy graphdist

test: lint
	$(BIN)/pytest

$(VENV)/.bench-installed: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e '.[bench]'
	touch $@

# The benchmark suite, quick mode (about 2 minutes); rewrites README's benchmark section.
bench: $(VENV)/.bench-installed
	$(BIN)/python benchmarks/suite.py --readme README.md

bench-full: $(VENV)/.bench-installed
	$(BIN)/python benchmarks/suite.py --full --readme README.md
	$(BIN)/python benchmarks/mwms_throughput.py

clean:
	rm -rf $(VENV) *.egg-info .mypy_cache .ruff_cache .pytest_cache
