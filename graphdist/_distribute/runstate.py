"""What a run keeps across its attempts (:class:`RunState`): its spec, policy and deadline, the
attempt it is in, and its events, rendered for the console, recorded in the log folder and, with
``--output-format jsonl``, printed as they happen; the task lines a broken attempt held
(:class:`graphdist._distribute.fallout.Fallout`) are given back by the event that ends its story."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from graphdist._distribute.events import (
    AttemptStarted,
    Cause,
    ConsoleLines,
    Event,
    Folded,
    GaveUp,
    Line,
    OutputLost,
    Payload,
    Preempted,
    Progress,
    Restarting,
    RunEnded,
    TaskExited,
    render,
    straggler_why,
    summary,
)
from graphdist._distribute.fallout import DEATH_SLACK_S, Fallout
from graphdist._distribute.liveline import LiveLine
from graphdist._distribute.progress import StepBook, Stragglers
from graphdist._distribute.runlogs import RunLogs
from graphdist._distribute.runmetrics import RunMetrics
from graphdist._distribute.runspec import RunSpec
from graphdist._distribute.taskproc import Output, how
from graphdist._exceptions import LaunchTimeoutError, TaskOutcome
from graphdist._proc.restarts import RestartPolicy
from graphdist._proc.signals import SignalScope

__all__ = ["RunState"]

#: The events that end a broken attempt's story: what its break held is given back with them.
_ENDS_A_BREAK = (Restarting, GaveUp, AttemptStarted, RunEnded, Preempted)


class RunState:
    """What a run keeps across its attempts: its spec, where its output goes and in which
    format, its log folder, its restart policy and deadline, which attempt it is in (from 1),
    and its events, which it renders and records as they happen (:mod:`graphdist._distribute.
    events`)."""

    def __init__(self, spec: RunSpec, logs: RunLogs | None) -> None:
        self.spec = spec
        self.out = Output(spec.output, None if logs is None else logs.path)
        self.jsonl = spec.jsonl
        self.logs = logs
        self.policy = RestartPolicy(
            spec.max_restarts,
            spec.restart_window_s,
            what="the run",
            min_uptime_s=spec.min_uptime_s,
        )
        self.timeout_s = spec.timeout_s
        self.preemption_code = spec.preemption_code
        self.heartbeat_s = spec.heartbeat_s
        self.started = time.monotonic()
        self.attempt = 1
        self.events: list[Event] = []  # every event but the output lines
        self.console = ConsoleLines()  # TensorFlow's own lines stay in the logs (issue 29)
        # the lines read once an attempt broke
        self.fallout = Fallout(self._show, keep=self.jsonl, deaths=self.death_at)
        self.procs: list[Any] = []  # the attempt's command tasks (run_attempts's list)
        self.ended = False
        self.metrics = None if spec.metrics_file is None else RunMetrics(spec.metrics_file)
        self.steps = StepBook()  # the tasks' progress records (graphdist.step)
        self.stragglers = Stragglers()  # the rule over their rates
        # stragglers to kill (--restart-stragglers): task -> (its attempt, why)
        self._slow: dict[str, tuple[int, str]] = {}
        self.nodes: dict[str, str] = {}  # the attempt's: task -> where it runs
        self.live = LiveLine.maybe(spec.output, self.out.lock, self.jsonl)  # on a terminal
        self.out.live = self.live
        self._lock = threading.Lock()

    @property
    def deadline(self) -> float | None:
        return None if self.timeout_s is None else self.started + self.timeout_s

    def line(self, task: str, text: str) -> None:
        """One line of a task's output: shown, never kept (a chatty task's lines add up); held
        once its attempt broke (:class:`graphdist._distribute.fallout.Fallout`)."""
        self.fallout.line(task, text)

    def death_at(self, procs: Sequence[Any] | None = None) -> float | None:
        """When the attempt's first failed task ended, as recorded where it ran (on the clock
        of :attr:`fallout`), less DEATH_SLACK_S; None: no task has failed. ``procs``: the tasks
        to look at, as the loop sees them; default: those that tell it from any thread
        (``failed_now``: a task's reader asks, before its lines are shown)."""
        ok = (None, 0, self.preemption_code)  # a preemption's 42 breaks nothing
        if procs is None:
            failed = [p for p in list(self.procs) if getattr(p, "failed_now", None) is not None]
            failed = [p for p in failed if p.failed_now(ok)]
        else:
            failed = [p for p in procs if p.ended() not in ok]
        if not failed:
            return None
        first: float = min(self.started + p.ended_at_s() for p in failed)
        return min(first - DEATH_SLACK_S, time.monotonic())

    def _show(self, task: str, text: str) -> None:
        if self.jsonl:
            event = Event.of(Line(text), time.monotonic() - self.started, self.attempt, task)
            self.out.write(event.to_json())
        elif (shown := self.console.render(task, text)) is not None:
            self.out.write(shown)

    def emit(self, payload: Payload, task: str | None = None) -> Event:
        """Tell ``payload`` (rendered, recorded, printed). An event that ends an attempt's
        story (restarting, gave-up, the next attempt, the run's end) releases what its break
        held: the cause's own lines before it, one ``folded`` line per other task after it."""
        if not isinstance(payload, _ENDS_A_BREAK):
            return self._emit(payload, task)
        cause = getattr(payload, "cause", None)
        released = self.fallout.release(None if cause is None else cause.task)
        if cause is not None:
            for text in released.cause_lines:
                self._show(cause.task, text)
            event = self._emit(payload, task)  # the restart's line, then what it folded
        after = released.why or (f"{cause.task}'s end" if cause is not None else "the stop")
        for name, count in sorted(released.counts.items()):
            log = None
            if self.logs is not None:
                log = os.path.join(self.logs.path, f"attempt-{self.attempt}", f"{name}.log")
            self._emit(Folded(count, after, log), name)
        if cause is None:  # what it folded, then the run's end (its summary) or the next attempt
            event = self._emit(payload, task)
        return event

    def progress(self, task: str, record: Mapping[str, Any]) -> None:
        """A task's progress record (its guard relays it): a ``progress`` event, with the
        task's rate and the steps redone (:class:`graphdist._distribute.progress.StepBook`)."""
        with self._lock:
            event_attempt = self.attempt
            payload = self.steps.payload(task, self.attempt, record)
            at_s = time.monotonic() - self.started
            late = self.stragglers.check(
                task, at_s, payload.steps_per_s, self.nodes.get(task), payload.wait_s
            )
        self._emit(payload, task)
        if late is not None:
            self._emit(late, task)
            if self.spec.restart_stragglers:
                why = straggler_why(dataclasses.asdict(late))
                with self._lock:
                    self._slow[task] = (event_attempt, why)

    def take_stragglers(self) -> dict[str, str]:
        """The stragglers of this attempt named since the last call, to kill
        (``--restart-stragglers``): task -> why, in words; none where the policy would not
        restart the run (its budget spent: a straggler that finishes beats a run that fails)."""
        with self._lock:
            slow, self._slow = self._slow, {}
        if self.policy.in_window >= self.policy.max_restarts:
            return {}
        return {task: why for task, (attempt, why) in slow.items() if attempt == self.attempt}

    def _emit(self, payload: Payload, task: str | None = None) -> Event:
        keep = not isinstance(payload, Progress)  # a long run's many: recorded, never kept
        with self._lock:
            if isinstance(payload, AttemptStarted):
                self.nodes = dict(payload.nodes)
                self.stragglers.forget()
                self._slow.clear()
            elif isinstance(payload, TaskExited) and task is not None:
                self.stragglers.forget(task)
            event = Event.of(payload, time.monotonic() - self.started, self.attempt, task)
            if keep:
                self.events.append(event)
            events = list(self.events) if keep and not self.jsonl else []
        if self.logs is not None:
            self.logs.record_event(event)
        lost = None if self.metrics is None else self.metrics.feed(event)
        if self.live is not None:
            self.live.feed(event)
        if self.jsonl:
            self.out.note(event.to_json())
        elif keep:
            text = render(event, events[:-1], success=not self.out.lost)
            if text is not None:
                self.out.note(text)
        if lost is not None and self.metrics is not None:  # said once: no more are written
            self._emit(OutputLost(self.metrics.path, lost))
        return event

    def end(self, outcome: str, *, show: bool, ran: Sequence[str] = ()) -> None:
        """The run's last event, with its summary: to the log folder always, to the output
        where ``show``; ``ran``: a success's command tasks (the output says the success in
        one line, whatever ``show``). Once only: the first ending is the run's."""
        if self.ended:
            return
        self.ended = True
        logs = None if self.logs is None else self.logs.path
        served = [f"{job}-{i}" for job in self.spec.served for i in range(self.spec.jobs[job])]
        with self._lock:
            steps, redone = self.steps.steps(), self.steps.redone
        served = served if ran else []
        ended = RunEnded(outcome, self.attempt, logs, show, list(ran), served, steps, redone)
        event = self.emit(ended)
        if self.logs is not None:
            self.logs.write_summary(summary(self.events[: self.events.index(event) + 1]))

    def close(self) -> None:
        """Take the live line away (the run's output is over)."""
        if self.live is not None:
            self.live.stop()

    def timed_out(self, results: Sequence[TaskOutcome], doing: str) -> LaunchTimeoutError:
        return LaunchTimeoutError(
            f"The run did not finish within {self.timeout_s:g} s ({doing}); every task was "
            "stopped; raise timeout_s if it needs longer",
            results,
        )

    def backoff(self, wait: float, signals: SignalScope, what: str) -> None:
        """Wait ``wait`` seconds before restarting ``what``; the deadline holds meanwhile."""
        deadline = self.deadline
        left = None if deadline is None else deadline - time.monotonic()
        with signals.interruptible():
            time.sleep(wait if left is None else max(0.0, min(wait, left)))
        if left is not None and left < wait:
            raise self.timed_out([], f"it was waiting {wait:g} s to restart {what}")

    def cause(self, result: TaskOutcome, ended_at_s: float) -> Cause:
        """A failed task, as the restarting and gave-up events carry it."""
        return Cause(result.name, result.pid, result.exitcode, how(result), round(ended_at_s, 3))
