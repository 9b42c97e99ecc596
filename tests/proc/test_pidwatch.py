"""The kernel's word on a process (graphdist._proc.pidwatch): exact at once, immune to pid
reuse, and the same answers where pidfds are missing. Small processes (sleep), no TensorFlow."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from graphdist._proc import pidwatch
from graphdist._proc.pidwatch import PidWatch


@pytest.fixture
def sleeper():
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()
    assert proc.poll() is not None


def test_a_running_process_is_not_ended(sleeper):
    watch = PidWatch(sleeper.pid)
    assert not watch.ended()
    assert not watch.wait(0.05)
    watch.close()


def test_an_ended_process_reads_ended_before_anyone_reaped_it(sleeper):
    """The pidfd says 'ended' for a zombie: the parent's exit news (here: its wait) is not
    needed, which is what a fleet's fork server delays on a loaded machine."""
    watch = PidWatch(sleeper.pid)
    os.kill(sleeper.pid, signal.SIGKILL)
    assert watch.wait(10.0)
    assert sleeper.returncode is None  # not reaped: the kernel's word came first
    assert watch.ended()
    watch.close()


def test_a_signal_through_the_watch_reaches_its_process_and_no_other(sleeper):
    watch = PidWatch(sleeper.pid)
    assert watch.send(signal.SIGTERM)
    assert sleeper.wait(10.0) == -signal.SIGTERM
    assert not watch.send(signal.SIGTERM)  # ended: nothing is sent to a reused pid
    watch.close()


def test_a_pid_that_is_gone_reads_ended_from_the_start():
    proc = subprocess.Popen(["true"])
    proc.wait()
    watch = PidWatch(proc.pid)
    assert watch.ended()
    assert not watch.send(signal.SIGKILL)


def test_without_pidfds_a_zombie_is_ended_by_polling(sleeper, monkeypatch):
    monkeypatch.delattr(os, "pidfd_open")
    watch = PidWatch(sleeper.pid)
    assert not watch.ended()
    os.kill(sleeper.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not watch.ended() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert watch.ended()
    assert sleeper.returncode is None  # a zombie: ended all the same


def test_gone_within_waits_no_longer_than_asked(sleeper):
    started = time.monotonic()
    assert not pidwatch.gone_within(sleeper.pid, None, 0.2, poll_s=0.02)
    assert time.monotonic() - started < 2.0
