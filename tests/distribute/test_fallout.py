"""A restart reads as one (issue 57): once an attempt is broken, the other tasks' lines are its
fallout, held, and the console shows the cause's own lines, then the restart's line, then one
folded line per other task (graphdist._distribute.fallout.Fallout, RunState.emit). The rule is
over when each line was read, injected here; and two threads racing a line against the break
never give another verdict than the rule. A Ctrl-C is acknowledged with one line and a second one
cuts the tasks' grace (supervise.stop_interrupted), over in-process fakes of task processes."""

from __future__ import annotations

import io
import json
import signal
import threading
import time

import pytest

from graphdist._cluster import Task
from graphdist._distribute import supervise
from graphdist._distribute.events import Cause, Event, Restarting, Stopping
from graphdist._distribute.events import render as render_event
from graphdist._distribute.fallout import Fallout, is_fallout
from graphdist._distribute.runspec import RunSpec
from graphdist._distribute.runstate import RunState
from graphdist._distribute.taskproc import TaskResult
from graphdist._proc.process import NOW_SIGNAL
from graphdist._proc.signals import SignalScope


class _Clock:
    """An injected clock: each call gives the time set last."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_rule_is_when_the_line_was_read():
    assert not is_fallout(5.0, None)  # not broken
    assert not is_fallout(4.999, 5.0)  # read before the break
    assert is_fallout(5.0, 5.0) and is_fallout(7.0, 5.0)


def test_lines_before_the_break_are_shown_after_it_held_then_given_back_by_cause():
    clock, shown = _Clock(), []
    fallout = Fallout(lambda task, text: shown.append((task, text)), clock=clock, delay_s=0.2)
    clock.now = 1.0
    fallout.line("worker-0", "epoch 1/3 done")
    assert shown == []  # it waits its delay
    clock.now = 2.0
    fallout.broke()  # what was read before is shown now, before the break's words
    assert shown == [("worker-0", "epoch 1/3 done")]
    for i, (task, text) in enumerate(
        [("worker-0", "Traceback (most recent call last):"), ("worker-1", "its own error")] * 3
    ):
        clock.now = 2.0 + i / 10
        fallout.line(task, text)
    released = fallout.release("worker-1")
    assert shown == [("worker-0", "epoch 1/3 done")]
    assert released.cause_lines == ["its own error"] * 3  # the cause's own: shown before
    assert released.counts == {"worker-0": 3}  # the others': one folded line each
    assert released.why is None
    clock.now = 3.0  # the next attempt: not broken
    fallout.line("worker-0", "epoch 2/3 done")
    fallout.release(None)
    assert shown[-1] == ("worker-0", "epoch 2/3 done")


def test_a_survivors_lines_read_just_before_the_death_was_reported_are_its_fallout():
    """The survivor saw its peer's closed connection before the peer's guard reaped it and
    said so: its first lines, read within the delay before the death is known, are held by
    the death's recorded end, not shown."""
    clock, shown = _Clock(), []
    deaths: list[float] = []
    fallout = Fallout(
        lambda task, text: shown.append(text),
        deaths=lambda: deaths[0] if deaths else None,
        clock=clock,
        delay_s=0.2,
    )
    clock.now = 5.00
    fallout.line("worker-0", "epoch 2/3 done")
    clock.now = 5.30
    fallout.line("worker-0", "Traceback (most recent call last):")  # the first: shown then
    assert shown == ["epoch 2/3 done"]
    deaths.append(5.29)  # worker-1's guard reports: it ended at 5.29 (less the slack)
    clock.now = 5.31
    fallout.line("worker-0", "UnavailableError: Socket closed")
    clock.now = 5.60  # due: the death is looked for first
    fallout.line("worker-0", "  File 'x.py', line 3")
    assert shown == ["epoch 2/3 done"]
    assert fallout.release("worker-1").counts == {"worker-0": 3}


def test_jsonl_keeps_every_line_and_counts_the_fallout():
    clock, shown = _Clock(), []
    fallout = Fallout(lambda t, x: shown.append(x), keep=True, clock=clock)
    clock.now = 1.0
    fallout.broke("Ctrl-C")
    fallout.line("worker-0", "KeyboardInterrupt")
    assert shown == ["KeyboardInterrupt"]
    released = fallout.release(None)
    assert released.counts == {"worker-0": 1} and released.why == "Ctrl-C"


