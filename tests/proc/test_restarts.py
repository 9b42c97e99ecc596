"""The one restart policy, driven by a fake clock: the window's counts, bursts, the cap of the
back-off, preemptions and start-up failures, and the words every loop prints."""

from __future__ import annotations

import pytest

from graphdist._exceptions import ArgumentError
from graphdist._proc import restarts
from graphdist._proc.restarts import (
    BACKOFF,
    OOM_STARTUPS,
    STARTUP_FAILURES,
    Backoff,
    RestartPolicy,
    backoff_s,
    check_min_uptime,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _policy(max_restarts: int, window_s: float, **kwargs) -> tuple[RestartPolicy, Clock]:
    clock = Clock()
    kwargs.setdefault("min_uptime_s", 0.0)
    return RestartPolicy(max_restarts, window_s, what="the run", clock=clock, **kwargs), clock


def test_backoff_restarts_at_once_then_doubles_from_half_a_second_up_to_thirty_and_says_so():
    assert [backoff_s(n) for n in range(1, 10)] == [0, 0.5, 1, 2, 4, 8, 16, 30, 30]
    assert backoff_s(10_000) == 30
    assert BACKOFF.describe() == "at once, then 0.5 s, doubling, at most 30 s"
    assert Backoff(1.0, 3.0, 10.0, 2.0).describe() == "2 s, then 1 s, times 3, at most 10 s"


def test_a_burst_gets_n_restarts_within_the_window_then_a_give_up_in_the_window_s_words():
    policy, clock = _policy(2, 60.0)
    waits = []
    for _ in range(2):
        clock.now += 1
        decision = policy.failed()
        assert decision.restart
        waits.append((decision.wait_s, decision.restart_number))
        policy.restarted(decision)
    clock.now += 1
    final = policy.failed()
    assert waits == [(0, 1), (0.5, 2)]
    assert not final.restart and final.reason == "budget" and final.in_window == 2
    assert final.words() == "gave up on the run after 2 restart(s) (at most 2 within 60 s)"


def test_failures_spread_over_more_than_the_window_never_give_up_and_count_the_window_only():
    """The drift the issue found: 'restart 4 of at most 1 within 2 s'. Every count printed is
    the window's, so a failure every 12 s with a 10 s window is always restart 1 of 1."""
    policy, clock = _policy(1, 10.0)
    for _ in range(5):
        clock.now += 12
        decision = policy.failed()
        assert decision.restart and decision.wait_s == 0  # ran a whole window: at once again
        assert decision.words() == "restarting the run at once (restart 1 of at most 1 within 10 s)"
        policy.restarted(decision)
    assert policy.restarts == 5


def test_the_back_off_is_capped_and_resets_after_a_stable_window():
    policy, clock = _policy(20, 1000.0, backoff=Backoff(1.0, 2.0, 8.0, first_s=1.0))
    waits = []
    for _ in range(6):
        clock.now += 1
        decision = policy.failed()
        waits.append(decision.wait_s)
        policy.restarted(decision)
    assert waits == [1, 1, 2, 4, 8, 8]
    clock.now += 1000  # ran a whole window without failing
    assert policy.failed().wait_s == 1


def test_a_preemption_restarts_at_once_and_spends_no_restart():
    policy, clock = _policy(0, 60.0)
    for _ in range(3):
        clock.now += 1
        decision = policy.failed(preempted=True)
        assert decision.restart and decision.wait_s == 0 and decision.reason == "preempted"
        assert decision.words() == "restarting the run at once (a preemption spends no restart)"
        policy.restarted(decision)
    assert policy.in_window == 0 and policy.restarts == 3
    assert not policy.failed().restart  # max_restarts 0: a real failure is final
    assert policy.failed().words() == "not restarting the run (max_restarts is 0)"


def test_start_up_failures_in_a_row_give_up_early_and_say_why():
    policy, clock = _policy(100, 60.0, min_uptime_s=10.0)
    for k in range(1, STARTUP_FAILURES):
        policy.started()
        clock.now += 2  # failed 2 s after it started
        decision = policy.failed()
        assert decision.restart and decision.startup_failures == k
        policy.restarted(decision)
    policy.started()
    clock.now += 2
    final = policy.failed()
    assert not final.restart and final.reason == "startup"
    assert final.words() == (
        f"gave up on the run: it failed {STARTUP_FAILURES} times in a row within 10 s of "
        "starting, a start-up failure that restarts will not fix"
    )


def test_an_unfixable_error_at_start_up_gives_up_at_once_and_names_it():
    """A task that dies at start of a missing module will die of it on every try: the first
    such failure is final, not the third (issue 39: README's run spent two restarts and printed
    three tracebacks of one ImportError)."""
    error = "ModuleNotFoundError: No module named 'tf_keras'"
    policy, clock = _policy(100, 60.0, min_uptime_s=10.0)
    policy.started()
    clock.now += 2
    final = policy.failed(error=error)
    assert (final.restart, final.reason, final.error) == (False, "startup", error)
    assert final.words() == (
        f"gave up on the run: it failed within 10 s of starting with {error}, an error that "
        "restarts will not fix"
    )
    # the same error after a long uptime is no start-up failure: a restart may well help
    policy, clock = _policy(100, 60.0, min_uptime_s=10.0)
    policy.started()
    clock.now += 30
    assert policy.failed(error=error).restart
    # nor with the start-up rule turned off
    policy, clock = _policy(100, 60.0, min_uptime_s=0.0)
    policy.started()
    assert policy.failed(error=error).restart
    # a part's failure never tells of the whole's start-up
    policy, clock = _policy(100, 60.0, min_uptime_s=10.0)
    assert policy.failed(what="the server of ps-0", startup=False, error=error).restart


def test_out_of_memory_at_each_of_the_last_starts_gives_up_and_says_so():
    """The same limit ends the same start the same way: out of memory within min_uptime_s of
    its start, OOM_STARTUPS times in a row, the run gives up (the budget would allow more);
    one long attempt between, or another kind of failure, starts the count over."""
    oom = "the kernel's OOM killer; limit 400 MiB of memory cgroup /x"
    policy, clock = _policy(100, 60.0, min_uptime_s=10.0)
    for _ in range(OOM_STARTUPS - 1):
        policy.started()
        clock.now += 2
        decision = policy.failed(oom=oom)
        assert decision.restart
        policy.restarted(decision)
    policy.started()
    clock.now += 2
    final = policy.failed(oom=oom)
    assert (final.restart, final.reason, final.oom) == (False, "startup", oom)
    assert final.words() == (
        f"gave up on the run: it ran out of memory at each of its last {OOM_STARTUPS} starts, "
        "within 10 s of starting; restarts will not fix that: give it more memory, or make it "
        "use less"
    )
    policy, clock = _policy(100, 60.0, min_uptime_s=10.0)
    for uptime, kind in ((2, oom), (2, None), (30, oom), (2, oom)):
        policy.started()
        clock.now += uptime
        decision = policy.failed(oom=kind)
        assert decision.restart, (uptime, kind)  # never OOM_STARTUPS short OOMs in a row
        policy.restarted(decision)


def test_one_long_attempt_breaks_a_run_of_start_up_failures():
    policy, clock = _policy(100, 60.0, min_uptime_s=10.0)
    for uptime in (2, 2, 30, 2, 2):  # the third attempt trained for 30 s
        policy.started()
        clock.now += uptime
        decision = policy.failed()
        assert decision.restart, decision
        policy.restarted(decision)


def test_a_part_spends_the_same_budget_in_its_own_words_without_touching_start_up():
    policy, clock = _policy(1, 60.0, min_uptime_s=10.0)
    clock.now += 1
    decision = policy.failed(what="the server of worker-1", startup=False)
    assert decision.words().startswith("restarting the server of worker-1 at once (restart 1 ")
    assert decision.startup_failures == 0
    policy.restarted(decision)
    clock.now += 1
    assert policy.failed().reason == "budget"


def test_a_restart_by_hand_resets_the_back_off_but_not_the_window():
    policy, clock = _policy(3, 60.0)
    for _ in range(2):
        clock.now += 1
        policy.restarted(policy.failed())
    policy.reset()
    clock.now += 1
    decision = policy.failed()
    assert decision.wait_s == 0 and decision.restart_number == 3  # at once, as a first failure


def test_the_module_default_back_off_is_read_when_a_policy_is_made(monkeypatch):
    monkeypatch.setattr(restarts, "BACKOFF", Backoff(0.0, 2.0, 5.0, first_s=5.0))
    policy, _clock = _policy(1, 60.0)
    assert policy.failed().wait_s == 5.0


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "10", True, None])
def test_min_uptime_is_a_finite_number_of_seconds(bad):
    with pytest.raises(ArgumentError, match="min_uptime_s must be"):
        check_min_uptime(bad)
    assert check_min_uptime(0) == 0.0 and check_min_uptime(2.5) == 2.5


