"""The verdicts a user reads, decided from facts by rules: pure functions, no clock, no waiting.

Two verdicts flaked while they were decided by which of two events reached graphdist first:

- **A task's status** (:func:`task_status`): ``dead`` when the kernel (a pidfd on this machine)
  or the task's engine (Ray's actor record, Slurm's step) says its process ended, with its exit
  status or signal; ``alive`` when it answered its probe; ``not answering`` only for a process
  that is still running and whose probe failed. A task graphdist's ``kill()`` is ending is dead
  even before the kernel says so (SIGKILL cannot be caught), and its detail says that graphdist
  killed it. The probe's answer never decides between ``dead`` and ``not answering``.
- **The cause of a restart** (:func:`restart_cause`): the task that ended first, by the time
  recorded where it ran (its guard's clock, an engine's record). Among ends close together
  (:data:`CLOSE_S`), a death (a signal other than SIGABRT, a task killed as frozen, a task lost
  with its node) ranks above an exit with an error code, which ranks above an exit 0. The order
  in which the news arrived plays no part.

The callers gather the facts (and wait, bounded, for news that is late); these functions only
decide. ``tests/test_verdicts.py`` tests the rules over injected facts.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass

from graphdist._failures import ALIVE, DEAD, NOT_ANSWERING, how_ended

__all__ = [
    "CLOSE_S",
    "KILLED_BY_GRAPHDIST",
    "ProcessFacts",
    "TaskEnd",
    "end_rank",
    "ended_detail",
    "restart_cause",
    "task_status",
]

#: Seconds within which two tasks' ends count as close together: a peer's death makes the
#: others fail fast (a collective's broken connection, in well under a second), so an error
#: exit this close after a death is taken as its consequence.
CLOSE_S = 1.0

#: What a task's detail adds when graphdist's own ``kill()`` ended it.
KILLED_BY_GRAPHDIST = "by graphdist's kill()"


@dataclass(frozen=True)
class ProcessFacts:
    """What is known of a task's process, from the only sources that know.

    - ``ended``: True once the kernel (a pidfd held since the process started) or the task's
      engine says it ended; False while it runs; None where nobody here can tell (a server on
      another machine that graphdist does not own).
    - ``exitcode``: how it ended, once known (Popen's convention: ``-N`` for signal N).
    - ``killed_with``: the signal graphdist's ``kill()`` sent to end it, if it did.
    - ``oom``: the kernel's (or the engine's) record that it was killed for memory, in words
      (``out of memory (...)``), if there is one.
    """

    ended: bool | None
    exitcode: int | None = None
    killed_with: int | None = None
    oom: str | None = None


def ended_detail(facts: ProcessFacts) -> str:
    """How a task's process ended, as its ``dead`` status's detail: its exit status or signal,
    saying so when graphdist killed it; what is known when its exit status has not arrived."""
    if facts.oom is not None and facts.killed_with is None:  # (Ray does not say how it ended)
        how = "" if facts.exitcode is None else f" and {how_ended(facts.exitcode)}"
        return f"ran {facts.oom}{how}"
    if facts.exitcode is not None:
        words = how_ended(facts.exitcode)
        if facts.killed_with is not None and facts.exitcode == -facts.killed_with:
            words += f" {KILLED_BY_GRAPHDIST}"
        return words
    if facts.killed_with is not None:
        return f"{how_ended(-facts.killed_with)} {KILLED_BY_GRAPHDIST}"
    return "ended; its exit status has not reached graphdist yet"


def task_status(facts: ProcessFacts, answered: bool, error: str = "") -> tuple[str, str]:
    """``(status, detail)`` of a task: its process's facts first, then its probe's answer
    (``answered``; ``error``: the probe's last gRPC error, for the detail).

    - the process ended: ``dead`` (whatever the probe said: a port can answer while its process
      is a zombie, and a dead one's probe may time out on a loaded machine);
    - the probe answered: ``alive``;
    - graphdist's ``kill()`` is ending it: ``dead`` (its exit's news is on its way);
    - else: ``not answering``, with the probe's error: a running process whose server did not
      answer (frozen, overloaded), or a server no one here can see the process of.
    """
    if facts.ended:
        return DEAD, ended_detail(facts)
    if answered:
        return ALIVE, ""
    if facts.killed_with is not None:
        return DEAD, ended_detail(facts)
    return NOT_ANSWERING, error


@dataclass(frozen=True)
class TaskEnd:
    """One task's end, as recorded where it ran.

    - ``name``: the task (``worker-1``);
    - ``ended_at_s``: when it ended, on one clock for every task of the run (seconds);
    - ``exitcode``: Popen's convention (``-N``: killed by signal N); None if unknown;
    - ``frozen``: graphdist killed it because it was frozen, or a straggler (the user asked
      for that); ``lost``: its node was lost; ``oom``: it was killed for memory (whatever its
      exit status: srun's is 1).
    """

    name: str
    ended_at_s: float
    exitcode: int | None
    frozen: bool = False
    lost: bool = False
    oom: bool = False


def end_rank(end: TaskEnd) -> int:
    """0: a death (killed by a signal other than SIGABRT, TensorFlow's own fatal error, which is
    often about a peer; killed as frozen; lost with its node; killed for memory); 1: an exit
    with an error code (or an unknown one); 2: an exit 0."""
    code = end.exitcode
    killed = code is not None and code < 0 and code != -signal.SIGABRT
    if end.frozen or end.lost or end.oom or killed:
        return 0
    return 2 if code == 0 else 1


def restart_cause(ends: Sequence[TaskEnd], close_s: float = CLOSE_S) -> TaskEnd:
    """The task whose end broke the attempt: of the ends within ``close_s`` seconds of the
    earliest one, the best ranked (:func:`end_rank`), then the earliest, then by name (so the
    same facts always give the same cause). Raises ValueError if ``ends`` is empty."""
    if not ends:
        raise ValueError("restart_cause needs at least one task's end")
    first = min(end.ended_at_s for end in ends)
    close = [end for end in ends if end.ended_at_s - first <= close_s]
    return min(close, key=lambda end: (end_rank(end), end.ended_at_s, end.name))
