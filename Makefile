# Two entry points for users: `make demo` (the main job) and `make test` (the whole suite: its
# time here is benchmarks/suite_cost.py's record in docs/benchmarks.md); `make check` is the
# everyday loop: lint (ruff, mypy) and the unit tier, `pytest -m "not integration"` (in-process
# tests and light subprocesses: no TensorFlow server, warm agent, Ray, Slurm or host bed; a
# unit-tier test that starts a process importing TensorFlow fails, naming it: tests/conftest.py).
# `make docs` builds the documentation site.
# Each creates .venv on first use: `demo` installs graphdist, its runtime dependencies and the
# `distribute` extra (tf-keras: README's next command, a `graphdist run` of the MWMS example),
# `test` and `check` add the test extras (and Ray, whose backend the suite covers), and `test`, as
# root with apt-get, Debian's Slurm and munge for the Slurm bed of tests/slurm
# (tests/slurm/install-slurm.sh: a no-op once installed; it leaves none of their services running). Nothing else installs system
# packages: without Graphviz, a placement picture is written as .dot only; an .svg, .png or .pdf
# one is refused with one line that says how to get Graphviz (`make demo` draws none).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test check lint corners docs bench bench-full bench-smoke mutants clean

$(VENV)/.installed: setup.cfg setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[distribute]'
	touch $@

$(VENV)/.test-installed: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e '.[test,ray]'
	touch $@

demo: $(VENV)/.installed
	TF_CPP_MIN_LOG_LEVEL=2 $(BIN)/graphdist demo

lint: $(VENV)/.test-installed
	$(BIN)/ruff check graphdist tests examples benchmarks noxfile.py docs/conf.py
	$(BIN)/ruff format --check graphdist tests examples benchmarks noxfile.py docs/conf.py
	$(BIN)/mypy graphdist

test: lint
	sh tests/slurm/install-slurm.sh
	sh tests/install-chromium.sh
	$(BIN)/pytest

check: lint
	$(BIN)/pytest -m "not integration"

# Mutation testing of the pure modules (tests/mutants.py, mutmut): each module's mutants against
# its own unit tests, every survivor printed with its diff; exits 1 on one docs/mutants.md does not
# explain. RECORD=1 writes the record in docs/mutants.md.
mutants: $(VENV)/.test-installed
	$(BIN)/python -m tests.mutants $(if $(RECORD),--record docs/mutants.md)

# The oldest and newest corners of the support matrix (Python 3.10 + TensorFlow 2.16, Python
# 3.13 + TensorFlow 2.21), each in its own environment under .nox/; `$(BIN)/nox -l` lists all cells.
corners: $(VENV)/.test-installed
	$(BIN)/nox -t corners

$(VENV)/.docs-installed: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e '.[docs]'
	touch $@

# The documentation site, offline (no intersphinx, nothing fetched) and strict: every warning is
# an error (-W), all of them reported (--keep-going). The tutorial notebook runs on every build, on
# a real fleet (docs/conf.py): a failing cell fails the build; -E reads every page afresh, so
# the notebook runs on every `make docs`, not only when it changed. Output: docs/_build/html.
docs: $(VENV)/.docs-installed
	TF_CPP_MIN_LOG_LEVEL=2 $(BIN)/sphinx-build -E -W --keep-going -b html docs docs/_build/html

$(VENV)/.bench-installed: $(VENV)/.test-installed
	$(BIN)/python -m pip install -q -e '.[bench]'
	touch $@

# The benchmark suite, quick mode (three interleaved rounds; the record in docs/benchmarks.md says
# how long its run took): prints its tables and writes them to bench-results/ (ignored by git),
# then each target as met or MISSED, and fails on a miss. README=1 updates the record instead:
# the section `suite` of docs/benchmarks.md and benchmarks/results/. bench-smoke runs every
# measurement once at its smallest size (what tests/test_bench.py runs; its figures mean nothing).
bench: $(VENV)/.bench-installed
	$(BIN)/python benchmarks/suite.py $(if $(README),--readme docs/benchmarks.md)

bench-full: $(VENV)/.bench-installed
	$(BIN)/python benchmarks/suite.py --full $(if $(README),--readme docs/benchmarks.md)
	$(BIN)/python benchmarks/mwms_throughput.py

bench-smoke: $(VENV)/.bench-installed
	$(BIN)/python benchmarks/suite.py --smoke

clean:
	rm -rf $(VENV) .nox *.egg-info .mypy_cache .ruff_cache .pytest_cache docs/_build docs/jupyter_execute
