"""Process control, one home for it: how graphdist stops processes, ties a child's life to its
parent's, and waits for processes to be gone.

- :func:`stop_all` escalates: SIGTERM to every target at once, up to ``grace_s`` for them to exit,
  then SIGKILL to the rest and up to ``kill_wait_s`` more. Fleets (their server processes), the
  launcher (each task's process group) and detached fleets (recorded pids) all stop this way; each
  wraps its processes in a small object with ``signal(sig)`` and ``running()`` (:class:`Stoppable`).
- :func:`set_parent_death_signal` asks the kernel to SIGKILL the calling process when its parent
  thread exits (``PR_SET_PDEATHSIG``); server processes and launched tasks use it so that nothing
  outlives its owner.
- :func:`wait_gone` waits until pids have exited (a zombie counts as exited).
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import time
from collections.abc import Iterable
from typing import Protocol, TypeVar

import psutil

__all__ = [
    "KILL_WAIT_S",
    "STOP_GRACE_S",
    "Stoppable",
    "set_parent_death_signal",
    "stop_all",
    "wait_gone",
]

#: Seconds a process gets between SIGTERM and SIGKILL.
STOP_GRACE_S = 3.0
#: Seconds to wait for SIGKILLed processes to be gone before reporting them as survivors.
KILL_WAIT_S = 5.0
_POLL_S = 0.02
_PR_SET_PDEATHSIG = 1


class Stoppable(Protocol):
    """Something :func:`stop_all` can stop: it takes signals and says whether it still runs."""

    def signal(self, sig: int) -> None: ...

    def running(self) -> bool: ...


_S = TypeVar("_S", bound=Stoppable)


def _wait(targets: list[_S], seconds: float) -> list[_S]:
    deadline = time.monotonic() + seconds
    live = [t for t in targets if t.running()]
    while live and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        live = [t for t in live if t.running()]
    return live


def stop_all(
    targets: Iterable[_S], grace_s: float = STOP_GRACE_S, kill_wait_s: float = KILL_WAIT_S
) -> list[_S]:
    """SIGTERM every running target, wait up to ``grace_s`` seconds, SIGKILL the rest and wait up
    to ``kill_wait_s``; return the targets still running after that (normally none)."""
    live = [t for t in targets if t.running()]
    for target in live:
        target.signal(signal.SIGTERM)
    live = _wait(live, grace_s)
    for target in live:
        target.signal(signal.SIGKILL)
    return _wait(live, kill_wait_s)


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when the thread that forked it exits.

    Safe between fork and exec (``preexec_fn``). Returns False where ``prctl`` is unavailable."""
    with contextlib.suppress(OSError, AttributeError):
        return int(ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)) == 0
    return False


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def wait_gone(pids: Iterable[int], timeout_s: float) -> list[int]:
    """Wait until every pid has exited; return those still running after ``timeout_s``."""
    pending = list(pids)
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        pending = [p for p in pending if not _gone(p)]
        if pending:
            time.sleep(_POLL_S)
    return [p for p in pending if not _gone(p)]
