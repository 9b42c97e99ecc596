"""The pytest plugin gives a user's tests a fleet and stops it afterwards."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]
pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_user_tests_get_a_running_fleet_and_a_factory(pytester):
    pytester.makepyfile(
        """
        import os, psutil
        PIDS = []

        def test_session_fleet(graphdist_fleet):
            assert len(graphdist_fleet.tasks) == 2
            PIDS.extend(graphdist_fleet.pids)

        def test_factory(graphdist_fleet_factory):
            fleet = graphdist_fleet_factory("worker=1,ps=1")
            assert fleet.cluster.jobs == ("ps", "worker")
            PIDS.extend(fleet.pids)

        def test_all_fleets_were_stopped_at_the_end():
            pass

        def teardown_module():
            with open(os.environ["PIDFILE"], "w") as f:
                f.write(" ".join(map(str, PIDS)))
        """
    )
    import os
    import tempfile

    from tests.conftest import EVENTUALLY_S, wait_gone

    pidfile = tempfile.mktemp()
    os.environ["PIDFILE"] = pidfile
    try:
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
        result.assert_outcomes(passed=3)
        with open(pidfile) as f:
            pids = [int(p) for p in f.read().split()]
    finally:
        os.environ.pop("PIDFILE", None)
    assert len(pids) == 4
    assert wait_gone(pids, EVENTUALLY_S) == []
