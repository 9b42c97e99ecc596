"""What a run does, as structured events: the launcher emits them; the console output, the summary,
the log folder's ``events.jsonl`` and the fault injector all read them. Nothing reads the
launcher's human text: its words are one rendering of these events (:func:`render`).

An :class:`Event` has a ``kind``, the seconds since the run started (``at_s``), the ``attempt``
it belongs to (from 1, as everywhere graphdist shows attempts), the ``task`` it is about (if any,
named ``worker-1``) and the kind's own fields. Each kind is one frozen dataclass (its
:attr:`Event.payload`: :class:`AttemptStarted`, :class:`Line`, ...), which every run backend
emits with the same fields; :meth:`Event.from_json` checks a line's fields against it:

=================  ===========================================================================
kind               fields
=================  ===========================================================================
attempt-started    ``tasks`` (the command tasks), ``servers`` (ps runs: the server tasks),
                   ``restarts`` (the value of ``GRAPHDIST_RESTART`` in this attempt),
                   ``backend`` (the run backend's name), ``nodes`` (task -> the host or node
                   it runs on), ``cluster`` (every task's address, as TF_CONFIG has it)
task-started       ``pid`` (the task's guard), ``warm`` (forked from the run's warm interpreter,
                   TensorFlow already imported), ``cold_because`` (why not, for a cold task),
                   ``spare`` (its guard was forked while the failed attempt was stopped)
line               ``text``: one line of a task's output (cut at the launcher's line limit);
                   the console leaves out TensorFlow's own log lines unless
                   ``GRAPHDIST_TF_LOGS=1`` (:mod:`graphdist._tflog`)
task-exited        ``pid``, ``exitcode`` (Popen's: -9 for SIGKILL), ``how`` (in words),
                   ``ended_at_s`` (when the task's command ended, which may be before the
                   launcher saw it), ``server`` (true for a ps run's server task)
resumed            ``text``: what the attempt said it resumed from
restarting         ``cause`` (the task, ``how``, ``ended_at_s``), ``wait_s``, ``scope`` ("run" or
                   "server"), ``decision`` (the restart policy's words)
preempted          ``code`` (the preemption exit code every task exited with), ``decision``
preemption-notice  ``signal`` (SIGUSR1: Slurm's warning), ``tasks`` (those sent SIGTERM)
gave-up            ``cause`` as above, ``reason`` ("budget", "startup", "failed": no restarts
                   allowed), ``decision``
run-ended          ``outcome`` ("succeeded", "failed", "timed out", "stopped by SIGTERM" ...),
                   ``attempts``, ``logs`` (the run's log folder, or None), ``show`` (whether
                   the console showed the summary), ``ran`` (a success's command tasks, each
                   exited 0; empty otherwise), ``served`` (the server tasks that served them),
                   ``steps`` (each task's last reported steps, :func:`graphdist.step`; empty
                   where none reported), ``redone`` (the steps done again after restarts)
output-lost        ``sink`` (the task's log file, or with no task the run's metrics file:
                   ``--metrics-file``), ``error``
stopping           ``signal`` (the stop signal that came: SIGINT, SIGTERM, SIGHUP), ``tasks``
                   (those told, still running), ``grace_s`` (what each gets to end), ``again``
                   (whether the same signal once more ends them at once)
progress           ``step`` (steps done), ``total`` (the steps the script will do, when it
                   said), ``steps_per_s`` (since the task's record before in this attempt;
                   None for its first), ``scalars`` (e.g. ``loss``; None: not finite),
                   ``redone`` (on a later attempt's first record: the steps an earlier one had
                   done past this start), ``wait_s`` (what the task waited for the others
                   in its step: ``graphdist.step(ready=...)``, or ``graphdist.progress()``'s
                   marks in ``fit``; None where not said); never
                   rendered on the console, and not kept in memory: ``events.jsonl`` and
                   jsonl output have them
straggler          ``node``, ``steps_per_s`` (the task's), ``others_per_s`` (the other tasks'
                   median), ``costs_s`` (its step's time beyond theirs; synchronous: what the
                   others wait for it a step), ``for_s`` (how long it held), ``others_wait_s``
                   (synchronous: the others' median wait a step; None for the rate rule): a
                   task that stayed below a share of the others' rate, or the one the others
                   waited for; said once until it recovers, nothing restarted unless asked
folded             ``lines`` (how many of the task's output lines, read once its attempt was
                   broken, the console left out), ``after`` (what broke it, in words), ``log``
                   (the task's log file, which has them whole; None: no log folder)
=================  ===========================================================================

``graphdist run --output-format jsonl`` writes every event, task lines included, as one JSON
object a line on stdout (:meth:`Event.to_json`), in the order they happened; the default
``text`` format writes :func:`render`'s lines.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from graphdist._failures import exited
from graphdist._tflog import LOOKBACK, classify, is_tf_log, tf_logs_live

__all__ = [
    "KINDS",
    "AttemptStarted",
    "Cause",
    "ConsoleLines",
    "Event",
    "Folded",
    "GaveUp",
    "Line",
    "OutputLost",
    "Payload",
    "Preempted",
    "PreemptionNotice",
    "Progress",
    "Restarting",
    "Resumed",
    "RunEnded",
    "Stopping",
    "Straggler",
    "TaskExited",
    "TaskStarted",
    "render",
    "straggler_why",
    "summary",
]


# -- one dataclass per kind: every backend emits the same fields -------------------------------


@dataclass(frozen=True)
class AttemptStarted:
    """An attempt's tasks are placed (their addresses known) and about to start."""

    KIND: ClassVar[str] = "attempt-started"
    tasks: list[str]  # the command tasks
    servers: list[str]  # a ps run's server tasks
    restarts: int  # GRAPHDIST_RESTART in this attempt
    backend: str  # the run backend's name
    nodes: dict[str, str]  # task -> where it runs (a host name, a Ray node's id)
    cluster: dict[str, list[str]]  # every task's address, as TF_CONFIG names it