def test_jsonl_shows_a_line_that_a_reported_death_made_fallout_while_it_waited():
    """The dead task's own last line, read after its recorded end (its guard reported it
    first): the death is found as the waiting line comes due, which makes the line fallout.
    jsonl shows it all the same (it was lost: a ps run's chief printed, then SIGKILLed itself,
    and its line had no event, CI 2026-12-07)."""
    clock, shown = _Clock(), []
    deaths: list[float] = []
    fallout = Fallout(
        lambda t, x: shown.append((t, x)),
        keep=True,
        deaths=lambda: deaths[0] if deaths else None,
        clock=clock,
        delay_s=0.2,
    )
    deaths.append(4.95)  # chief-0 ended at 5.0 (less the slack), reported before its line read
    clock.now = 5.10
    fallout.line("chief-0", "reached")
    assert shown == [("chief-0", "reached")]
    assert fallout.release("chief-0").counts == {}


class _Recorded:
    """The monotonic clock, each time it gave recorded."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self) -> float:
        self.times.append(time.monotonic())
        return self.times[-1]


def _race_once() -> tuple[list[float], float | None, list[int], int]:
    """A reader's 20 lines against the loop's break, started together: the read times, the
    break's time, the lines shown and the count held."""
    clock = _Recorded()
    shown: list[int] = []
    fallout = Fallout(lambda t, x: shown.append(int(x)), clock=clock, delay_s=0.0)
    start = threading.Barrier(2)

    def reader() -> None:
        start.wait()
        for i in range(20):
            fallout.line("worker-0", str(i))

    thread = threading.Thread(target=reader)
    thread.start()
    start.wait()
    fallout.broke()
    thread.join()
    broken_at = fallout.broken_at
    held = fallout.release("worker-1").counts.get("worker-0", 0)
    return [t for t in clock.times if t != broken_at][:20], broken_at, shown, held


@pytest.mark.timeout(60)
def test_a_line_racing_the_break_gets_the_rules_verdict_whichever_thread_wins():
    """Every line is shown exactly when the rule says so, by the time it was read (recorded
    by the clock the Fallout reads under its lock), whichever thread went first."""
    for _ in range(200):
        reads, broken_at, shown, held = _race_once()
        assert len(reads) == 20
        expected = [i for i, t in enumerate(reads) if not is_fallout(t, broken_at)]
        assert shown == expected
        assert held == 20 - len(expected)


def _run(tmp_path, output_format: str = "text") -> tuple[RunState, io.StringIO]:
    out = io.StringIO()
    spec = RunSpec.check(
        ["python", "train.py"], output=out, output_format=output_format, max_restarts=1
    )
    logs_dir = tmp_path / "logs"
    from graphdist._distribute.runlogs import RunLogs

    return RunState(spec, RunLogs(str(logs_dir))), out


def _cause() -> Cause:
    return Cause("worker-1", 4242, -9, "was killed by SIGKILL (exit status 137)", 2.0)


def test_the_restart_line_comes_first_then_one_folded_line_per_survivor(tmp_path):
    run, out = _run(tmp_path)
    run.line("worker-0", "epoch 1/3 done")
    run.fallout.broke()
    for n in range(61):
        run.line("worker-0", f"  File 'x.py', line {n}")
    run.line("worker-2", "InternalError: Collective ops is aborted")
    run.line("worker-1", "the cause's own last line")
    run.emit(Restarting(_cause(), 0.0, "run", "restarting the run at once"))
    log = f"{run.logs.path}/attempt-1/worker-0.log"
    assert out.getvalue().splitlines() == [
        "[worker-0] epoch 1/3 done",
        "[worker-1] the cause's own last line",
        "graphdist: worker-1 was killed by SIGKILL (exit status 137); every task was stopped; "
        "restarting the run at once",
        f"graphdist: worker-0: 61 lines after worker-1's end not shown (whole in {log})",
        "graphdist: worker-2: 1 line after worker-1's end not shown "
        f"(whole in {run.logs.path}/attempt-1/worker-2.log)",
    ]
    folded = [e for e in run.events if e.kind == "folded"]
    assert [(e.task, e.data["lines"]) for e in folded] == [("worker-0", 61), ("worker-2", 1)]


