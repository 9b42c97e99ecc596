"""What a fleet's task handle tells, on every backend: the :class:`TaskHandle` contract, the
names every handle derives from its :class:`Task` (:class:`TaskView`), and a death the fleet's
watcher saw (:class:`TaskExit`). Imported by the client, the guard and health alike, so none of
them imports another for its types."""

from __future__ import annotations

import os
from typing import NamedTuple, Protocol

from graphdist._cluster import Task

__all__ = ["LOG_TAIL_LINES", "TaskExit", "TaskHandle", "TaskView", "read_log_tail"]

LOG_TAIL_LINES = 12
"""How many of a task's last log lines its errors quote."""


class TaskExit(NamedTuple):
    """A task death the fleet's watcher saw: ``task`` (``"job:index"``), its ``pid``, its
    ``exitcode`` (negative: killed by that signal; ``None`` if the backend cannot tell) and when
    (``time.monotonic()``)."""

    task: str
    pid: int | None
    exitcode: int | None
    at: float


class TaskHandle(Protocol):
    """What a fleet's task handle tells, on every backend (a plain attribute or a property).

    ``alive``, ``pid``, ``exitcode`` and ``restarts`` are read by the fleet's watcher every
    ``watch_interval_s`` and by session guards: on every backend they are cheap and never
    block (a backend whose processes are elsewhere answers from what it last heard)."""

    @property
    def job(self) -> str: ...
    @property
    def index(self) -> int: ...
    @property
    def address(self) -> str: ...
    @property
    def target(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def pid(self) -> int | None: ...
    @property
    def alive(self) -> bool: ...
    @property
    def exitcode(self) -> int | None: ...
    @property
    def restarts(self) -> int: ...
    @property
    def log_path(self) -> str | None: ...
    def log_tail(self, lines: int = ...) -> list[str]: ...
    def ended_why(self, pid: int) -> str | None: ...


class TaskView:
    """What every backend's task handle derives from its :class:`Task`: the names. Subclasses add
    the rest of :class:`TaskHandle` (``pid``, ``alive``, ``exitcode``, ``restarts``, ``log_path``,
    ``log_tail``)."""

    task: Task

    @property
    def job(self) -> str:
        return self.task.job

    @property
    def index(self) -> int:
        return self.task.index

    @property
    def address(self) -> str:
        return self.task.address

    @property
    def target(self) -> str:
        return self.task.target

    @property
    def name(self) -> str:
        return self.task.name

    def ended_why(self, pid: int) -> str | None:
        """What the backend's own record says of why its process ``pid`` ended, where its exit
        status does not (``out of memory (...)``); None where it says nothing. May ask the
        backend (not for the watcher's cheap reads)."""
        return None


def read_log_tail(path: str | None, lines: int = LOG_TAIL_LINES) -> list[str]:
    """The last ``lines`` lines of a log file ([] if it cannot be read)."""
    if not path:
        return []
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            data = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [line for line in data.splitlines() if line.strip()][-lines:]