# -- what mutation testing found unpinned (make mutants, docs/mutants.md) -----------------------


def test_a_bad_min_uptime_names_the_argument_and_the_value():
    with pytest.raises(ArgumentError) as info:
        check_min_uptime("10")
    assert str(info.value) == "min_uptime_s must be a finite number of seconds >= 0, not '10'"
    assert (info.value.name, info.value.value) == ("min_uptime_s", "10")
    with pytest.raises(ArgumentError) as info:
        check_min_uptime(-1)
    assert str(info.value) == "min_uptime_s must be >= 0 seconds, not -1"
    assert (info.value.name, info.value.value) == ("min_uptime_s", -1)


def test_the_back_offs_exponent_is_capped_so_a_long_run_of_failures_cannot_overflow():
    unbounded = Backoff(1.0, 2.0, float("inf"))
    assert unbounded.delay(66) == 2.0**64
    assert unbounded.delay(10_000) == 2.0**64  # 2.0 ** 9998 would raise OverflowError


def test_a_restart_after_a_wait_says_when_and_a_policy_names_it_by_default():
    policy, clock = _policy(2, 60.0)
    clock.now += 1
    policy.restarted(policy.failed())
    clock.now += 1
    decision = policy.failed()
    assert (decision.restart, decision.wait_s, decision.reason) == (True, 0.5, "failed")
    assert decision.words() == "restarting the run in 0.5 s (restart 2 of at most 2 within 60 s)"
    assert RestartPolicy(1, clock=Clock()).failed().words() == (
        "restarting it at once (restart 1 of at most 1 within 60 s)"
    )