@dataclass(frozen=True)
class TaskStarted:
    """A command task's process started: warm (forked from the run's warm interpreter,
    :mod:`graphdist._distribute.warm`) or cold (a fresh process), and why not warm; ``spare``:
    its guard was forked ahead, while the failed attempt before it was being stopped."""

    KIND: ClassVar[str] = "task-started"
    pid: int | None
    warm: bool
    cold_because: str | None = None
    spare: bool = False


@dataclass(frozen=True)
class Line:
    KIND: ClassVar[str] = "line"
    text: str


@dataclass(frozen=True)
class TaskExited:
    KIND: ClassVar[str] = "task-exited"
    pid: int | None
    exitcode: int | None
    how: str
    ended_at_s: float | None = None  # when the command ended (None for a server)
    server: bool = False


@dataclass(frozen=True)
class Resumed:
    KIND: ClassVar[str] = "resumed"
    text: str


@dataclass(frozen=True)
class Cause:
    """The failed task that a restarting or gave-up event is about."""

    task: str
    pid: int | None
    exitcode: int | None
    how: str
    ended_at_s: float


@dataclass(frozen=True)
class Restarting:
    KIND: ClassVar[str] = "restarting"
    cause: Cause
    wait_s: float
    scope: str  # "run" or "server"
    decision: str


@dataclass(frozen=True)
class Preempted:
    KIND: ClassVar[str] = "preempted"
    code: int
    decision: str


@dataclass(frozen=True)
class PreemptionNotice:
    """The launcher got a preemption notice (Slurm's warning signal, SIGUSR1): every task still
    running was sent SIGTERM, so that TensorFlow's ``PreemptionCheckpointHandler`` saves and
    exits with the preemption code (a preemption: the run goes on at once)."""

    KIND: ClassVar[str] = "preemption-notice"
    signal: str
    tasks: list[str]


@dataclass(frozen=True)
class GaveUp:
    KIND: ClassVar[str] = "gave-up"
    cause: Cause
    reason: str  # "budget", "startup", "failed" (no restarts allowed), "gone" (the backend's
    # engine: Ray's head)
    decision: str


@dataclass(frozen=True)
class RunEnded:
    KIND: ClassVar[str] = "run-ended"
    outcome: str
    attempts: int
    logs: str | None = None
    show: bool = True
    ran: list[str] = field(default_factory=list)
    served: list[str] = field(default_factory=list)
    steps: dict[str, int] = field(default_factory=dict)  # task -> its last reported steps
    redone: int = 0  # steps done again after restarts, every task's


