"""Task health, checked over gRPC: alive, dead (its process exited), or not answering; and the
one home of "a task failed".

A frozen task (SIGSTOP, a stuck machine) still has its port open, so only a real call with a
deadline tells it apart from a live one; a busy one answers it (the liveness call of
:mod:`graphdist._net.probe`, not TensorFlow's GetStatus, which waits for a free thread of the
server's compute pool). All tasks are probed at once, so a health check takes at
most one probe timeout however many tasks are frozen.

How a failed task is *worded* is decided in :mod:`graphdist._failures` (the bottom layer, so the
launcher and the supervisor use it too); this module decides what changed for a session
(:func:`problem_of`) and reads health over gRPC.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from graphdist._failures import (
    ALIVE,
    DEAD,
    NOT_ANSWERING,
    RESTARTED,
    dead_detail,
    task_name,
)
from graphdist._net.probe import probe_many, probers

if TYPE_CHECKING:
    from graphdist._fleet.task import TaskHandle

__all__ = ["HealthReport", "TaskHealth", "probe_all", "problem_of"]


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
        name = task_name(self.job, self.index)
        return f"{name} at {self.address} pid={self.pid}: {self.status}{extra}"


class HealthReport(list[TaskHealth]):
    """What ``fleet.health()`` returns: a list of :class:`TaskHealth`, one line per task as
    text, a table in a notebook."""

    def __str__(self) -> str:
        return "\n".join(map(str, self))

    def _repr_html_(self) -> str:
        """One row per task in its health's colour, with a text colour of its own (a dark
        theme's light text on a light background is unreadable)."""
        colours = {ALIVE: "#d9f2d9", DEAD: "#f8d0d0", NOT_ANSWERING: "#fbe8c0"}
        rows = "".join(
            f'<tr style="background:{colours.get(h.status, "#eee")};color:#1a1a1a">'
            f"<td>{task_name(h.job, h.index)}</td>"
            f"<td>{html.escape(h.address)}</td><td>{h.pid}</td><td>{h.status}</td>"
            f"<td>{html.escape(h.detail)}</td></tr>"
            for h in self
        )
        return (
            "<table><thead><tr><th>task</th><th>address</th><th>pid</th><th>health</th>"
            f"<th>detail</th></tr></thead><tbody>{rows}</tbody></table>"
        )


def probe_all(
    addresses: Sequence[str], timeout_s: float, *, alive: bool
) -> list[tuple[bool, str | None]]:
    """Probe every address at once (``alive``: is it alive, else does it serve TensorFlow);
    ``(answered, last gRPC error)`` for each, in order."""
    with probers(addresses, alive=alive) as each:
        answered = probe_many(each, timeout_s)
        return [(ok, p.last_error) for ok, p in zip(answered, each, strict=True)]


def problem_of(task: TaskHandle, pid: int | None, restarts: int | None) -> tuple[str, str] | None:
    """``(status, detail)`` if ``task`` died, or was restarted since it had ``pid`` and
    ``restarts``; None while it is the same live process."""
    alive = task.alive
    if task.restarts != restarts and (alive or task.pid is None):
        now = f"now pid {task.pid}" if alive else "its new server is starting"
        return RESTARTED, f"{_before(task, pid)}, {now}"
    if not alive:
        return DEAD, dead_detail(task.exitcode)
    if task.pid != pid:
        return RESTARTED, f"{_before(task, pid)}, now pid {task.pid}"
    return None


def _before(task: TaskHandle, pid: int | None) -> str:
    """``pid N before``, with why it ended where the backend's record says (a RayFleet server
    that Ray's memory monitor killed and Ray started again)."""
    why = task.ended_why(pid) if pid is not None else None
    return f"pid {pid} before" + (f" ran {why}" if why else "")
