"""Task health, checked over gRPC: alive, dead (its process exited), or not answering; and the
one home of "a task failed".

A frozen task (SIGSTOP, a stuck machine) still has its port open, so only a real call with a
deadline tells it apart from a live one. All tasks are probed at once, so a health check takes at
most one probe timeout however many tasks are frozen.

How a failed task is reported is decided here and nowhere else: the status constants and their
hints, :func:`task_failed` (every :class:`TaskFailedError`), :func:`exited` and
:func:`dead_detail` (how a process ended, in words: the CLI, the supervisor, ``graphdist
status``, the launcher and a failed start all say it with them).
"""

from __future__ import annotations

import contextlib
import html
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from graphdist._exceptions import TaskFailedError
from graphdist._net.probe import probe_many, probers

if TYPE_CHECKING:
    from graphdist._fleet.task import TaskHandle

__all__ = [
    "ALIVE",
    "DEAD",
    "NOT_ANSWERING",
    "RESTARTED",
    "HealthReport",
    "TaskHealth",
    "dead_detail",
    "exited",
    "probe_all",
    "problem_of",
    "task_failed",
]

ALIVE = "alive"
DEAD = "dead"
NOT_ANSWERING = "not answering"
RESTARTED = "restarted"
"""A task whose server was started again since a session opened: the session's state is lost."""
_HINTS = {
    DEAD: "restart it with fleet.restart({job!r}, {index}) and open a new session",
    RESTARTED: "its server lost this session's state; open a new session",
    NOT_ANSWERING: "it may be frozen or overloaded",
}


@dataclass(frozen=True)
class TaskHealth:
    """One task's health: ``status`` is ``"alive"``, ``"dead"`` or ``"not answering"``."""

    job: str
    index: int
    address: str
    pid: int | None
    status: str
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == ALIVE

    def __str__(self) -> str:
        extra = f" ({self.detail})" if self.detail else ""
        return f"{self.job}:{self.index} at {self.address} pid={self.pid}: {self.status}{extra}"


class HealthReport(list[TaskHealth]):
    """What ``fleet.health()`` returns: a list of :class:`TaskHealth`, one line per task as
    text, a table in a notebook."""

    def __str__(self) -> str:
        return "\n".join(map(str, self))

    def _repr_html_(self) -> str:
        colours = {ALIVE: "#d9f2d9", DEAD: "#f8d0d0", NOT_ANSWERING: "#fbe8c0"}
        rows = "".join(
            f'<tr style="background:{colours.get(h.status, "#eee")}"><td>{h.job}:{h.index}</td>'
            f"<td>{html.escape(h.address)}</td><td>{h.pid}</td><td>{h.status}</td>"
            f"<td>{html.escape(h.detail)}</td></tr>"
            for h in self
        )
        return (
            "<table><thead><tr><th>task</th><th>address</th><th>pid</th><th>health</th>"
            f"<th>detail</th></tr></thead><tbody>{rows}</tbody></table>"
        )


def _code(exitcode: int | None) -> str:
    """``code 3``, ``code -9 (SIGKILL)`` (killed by a signal), ``an unknown code``."""
    if exitcode is None:
        return "an unknown code"
    if exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"code {exitcode} ({signal.Signals(-exitcode).name})"
    return f"code {exitcode}"


def dead_detail(exitcode: int | None) -> str:
    """A dead task's health detail: ``exit code 3``, ``exit code -9 (SIGKILL)``."""
    return f"exit {_code(exitcode)}"


def exited(name: str, exitcode: int | None) -> str:
    """``NAME exited with code 3`` (``... with code -9 (SIGKILL)``): how a process ended."""
    return f"{name} exited with {_code(exitcode)}"


def probe_all(addresses: Sequence[str], timeout_s: float) -> list[tuple[bool, str | None]]:
    """Probe every address at once; ``(answered, last gRPC error)`` for each, in order."""
    with probers(addresses) as each:
        answered = probe_many(each, timeout_s)
        return [(ok, p.last_error) for ok, p in zip(answered, each, strict=True)]


def problem_of(task: TaskHandle, pid: int | None, restarts: int | None) -> tuple[str, str] | None:
    """``(status, detail)`` if ``task`` died, or was restarted since it had ``pid`` and
    ``restarts``; None while it is the same live process."""
    alive = task.alive
    if task.restarts != restarts and (alive or task.pid is None):
        now = f"now pid {task.pid}" if alive else "its new server is starting"
        return RESTARTED, f"pid {pid} before, {now}"
    if not alive:
        return DEAD, dead_detail(task.exitcode)
    if task.pid != pid:
        return RESTARTED, f"pid {pid} before, now pid {task.pid}"
    return None


def task_failed(
    task: TaskHandle | TaskHealth,
    status: str,
    detail: str = "",
    *,
    what: str = "",
    timeout_ms: int | None = None,
) -> TaskFailedError:
    """The one way a failed task is reported: ``Task job:i at address is STATUS (detail): what;
    what to do``, with the task, address, status and the session's timeout as attributes."""
    name = f"{task.job}:{task.index}"
    verb = "was" if status == RESTARTED else "is"
    hint = _HINTS.get(status, "").format(job=task.job, index=task.index)
    return TaskFailedError(
        f"Task {name} at {task.address} {verb} {status}"
        + (f" ({detail})" if detail else "")
        + (f": {what}" if what else "")
        + (f"; {hint}" if hint else ""),
        task=name,
        address=task.address,
        status=status,
        timeout_ms=timeout_ms,
    )
