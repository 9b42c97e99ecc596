"""tests/sigtrace.py, the record that names who continued a process a test had stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import EVENTUALLY_S, REPO, anchored_group, sigstop
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


# A parent whose child stops itself; the parent sleeps until it is killed.
PARENT = (
    "import os, signal, time\n"
    "child = os.fork()\n"
    "if child == 0:\n"
    "    os.kill(os.getpid(), signal.SIGSTOP)\n"
    "    os._exit(0)\n"
    "print(child, flush=True)\n"
    "time.sleep(60)\n"
)


def _stopped_child_outlives_its_parent(group: int) -> str:
    """In process group ``group`` (0: a new one), a parent and its stopped child; the parent is
    SIGKILLed: the child's state right after (a SIGCONT acts when it is sent: the kernel sends
    an orphaned group's during the parent's exit, before its end can be waited for)."""
    from graphdist._proc.process import proc_stat

    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, process_group=group
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + EVENTUALLY_S
        while (proc_stat(child) or ("gone", 0))[0] != "T":
            assert time.monotonic() < deadline, "the child did not stop"
            time.sleep(0.01)
        parent.kill()
        parent.wait()
        return (proc_stat(child) or ("gone", 0))[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


@pytest.mark.timeout(60)
@pytest.mark.skipif(sys.version_info < (3, 11), reason="Popen's process_group is Python 3.11's")
def test_a_group_left_orphaned_continues_its_stopped_process_and_an_anchored_one_does_not():
    """The kernel's rule behind tests/conftest.py ``anchored_group``, in the pool tests' shape:
    a stopped child whose parent was its group's last link to the rest of the session is
    continued (SIGHUP and SIGCONT to the group) when that parent dies; in an anchored group it
    stays stopped. Red if anchored_group's anchor did not keep its group linked."""
    assert _stopped_child_outlives_its_parent(0) != "T"
    with anchored_group() as group:
        assert _stopped_child_outlives_its_parent(group) == "T"


# In a session of its own (so its group is orphaned: its leader's parent is the test, in another
# session), a process stopped in the leader's group; then a process of that group forks a child
# and leaves for a group of its own, and the child exits: the kernel's check of that exit
# continues the stopped process of the orphaned group, a group the exit is no part of.
ORPHANED = """
import os, signal, subprocess, sys
from tests.conftest import sigstop
from graphdist._proc.process import proc_stat
signal.signal(signal.SIGHUP, lambda *_: None)  # the group's SIGHUP may reach this process too
stopped = subprocess.Popen(["sleep", "30"])  # a default SIGHUP: exec resets the handler
sigstop(stopped.pid)
trigger = os.fork()
if trigger == 0:
    go_r, go_w = os.pipe()
    child = os.fork()
    if child == 0:  # stays in the leader's group, with its parent gone to another
        os.close(go_w)
        os.read(go_r, 1)
        os._exit(0)
    os.setpgid(0, 0)
    os.close(go_w)  # now the child may exit
    os.waitpid(child, 0)
    os._exit(0)
os.waitpid(trigger, 0)
print((proc_stat(stopped.pid) or ("gone", 0))[0])
stopped.kill()
stopped.wait()
"""


@pytest.mark.timeout(60)
def test_an_orphaned_groups_stopped_process_is_continued_by_an_exit_across_a_group_boundary():
    """Why a process a test stops is kept out of the suite's own group: orphaned (as under a CI
    runner), that group's stopped process is continued by such an exit anywhere in it."""
    done = subprocess.run(
        [sys.executable, "-c", ORPHANED],
        capture_output=True,
        text=True,
        timeout=50,
        cwd=REPO,
        start_new_session=True,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() != "T", "the orphaned group's stopped process stayed stopped"
