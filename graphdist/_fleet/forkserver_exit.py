"""Imported only inside graphdist's fork servers (as the last preload module): make the fork
server exit at once when its owner is gone.

multiprocess's fork server leaves its loop with ``SystemExit`` when its owner's end of the "alive"
pipe closes, then runs a normal interpreter shutdown, which with TensorFlow loaded takes 1-5 s
(TensorFlow's own exit handlers and module teardown). Nothing in the fork server needs that
clean-up: its children exit through ``os._exit`` and never run exit handlers. This handler is
registered after TensorFlow's, so it runs first and ends the process.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys


def _exit_now() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    os._exit(0)


atexit.register(_exit_now)
