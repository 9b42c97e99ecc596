"""The launcher names a restart's cause by the rule over recorded ends, whichever news it saw
first (graphdist._distribute.supervise._cause): in-process fakes of a run's task processes,
each with the facts a loaded machine delivered in CI, in every order."""

from __future__ import annotations

import itertools
import signal
import time

from graphdist._cluster import Task
from graphdist._distribute import supervise
from graphdist._distribute.taskproc import TaskResult
from graphdist._proc.signals import SignalScope


class _Ended:
    """A task process whose end is known from the start (its news came before the decision)."""

    def __init__(self, index: int, code: int | None, at_s: float, **marks: str) -> None:
        self.result = TaskResult(Task("worker", index, f"localhost:{1000 + index}"), **marks)
        self._code, self._at = code, at_s

    def ended(self) -> int | None:
        return self._code

    def ended_at_s(self) -> float:
        return self._at


class _Late(_Ended):
    """A task whose end's news reaches the launcher ``late_s`` seconds after the decision
    began (its guard's report, carried by srun on a loaded node)."""

    def __init__(self, index: int, code: int, at_s: float, late_s: float) -> None:
        super().__init__(index, code, at_s)
        self._arrives = time.monotonic() + late_s

    def ended(self) -> int | None:
        return self._code if time.monotonic() >= self._arrives else None


def test_the_killed_worker_is_the_cause_in_every_order_of_the_news():
    for order in itertools.permutations(range(3)):
        procs = [
            _Ended(0, 1, 10.05),  # its collective failed after its peer's death
            _Ended(1, -signal.SIGKILL, 10.00),
            _Ended(2, 1, 10.07),
        ]
        ordered = [procs[i] for i in order]
        assert supervise._cause(ordered, SignalScope()).result.name == "worker-1", order


def test_a_death_whose_news_comes_late_is_still_the_cause():
    """worker-0's error exit is seen first; worker-1's SIGKILL, recorded earlier, arrives 0.3 s
    later, within the launcher's window: the rule names worker-1."""
    procs = [_Ended(0, 1, 10.05), _Late(1, -signal.SIGKILL, 10.00, late_s=0.3)]
    started = time.monotonic()
    assert supervise._cause(procs, SignalScope()).result.name == "worker-1"
    assert time.monotonic() - started < supervise.CAUSE_WINDOW_S + 2.0


def test_the_decision_does_not_wait_once_every_task_ended():
    procs = [_Ended(0, 1, 3.0), _Ended(1, 1, 3.1)]
    started = time.monotonic()
    assert supervise._cause(procs, SignalScope()).result.name == "worker-0"
    assert time.monotonic() - started < supervise.CAUSE_WINDOW_S / 2


def test_a_task_killed_as_frozen_is_the_cause_before_a_peers_error_exit():
    procs = [_Ended(0, 1, 5.0), _Ended(1, -signal.SIGKILL, 5.3, frozen="3 probes unanswered")]
    assert supervise._cause(procs, SignalScope()).result.name == "worker-1"


def test_a_task_still_running_is_never_the_cause():
    procs = [_Ended(0, None, 0.0), _Ended(1, 2, 5.0)]
    assert supervise._cause(procs, SignalScope()).result.name == "worker-1"
