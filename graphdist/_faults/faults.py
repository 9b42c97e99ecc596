"""Fault injection into a ``graphdist run``: kill or freeze one task at a chosen point, to test
that a training script survives a failed worker. The pytest plugin's ``graphdist_faults`` fixture
is a :class:`~graphdist._faults.injector.FaultInjector`; this module holds what to inject
and what a run did, ``injector`` the runner, the plugin only the fixture.

:meth:`FaultInjector.run` runs ``python -m graphdist run [OPTIONS] -- COMMAND`` (the launcher) as
a subprocess, reads its output line by line and injects each :class:`Fault` when it is due:

- ``kill(task, ...)``: SIGKILL to the task's processes (a worker that died: out of memory, a
  lost machine);
- ``freeze(task, ..., for_s=None)``: SIGSTOP to them (a worker that hangs: swapped out, a
  stuck NFS mount), and SIGCONT ``for_s`` seconds later, or never during the run. Whatever is
  still stopped when the launcher ends gets SIGCONT, then SIGKILL if it is still there, so
  nothing is left stopped.
- ``hang(task, ..., for_s=None)``: freeze them with a cgroup v2 freezer
  (:mod:`graphdist._faults.freezer`): a worker hung in native code, which no process state
  shows (they stay in state ``S``) and only a heartbeat finds; thawed and the cgroup removed as
  a freeze is. Needs a writable cgroup v2 hierarchy (root): ArgumentError otherwise.

When a fault is due:

- ``after=REGEX``: once the first output line of task ``of`` (default: the faulted task itself)
  in the fault's ``attempt`` matches ``REGEX`` (``re.search`` on the line without its
  ``[worker-1]`` prefix);
- ``after_s=SECONDS``: that many seconds after the task's process of that attempt started.

``attempt`` (default 0, the first) is the number of restarts before the attempt: the tasks of that
attempt have ``GRAPHDIST_RESTART=attempt``, and the launcher, which counts attempts from 1, shows
it as attempt ``attempt + 1``. Each line is matched in the attempt the launcher's event for it
says (the injector runs the launcher with ``--output-format jsonl`` and reads its events, never
its words: :mod:`graphdist._distribute.events`).

The task's processes are found among the launcher's descendants by their environment: the
command process of a chief or worker task is the child of the task's guard with
``GRAPHDIST_TASK=<task>`` and ``GRAPHDIST_RESTART=<attempt>`` (missing counts as 0); "the task's
processes" are that command and everything it started (the guard, graphdist's own machinery, is
left alone). A parameter-server run's ps and worker tasks are graphdist servers (they run no
COMMAND); they are found by their process title (``graphdist worker:1 (fleet of pid N)``), and a
worker server the launcher restarts in place does not start a new attempt. Only processes of
this run are ever signalled, by pid, through ``psutil.Process`` objects that refuse a pid the
system has since given to another process.

The run's processes also carry ``GRAPHDIST_FAULTS_RUN=<a mark of this run>`` in their environment
(and ``PYTHONUNBUFFERED=1`` unless ``env`` says otherwise, so that a script's ``print`` reaches
the launcher, and the fault, when it happens rather than when a buffer fills), so that
:meth:`FaultInjector.close` finds whatever escaped the launcher's tree.

:meth:`~FaultInjector.run` returns a :class:`RunOutcome`: the return code, every output line
(stdout, the prefixed lines as the launcher printed them; stderr as text), each line tagged with
its task and attempt, the faults injected (task, pid, attempt, when, and whether the process was
seen stopped or gone afterwards), those that never were (and why), and how many attempts the
run made (the launcher's attempt events and run-ended event, and the distinct
``GRAPHDIST_RESTART``
values seen, whichever is more). Bad arguments raise :class:`ArgumentError` naming the argument
and quoting the value, before anything starts. A run never waits forever: without ``wait_s``
(or ``timeout_s``, the launcher's own limit) the launcher is stopped after
:data:`DEFAULT_RUN_TIMEOUT_S` and the outcome says it ``timed_out``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from graphdist._exceptions import ArgumentError
from graphdist._validate import count, show
from graphdist._validate import timeout_s as check_timeout_s

if TYPE_CHECKING:
    pass

__all__ = [
    "DEFAULT_RUN_TIMEOUT_S",
    "MARK_ENV",
    "MAX_RESTARTS",
    "Fault",
    "Injected",
    "Missed",
    "OutputLine",
    "RunOutcome",
    "freeze",
    "hang",
    "kill",
]

Action = Literal["kill", "freeze", "hang"]

MARK_ENV = "GRAPHDIST_FAULTS_RUN"
"""Every process of one :meth:`FaultInjector.run` has this in its environment, set to the run's
mark (:attr:`RunOutcome.mark`)."""
SCAN_S = 0.2
"""Seconds between two looks at the launcher's processes (for ``after_s`` faults, thaws and the
attempts seen); a line that makes a fault due is acted on at once."""
DUE_WAIT_S = 10.0
"""Seconds a due fault waits for its task's process to be found before it counts as missed."""
STOP_WAIT_S = 30.0
"""Seconds the launcher gets to stop its tasks after SIGTERM before everything is SIGKILLed."""
STREAMS_WAIT_S = 5.0
"""Seconds to read on after the launcher has exited, for the output still in its pipes."""
GONE_WAIT_S = 10.0
"""Seconds to wait for SIGKILLed processes to be gone (and, once the launcher has exited, for
its tasks' guards to finish) before they are reported."""
DEFAULT_RUN_TIMEOUT_S = 600.0
"""Seconds :meth:`FaultInjector.run` waits for the launcher by default (no ``wait_s`` and no
``timeout_s``): then it is stopped and the outcome says so (``timed_out``), so that a frozen
task never makes a test wait forever (or for pytest-timeout, which leaves no outcome)."""
RUN_MARGIN_S = 60.0
"""Seconds past ``timeout_s`` (the launcher's own limit) that ``run`` waits by default."""
MAX_RESTARTS = 1000
"""The most ``max_restarts`` a run takes: each restart is a whole new attempt of the run, and a
test that needs more than a thousand of them has a problem no restart solves."""

