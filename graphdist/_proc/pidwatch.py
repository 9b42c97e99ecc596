"""The kernel's word on whether one process still runs: a pidfd, opened while the process is
known to run, held until the owner lets it go.

A pidfd is exact and immune to pid reuse: it becomes readable the moment its process ends (a
zombie too), and a signal sent through it can reach no other process. A process that is not
this process's child (a fleet's server is its fork server's child) has no exit news here but
the fork server's message, which a loaded machine delays by seconds: the pidfd says at once
that it ended, the message later says how. Where pidfds are missing (Linux before 5.3), a
``kill(pid, 0)`` and the process's state in ``/proc`` stand in (a zombie counts as ended).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from collections.abc import Callable

__all__ = ["PidWatch", "gone_within"]

_POLL_S = 0.05


def _zombie_or_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] in (b"Z", b"X")


def gone_within(
    pid: int, pidfd: int | None, timeout_s: float | None, poll_s: float = _POLL_S
) -> bool:
    """Whether process ``pid`` (``pidfd``: its pidfd, or None to poll) is gone within
    ``timeout_s`` seconds (None: wait until it is; 0: look once)."""
    if pidfd is not None:
        return bool(select.select([pidfd], [], [], timeout_s)[0])
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        if _zombie_or_gone(pid):
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


class PidWatch:
    """One process, watched through its pidfd (or polled where pidfds are missing).

    Open it while the process is known to run (right after it started): a pid that is already
    gone reads as ended from the start. :meth:`close` releases the pidfd (also on garbage
    collection); an ended process's watch keeps saying so."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd: int | None = None
        self._ended = False
        try:
            self._fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._ended = True
        except (OSError, AttributeError):  # no pidfds here: poll
            self._ended = _zombie_or_gone(pid)

    def ended(self) -> bool:
        """Whether the kernel says the process ended (now, without waiting)."""
        return self.wait(0)

    def wait(self, timeout_s: float | None) -> bool:
        """Whether the process ended within ``timeout_s`` seconds (None: until it does)."""
        if not self._ended:
            self._ended = gone_within(self.pid, self._fd, timeout_s)
        return self._ended

    def send(self, sig: int) -> bool:
        """Send ``sig`` to the process if it still runs; whether it was sent."""
        if self.ended():
            return False
        try:
            if self._fd is not None:
                signal.pidfd_send_signal(self._fd, sig)
            else:
                os.kill(self.pid, sig)
        except ProcessLookupError:
            self._ended = True
            return False
        except OSError:
            return False
        return True

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            self._ended = self._ended or gone_within(self.pid, fd, 0)
            with contextlib.suppress(OSError):
                os.close(fd)
        elif not self._ended:
            self._ended = _zombie_or_gone(self.pid)

    def __del__(
        self,
        _close: Callable[[int], None] = os.close,
        _suppress: type[contextlib.suppress] = contextlib.suppress,
    ) -> None:
        # at interpreter exit this module's globals may be gone: only what was bound here
        fd, self._fd = self._fd, None
        if fd is not None:
            with _suppress(OSError):
                _close(fd)

    def __repr__(self) -> str:
        return f"<PidWatch pid={self.pid} {'ended' if self._ended else 'watched'}>"
