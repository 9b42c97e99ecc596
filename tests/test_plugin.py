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


def test_graphdist_cluster_chooses_the_session_fleets_cluster(pytester, tmp_path):
    """`pytest --graphdist-cluster worker=1,ps=1`: the user's test sees a running fleet of those
    jobs, which answers, and is stopped when the session ends."""
    pidfile = tmp_path / "pids"
    pytester.makepyfile(
        f"""
        def test_the_fleet_has_the_cluster_asked_for(graphdist_fleet):
            assert graphdist_fleet.cluster.jobs == ("ps", "worker")
            assert [(t.job, t.index) for t in graphdist_fleet.tasks] == [("ps", 0), ("worker", 0)]
            assert all(report.ok for report in graphdist_fleet.health())
            with open({str(pidfile)!r}, "w") as f:
                f.write(" ".join(map(str, graphdist_fleet.pids)))
        """
    )
    from tests.conftest import EVENTUALLY_S, wait_gone

    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--graphdist-cluster", "worker=1,ps=1"
    )
    result.assert_outcomes(passed=1)
    pids = [int(p) for p in pidfile.read_text().split()]
    assert len(pids) == 2
    assert wait_gone(pids, EVENTUALLY_S) == []


# A user's "training" script: STEPS lines `step k` (a pause after each), then `done`; a restarted
# attempt (GRAPHDIST_RESTART > 0) says `resumed` first. No TensorFlow: this is about the fixture.
FAKE_TRAINING = """
import os, sys, time
if int(os.environ.get("GRAPHDIST_RESTART", "0")):
    print("resumed", flush=True)
for k in range(int(sys.argv[1])):
    print(f"step {k}", flush=True)
    time.sleep(0.4)
print("done", flush=True)
"""

USERS_FAULT_TESTS = """
import os, sys
import pytest

SCRIPT = {script!r}
RUNS = []


@pytest.fixture
def train(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return [sys.executable, str(path), "8"]


def keep(outcome):
    RUNS.append(outcome)
    return outcome


def test_a_killed_worker_is_survived_with_one_restart(graphdist_faults, train):
    out = keep(graphdist_faults.run(
        train, max_restarts=1, faults=[graphdist_faults.kill("worker-1", after=r"^step 2$")]
    ))
    assert out.returncode == 0, out.describe()
    assert out.attempts == 2 and out.restarts == 1 and out.restart_values == [0, 1]
    [kill] = out.injected
    assert (kill.task, kill.action, kill.attempt, kill.confirmed) == ("worker-1", "kill", 0, True)
    assert kill.line == "[worker-1] step 2" and kill.pid in out.pids
    assert out.missed == [] and out.leftovers == []
    assert "resumed" not in out.lines_of("worker-1", attempt=0)
    assert "done" not in out.lines_of("worker-1", attempt=0)
    assert out.lines_of("worker-1", attempt=1)[0] == "resumed"
    assert out.lines_of("worker-0", attempt=1)[-1] == "done"
    assert "[worker-1] done" in out.lines
    restarts = [ln for ln in out.launcher_lines() if "restarting the run" in ln]
    assert len(restarts) == 1 and "worker-1" in restarts[0] and "SIGKILL" in restarts[0]


def test_without_restarts_a_killed_worker_fails_the_run(graphdist_faults, train):
    out = keep(graphdist_faults.run(
        train, max_restarts=0, faults=[graphdist_faults.kill("worker-1", after="step 1")]
    ))
    assert out.returncode == 128 + 9, out.describe()  # the killed task's status, as a shell has it
    assert out.attempts == 1 and len(out.injected) == 1
    assert "Error: Task worker-1 was killed by SIGKILL (exit status 137)" in out.stderr
    assert out.leftovers == []


def test_beyond_the_budget_one_line_names_the_task_how_and_the_count(graphdist_faults, train):
    kill = graphdist_faults.kill
    out = keep(graphdist_faults.run(
        train,
        max_restarts=1,
        faults=[kill("worker-1", after="step 1"), kill("worker-0", after="resumed", attempt=1)],
    ))
    assert out.returncode == 128 + 9, out.describe()
    assert out.attempts == 2 and [i.attempt for i in out.injected] == [0, 1]
    first = out.stderr.splitlines()[0]
    assert first.startswith("Error: Task worker-0 was killed by SIGKILL (exit status 137)"), first
    assert "gave up on the run after 1 restart(s)" in first, first


def test_a_frozen_worker_is_stopped_then_continued(graphdist_faults, train):
    out = keep(graphdist_faults.run(
        train, faults=[graphdist_faults.freeze("worker-1", after="step 2", for_s=1.0)]
    ))
    assert out.returncode == 0, out.describe()
    [freeze] = out.injected
    assert freeze.confirmed and freeze.thawed_at_s is not None  # seen stopped, then SIGCONT
    assert out.lines_of("worker-1")[-1] == "done" and out.attempts == 1


def test_a_worker_frozen_for_good_is_found_by_the_heartbeat_and_fails_the_run(
    graphdist_faults, train
):
    # No restarts: the heartbeat (3 s by default) kills the stopped worker and the run fails as
    # for a killed one, long before the timeout would have ended it.
    out = keep(graphdist_faults.run(
        train,
        timeout_s=60,
        faults=[graphdist_faults.freeze("worker-1", after="step 0", of="worker-0")],
    ))
    assert out.returncode == 128 + 9, out.describe()
    first = out.stderr.splitlines()[0]
    assert first.startswith("Error: Task worker-1 was frozen (stopped (state T) for "), first
    assert first.split(" for ")[1].startswith("3."), first  # the default timeout, one look late
    assert out.injected[0].confirmed and out.leftovers == []


def test_a_worker_frozen_for_good_is_ended_by_the_timeout(graphdist_faults, train):
    out = keep(graphdist_faults.run(
        train,
        timeout_s=8,
        launcher_args=["--heartbeat-timeout", "off"],
        faults=[graphdist_faults.freeze("worker-1", after="step 0", of="worker-0")],
    ))
    assert out.returncode == 1, out.describe()
    assert "still running: worker-1" in out.stderr
    assert out.injected[0].confirmed and out.leftovers == []
    assert "done" not in out.lines_of("worker-1")


def test_a_fault_that_never_came_is_reported(graphdist_faults, train):
    kill = graphdist_faults.kill
    out = keep(graphdist_faults.run(
        train,
        max_restarts=1,
        faults=[kill("worker-1", after="no such line"), kill("worker-0", after_s=0, attempt=1)],
    ))
    assert out.returncode == 0 and out.injected == [] and out.attempts == 1
    [line, later] = out.missed
    assert "no line of worker-1 in attempt 0 matched 'no such line'" in line.why
    assert "the run ended in attempt 0; attempt 1 never came" in later.why


def test_bad_arguments_are_refused_before_anything_starts(graphdist_faults, train):
    from graphdist import ArgumentError

    with pytest.raises(ArgumentError, match="no task 'worker-2'"):
        graphdist_faults.run(train, faults=[graphdist_faults.kill("worker-2", after_s=1)])
    with pytest.raises(ArgumentError, match="attempt 1 cannot happen"):
        later = graphdist_faults.kill("worker-1", after_s=1, attempt=1)
        graphdist_faults.run(train, faults=[later])


def teardown_module():
    with open(os.environ["PIDFILE"], "w") as f:
        f.write(" ".join(str(p) for out in RUNS for p in out.pids))
"""