def test_jsonl_keeps_the_line_events_and_adds_the_folded_ones(tmp_path):
    run, out = _run(tmp_path, "jsonl")
    run.fallout.broke()
    run.line("worker-0", "Traceback (most recent call last):")
    run.emit(Restarting(_cause(), 0.0, "run", "restarting the run at once"))
    kinds = [json.loads(line)["event"] for line in out.getvalue().splitlines()]
    assert kinds == ["line", "restarting", "folded"]
    Event.from_json(out.getvalue().splitlines()[-1])  # its fields are the dataclass's


def test_the_stopping_line_says_what_happens():
    stopping = Event.of(Stopping("SIGINT", ["worker-0", "worker-1"], 1.0, again=True), 0.5, 1)
    assert render_event(stopping) == (
        "graphdist: Ctrl-C: stopping 2 tasks; Ctrl-C again to kill them now"
    )
    idle = Event.of(Stopping("SIGINT", [], 1.0, again=True), 0.5, 2)  # during a back-off
    assert render_event(idle) == "graphdist: Ctrl-C: stopping the run (no task runs)"
    term = Event.of(Stopping("SIGTERM", ["worker-0"], 5.0), 0.5, 1)
    assert render_event(term) == "graphdist: SIGTERM: stopping 1 task; each gets up to 5 s to end"


class _Running:
    """A task process that runs until it is sent NOW_SIGNAL (it ignores SIGINT); ``on_sigint``
    runs when it is sent SIGINT (a second Ctrl-C arriving meanwhile, say)."""

    def __init__(self, index: int, on_sigint=None) -> None:
        self.result = TaskResult(Task("worker", index, f"localhost:{1000 + index}"))
        self.sent: list[int] = []
        self._on_sigint = on_sigint

    def running(self) -> bool:
        return NOW_SIGNAL not in self.sent

    def signal(self, sig: int) -> None:
        self.sent.append(sig)
        if sig == signal.SIGINT and self._on_sigint is not None:
            self._on_sigint()


def test_ctrl_c_tells_every_task_and_kills_those_left_after_the_grace(tmp_path, monkeypatch):
    monkeypatch.setattr(supervise, "INTERRUPT_GRACE_S", 0.3)
    run, out = _run(tmp_path)
    scope = SignalScope()
    scope.received.append(signal.SIGINT)
    procs = [_Running(0), _Running(1)]
    began = time.monotonic()
    supervise.stop_interrupted(procs, scope, run, signal.SIGINT)
    assert time.monotonic() - began >= 0.3  # the grace, for tasks that ignore SIGINT
    assert [p.sent for p in procs] == [[signal.SIGINT, NOW_SIGNAL]] * 2
    assert out.getvalue().splitlines() == [
        "graphdist: Ctrl-C: stopping 2 tasks; Ctrl-C again to kill them now"
    ]


@pytest.mark.timeout(60)
def test_a_second_ctrl_c_kills_the_tasks_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(supervise, "INTERRUPT_GRACE_S", 30.0)  # the grace never ends here
    run, _out = _run(tmp_path)
    scope = SignalScope()
    scope.received.append(signal.SIGINT)
    procs = [_Running(0, on_sigint=lambda: scope.received.append(signal.SIGINT)), _Running(1)]
    began = time.monotonic()
    supervise.stop_interrupted(procs, scope, run, signal.SIGINT)
    assert time.monotonic() - began < 10.0
    assert [p.sent for p in procs] == [[signal.SIGINT, NOW_SIGNAL]] * 2


def test_sigterm_keeps_the_grace_for_a_checkpoint(tmp_path):
    run, out = _run(tmp_path)
    procs = [_Running(0)]
    supervise.stop_interrupted(procs, SignalScope(), run, signal.SIGTERM)
    assert procs[0].sent == []  # end_tasks stops it with the grace (SIGTERM first)
    assert "each gets up to" in out.getvalue()
