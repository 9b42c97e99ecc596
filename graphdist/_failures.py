"""The one home of "a task failed", at the bottom of graphdist's layers: every module that
reports a failed task, a dead process or a refused restart says it with these words (the fleet's
sessions and health, the launcher, the supervisor, ``graphdist status`` and the CLI).

- A task is named one way for people: ``worker-1`` (:func:`task_name`, ``Task.name``), as in log
  file names, output prefixes and ``GRAPHDIST_TASK``; TensorFlow's own device strings
  (``/job:worker/task:1``) stay TensorFlow's.
- How a process ended has one convention: exit codes as the process gave them, and a process
  killed by a signal named with the signal and the shell's exit status, which is what graphdist's
  commands exit with (``worker-1 was killed by SIGKILL (exit status 137)``).
- The statuses of a failed task (:data:`DEAD`, :data:`RESTARTED`, :data:`NOT_ANSWERING`) with
  their hints, and :func:`task_failed`, which builds every :class:`TaskFailedError`.
- Hints name API arguments (``start_timeout_s``); the CLI maps them to its flags when it prints
  an error (:func:`graphdist._cli.parser.cli_words`).
"""

from __future__ import annotations

import contextlib
import signal
from typing import Any

from graphdist._exceptions import TaskFailedError

__all__ = [
    "ALIVE",
    "DEAD",
    "NOT_ANSWERING",
    "RESTARTED",
    "dead_detail",
    "exit_status",
    "exited",
    "from_exit_status",
    "how_ended",
    "task_failed",
    "task_name",
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


def task_name(job: str, index: int) -> str:
    """``worker-1``: how graphdist names a task for people (``Task.name``)."""
    return f"{job}-{index}"


def exit_status(exitcode: int) -> int:
    """The shell's exit status of a process that ended with ``exitcode`` (Popen's: -N for a
    signal N): 128 + N for a signal, else the code, at most 255."""
    return min(128 - exitcode, 255) if exitcode < 0 else min(exitcode, 255)


def from_exit_status(status: int | None) -> int | None:
    """Popen's code of a process whose exit status (a shell's, srun's, graphdist's guard's) is
    ``status``: 128 + N (killed by signal N) is -N; the inverse of :func:`exit_status`."""
    if status is not None and 128 < status < 128 + signal.NSIG:
        return -(status - 128)
    return status


def how_ended(exitcode: int | None) -> str:
    """``exited with code 3``, ``was killed by SIGKILL (exit status 137)``, ``exited with an
    unknown code``."""
    if exitcode is None:
        return "exited with an unknown code"
    if exitcode < 0:
        name = f"signal {-exitcode}"
        with contextlib.suppress(ValueError):
            name = signal.Signals(-exitcode).name
        return f"was killed by {name} (exit status {exit_status(exitcode)})"
    return f"exited with code {exitcode}"


def exited(name: str, exitcode: int | None) -> str:
    """``worker-1 exited with code 3``, ``worker-1 was killed by SIGKILL (exit status 137)``."""
    return f"{name} {how_ended(exitcode)}"


def dead_detail(exitcode: int | None) -> str:
    """A dead task's health detail: ``exited with code 3``, ``was killed by SIGKILL ...``."""
    return how_ended(exitcode)


def task_failed(
    task: Any,
    status: str,
    detail: str = "",
    *,
    what: str = "",
    timeout_ms: int | None = None,
) -> TaskFailedError:
    """The one way a failed task is reported: ``Task worker-1 at address is STATUS (detail):
    what; what to do``, with the task, address, status and the session's timeout as
    attributes. ``task``: anything with ``job``, ``index`` and ``address`` (a TaskHandle)."""
    name = task_name(task.job, task.index)
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