def test_user_tests_inject_faults_into_a_run_and_nothing_is_left(pytester):
    import os
    import tempfile
    import uuid

    from tests.conftest import EVENTUALLY_S, processes_marked, wait_gone

    pytester.makepyfile(USERS_FAULT_TESTS.format(script=FAKE_TRAINING))
    pidfile = tempfile.mktemp()
    mark = uuid.uuid4().hex
    os.environ["PIDFILE"], os.environ["GRAPHDIST_TEST_MARK"] = pidfile, mark
    try:
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
        result.assert_outcomes(passed=8)
        with open(pidfile) as f:
            pids = [int(p) for p in f.read().split()]
    finally:
        os.environ.pop("PIDFILE", None)
        os.environ.pop("GRAPHDIST_TEST_MARK", None)
    assert len(pids) >= 6 * 4  # every run's launcher-side guards and commands were seen
    assert wait_gone(pids, EVENTUALLY_S) == []
    assert processes_marked(mark) == []


PAGE_TRAIN = """
import argparse, time
parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.parse_args()
for epoch in range(1, 4):
    time.sleep(1.0)
    print(f"epoch {epoch}/3 done", flush=True)
"""


@pytest.mark.timeout(180)
def test_the_pytest_page_example_runs_as_written(pytester):
    """docs/pytest.md's test, as the page writes it, in a user's project whose train.py prints
    "epoch N/3 done" lines: it passes (worker-1 killed once worker-0 printed epoch 2, one
    restart, exit 0)."""
    import re
    from pathlib import Path

    from tests.conftest import REPO

    text = Path(REPO, "docs", "pytest.md").read_text(encoding="utf-8")
    [block] = re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)
    pytester.makepyfile(test_page=block)
    (pytester.path / "train.py").write_text(PAGE_TRAIN)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=1)