@dataclass(frozen=True)
class Stopping:
    """A stop signal came: every task still running was told (``tasks``) and gets ``grace_s``
    to end; ``again``: the same signal once more ends them at once."""

    KIND: ClassVar[str] = "stopping"
    signal: str
    tasks: list[str]
    grace_s: float
    again: bool = False


@dataclass(frozen=True)
class Folded:
    """A task's output lines read after its attempt broke, left out of the console: ``lines``
    of them, ``after`` what (in words), whole in ``log`` (None: the run keeps no log folder)."""

    KIND: ClassVar[str] = "folded"
    lines: int
    after: str
    log: str | None = None


@dataclass(frozen=True)
class Progress:
    """A task's training progress, as its script reported it (:func:`graphdist.step`, the
    :func:`graphdist.progress` callback), at most every ``progress.INTERVAL_S`` per process."""

    KIND: ClassVar[str] = "progress"
    step: int  # steps done
    total: int | None  # the steps the script said it will do, if it said
    steps_per_s: float | None  # since the task's record before, in this attempt
    scalars: dict[str, float | None]  # e.g. loss; None: not a finite number
    redone: int = 0  # steps an earlier attempt had done past this one's start: done again
    wait_s: float | None = None  # what the task waited for the others in its step (its ready)


@dataclass(frozen=True)
class Straggler:
    """A task whose step rate stayed below a share of the other tasks' median for a while, or
    (synchronous) the one the others waited for (:class:`graphdist._distribute.progress.
    Stragglers`); nothing is restarted for it unless the user asked."""

    KIND: ClassVar[str] = "straggler"
    node: str | None  # where it runs (the attempt's nodes)
    steps_per_s: float  # its rate
    others_per_s: float  # the other tasks' median rate
    costs_s: float  # what it costs a step: its step's time beyond the others' (or their wait)
    for_s: float  # how long it has held
    others_wait_s: float | None = None  # synchronous: the others' wait a step (the wait rule)


@dataclass(frozen=True)
class OutputLost:
    KIND: ClassVar[str] = "output-lost"
    sink: str | None
    error: str


Payload = (
    AttemptStarted
    | TaskStarted
    | Line
    | TaskExited
    | Resumed
    | Restarting
    | Preempted
    | PreemptionNotice
    | GaveUp
    | RunEnded
    | OutputLost
    | Stopping
    | Folded
    | Progress
    | Straggler
)
_TYPES: dict[str, type[Any]] = {
    t.KIND: t
    for t in (
        AttemptStarted,
        TaskStarted,
        Line,
        TaskExited,
        Resumed,
        Restarting,
        Preempted,
        PreemptionNotice,
        GaveUp,
        RunEnded,
        OutputLost,
        Stopping,
        Folded,
        Progress,
        Straggler,
    )
}
KINDS = tuple(_TYPES)


def _payload(kind: str, data: Mapping[str, Any]) -> Any:
    """The typed payload of ``kind`` from its JSON fields; ValueError for a field too many or
    one missing."""
    cls = _TYPES[kind]
    fields = dict(data)
    if isinstance(fields.get("cause"), Mapping):
        fields["cause"] = Cause(**fields["cause"])
    try:
        return cls(**fields)
    except TypeError as exc:
        raise ValueError(f"a {kind} event with other fields than {cls.__name__}'s: {exc}") from None


@dataclass(frozen=True)
class Event:
    """One thing a run did (see the module docstring for the kinds and their fields): its kind,
    when, in which attempt, about which task, and its payload's fields as ``data`` (what the
    JSON line carries, and what :func:`render` and :func:`summary` read)."""

    kind: str
    at_s: float
    attempt: int
    task: str | None = None
    data: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, payload: Payload, at_s: float, attempt: int, task: str | None = None) -> Event:
        """The event of a typed payload."""
        return cls(payload.KIND, at_s, attempt, task, dataclasses.asdict(payload))

    @property
    def payload(self) -> Any:
        """The typed payload (:data:`Payload`); ValueError when ``data`` is not its kind's."""
        return _payload(self.kind, self.data)

    def to_json(self) -> str:
        head = {"event": self.kind, "at_s": round(self.at_s, 3), "attempt": self.attempt}
        if self.task is not None:
            head["task"] = self.task
        return json.dumps({**head, **self.data}, sort_keys=False)

    @classmethod
    def from_json(cls, text: str) -> Event:
        """The event :meth:`to_json` wrote, its fields checked against its kind's dataclass;
        ValueError for anything else."""
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("event") not in KINDS:
            raise ValueError(f"not a graphdist run event: {text[:200]!r}")
        kind, at_s, attempt = data.pop("event"), data.pop("at_s"), data.pop("attempt")
        task = data.pop("task", None)
        _payload(kind, data)
        return cls(kind, float(at_s), int(attempt), task, data)


