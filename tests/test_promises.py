"""The ``promise`` marker's hook (tests/conftest.py): a promise test that skips fails (in its
call) or errors (in its setup: a fixture or a ``skipif``), naming what it lacked and the variable
that allows the skip; other skips stay skips."""

from __future__ import annotations

import textwrap

import pytest

from tests.conftest import ALLOW_PROMISE_SKIPS

pytest_plugins = ["pytester"]

TESTS = textwrap.dedent(
    """
    import pytest

    @pytest.mark.promise
    def test_promise_that_cannot_run():
        pytest.skip("setpriv is not installed")

    @pytest.mark.promise
    @pytest.mark.skipif(True, reason="needs root")
    def test_promise_skipped_by_a_mark():
        pass

    @pytest.fixture
    def missing():
        pytest.skip("no network namespaces here")

    @pytest.mark.promise
    def test_promise_whose_fixture_skips(missing):
        pass

    @pytest.mark.promise
    def test_promise_that_runs():
        pass

    @pytest.mark.promise
    @pytest.mark.xfail(reason="known bug")
    def test_promise_expected_to_fail():
        assert False

    def test_plain_skip():
        pytest.skip("Graphviz is not installed")
    """
)


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest("from tests.conftest import pytest_runtest_makereport  # noqa: F401")
    pytester.makeini("[pytest]\nmarkers =\n    promise: a promise\n")
    pytester.makepyfile(test_suite=TESTS)
    return pytester


def _run(suite: pytest.Pytester) -> pytest.RunResult:
    # In-process: the outer run already imported graphdist and tests, hence the warning filter.
    quiet = "ignore::pytest.PytestAssertRewriteWarning"
    return suite.runpytest("-p", "no:xdist", "-p", "no:cacheprovider", "-W", quiet)


def test_a_promise_skip_fails_and_says_what_was_missing(suite, monkeypatch):
    monkeypatch.delenv(ALLOW_PROMISE_SKIPS, raising=False)
    result = _run(suite)
    result.assert_outcomes(passed=1, failed=1, errors=2, skipped=1, xfailed=1)
    text = result.stdout.str()
    for missing in ("setpriv is not installed", "needs root", "no network namespaces here"):
        assert f"promise test could not run: {missing}" in text
    assert f"{ALLOW_PROMISE_SKIPS}=1" in text
    assert "Graphviz" not in text.split("short test summary")[0]  # a plain skip: no failure


def test_the_variable_lets_promise_tests_skip(suite, monkeypatch):
    monkeypatch.setenv(ALLOW_PROMISE_SKIPS, "1")
    result = _run(suite)
    result.assert_outcomes(passed=1, skipped=4, xfailed=1)


def test_only_the_value_1_allows(suite, monkeypatch):
    monkeypatch.setenv(ALLOW_PROMISE_SKIPS, "yes")
    result = _run(suite)
    result.assert_outcomes(passed=1, failed=1, errors=2, skipped=1, xfailed=1)


NEEDS = textwrap.dedent(
    """
    import pytest

    pytestmark = [pytest.mark.needs("graphdist_no_such_module", extra="ray")]

    def test_needs_a_missing_module():
        pass

    @pytest.mark.needs("json")
    def test_needs_an_installed_one_too():
        pass
    """
)


@pytest.mark.parametrize("allowed", [False, True])
def test_a_missing_declared_dependency_skips_as_a_promise_does(pytester, monkeypatch, allowed):
    """``needs(MODULE, extra=...)`` (a declared test dependency: Ray, nbclient, ...): where the
    module is missing, its tests fail (in setup) naming it and the extra that installs it, and
    skip only where promise skips are allowed; a module-level ``importorskip`` skipped them where
    no hook could see it."""
    pytester.makeconftest(
        "from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n"
        "from tests.conftest import pytest_runtest_makereport  # noqa: F401\n"
    )
    pytester.makeini(
        "[pytest]\nmarkers =\n    promise: a promise\n    needs(module, extra): a dependency\n"
    )
    pytester.makepyfile(test_needs=NEEDS)
    if allowed:
        monkeypatch.setenv(ALLOW_PROMISE_SKIPS, "1")
    else:
        monkeypatch.delenv(ALLOW_PROMISE_SKIPS, raising=False)
    result = _run(pytester)
    if allowed:
        result.assert_outcomes(skipped=2)
    else:
        result.assert_outcomes(errors=2)
        text = result.stdout.str()
        missing = "graphdist_no_such_module is not installed (pip install -e '.[ray]')"
        assert f"promise test could not run: {missing}" in text, text
