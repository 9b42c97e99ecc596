"""The unit tier's guards (tests/conftest.py): under ``-m "not integration"`` (``make check``), a
test that starts a process which imports TensorFlow fails at teardown, naming the process, and
one that makes a network namespace, a host bed or a Ray instance fails at once; the tests that
use a fleet fixture are integration tests whatever their module says. Red if a test could slow
the fast tier down, or make it lie about what it runs, without anyone being told."""

from __future__ import annotations

import os
import textwrap

import pytest

from tests.conftest import TRIPWIRE, TRIPWIRE_RECORDS, TRIPWIRE_TEST

pytest_plugins = ["pytester"]

TESTS = textwrap.dedent(
    """
    import subprocess, sys

    import pytest

    from tests.conftest import forbid_in_unit_tier

    LOOKS_UP_TENSORFLOW = "import importlib.util; importlib.util.find_spec('tensorflow')"

    def test_starts_a_process_that_imports_tensorflow():
        subprocess.run([sys.executable, "-c", LOOKS_UP_TENSORFLOW], check=True)

    def test_starts_a_plain_process():
        subprocess.run([sys.executable, "-c", "import json"], check=True)

    def test_makes_a_network_namespace():
        forbid_in_unit_tier("a network namespace")

    def test_uses_a_fleet(graphdist_fleet_factory):
        pass

    @pytest.mark.integration
    def test_marked():
        subprocess.run([sys.executable, "-c", LOOKS_UP_TENSORFLOW], check=True)
    """
)


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    # this run's own guards off while the inner run's work (when this one is the unit tier)
    for name in (TRIPWIRE_RECORDS, TRIPWIRE_TEST):
        monkeypatch.delenv(name, raising=False)
    path = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in path if p != TRIPWIRE))
    pytester.makeconftest(
        "from tests.conftest import (  # noqa: F401\n"
        "    pytest_itemcollected, pytest_runtest_makereport, pytest_runtest_protocol,\n"
        ")\n"
    )
    pytester.makeini("[pytest]\nmarkers =\n    integration: heavy\n    promise: a promise\n")
    pytester.makepyfile(test_suite=TESTS)
    return pytester


def _run(suite: pytest.Pytester, *args: str) -> pytest.RunResult:
    quiet = "ignore::pytest.PytestAssertRewriteWarning"
    return suite.runpytest("-p", "no:xdist", "-p", "no:cacheprovider", "-W", quiet, *args)


def test_the_unit_tier_fails_a_test_that_starts_tensorflow_or_a_namespace(suite):
    result = _run(suite, "-m", "not integration")
    # the fleet fixture's test and the marked one are integration tests: not run
    result.assert_outcomes(passed=2, failed=1, errors=1, deselected=2)
    text = result.stdout.str()
    assert "a unit-tier test started a process that imported TensorFlow" in text
    assert "test_starts_a_process_that_imports_tensorflow: pid " in text
    assert "a unit-tier test starts a network namespace" in text
    assert "test_starts_a_plain_process" not in text.split("short test summary")[-1]


def test_outside_the_unit_tier_nothing_is_watched(suite):
    result = _run(suite, "-k", "not fleet")
    result.assert_outcomes(passed=4)