def _cause(data: Mapping[str, Any]) -> str:
    """``worker-1 was killed by SIGKILL (exit status 137)``, or as the cause's ``how`` says
    (``was frozen (...) and was killed``)."""
    cause = data["cause"]
    how = cause.get("how")
    return f"{cause['task']} {how}" if how else exited(cause["task"], cause.get("exitcode"))


def _shown(task: str | None, text: str, before: Sequence[str]) -> str | None:
    """A task's line as the console shows it, or None for one of TensorFlow's own (kept in the
    task's log and in jsonl; ``GRAPHDIST_TF_LOGS=1`` shows them); ``before``: its last lines."""
    if not tf_logs_live(check=False) and is_tf_log(text, before):
        return None
    return f"[{task}] {text}"


class ConsoleLines:
    """The console's rendering of task lines as they come: it keeps each task's reading state
    (what makes a line a continuation of TensorFlow's), not its lines and not the events (a run
    keeps no line events: a chatty task's lines add up), so each line is read once."""

    def __init__(self) -> None:
        self._state: dict[str, str | None] = {}

    def render(self, task: str, text: str) -> str | None:
        """``[task] text``, or None for one of TensorFlow's own lines (see :func:`render`)."""
        tf_line, self._state[task] = classify(text, self._state.get(task))
        if tf_line and not tf_logs_live(check=False):
            return None
        return f"[{task}] {text}"


def _lines_before(task: str | None, events: Sequence[Event]) -> list[str]:
    """The last few lines ``task`` wrote, oldest first (what can make a line a continuation)."""
    lines: list[str] = []
    for e in reversed(events[-200:]):
        if e.kind == "line" and e.task == task:
            lines.append(e.data["text"])
            if len(lines) == LOOKBACK:
                break
    return lines[::-1]


def straggler_why(data: Mapping[str, Any]) -> str:
    """Why a task was named a straggler, in words (a ``straggler`` event's fields): the
    console's line and a restart's cause (``--restart-stragglers``) both say it."""
    if data.get("others_wait_s") is not None:
        return (
            f"the other tasks wait {data['costs_s'] * 1000:.0f} ms a step for it, "
            f"for {data['for_s']:.0f} s"
        )
    return (
        f"{data['steps_per_s']:.1f} steps/s against the other tasks' "
        f"{data['others_per_s']:.1f} for {data['for_s']:.0f} s"
    )


