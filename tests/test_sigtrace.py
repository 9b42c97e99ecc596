"""tests/sigtrace.py, the record that names who continued a process a test had stopped."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from tests.conftest import sigstop
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
