"""One fault-injection run's state (:class:`Run`: its launcher, output, faults pending, injected
and missed, frozen processes) and the helpers over its processes (psutil: alive, signalled,
waited for, found by their mark), for :mod:`graphdist._faults.injector`."""

from __future__ import annotations

import contextlib
import math
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING

from graphdist._distribute.events import Event
from graphdist._faults.faults import MARK_ENV, Fault, Injected, Missed, OutputLine
from graphdist._faults.freezer import Freezer
from graphdist._proc.marks import marked
from graphdist._proc.process import proc_stat

if TYPE_CHECKING:
    import psutil

__all__ = [
    "Frozen",
    "Pending",
    "Run",
    "alive",
    "environ_of",
    "marked_procs",
    "pump",
    "remove_freezers",
    "signal_all",
    "start_time",
    "wait_gone",
]


def environ_of(proc: psutil.Process) -> dict[str, str] | None:
    import psutil

    try:
        return proc.environ()
    except psutil.Error:
        return None


def alive(proc: psutil.Process) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def signal_all(procs: Iterable[psutil.Process], sig: int) -> list[int]:
    """Send ``sig`` to each process still running (a reused pid is refused by psutil)."""
    import psutil

    sent = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)
            sent.append(proc.pid)
    return sent


def wait_gone(procs: Iterable[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    pending = list(procs)
    deadline = time.monotonic() + timeout_s
    while True:
        pending = [p for p in pending if alive(p)]
        if not pending or time.monotonic() >= deadline:
            return pending
        time.sleep(0.05)


def marked_procs(mark: str) -> list[psutil.Process]:
    """Every live process with ``MARK_ENV=mark`` in its environment, wherever it is."""
    import psutil

    found = []
    for pid in marked(mark, env=MARK_ENV):
        with contextlib.suppress(psutil.Error):
            found.append(psutil.Process(pid))
    return found


@dataclass
class Pending:
    fault: Fault
    due_since: float | None = None  # monotonic, once its condition held
    line: str | None = None


@dataclass
class Frozen:
    record: Injected
    procs: list[psutil.Process]
    thaw_at: float | None  # monotonic
    freezer: Freezer | None = None  # a hang's cgroup; None: a freeze (SIGSTOP)

    def thaw(self) -> bool:
        """SIGCONT (a freeze) or thaw the cgroup (a hang); whether anything was left."""
        live = [p for p in self.procs if alive(p)]
        if self.freezer is not None:
            self.freezer.thaw()
            return bool(live)
        return bool(signal_all(live, signal.SIGCONT))


@dataclass
class Run:
    """One launcher run in progress."""

    argv: list[str]
    mark: str
    launcher: subprocess.Popen[bytes]
    ps: int
    started: float = field(default_factory=time.monotonic)
    lines: queue.Queue[tuple[str, str | None, float]] = field(default_factory=queue.Queue)
    output: list[OutputLine] = field(default_factory=list)
    seen: dict[int, psutil.Process] = field(default_factory=dict)
    restart_values: set[int] = field(default_factory=set)
    # (task, attempt from 0) -> its guard's pid, as the launcher's task-started event says:
    # a warm task's guard is no child of the launcher, and its environment (GRAPHDIST_TASK)
    # is not in its /proc/PID/environ (set after the fork, in memory)
    guards: dict[tuple[str, int], int] = field(default_factory=dict)
    # each guard as it was when the run said it started: a reused pid is not it (is_running)
    guard_procs: dict[int, psutil.Process] = field(default_factory=dict)
    attempt: int = 0  # the launcher's current attempt (GRAPHDIST_RESTART), from its events
    summary_attempts: int = 0
    events: list[Event] = field(default_factory=list)
    injected: list[Injected] = field(default_factory=list)
    missed: list[Missed] = field(default_factory=list)
    frozen: list[Frozen] = field(default_factory=list)
    readers: list[threading.Thread] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.started


def remove_freezers(run: Run) -> None:
    """A hang's cgroup goes once its processes have (or they go back to the root cgroup)."""
    for frozen in run.frozen:
        if frozen.freezer is not None:
            frozen.freezer.remove()


def start_time(proc: psutil.Process) -> float:
    """When ``proc`` started, in seconds after boot (``time.CLOCK_BOOTTIME``'s count, which no
    change of the wall clock moves); infinity once it is gone."""
    stat = proc_stat(proc.pid)
    return math.inf if stat is None else stat.started


def pump(
    stream: IO[bytes] | None, name: str, lines: queue.Queue[tuple[str, str | None, float]]
) -> None:
    """Put each line of ``stream`` on ``lines`` with when it was read; ``None`` at its end."""
    try:
        if stream is not None:
            for raw in stream:
                lines.put((name, raw.decode("utf-8", "replace").rstrip("\r\n"), time.monotonic()))
    except (OSError, ValueError):
        pass
    finally:
        lines.put((name, None, time.monotonic()))
