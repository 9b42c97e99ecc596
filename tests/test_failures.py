"""The words of a failed task (graphdist/_failures.py), unit by unit: how a task is named, how a
process ended (exit code; killed by a signal, with the shell's exit status), and the one
TaskFailedError every layer raises. Pure: no process is started."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from graphdist._exceptions import TaskFailedError
from graphdist._failures import (
    ALIVE,
    DEAD,
    NOT_ANSWERING,
    RESTARTED,
    dead_detail,
    exit_status,
    exited,
    how_ended,
    task_failed,
    task_name,
)

TASK = SimpleNamespace(job="worker", index=1, address="localhost:2222")


def test_a_task_is_named_job_dash_index():
    assert task_name("worker", 1) == "worker-1"
    assert task_name("ps", 0) == "ps-0"


@pytest.mark.parametrize(
    ("exitcode", "status"),
    [
        (0, 0),
        (1, 1),
        (255, 255),
        (256, 255),  # a code over a byte: the most a shell shows
        (-signal.SIGKILL, 137),
        (-signal.SIGTERM, 143),
        (-1, 129),
        (-127, 255),  # 128 + 127 is over a byte
        (-128, 255),
    ],
)
def test_the_exit_status_is_the_code_or_128_plus_the_signal_at_most_255(exitcode, status):
    assert exit_status(exitcode) == status


def test_how_a_process_ended_names_its_code_or_its_signal_with_the_shells_status():
    assert how_ended(0) == "exited with code 0"
    assert how_ended(3) == "exited with code 3"
    assert how_ended(-signal.SIGKILL) == "was killed by SIGKILL (exit status 137)"
    assert how_ended(-signal.SIGSEGV) == "was killed by SIGSEGV (exit status 139)"
    assert how_ended(-100) == "was killed by signal 100 (exit status 228)"  # no such signal
    assert how_ended(None) == "exited with an unknown code"


def test_exited_and_dead_detail_say_the_same_thing():
    assert exited("worker-1", -signal.SIGKILL) == "worker-1 was killed by SIGKILL (exit status 137)"
    assert exited("ps-0", 2) == "ps-0 exited with code 2"
    assert exited("ps-0", None) == "ps-0 exited with an unknown code"
    for code in (None, 0, 5, -signal.SIGTERM):
        assert dead_detail(code) == how_ended(code)


def test_the_statuses_are_the_words_health_prints():
    assert (ALIVE, DEAD, NOT_ANSWERING, RESTARTED) == (
        "alive",
        "dead",
        "not answering",
        "restarted",
    )


def test_a_dead_task_is_named_with_its_detail_what_failed_and_how_to_restart_it():
    error = task_failed(TASK, DEAD, "was killed by SIGKILL", what="the run failed", timeout_ms=5)
    assert isinstance(error, TaskFailedError)
    assert str(error) == (
        "Task worker-1 at localhost:2222 is dead (was killed by SIGKILL): the run failed; "
        "restart it with fleet.restart('worker', 1) and open a new session"
    )
    assert (error.task, error.address, error.status, error.timeout_ms) == (
        "worker-1",
        "localhost:2222",
        DEAD,
        5,
    )


def test_a_restarted_task_was_restarted_and_a_silent_one_may_be_frozen():
    restarted = task_failed(TASK, RESTARTED)
    assert str(restarted) == (
        "Task worker-1 at localhost:2222 was restarted; "
        "its server lost this session's state; open a new session"
    )
    assert restarted.timeout_ms is None
    silent = task_failed(TASK, NOT_ANSWERING, "3 probes")
    assert str(silent) == (
        "Task worker-1 at localhost:2222 is not answering (3 probes); "
        "it may be frozen or overloaded"
    )


def test_a_status_without_a_hint_gets_none_and_nothing_empty_is_printed():
    error = task_failed(TASK, "gone")
    assert str(error) == "Task worker-1 at localhost:2222 is gone"
    assert error.status == "gone"
