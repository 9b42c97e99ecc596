"""A run's timeline, read from its events (:func:`timeline`): what ``graphdist report`` draws
(:mod:`graphdist._distribute.report`, :mod:`graphdist._distribute.reportdraw`).

What a bar says is decided by a rule over the events' facts (:func:`_state`), never by their
order: an attempt's cause is the task its ``restarting`` or ``gave-up`` event names, with that
task's pid; a task that exited 0 is done; every other exit in an attempt that had a cause, a
preemption, a stop signal or the run's end was stopped (or preempted, with the preemption's
code); an exit in an attempt with none of those (a launcher that died) failed on its own.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from graphdist._distribute.events import Event, summary

__all__ = ["MAX_POINTS", "Point", "Span", "Thin", "Timeline", "order", "timeline"]

_JOBS = {"chief": 0, "worker": 1, "ps": 2, "evaluator": 3}
_TASK = re.compile(r"(.*)-([0-9]+)")
#: Progress records drawn per task and attempt: a long run's are thinned to at most twice as
#: many, evenly spread as they are read (its first and last kept).
MAX_POINTS = 1000


@dataclass
class Span:
    """One task's part of one attempt: from its start to its exit (``end_s`` None: no exit)."""

    task: str
    attempt: int
    start_s: float
    end_s: float | None = None
    exitcode: int | None = None
    how: str | None = None
    pid: int | None = None
    server: bool = False
    state: str = "running"


@dataclass
class Point:
    """One progress record of a task."""

    at_s: float
    attempt: int
    step: int
    steps_per_s: float | None
    loss: float | None
    redone: int


@dataclass
class Timeline:
    """What the report draws, read from a run's events (:func:`timeline`)."""

    tasks: list[str]
    spans: list[Span]
    attempts: dict[int, float]  # attempt -> when it started
    ends: dict[int, str]  # attempt -> how it ended, in words
    marks: list[tuple[float, str, str | None, str]]  # (at_s, kind, task, words)
    progress: dict[str, list[Point]] = field(default_factory=dict)
    took_s: float = 0.0
    outcome: str | None = None  # None: the events have no run-ended (a run going on, or lost)
    steps: dict[str, int] = field(default_factory=dict)
    redone: int = 0
    summary: str = ""
    skipped: int = 0  # lines of events.jsonl that were no event


class Thin:
    """At most ``2 * MAX_POINTS`` of one task's records in one attempt, evenly spread as they
    come: past that, every other one kept goes and the stride doubles. The first (with its
    ``redone``) and the newest are always kept."""

    def __init__(self) -> None:
        self.kept: list[Any] = []
        self.stride, self.seen = 1, 0
        self.newest: Any = None

    def add(self, item: Any) -> None:
        if self.seen % self.stride == 0:
            self.kept.append(item)
            self.newest = None
        else:
            self.newest = item
        self.seen += 1
        if len(self.kept) >= 2 * MAX_POINTS:
            self.kept = self.kept[::2]
            self.stride *= 2

    def items(self) -> list[Any]:
        return self.kept + ([] if self.newest is None else [self.newest])


def order(task: str) -> tuple[int, int, str]:
    match = _TASK.fullmatch(task)
    if match is None:
        return (9, 0, task)
    return (_JOBS.get(match.group(1), 8), int(match.group(2)), task)


