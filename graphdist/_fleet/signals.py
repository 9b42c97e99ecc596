"""Turning SIGINT, SIGTERM and SIGHUP into an event a foreground loop can wait on.

Handlers (not a blocked signal mask plus ``sigwait``) because a process-directed signal may be
delivered to any thread whose mask allows it: gRPC and thread-pool threads do, and the signal
would then kill the process or surface as a stray KeyboardInterrupt instead of a clean stop.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

__all__ = ["STOP_SIGNALS", "stop_on_signals"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def stop_on_signals() -> threading.Event:
    """Install handlers (main thread only) that set and return one event on any stop signal."""
    event = threading.Event()

    def handler(signum: int, frame: FrameType | None) -> None:
        event.set()

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)
    return event