def render(event: Event, events: Sequence[Event] = (), *, success: bool = True) -> str | None:
    """The console's words for ``event`` (``None``: it shows nothing); ``events``, every event
    of the run so far, for the summary that ``run-ended`` shows; ``success``: whether a run that
    succeeded says so in a line of its own (not where its output was lost: its exit status 0
    says it, and the loss was said once)."""
    data = event.data
    if event.kind == "line":
        return _shown(event.task, data["text"], _lines_before(event.task, events))
    if event.kind == "restarting":
        if data.get("scope") == "server":
            return (
                f"graphdist: the server of {_cause(data)}; {data['decision']} on its address; "
                "the coordinator carries on"
            )
        return f"graphdist: {_cause(data)}; every task was stopped; {data['decision']}"
    if event.kind == "preemption-notice":
        return (
            f"graphdist: {data['signal']}, a preemption notice: sent SIGTERM to "
            f"{', '.join(data['tasks']) or 'no task'} to save and exit with the preemption code"
        )
    if event.kind == "preempted" and str(data.get("decision", "")).startswith("the run ends"):
        return (
            f"graphdist: attempt {event.attempt} was preempted: every task exited with code "
            f"{data['code']}; {data['decision']}"
        )
    if event.kind == "preempted":
        return (
            f"graphdist: attempt {event.attempt} was preempted: every task exited with code "
            f"{data['code']}; restarting the run at once (a preemption spends no restart)"
        )
    if event.kind == "stopping":
        count = len(data["tasks"])
        name = "Ctrl-C" if data["signal"] == "SIGINT" else data["signal"]
        if not count:
            return f"graphdist: {name}: stopping the run (no task runs)"
        told = f"stopping {count} task{'' if count == 1 else 's'}"
        if data.get("again"):
            return f"graphdist: {name}: {told}; {name} again to kill them now"
        return f"graphdist: {name}: {told}; each gets up to {data['grace_s']:g} s to end"
    if event.kind == "folded":
        count = data["lines"]
        kept = f"whole in {data['log']}" if data.get("log") else "pass --log-dir to keep them"
        return (
            f"graphdist: {event.task}: {count} line{'' if count == 1 else 's'} after "
            f"{data['after']} not shown ({kept})"
        )
    if event.kind == "straggler":
        where = f" on {data['node']}" if data.get("node") else ""
        more = (
            f"at {data['steps_per_s']:.1f} steps/s"
            if data.get("others_wait_s") is not None
            else f"{data['costs_s'] * 1000:.0f} ms more a step"
        )
        return (
            f"graphdist: {event.task}{where} is a straggler: {straggler_why(data)}, {more} "
            "(nothing is restarted for it)"
        )
    if event.kind == "run-ended":
        shown = [summary([*events, event])] if data.get("show", True) else []
        if data.get("ran") and success:  # a success says so, however soon it came (issue 57)
            shown.append(succeeded(data["ran"], data.get("served", [])))
        return "\n".join(shown) or None
    if event.kind == "output-lost" and event.task is None and data.get("sink") != "output":
        return (
            f"graphdist: cannot write the run's metrics {data['sink']}: {data['error']}; they "
            "are no longer written"
        )
    if event.kind == "output-lost" and data.get("sink") != "output":
        return (
            f"graphdist: cannot write {event.task}'s log {data['sink']}: {data['error']}; its "
            "output is no longer logged there"
        )
    return None


def succeeded(ran: Sequence[str], served: Sequence[str]) -> str:
    """A successful run's last line: its command tasks, each exited 0, and its server tasks."""
    line = f"graphdist: the run succeeded: {len(ran)} task(s) exited 0 ({', '.join(ran)})"
    if served:
        line += f"; {len(served)} server task(s) served it ({', '.join(served)})"
    return line


def summary(events: Sequence[Event]) -> str:
    """The run's summary, from its events: attempts, the time, how it ended, which task failed
    how and when in each attempt, what the next attempt resumed from, and the log folder."""
    ended = next((e for e in reversed(events) if e.kind == "run-ended"), None)
    attempts = max((e.attempt for e in events), default=1)
    took = events[-1].at_s if events else 0.0
    outcome = "" if ended is None else f"; {ended.data['outcome']}"
    lines = [f"graphdist: run summary: {attempts} attempt(s) in {took:.1f} s{outcome}"]
    resumed = {e.attempt: e.data["text"] for e in events if e.kind == "resumed"}
    for e in events:
        if e.kind == "preempted":
            lines.append(f"  attempt {e.attempt}: preempted (every task exited {e.data['code']})")
        elif e.kind in ("restarting", "gave-up") and "cause" in e.data:
            cause = e.data["cause"]
            when = cause.get("ended_at_s", e.at_s)
            line = f"  attempt {e.attempt}: {_cause(e.data)} at {when:.1f} s"
            if e.kind == "restarting" and e.data.get("scope") == "server":
                line += " (its server was restarted)"
            elif e.kind == "restarting" and e.attempt + 1 in resumed:
                line += f"; attempt {e.attempt + 1} resumed from {resumed[e.attempt + 1]}"
            lines.append(line)
    steps = {} if ended is None else ended.data.get("steps") or {}
    if steps:
        line = "  steps: " + ", ".join(f"{task} {n}" for task, n in sorted(steps.items()))
        redone = ended.data.get("redone", 0) if ended is not None else 0
        lines.append(line + (f" ({redone} done again after restarts)" if redone else ""))
    if ended is not None and ended.data.get("logs"):
        lines.append(f"  logs: {ended.data['logs']}")
    return "\n".join(lines)
