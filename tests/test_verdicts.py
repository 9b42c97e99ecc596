"""The verdict rules over injected facts (graphdist._verdicts): no process, no clock, no race.

Each case is a situation a loaded machine produced in CI, as facts: the rule must give the same
verdict whichever news would have arrived first."""

from __future__ import annotations

import signal

import pytest

from graphdist._failures import ALIVE, DEAD, NOT_ANSWERING
from graphdist._verdicts import (
    CLOSE_S,
    KILLED_BY_GRAPHDIST,
    ProcessFacts,
    TaskEnd,
    end_rank,
    ended_detail,
    restart_cause,
    task_status,
)

KILL = -signal.SIGKILL
TIMEOUT = "DEADLINE_EXCEEDED: Deadline Exceeded"
REFUSED = "UNAVAILABLE: failed to connect to all addresses; Connection refused"

# -- a task's status -------------------------------------------------------------------------


@pytest.mark.parametrize("answered", [True, False])
@pytest.mark.parametrize("error", ["", TIMEOUT, REFUSED])
def test_a_process_the_kernel_says_ended_is_dead_whatever_its_probe_said(answered, error):
    status, detail = task_status(ProcessFacts(ended=True, exitcode=KILL), answered, error)
    assert (status, detail) == (DEAD, "was killed by SIGKILL (exit status 137)")


def test_a_killed_task_whose_probe_timed_out_is_dead_not_frozen():
    """CI, 2026-12-04/05: a SIGKILLed server's probe timed out before its exit's news came; the
    verdict was 'not answering'. The kernel's word decides."""
    assert task_status(ProcessFacts(ended=True, exitcode=None), False, TIMEOUT)[0] == DEAD


def test_a_task_graphdist_is_killing_is_dead_and_says_graphdist_killed_it():
    facts = ProcessFacts(ended=False, killed_with=signal.SIGKILL)
    status, detail = task_status(facts, False, TIMEOUT)
    assert status == DEAD
    assert detail == f"was killed by SIGKILL (exit status 137) {KILLED_BY_GRAPHDIST}"


def test_a_task_graphdist_killed_says_so_once_its_exit_status_came():
    facts = ProcessFacts(ended=True, exitcode=KILL, killed_with=signal.SIGKILL)
    assert task_status(facts, False)[1].endswith(KILLED_BY_GRAPHDIST)


def test_a_task_that_ended_otherwise_after_graphdists_signal_says_how_it_ended():
    """SIGTERM sent, but the server exited with 3 by itself: no claim that graphdist ended it."""
    facts = ProcessFacts(ended=True, exitcode=3, killed_with=signal.SIGTERM)
    assert task_status(facts, False) == (DEAD, "exited with code 3")


def test_a_dead_task_whose_exit_status_has_not_arrived_says_so():
    assert "not reached graphdist yet" in ended_detail(ProcessFacts(ended=True))


def test_a_task_the_oom_killer_ended_says_it_ran_out_of_memory_unless_graphdist_killed_it():
    oom = "out of memory (the kernel's OOM killer; limit 200 MiB of memory cgroup /x)"
    facts = ProcessFacts(ended=True, exitcode=-signal.SIGKILL, oom=oom)
    assert task_status(facts, True) == (
        DEAD,
        f"ran {oom} and was killed by SIGKILL (exit status 137)",
    )
    killed = ProcessFacts(ended=True, exitcode=-9, killed_with=signal.SIGKILL, oom=oom)
    assert "out of memory" not in ended_detail(killed)  # graphdist's kill() is the cause


@pytest.mark.parametrize("error", [TIMEOUT, REFUSED])
def test_a_running_process_whose_probe_failed_is_not_answering(error):
    assert task_status(ProcessFacts(ended=False), False, error) == (NOT_ANSWERING, error)


def test_a_running_process_that_answered_is_alive():
    assert task_status(ProcessFacts(ended=False), True) == (ALIVE, "")


def test_a_server_nobody_here_can_see_the_process_of_is_judged_by_its_probe():
    assert task_status(ProcessFacts(ended=None), True)[0] == ALIVE
    assert task_status(ProcessFacts(ended=None), False, REFUSED)[0] == NOT_ANSWERING


# -- the cause of a restart ------------------------------------------------------------------


def test_a_killed_worker_is_the_cause_though_its_peers_error_exit_came_first():
    """Slurm, CI 2026-12-05: worker-0's collective failed (exit 1) 0.05 s after worker-1 was
    SIGKILLed, and its news reached the launcher first. The rule reads recorded times."""
    ends = [TaskEnd("worker-0", 10.05, 1), TaskEnd("worker-1", 10.00, KILL)]
    assert restart_cause(ends).name == "worker-1"
    assert restart_cause(list(reversed(ends))).name == "worker-1"


def test_a_death_ranks_above_an_error_exit_close_before_it():
    """Both recorded, the error exit a little earlier (clocks, reporting): still the death."""
    ends = [TaskEnd("worker-0", 10.00, 1), TaskEnd("worker-1", 10.00 + CLOSE_S / 2, KILL)]
    assert restart_cause(ends).name == "worker-1"


def test_an_error_exit_well_before_a_death_is_the_cause():
    ends = [TaskEnd("worker-0", 10.0, 1), TaskEnd("worker-1", 10.0 + CLOSE_S + 0.5, KILL)]
    assert restart_cause(ends).name == "worker-0"


@pytest.mark.parametrize("mark", ["frozen", "lost"])
def test_a_task_killed_as_frozen_or_lost_with_its_node_counts_as_a_death(mark):
    ends = [TaskEnd("worker-0", 5.0, 1), TaskEnd("worker-1", 5.2, 1, **{mark: True})]
    assert restart_cause(ends).name == "worker-1"


def test_sigabrt_is_tensorflows_own_fatal_error_not_a_death():
    ends = [TaskEnd("worker-0", 5.0, 2), TaskEnd("worker-1", 5.1, -signal.SIGABRT)]
    assert end_rank(ends[1]) == 1
    assert restart_cause(ends).name == "worker-0"


def test_an_error_exit_ranks_above_an_exit_0():
    ends = [TaskEnd("chief", 1.0, 0), TaskEnd("worker-0", 1.1, 1)]
    assert restart_cause(ends).name == "worker-0"
    assert end_rank(TaskEnd("x", 0, None)) == 1  # an unknown code is not a success


def test_the_same_facts_give_the_same_cause_in_any_order():
    ends = [TaskEnd(f"worker-{i}", 3.0, KILL) for i in range(4)]
    causes = {restart_cause(ends[i:] + ends[:i]).name for i in range(4)}
    assert causes == {"worker-0"}


def test_the_earliest_of_two_deaths_is_the_cause():
    ends = [TaskEnd("worker-0", 3.2, KILL), TaskEnd("worker-1", 3.0, -signal.SIGTERM)]
    assert restart_cause(ends).name == "worker-1"


def test_no_end_is_a_value_error():
    with pytest.raises(ValueError):
        restart_cause([])
