"""The fleet's watcher: it hears of every task death, once per death, on every backend that has
processes (the seam that supervisors and fast failure build on)."""

from __future__ import annotations

import threading
import time

import pytest

import graphdist
from tests.conftest import EVENTUALLY_S

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _wait_for(predicate, timeout_s: float = EVENTUALLY_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_watcher_reports_each_death_once_with_its_task_and_exit_code(graphdist_fleet_factory):
    fleet = graphdist_fleet_factory("local=2")
    heard: list[str] = []
    lock = threading.Lock()

    def on_exit(task) -> None:
        with lock:
            heard.append(task.name)

    fleet.watch(on_exit)
    first_pid = fleet.task("local", 1).pid
    fleet.kill("local", 1)
    assert _wait_for(lambda: heard == ["local-1"]), heard
    (event,) = fleet.task_exits()
    assert (event.task, event.pid, event.exitcode) == ("local-1", first_pid, -9)

    fleet.restart("local", 1)  # a new process: its death is a new event
    time.sleep(5 * fleet.watch_interval_s)
    assert heard == ["local-1"]  # not reported again while it runs
    fleet.kill("local", 1)
    assert _wait_for(lambda: heard == ["local-1", "local-1"]), heard
    assert [e.pid for e in fleet.task_exits()] == [first_pid, fleet.task("local", 1).pid]
    assert fleet.task("local", 0).alive


def test_watcher_stops_when_the_fleet_closes(graphdist_fleet_factory):
    fleet = graphdist_fleet_factory("local=1")
    fleet.watch(lambda task: None)
    thread = fleet._watch_thread
    assert thread is not None and thread.is_alive()
    fleet.close()
    thread.join(EVENTUALLY_S)
    assert not thread.is_alive()
    assert fleet.task_exits() == []  # closing is not a death
    assert isinstance(graphdist.TaskExit, type)
