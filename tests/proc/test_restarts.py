"""The one restart policy: at most N restarts within any window, backing off 0.5 s doubling."""

from __future__ import annotations

from graphdist._proc.restarts import RestartBudget, backoff_s


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_from_half_a_second_up_to_thirty():
    assert [backoff_s(n) for n in range(1, 10)] == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]


def test_a_budget_allows_n_restarts_within_its_window_then_refuses():
    clock = Clock()
    budget = RestartBudget(2, 60.0, clock=clock)
    waits = []
    for _ in range(2):
        clock.now += 1
        waits.append(budget.failed())
        budget.restarted()
    clock.now += 1
    assert waits == [0.5, 1.0] and budget.failed() is None and budget.restarts == 2


def test_restarts_older_than_the_window_no_longer_count_and_a_stable_run_resets_the_backoff():
    clock = Clock()
    budget = RestartBudget(1, 10.0, clock=clock)
    for _ in range(5):  # fails every 12 s: never 2 restarts within 10 s
        clock.now += 12
        assert budget.failed() == 0.5
        budget.restarted()
    assert budget.restarts == 5
