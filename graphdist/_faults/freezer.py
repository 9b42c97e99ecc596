"""A task hung in native code, for real: its processes frozen by a cgroup v2 freezer.

SIGSTOP (``freeze``) leaves a mark anyone can read: state ``T`` in ``/proc/PID/stat``. A process
stuck in the kernel or in native code (an NFS read, a driver, a deadlock in every thread) shows
nothing of the kind, its threads simply stop running, and only a heartbeat finds it. The cgroup
v2 freezer does exactly that to the processes of a cgroup (``cgroup.freeze``): they stay in state
``S``, answer nothing, and still die of SIGKILL (unlike cgroup v1's freezer, whose frozen tasks
cannot die until thawed). It needs a writable cgroup v2 hierarchy: root on most machines.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterable

__all__ = ["Freezer", "freezer_root"]

_EMPTY_WAIT_S = 5.0


def freezer_root() -> str | None:
    """Where a cgroup v2 hierarchy is mounted and writable here (None: nowhere)."""
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    for fields in mounts:
        if len(fields) > 2 and fields[2] == "cgroup2" and os.access(fields[1], os.W_OK):
            return fields[1]
    return None


class Freezer:
    """A cgroup of its own under :func:`freezer_root` (``graphdist-hang-<token>``): :meth:`add`
    moves processes in, :meth:`freeze` / :meth:`thaw` stop and resume them, :meth:`remove`
    takes the cgroup away (what is still in it goes back to the hierarchy's root first)."""

    def __init__(self, root: str | None = None) -> None:
        root = root or freezer_root()
        if root is None:
            raise OSError("no writable cgroup v2 hierarchy on this machine (needs root)")
        self.root = root
        self.path = os.path.join(root, f"graphdist-hang-{secrets.token_hex(6)}")
        os.mkdir(self.path)

    def add(self, pids: Iterable[int]) -> list[int]:
        """Move ``pids`` in; those moved (a process already gone is left out)."""
        moved = []
        for pid in pids:
            try:
                self._write("cgroup.procs", str(pid))
            except (ProcessLookupError, OSError):
                continue
            moved.append(pid)
        return moved

    def freeze(self) -> bool:
        """Freeze every process in it; whether the kernel says it is frozen (within 5 s)."""
        self._write("cgroup.freeze", "1")
        deadline = time.monotonic() + _EMPTY_WAIT_S
        while time.monotonic() < deadline:
            if self.frozen():
                return True
            time.sleep(0.01)
        return False

    def frozen(self) -> bool:
        try:
            with open(os.path.join(self.path, "cgroup.events"), encoding="ascii") as f:
                return "frozen 1" in f.read().splitlines()
        except OSError:
            return False

    def thaw(self) -> None:
        with contextlib.suppress(OSError):
            self._write("cgroup.freeze", "0")

    def pids(self) -> list[int]:
        try:
            with open(os.path.join(self.path, "cgroup.procs"), encoding="ascii") as f:
                return [int(p) for p in f.read().split()]
        except OSError:
            return []

    def remove(self) -> None:
        """Thaw, hand back what is left to the root cgroup, and remove the cgroup."""
        if not os.path.isdir(self.path):
            return
        self.thaw()
        deadline = time.monotonic() + _EMPTY_WAIT_S
        while time.monotonic() < deadline:
            left = self.pids()
            for pid in left:
                with (
                    contextlib.suppress(OSError),
                    open(os.path.join(self.root, "cgroup.procs"), "w") as f,
                ):
                    f.write(str(pid))
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:  # EBUSY: a process is still leaving (a zombie being reaped)
                time.sleep(0.02)

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w", encoding="ascii") as f:
            f.write(value)
