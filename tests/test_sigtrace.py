"""tests/sigtrace.py, the record that names who continued a process a test had stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO, sigstop
from tests.sigtrace import watching


@pytest.mark.timeout(30)
def test_a_sigcont_from_another_process_is_named_and_the_tests_own_signals_are_not():
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        with watching(sleeper.pid) as log:
            sigstop(sleeper.pid)
            kill = subprocess.run(["kill", "-CONT", str(sleeper.pid)], check=True)
            assert kill.returncode == 0
            os.kill(sleeper.pid, signal.SIGCONT)  # the test's own: not named
        if log.signals is None:
            pytest.skip(log.describe())  # no writable tracefs here (not root)
        assert [s["sig"] for s in log.signals] == ["19", "18", "18"], log.signals
        assert [s["comm"].strip() for s in log.foreign()] == ["kill"], log.signals
        assert log.describe().startswith("signal 18 from kill (pid "), log.describe()
    finally:
        sleeper.kill()
        sleeper.wait(10)
    assert not any(n.startswith(f"graphdist-sig-{os.getpid()}-") for n in _instances())


def _instances() -> list[str]:
    try:
        return os.listdir("/sys/kernel/tracing/instances")
    except OSError:
        return []


# In a session of its own (orphaned: its leader's parent is the test, in another session), a
# process stopped in the leader's group and one stopped in an anchored group; then a process of
# the leader's group forks a child and leaves for a group of its own, and the child exits: the
# kernel's orphaned-group check of that exit continues whatever is stopped in the leader's group.
ORPHANED = """
import json, os, signal, subprocess, sys, time
from tests.conftest import anchored_group, sigstop
from graphdist._proc.process import proc_stat

def stopped(group=None):
    kw = {} if group is None else {"process_group": group}
    proc = subprocess.Popen(["sleep", "30"], **kw)
    sigstop(proc.pid)
    return proc

with anchored_group() as group:
    plain, anchored = stopped(), stopped(group)
    trigger = os.fork()
    if trigger == 0:
        child = os.fork()
        if child == 0:
            time.sleep(0.2)
            os._exit(0)
        os.setpgid(0, 0)
        os.waitpid(child, 0)
        os._exit(0)
    os.waitpid(trigger, 0)
    time.sleep(0.2)
    print(json.dumps([proc_stat(p.pid)[0] for p in (plain, anchored)]))
    for proc in (plain, anchored):
        proc.kill()
        proc.wait()
"""


@pytest.mark.timeout(60)
@pytest.mark.skipif(sys.version_info < (3, 11), reason="Popen's process_group is Python 3.11's")
def test_an_orphaned_groups_stopped_process_is_continued_and_an_anchored_ones_is_not():
    """The kernel's rule behind tests/conftest.py ``anchored_group``: a stopped process in the
    suite's group is continued (and hung up: a ``sleep`` dies of it) by an exit elsewhere in the
    session when that group is orphaned (as under CI); one in an anchored group stays stopped."""
    done = subprocess.run(
        [sys.executable, "-c", ORPHANED],
        capture_output=True,
        text=True,
        timeout=50,
        cwd=REPO,
        start_new_session=True,
    )
    assert done.returncode == 0, done.stderr
    plain, anchored = json.loads(done.stdout)
    assert plain != "T", "the orphaned group's stopped process was not continued (nor hung up)"
    assert anchored == "T", f"the anchored group's stopped process was continued ({anchored})"
