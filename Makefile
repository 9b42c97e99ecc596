# Two entry points for users: `make demo` (the main job) and `make test` (the whole suite).
# Both create .venv on first use: `demo` installs graphdist and its runtime dependencies only,
# `test` adds the test extras (and Ray, whose backend the suite covers). Nothing here installs
# system packages: without Graphviz, placement pictures are written as .dot (the message says
# how to get SVG).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint corners bench bench-full bench-smoke clean

$(VENV)/.installed: setup.cfg setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.test-installed: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e '.[test,ray]'
	touch $@

demo: $(VENV)/.installed
	TF_CPP_MIN_LOG_LEVEL=2 $(BIN)/graphdist demo

lint: $(VENV)/.test-installed
	$(BIN)/ruff check graphdist tests examples benchmarks noxfile.py
	$(BIN)/ruff format --check graphdist
	$(BIN)/mypy graphdist

test: lint
	$(BIN)/pytest

# The oldest and newest corners of the support matrix (Python 3.10 + TensorFlow 2.16, Python
# 3.13 + TensorFlow 2.21), each in its own environment under .nox/; `$(BIN)/nox -l` lists all cells.
corners: $(VENV)/.test-installed
	$(BIN)/nox -t corners

$(VENV)/.bench-installed: $(VENV)/.test-installed
	$(BIN)/python -m pip install -q -e '.[bench]'
	touch $@

# The benchmark suite, quick mode (three interleaved rounds; 675 s on this 2-core machine on
# 2026-12-01, with other jobs running): prints its tables and writes them to bench-results/ (ignored by git), then each
# target as met or MISSED, and fails on a miss. README=1 updates the record instead: README's
# section `suite` and benchmarks/results/. bench-smoke runs every measurement once at its
# smallest size (what tests/test_bench.py runs; its figures mean nothing).
bench: $(VENV)/.bench-installed
	$(BIN)/python benchmarks/suite.py $(if $(README),--readme README.md)

bench-full: $(VENV)/.bench-installed
	$(BIN)/python benchmarks/suite.py --full $(if $(README),--readme README.md)
	$(BIN)/python benchmarks/mwms_throughput.py

bench-smoke: $(VENV)/.bench-installed
	$(BIN)/python benchmarks/suite.py --smoke

clean:
	rm -rf $(VENV) .nox *.egg-info .mypy_cache .ruff_cache .pytest_cache
