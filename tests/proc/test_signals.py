"""Foreground loops' stop signals (graphdist/_proc/signals.py)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

# The main thread blocks SIGINT, so the kernel must hand it to the other thread: what happens at
# random when gRPC's or Ray's threads are there (graphdist up on Ray, graphdist serve).
WAITER = r"""
import signal, sys, threading, time
from graphdist._proc.signals import stop_on_signals, wait_for_stop
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
stop = stop_on_signals()
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
print("waiting", flush=True)
wait_for_stop(stop)
print("stopped", flush=True)
"""


@pytest.mark.timeout(60)
def test_a_stop_signal_taken_by_another_thread_still_ends_the_wait() -> None:
    proc = subprocess.Popen([sys.executable, "-c", WAITER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "waiting\n"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=5)  # an untimed wait sleeps on: this times out
        assert out == "stopped\n" and proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