def timeline(events: Sequence[Event], skipped: int = 0) -> Timeline:
    """The report's content from a run's events, each bar's state by the rule of the module
    docstring."""
    spans: list[Span] = []
    open_: dict[str, Span] = {}
    attempts: dict[int, float] = {}
    causes: dict[int, tuple[str, int | None]] = {}  # attempt -> (task, pid) it names
    preempted: dict[int, int] = {}  # attempt -> the preemption code
    stopped: set[int] = set()  # attempts a stop signal ended
    ends: dict[int, str] = {}
    marks: list[tuple[float, str, str | None, str]] = []
    progress: dict[str, list[Point]] = {}
    tasks: set[str] = set()

    def close(task: str, end_s: float | None, **facts: Any) -> Span:
        span = open_.pop(task, None)
        if span is None:  # an exit with no start (a server, a task that never started)
            span = Span(task, attempt, attempts.get(attempt, end_s or 0.0))
        spans.append(span)
        span.end_s = end_s
        for name, value in facts.items():
            setattr(span, name, value)
        return span

    for e in events:
        attempt, d = e.attempt, e.data
        if e.task is not None:
            tasks.add(e.task)
        if e.kind == "attempt-started":
            attempts[attempt] = e.at_s
            for server in d.get("servers", []):
                open_[server] = Span(server, attempt, e.at_s, server=True)
                tasks.add(server)
            tasks.update(d.get("tasks", []))
            if attempt > 1:
                restarts = d.get("restarts", 0)
                again = f" (restart {restarts})" if restarts else ""
                marks.append((e.at_s, "attempt", None, f"attempt {attempt}{again}"))
        elif e.kind == "task-started" and e.task is not None:
            if e.task in open_:
                close(e.task, e.at_s)
            open_[e.task] = Span(e.task, attempt, e.at_s, pid=d.get("pid"))
        elif e.kind == "task-exited" and e.task is not None:
            ended = d.get("ended_at_s")
            close(
                e.task,
                e.at_s if ended is None else float(ended),
                exitcode=d.get("exitcode"),
                how=d.get("how"),
                pid=d.get("pid"),
                server=bool(d.get("server")),
            )
        elif e.kind in ("restarting", "gave-up"):
            cause = d["cause"]
            when = float(cause.get("ended_at_s", e.at_s))
            words = f"{cause['task']} {cause.get('how') or 'failed'}"
            if e.kind == "restarting" and d.get("scope") == "server":
                # the server alone restarts on its address; the attempt goes on
                close(cause["task"], when, exitcode=cause.get("exitcode"), how=cause.get("how"))
                spans[-1].state = "failed"
                spans[-1].server = True
                open_[cause["task"]] = Span(
                    cause["task"], attempt, e.at_s + float(d.get("wait_s", 0.0)), server=True
                )
                marks.append((when, "failure", cause["task"], f"{words}; its server restarted"))
                continue
            causes[attempt] = (cause["task"], cause.get("pid"))
            marks.append((when, "failure", cause["task"], words))
            ends[attempt] = f"{words}; {d.get('decision', '')}".rstrip("; ")
        elif e.kind == "preempted":
            preempted[attempt] = int(d["code"])
            ends[attempt] = f"preempted (every task exited {d['code']}); {d.get('decision', '')}"
            marks.append((e.at_s, "preempted", None, "preempted"))
        elif e.kind == "stopping":
            stopped.add(attempt)
            ends.setdefault(attempt, f"{d['signal']}: stopped")
            marks.append((e.at_s, "stopping", None, d["signal"]))
        elif e.kind == "straggler" and e.task is not None:
            marks.append((e.at_s, "straggler", e.task, "straggler"))
        elif e.kind == "progress" and e.task is not None:
            scalars = d.get("scalars")
            loss = scalars.get("loss") if isinstance(scalars, dict) else None
            progress.setdefault(e.task, []).append(
                Point(
                    e.at_s,
                    attempt,
                    int(d["step"]),
                    _finite(d.get("steps_per_s")),
                    _finite(loss),
                    int(d.get("redone") or 0),
                )
            )
    for task in list(open_):
        close(task, None)
    for task, series in progress.items():
        by_attempt: dict[int, Thin] = {}
        for point in series:
            by_attempt.setdefault(point.attempt, Thin()).add(point)
        progress[task] = [p for a in sorted(by_attempt) for p in by_attempt[a].items()]
    ended = next((e for e in reversed(events) if e.kind == "run-ended"), None)
    if ended is not None:  # the launcher ended the last attempt: its tasks' exits were stops
        stopped.add(ended.attempt)
    for span in spans:
        if span.state == "failed":  # a server's restart said so
            continue
        span.state = _state(span, causes.get(span.attempt), preempted.get(span.attempt), stopped)
    took = max((e.at_s for e in events), default=0.0)
    for attempt in attempts:
        if attempt not in ends:
            last = max(attempts)
            ends[attempt] = (
                (str(ended.data.get("outcome")) if ended is not None else "still running")
                if attempt == last
                else "ended"
            )
    return Timeline(
        tasks=sorted(tasks, key=order),
        spans=spans,
        attempts=attempts,
        ends=ends,
        marks=sorted(marks, key=lambda m: m[0]),
        progress=progress,
        took_s=took,
        outcome=None if ended is None else str(ended.data.get("outcome")),
        steps=dict(ended.data.get("steps") or {}) if ended is not None else {},
        redone=int(ended.data.get("redone") or 0) if ended is not None else 0,
        summary=summary(events),
        skipped=skipped,
    )


def _finite(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def _state(
    span: Span, cause: tuple[str, int | None] | None, code: int | None, stopped: set[int]
) -> str:
    """How a task's attempt ended, by rule: no exit → running; exit 0 → done; the attempt's
    cause (its task, and its pid where both say one) → failed; the preemption's code in a
    preempted attempt → preempted; any other exit in an attempt that a cause, a preemption, a
    stop signal or the run's end ended (a timeout, a task that could not start: the launcher
    names a task's own failure as a cause, a ``gave-up`` at least), or a server's (the launcher
    ends them with the attempt) → stopped; else (a launcher that died) → failed."""
    if span.end_s is None or (span.exitcode is None and span.how is None):
        return "running"
    if span.exitcode == 0:
        return "done"
    if cause is not None and cause[0] == span.task and None in (cause[1], span.pid):
        return "failed"
    if cause is not None and cause == (span.task, span.pid):
        return "failed"
    if code is not None and span.exitcode == code:
        return "preempted"
    if span.server or cause is not None or code is not None or span.attempt in stopped:
        return "stopped"  # a server ends with its attempt: a failed one is a cause
    return "failed"
