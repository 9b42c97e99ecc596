"""A fleet's verdicts on its tasks, in process: the facts and the probes injected, no server.

``Fleet._status`` (health, a guard's failed probes, the dead-task detail), ``kill()``'s record,
``problem_of`` and ``_diagnose``: the decisions that flaked when they hung on which of two
events a loaded machine showed first. The end-to-end tests with real servers are in
``test_faults.py`` and ``test_fast_failure.py``."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import pytest

from graphdist._cluster import Cluster, Task
from graphdist._fleet import client
from graphdist._fleet.client import Fleet, FleetState
from graphdist._fleet.health import problem_of
from graphdist._fleet.task import TaskView

TIMEOUT = "DEADLINE_EXCEEDED: Deadline Exceeded"
REFUSED = "UNAVAILABLE: Connection refused"


class FakeTask(TaskView):
    """A task handle whose process facts the test sets."""

    def __init__(self, index: int) -> None:
        self.task = Task("local", index, f"localhost:{2000 + index}")
        self.pid: int | None = 100 + index
        self.alive = True
        self.exitcode: int | None = None
        self.restarts = 0
        self.log_path = None

    def log_tail(self, lines: int = 12) -> list[str]:
        return []


class FakeFleet(Fleet[FakeTask]):
    """A running fleet of fake tasks; ``kill`` ends a task after ``end_after_s`` (a loaded
    machine's delay), or never (None)."""

    def __init__(self, n: int = 2, end_after_s: float | None = 0.0) -> None:
        super().__init__()
        self.cluster = Cluster.parse({"local": [f"localhost:{2000 + i}" for i in range(n)]})
        self._tasks = {("local", i): FakeTask(i) for i in range(n)}
        self._state = FleetState.RUNNING
        self.end_after_s = end_after_s

    def _kill_task(self, task: FakeTask, sig: int) -> None:
        def end() -> None:
            task.alive, task.exitcode = False, -sig

        if self.end_after_s == 0:
            end()
        elif self.end_after_s is not None:
            threading.Timer(self.end_after_s, end).start()


@pytest.fixture
def probes(monkeypatch):
    """What each address's probe answers: ``probes[address] = (answered, error)``."""
    answers: dict[str, tuple[bool, str | None]] = {}

    def probe_all(addresses, timeout_s, *, alive):
        return [answers.get(a, (True, None)) for a in addresses]

    monkeypatch.setattr(client, "probe_all", probe_all)
    monkeypatch.setattr(client, "EXIT_NEWS_S", 0.5)
    return answers


def statuses(fleet: Fleet[Any]) -> list[tuple[str, str]]:
    return [(h.status, h.detail) for h in fleet.health()]


def test_a_task_whose_process_ended_is_dead_though_its_probe_only_timed_out(probes):
    fleet = FakeFleet()
    task = fleet.task("local", 1)
    task.alive, task.exitcode = False, -signal.SIGKILL
    probes[task.address] = (False, TIMEOUT)
    assert statuses(fleet)[1] == ("dead", "was killed by SIGKILL (exit status 137)")


def test_a_running_task_whose_probe_timed_out_is_not_answering_at_once(probes):
    fleet = FakeFleet()
    probes["localhost:2001"] = (False, TIMEOUT)
    started = time.monotonic()
    assert statuses(fleet) == [("alive", ""), ("not answering", TIMEOUT)]
    assert time.monotonic() - started < 0.4  # a timeout is not news on its way: no wait


def test_a_refusing_server_whose_process_ends_meanwhile_is_dead(probes):
    """Its sockets closed a moment before the kernel marked it ended: the check waits for that
    word (bounded), and then says dead with how it ended."""
    fleet = FakeFleet()
    task = fleet.task("local", 1)
    probes[task.address] = (False, REFUSED)

    def end() -> None:
        task.alive, task.exitcode = False, 3

    threading.Timer(0.1, end).start()
    assert statuses(fleet)[1] == ("dead", "exited with code 3")


def test_a_refusing_server_whose_process_runs_on_is_not_answering(probes):
    fleet = FakeFleet()
    probes["localhost:2001"] = (False, REFUSED)
    started = time.monotonic()
    assert statuses(fleet)[1] == ("not answering", REFUSED)
    assert time.monotonic() - started < 2.0  # bounded by EXIT_NEWS_S (0.5 s here)


def test_a_task_kill_is_still_ending_is_dead_and_killed_by_graphdist(probes):
    """kill() records its signal before sending it: a check while the end is on its way (the
    kernel has not said so yet, the probe times out) says dead, not not answering."""
    fleet = FakeFleet(end_after_s=None)  # the end never comes within the test
    probes["localhost:2001"] = (False, TIMEOUT)
    fleet.kill("local", 1)
    status, detail = statuses(fleet)[1]
    assert status == "dead"
    assert detail == "was killed by SIGKILL (exit status 137) by graphdist's kill()"


def test_a_task_killed_by_graphdist_says_so_once_it_ended(probes):
    fleet = FakeFleet()
    fleet.kill("local", 1, signal.SIGTERM)
    assert statuses(fleet)[1] == (
        "dead",
        "was killed by SIGTERM (exit status 143) by graphdist's kill()",
    )


def test_a_killed_task_started_again_no_longer_carries_the_kill(probes):
    fleet = FakeFleet()
    fleet.kill("local", 1)
    task = fleet.task("local", 1)
    task.pid, task.alive, task.exitcode, task.restarts = 999, True, None, 1  # a new process
    assert statuses(fleet)[1] == ("alive", "")
    task.alive, task.exitcode = False, 2  # it dies by itself
    assert statuses(fleet)[1] == ("dead", "exited with code 2")


def test_diagnose_names_the_dead_task_before_a_silent_one(probes):
    fleet = FakeFleet(3)
    probes["localhost:2000"] = (False, TIMEOUT)
    dead = fleet.task("local", 2)
    dead.alive, dead.exitcode = False, -signal.SIGKILL
    probes[dead.address] = (False, TIMEOUT)
    error = fleet._diagnose(RuntimeError("step failed"), 1000)
    assert error is not None
    assert (error.task, error.status) == ("local-2", "dead")


def test_problem_of_tells_a_restart_from_a_death():
    task = FakeTask(1)
    assert problem_of(task, task.pid, 0) is None
    task.restarts, task.pid = 1, 555
    assert problem_of(task, 101, 0) == ("restarted", "pid 101 before, now pid 555")
    task.alive, task.exitcode = False, 1
    assert problem_of(task, 555, 1) == ("dead", "exited with code 1")


def test_a_remote_server_whose_host_refuses_its_port_is_dead():
    from graphdist._fleet.remote import RemoteFleet

    fleet = RemoteFleet.__new__(RemoteFleet)
    fleet.tls = None
    task = FakeTask(0)
    assert fleet._explain(task, "not answering", REFUSED) == (
        "dead",
        "its host refuses connections to port 2000",
    )
    assert fleet._explain(task, "not answering", TIMEOUT) == ("not answering", TIMEOUT)


# -- the guard's decision: when a run's probes fail, frozen or dead ---------------------------


@pytest.fixture
def watched(monkeypatch):
    """A guard over a FakeFleet, the watchdog's probe decision, the probes injected and every
    cancellation recorded instead of closing a session."""
    from graphdist._fleet import guard as guard_module
    from graphdist._fleet import watchdog as watchdog_module

    fleet = FakeFleet()
    answers: dict[str, tuple[bool, str | None]] = {}
    monkeypatch.setattr(
        watchdog_module,
        "probe_all",
        lambda addresses, timeout_s, *, alive: [answers.get(a, (True, None)) for a in addresses],
    )
    monkeypatch.setattr(client, "EXIT_NEWS_S", 0.3)
    guard = guard_module.SessionGuard(fleet, fleet.task("local", 0))
    dog = watchdog_module._Watchdog()
    cancelled: list[Any] = []
    monkeypatch.setattr(dog, "cancel", lambda g, ident, started, problem: cancelled.append(problem))
    run = watchdog_module._Run(0.0, fleet._epoch)

    def probe() -> list[Any]:
        dog._probe(guard, 1, 0.0, run, list(fleet.tasks))
        return cancelled

    return fleet, answers, probe


def test_a_run_is_cancelled_as_not_answering_after_the_third_missed_probe(watched):
    from graphdist._fleet.guard import MISSES_BEFORE_FROZEN

    fleet, answers, probe = watched
    answers[fleet.task("local", 1).address] = (False, TIMEOUT)
    for _ in range(MISSES_BEFORE_FROZEN - 1):
        assert probe() == []
    (problem,) = probe()
    assert (problem.task, problem.status) == ("local-1", "not answering")
    assert f"{MISSES_BEFORE_FROZEN} gRPC probes in a row unanswered" in str(problem)


def test_an_answer_between_misses_starts_the_count_again(watched):
    from graphdist._fleet.guard import MISSES_BEFORE_FROZEN

    fleet, answers, probe = watched
    address = fleet.task("local", 1).address
    for _ in range(MISSES_BEFORE_FROZEN - 1):
        answers[address] = (False, TIMEOUT)
        assert probe() == []
    answers[address] = (True, None)
    assert probe() == []
    answers[address] = (False, TIMEOUT)
    assert probe() == []


def test_a_task_whose_process_ended_is_cancelled_as_dead_not_frozen(watched):
    """Its probes missed because its process is gone, and the fleet's epoch had not moved yet
    (a loaded machine): the decision reads the facts, not the misses."""
    from graphdist._fleet.guard import MISSES_BEFORE_FROZEN

    fleet, answers, probe = watched
    task = fleet.task("local", 1)
    answers[task.address] = (False, TIMEOUT)
    for _ in range(MISSES_BEFORE_FROZEN - 1):
        probe()
    task.alive, task.exitcode = False, -signal.SIGKILL
    (problem,) = probe()
    assert (problem.task, problem.status) == ("local-1", "dead")
    assert "was killed by SIGKILL" in str(problem)


def test_a_task_the_fleet_is_killing_is_cancelled_as_dead_by_graphdist(watched):
    from graphdist._fleet.guard import MISSES_BEFORE_FROZEN

    fleet, answers, probe = watched
    fleet.end_after_s = None  # the end is on its way, not here yet
    answers[fleet.task("local", 1).address] = (False, TIMEOUT)
    fleet.kill("local", 1)
    for _ in range(MISSES_BEFORE_FROZEN - 1):
        probe()
    (problem,) = probe()
    assert (problem.task, problem.status) == ("local-1", "dead")
    assert "by graphdist's kill()" in str(problem)
