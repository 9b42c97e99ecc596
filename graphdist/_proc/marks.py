"""A launched task's mark: every process of one task carries it in its environment
(:data:`MARK_ENV`), so that its leftovers are found (:func:`marked`) and ended (:func:`end_marked`)
where its guard could not end them (a SIGKILLed guard)."""

from __future__ import annotations

import contextlib
import os

from graphdist._proc.process import STOP_GRACE_S, proc_stat, stop_all

__all__ = ["MARK_ENV", "end_marked", "marked"]

#: The environment variable that marks every process of one launched task (its guard passes it
#: on, and so does whatever the task starts, unless it clears its environment): what finds the
#: task's leftovers when its guard could not end them (:func:`marked`).
MARK_ENV = "GRAPHDIST_TASK_MARK"


def marked(value: str, env: str = MARK_ENV) -> list[int]:
    """The live processes of this user whose environment has ``env=value`` (this one excepted):
    a task's processes once its guard is gone (re-parented to init, a ``setsid`` daemon
    included), or a fault-injection run's (its own mark)."""
    needle = f"{env}={value}".encode()
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:  # gone, or another user's
            continue
        if needle in environ.split(b"\0") and (proc_stat(int(entry)) or ("Z", 0))[0] not in "ZX":
            found.append(int(entry))
    return found


class _Marked:
    """A process found by its mark, for :func:`stop_all` (psutil refuses a reused pid)."""

    def __init__(self, pid: int) -> None:
        import psutil

        self._psutil = psutil
        try:
            self._proc: psutil.Process | None = psutil.Process(pid)
        except psutil.Error:
            self._proc = None

    def signal(self, sig: int) -> None:
        if self._proc is not None:
            with contextlib.suppress(self._psutil.Error):
                self._proc.send_signal(sig)

    def running(self) -> bool:
        if self._proc is None:
            return False
        try:
            return bool(self._proc.status() != self._psutil.STATUS_ZOMBIE)
        except self._psutil.Error:
            return False


def end_marked(value: str, grace_s: float = STOP_GRACE_S) -> list[int]:
    """End every process marked ``MARK_ENV=value`` (:func:`marked`) as :func:`stop_all` does;
    return the pids it found (normally none: a task's guard ends its tree itself)."""
    pids = marked(value)
    if pids:
        stop_all([_Marked(pid) for pid in pids], grace_s)
    return pids