def test_a_restart_leaves_the_window_exactly_window_s_later():
    policy, clock = _policy(1, 10.0)
    policy.restarted(policy.failed())  # at 0
    clock.now = 9.99
    assert policy.in_window == 1
    clock.now = 10.0
    assert policy.in_window == 0
    assert policy.failed().restart


def test_giving_up_and_preempting_decide_with_every_field_set():
    policy, _clock = _policy(1, 60.0, min_uptime_s=5.0)
    policy.restarted(policy.failed())
    preempted = policy.failed(preempted=True)
    assert (preempted.restart, preempted.wait_s, preempted.in_window) == (True, 0.0, 1)
    final = policy.failed()
    assert (final.restart, final.wait_s, final.reason, final.in_window) == (False, 0.0, "budget", 1)
    assert final.min_uptime_s == 5.0

    policy, _clock = _policy(100, 60.0, min_uptime_s=5.0)
    for _ in range(STARTUP_FAILURES - 1):
        policy.restarted(policy.failed())
    final = policy.failed()
    assert (final.restart, final.wait_s, final.reason) == (False, 0.0, "startup")
    assert (final.in_window, final.startup_failures) == (STARTUP_FAILURES - 1, STARTUP_FAILURES)
    assert final.words() == (
        f"gave up on the run: it failed {STARTUP_FAILURES} times in a row within 5 s of "
        "starting, a start-up failure that restarts will not fix"
    )


def test_a_run_of_exactly_min_uptime_is_no_start_up_failure():
    policy, clock = _policy(100, 60.0, min_uptime_s=10.0)
    clock.now = 10.0
    assert policy.failed().startup_failures == 0
    policy.started()
    clock.now = 19.99
    assert policy.failed().startup_failures == 1


def test_the_back_off_counts_from_the_last_start_whatever_the_clock_reads():
    policy, clock = _policy(5, 60.0)
    clock.now = 1000.0
    policy.started()
    waits = []
    for _ in range(3):
        clock.now += 1
        decision = policy.failed()
        waits.append(decision.wait_s)
        policy.restarted(decision)
    assert waits == [0, 0.5, 1]


def test_a_restart_by_hand_starts_the_start_up_count_over():
    policy, _clock = _policy(100, 600.0, min_uptime_s=10.0)
    for _ in range(STARTUP_FAILURES - 1):
        policy.restarted(policy.failed())
    policy.reset()
    for _ in range(STARTUP_FAILURES - 1):
        decision = policy.failed()
        assert decision.restart, decision
        policy.restarted(decision)


def test_a_parts_restart_keeps_the_wholes_uptime_and_the_wholes_restart_resets_it():
    policy, clock = _policy(100, 600.0, min_uptime_s=10.0)
    clock.now = 5.0
    policy.restarted(policy.failed(what="the server of worker-1", startup=False))
    clock.now = 12.0  # 12 s since the whole started, 7 s since the part's restart
    decision = policy.failed()
    assert decision.startup_failures == 0
    policy.restarted(decision)  # the whole: its uptime counts from 12 s
    clock.now = 14.0
    assert policy.failed().startup_failures == 1


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "graphdist_no_such_module"],
        ["-m", "graphdist_no_such.module"],  # a dotted -m says it another way
        ["/nonexistent/train.py"],
        ["-c", "import graphdist_no_such_module"],
        ["-c", "def broken(:"],
    ],
)
def test_the_interpreters_own_start_up_errors_are_unfixable(argv):
    """What this Python really prints when a task cannot start, fed to the matcher (issue 57:
    a dotted `-m` spent every restart)."""
    import subprocess
    import sys

    from graphdist._distribute.taskproc import unfixable_error

    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert unfixable_error(done.stderr.splitlines()) is not None, done.stderr


def test_a_coloured_traceback_is_read_as_its_words():
    """Python 3.13 colours a traceback written to a terminal (a task's stderr under srun's pty,
    or a warm task's): the same words, the same verdict, said without the codes."""
    from graphdist._distribute.taskproc import unfixable_error

    line = "\x1b[1;35mModuleNotFoundError\x1b[0m: \x1b[35mNo module named 'nope'\x1b[0m"
    assert unfixable_error(["Traceback ...", line]) == "ModuleNotFoundError: No module named 'nope'"


def test_an_error_a_restart_may_fix_is_not_unfixable():
    from graphdist._distribute.taskproc import unfixable_error

    assert unfixable_error(["tensorflow.python.framework.errors_impl.UnavailableError: x"]) is None
    assert unfixable_error([]) is None