_TASK_RE = re.compile(r"(chief|worker|ps)-(\d+)")


# --- what to inject -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """One fault to inject: ``action`` (``"kill"`` or ``"freeze"``) on ``task`` (``"worker-1"``),
    due ``after`` a line of task ``of`` matches (a compiled regex) or ``after_s`` seconds into
    the task's process, in attempt ``attempt``; a freeze is undone after ``for_s`` seconds (None:
    not during the run). Made by :func:`kill` and :func:`freeze`, which check the values."""

    action: Action
    task: str
    after: re.Pattern[str] | None = None
    after_s: float | None = None
    attempt: int = 0
    of: str | None = None
    for_s: float | None = None

    @property
    def watched(self) -> str:
        """The task whose lines ``after`` is matched against."""
        return self.of or self.task

    def __repr__(self) -> str:
        when = (
            f"after={self.after.pattern!r}"
            if self.after is not None
            else f"after_s={self.after_s:g}"
        )
        extra = f", of={self.of!r}" if self.of else ""
        extra += f", attempt={self.attempt}" if self.attempt else ""
        extra += f", for_s={self.for_s:g}" if self.for_s is not None else ""
        return f"{self.action}({self.task!r}, {when}{extra})"


def _task_name(value: object, name: str) -> str:
    if not isinstance(value, str) or _TASK_RE.fullmatch(value) is None:
        raise ArgumentError(
            f"{name} must be a task name such as 'worker-1' (chief-0, worker-N, ps-N), "
            f"not {show(value)}",
            name=name,
            value=value,
        )
    return value


def _make(
    action: Action,
    task: str,
    after: str | re.Pattern[str] | None,
    after_s: float | None,
    attempt: int,
    of: str | None,
    for_s: float | None,
) -> Fault:
    task = _task_name(task, "task")
    if of is not None:
        of = _task_name(of, "of")
    if (after is None) == (after_s is None):
        raise ArgumentError(
            f"Say when to {action} {task}: pass after=REGEX (a line of the task's output) or "
            "after_s=SECONDS (into the task's process), exactly one of them"
            + (f", not both ({show(after)} and {show(after_s)})" if after is not None else ""),
            name="after",
            value=(after, after_s),
        )
    pattern = None
    if after is not None:
        if isinstance(after, re.Pattern):
            pattern = after
        elif isinstance(after, str):
            try:
                pattern = re.compile(after)
            except re.error as exc:
                raise ArgumentError(
                    f"after must be a regular expression; {show(after)} is not: {exc}",
                    name="after",
                    value=after,
                ) from None
        else:
            raise ArgumentError(
                f"after must be a regular expression (a str or re.Pattern), not {show(after)}",
                name="after",
                value=after,
            )
    elif isinstance(after_s, bool) or not isinstance(after_s, int | float):
        raise ArgumentError(
            f"after_s must be a number of seconds, not {show(after_s)}",
            name="after_s",
            value=after_s,
        )
    elif not math.isfinite(after_s) or after_s < 0:
        raise ArgumentError(
            f"after_s must be a finite number of seconds >= 0, not {show(after_s)}",
            name="after_s",
            value=after_s,
        )
    count(attempt, "attempt", minimum=0)
    if for_s is not None:
        for_s = check_timeout_s(for_s, "for_s")
    return Fault(
        action,
        task,
        pattern,
        None if after_s is None else float(after_s),
        attempt,
        of,
        for_s,
    )


def kill(
    task: str,
    *,
    after: str | re.Pattern[str] | None = None,
    after_s: float | None = None,
    attempt: int = 0,
    of: str | None = None,
) -> Fault:
    """SIGKILL ``task``'s processes (see the module docstring for ``after``, ``after_s``,
    ``attempt`` and ``of``). Raises ArgumentError for a bad value."""
    return _make("kill", task, after, after_s, attempt, of, None)


def freeze(
    task: str,
    *,
    after: str | re.Pattern[str] | None = None,
    after_s: float | None = None,
    attempt: int = 0,
    of: str | None = None,
    for_s: float | None = None,
) -> Fault:
    """SIGSTOP ``task``'s processes, and SIGCONT them ``for_s`` seconds later (default: not
    during the run; at its end in any case). Raises ArgumentError for a bad value."""
    return _make("freeze", task, after, after_s, attempt, of, for_s)


def hang(
    task: str,
    *,
    after: str | re.Pattern[str] | None = None,
    after_s: float | None = None,
    attempt: int = 0,
    of: str | None = None,
    for_s: float | None = None,
) -> Fault:
    """Freeze ``task``'s processes in a cgroup of their own (a hang in native code: no
    ``T`` state), thawed ``for_s`` seconds later (default: at the run's end). Raises
    ArgumentError for a bad value, or where no writable cgroup v2 hierarchy exists."""
    from graphdist._faults.freezer import freezer_root

    if freezer_root() is None:
        raise ArgumentError(
            "hang() freezes a task with a cgroup v2 freezer and needs a writable cgroup v2 "
            "hierarchy (root, with cgroup2 mounted); use freeze() for a SIGSTOP instead",
            name="hang",
            value=task,
        )
    return _make("hang", task, after, after_s, attempt, of, for_s)


# --- what happened --------------------------------------------------------------------------------


@dataclass
class OutputLine:
    """One line of the launcher's output: ``stream`` (``"stdout"`` or ``"stderr"``), the
    ``task`` that printed it (None for the launcher's own lines), the ``attempt`` it belongs to,
    its ``text`` without the ``[task]`` prefix, and when it was read (seconds into the run)."""

    stream: str
    task: str | None
    attempt: int
    text: str
    at_s: float


@dataclass
class Injected:
    """A fault that was injected: the task's command (or server) process ``pid``, every process
    signalled (``pids``), the ``attempt``, when (``at_s``, seconds into the run), the ``line``
    that made it due (None for ``after_s``), whether the processes were then seen gone (kill)
    or stopped (freeze) (``confirmed``), and when a freeze was undone (``thawed_at_s``: when
    SIGCONT went to what was left of it; None if nothing was left by the end of the run)."""

    fault: Fault
    task: str
    pid: int
    pids: list[int]
    attempt: int
    at_s: float
    line: str | None
    confirmed: bool
    thawed_at_s: float | None = None

    @property
    def action(self) -> Action:
        return self.fault.action


@dataclass
class Missed:
    """A fault that was never injected, and ``why`` (its line never came, its attempt never
    happened, its task's process was not found)."""

    fault: Fault
    why: str


@dataclass
class RunOutcome:
    """How a :meth:`FaultInjector.run` went (see the module docstring)."""

    argv: list[str]
    mark: str
    returncode: int
    output: list[OutputLine]
    injected: list[Injected]
    missed: list[Missed]
    attempts: int
    restart_values: list[int]
    elapsed_s: float
    timed_out: bool
    pids: list[int]
    leftovers: list[int]
    """Processes of the run still there after the launcher had exited and :data:`GONE_WAIT_S`
    had passed (then SIGKILLed): something the launcher should have stopped."""
    wait_s: float | None = None
    """How long the run could last before it was stopped (``timed_out``), in seconds."""

    @property
    def lines(self) -> list[str]:
        """Every stdout line, as the launcher printed it (``[worker-1] step 3``)."""
        return [
            f"[{o.task}] {o.text}" if o.task else o.text
            for o in self.output
            if o.stream == "stdout"
        ]

    @property
    def stdout(self) -> str:
        return "".join(line + "\n" for line in self.lines)

    @property
    def stderr(self) -> str:
        return "".join(o.text + "\n" for o in self.output if o.stream == "stderr")

    @property
    def faults(self) -> list[Injected]:
        """The faults injected (the same as :attr:`injected`)."""
        return self.injected

    @property
    def restarts(self) -> int:
        """The restarts the run made (``attempts - 1``)."""
        return self.attempts - 1

    def lines_of(self, task: str, attempt: int | None = None) -> list[str]:
        """The text of ``task``'s lines (without the prefix), of one ``attempt`` or all."""
        return [
            o.text
            for o in self.output
            if o.task == task and (attempt is None or o.attempt == attempt)
        ]

    def launcher_lines(self) -> list[str]:
        """The launcher's own lines (``graphdist: ...``, ``Error: ...``), stdout and stderr."""
        return [o.text for o in self.output if o.task is None]

    def describe(self, tail: int = 30) -> str:
        """A few lines for an assertion message: the code, attempts, faults and the last
        ``tail`` lines of output."""
        head = [
            f"exit code {self.returncode}, {self.attempts} attempt(s) in {self.elapsed_s:.1f} s"
            + (self._timed_out_note() if self.timed_out else ""),
            *(f"injected {i.fault!r} into pid {i.pid} at {i.at_s:.1f} s" for i in self.injected),
            *(f"missed {m.fault!r}: {m.why}" for m in self.missed),
        ]
        last = [
            (f"[{o.task}] " if o.task else "")
            + o.text
            + (" (stderr)" if o.stream == "stderr" else "")
            for o in self.output[-tail:]
        ]
        return "\n".join([*head, "output:", *last])

    def _timed_out_note(self) -> str:
        if self.wait_s is None:
            return " (timed out)"
        return (
            f" (timed out: the launcher was still running after wait_s={self.wait_s:g} s and was "
            "stopped; pass a larger wait_s if the run needs longer)"
        )

    def __str__(self) -> str:
        return self.describe()
