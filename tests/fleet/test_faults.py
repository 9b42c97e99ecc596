"""Dead and frozen tasks: typed errors that name the task, bounded waits, restarts."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil
import pytest
import tensorflow as tf

import graphdist
from graphdist._detached.state import SUPERVISOR_LOG
from graphdist._detached.supervisor import MONITOR_INTERVAL_S
from graphdist._distribute.heartbeat import process_state
from graphdist._fleet.client import EXIT_NEWS_S
from graphdist._graph.graphs import split_graph
from tests.conftest import EVENTUALLY_S, read_json, run_python, sigstop, wait_gone
from tests.sigtrace import watching

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
TIMEOUT_MS = 1500
REPEATS = 5
RESTARTING = "); restarting local-1 "  # the supervisor's line for each restart it schedules
GAVE_UP = "gave up on local-1 after 1 restart(s)"  # ... and for the cap of 1 reached


@pytest.fixture
def fleet(graphdist_fleet_factory):
    return graphdist_fleet_factory("local=2", operation_timeout_ms=TIMEOUT_MS)


def seed_graph(fleet):
    return split_graph(fleet.device("local", 0), fleet.device("local", 1))


def test_health_reports_alive_dead_and_not_answering(fleet):
    assert [h.status for h in fleet.health()] == ["alive", "alive"]
    # A frozen task is only told from a slow one by the probe's timeout: generous, so that the
    # live task answers in time on a loaded machine. A stopped task read alive is a failure.
    health = while_stopped(fleet.task("local", 1).pid, lambda: fleet.health(timeout_s=5.0))
    assert [h.status for h in health] == ["alive", "not answering"]
    fleet.kill("local", 1)
    health = fleet.health()
    assert [h.status for h in health] == ["alive", "dead"]
    assert "was killed by SIGKILL" in str(health[1])


def test_a_server_on_ipv6_loopback_at_a_tasks_port_does_not_answer_for_it(fleet):
    """``localhost`` is 127.0.0.1 and ::1; a task listens on 127.0.0.1 only, so another
    process may listen on ``[::1]`` at the same port. A client resolving ``localhost`` tries
    ::1 first: a gRPC server there answered the health probe of a SIGSTOPped task, read
    ``alive`` (the probe now dials 127.0.0.1). Red if the probe dials the name."""
    from concurrent import futures

    import grpc

    task = fleet.task("local", 1)
    other = grpc.server(futures.ThreadPoolExecutor(1))
    try:
        assert other.add_insecure_port(f"[::1]:{task.task.port}") == task.task.port
    except RuntimeError:  # no IPv6 loopback here: nothing can listen there either
        pytest.skip("no IPv6 loopback on this machine")
    other.start()
    try:
        health = while_stopped(task.pid, lambda: fleet.health(timeout_s=3.0))
    finally:
        other.stop(0)
    assert [h.status for h in health] == ["alive", "not answering"]


def test_a_session_reaches_its_master_though_another_server_is_on_ipv6_loopback_at_its_port(
    fleet,
):
    """The same for a session on ``grpc://localhost:PORT``: TensorFlow's own client reaches the
    master on 127.0.0.1 (measured: this passes with the name as the target), where grpcio's
    Python client had tried ``[::1]`` first. Pinned: a server there has no master service, and
    a session that reached it would fail (UNIMPLEMENTED)."""
    from concurrent import futures

    import grpc

    master = fleet.task("local", 0)
    other = grpc.server(futures.ThreadPoolExecutor(1))
    try:
        assert other.add_insecure_port(f"[::1]:{master.task.port}") == master.task.port
    except RuntimeError:
        pytest.skip("no IPv6 loopback on this machine")
    other.start()
    try:
        graph, y = seed_graph(fleet)
        with fleet.session("local", 0, graph=graph, operation_timeout_ms=30_000) as sess:
            assert sess.run(y) == 238
    finally:
        other.stop(0)


@pytest.mark.parametrize("killer", ["outside", "fleet.kill"])
def test_a_killed_task_whose_exit_news_is_late_is_reported_dead(fleet, killer):
    """A killed server's socket closes before its parent (the fork server) reaps it and tells
    the fleet: a health check in between said "not answering", and so did a run's diagnosis of
    a task that fleet.kill() was still killing (CI, 2026-12-05). Now the kernel's word (a
    pidfd) decides. Here the fork server is stopped while the task is killed, from outside or
    by fleet.kill() (which waits for the end), so no news of the exit can come: the task reads
    dead at once, and the check, once the fork server resumes 0.5 s into it, says how."""
    task = fleet.task("local", 1)
    pid, parent = task.pid, psutil.Process(task.pid).ppid()
    assert parent != os.getpid(), "the task is not the fork server's child"
    sigstop(parent)
    try:
        if killer == "outside":
            os.kill(pid, signal.SIGKILL)
        else:
            threading.Thread(target=fleet.kill, args=("local", 1), daemon=True).start()
        assert wait_gone([pid], EVENTUALLY_S) == []  # its socket is closed
        deadline = time.monotonic() + EVENTUALLY_S  # its ~100 threads end after its main one
        while task.alive and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not task.alive  # the kernel's word ...
        assert task.exitcode is None  # ... with no news from the fork server
        threading.Timer(0.5, os.kill, (parent, signal.SIGCONT)).start()
        health = fleet.health()
    finally:
        os.kill(parent, signal.SIGCONT)
    assert [h.status for h in health] == ["alive", "dead"], str(health)
    assert "was killed by SIGKILL" in str(health[1])


def test_a_closed_fleet_says_how_each_task_ended_though_the_news_was_late():
    """close() ends its tasks as the kernel says (pidfds); their exit statuses are the fork
    server's news. Here the fork server is stopped through the close and resumed 1.5 s into
    it (before EXIT_NEWS_S): close waits for the news, so the closed fleet's table, read at
    once, says "stopped" for each task (it read "exited with an unknown code" in the suite
    under load)."""
    fleet = graphdist.LocalFleet("local=2").start()
    pids = [t.pid for t in fleet.tasks]
    parent = psutil.Process(pids[0]).ppid()
    assert parent != os.getpid(), "the task is not the fork server's child"
    sigstop(parent)
    resume = threading.Timer(EXIT_NEWS_S * 0.75, os.kill, (parent, signal.SIGCONT))
    try:
        resume.start()
        fleet.close()
        page = fleet._repr_html_()
    finally:
        resume.cancel()
        os.kill(parent, signal.SIGCONT)
    assert wait_gone(pids, EVENTUALLY_S) == []
    assert page.count(">stopped<") == 2, page


def test_worker_killed_mid_session_names_the_worker_then_restart_works(fleet):
    graph, y = seed_graph(fleet)
    for _ in range(REPEATS):
        with fleet.session("local", 0, graph=graph) as sess:
            assert sess.run(y) == 238
            fleet.kill("local", 1)
            with pytest.raises(graphdist.TaskFailedError) as info:
                sess.run(y)
        err = info.value
        assert (err.task, err.status, err.timeout_ms) == ("local-1", "dead", TIMEOUT_MS)
        assert fleet.task("local", 1).address in str(err)
        assert err.__cause__ is None  # the fleet knew before TensorFlow was even asked
        fleet.restart("local", 1)
        with fleet.session("local", 0, graph=graph) as sess:
            assert sess.run(y) == 238
    assert fleet.task("local", 1).restarts == REPEATS


def test_master_killed_names_the_master_and_new_sessions_refuse_at_once(fleet):
    graph, y = seed_graph(fleet)
    for _ in range(REPEATS):
        sess = fleet.session("local", 0, graph=graph)
        assert sess.run(y) == 238
        fleet.kill("local", 0)
        with pytest.raises(graphdist.TaskFailedError) as info:
            sess.run(y)
        assert (info.value.task, info.value.status) == ("local-0", "dead")
        sess.close()
        with pytest.raises(graphdist.TaskFailedError, match="cannot open a session"):
            fleet.session("local", 0, graph=graph)
        fleet.restart("local", 0)


def while_stopped(pid: int, call: Callable[[], Any]) -> Any:
    """``call()`` while ``pid`` is stopped, its result; the stop is checked to have held
    throughout (state ``T`` after the call), and a failure names what the kernel's record saw
    sent to the task meanwhile by any other process (tests/sigtrace.py). ``sigstop`` waits
    until the task is stopped: a bare SIGSTOP takes hold only once a thread of the task runs,
    and until then its other threads run on (what made a "stopped" task answer a run here
    before 8bc3c50). A task is in a process group of its own whose link, the fork server, lives
    on, so no orphaned group's SIGCONT reaches it (tests/conftest.py ``anchored_group``)."""
    with watching(pid) as signals:
        sigstop(pid)
        try:
            result = call()
            state = process_state(pid)
        finally:
            os.kill(pid, signal.SIGCONT)
    assert state == "T", f"the stopped task was continued ({state}): {signals.describe()}"
    return result


def frozen_run(sess: Any, y: Any, pid: int) -> graphdist.TaskFailedError:
    """Run ``y`` while ``pid`` is stopped (see :func:`while_stopped`): the error it raises."""

    def run() -> Any:
        try:
            return sess.run(y)
        except graphdist.TaskFailedError as exc:
            return exc

    outcome = while_stopped(pid, run)
    assert isinstance(outcome, graphdist.TaskFailedError), (
        f"a run needing a stopped task returned {outcome!r}"
    )
    return outcome


def test_frozen_worker_is_reported_within_the_operation_timeout(fleet):
    graph, y = seed_graph(fleet)
    pid = fleet.task("local", 1).pid
    for _ in range(REPEATS):
        with fleet.session("local", 0, graph=graph) as sess:
            assert sess.run(y) == 238
            error = frozen_run(sess, y, pid)
        assert (error.task, error.status) == ("local-1", "not answering")
        assert error.timeout_ms == TIMEOUT_MS
        assert type(error.__cause__).__name__ == "DeadlineExceededError"
    with fleet.session("local", 0, graph=graph) as sess:
        assert sess.run(y) == 238


def test_a_busy_task_is_not_blamed_for_a_frozen_one(fleet):
    # After a failed run the fleet asks every task whether it answers; on a loaded machine the
    # master itself can miss that short probe. Here it is stopped for the first probe (as busy
    # as it gets) and resumed during the second: the frozen task must be the one named.
    master, frozen = fleet.task("local", 0).pid, fleet.task("local", 1).pid
    sigstop(frozen)
    sigstop(master)
    resume = threading.Timer(1.0, os.kill, (master, signal.SIGCONT))
    resume.start()
    try:
        error = fleet._diagnose(tf.errors.DeadlineExceededError(None, None, "deadline"), 1500)
    finally:
        resume.join()
        os.kill(master, signal.SIGCONT)
        os.kill(frozen, signal.SIGCONT)
    assert isinstance(error, graphdist.TaskFailedError)
    assert (error.task, error.status) == ("local-1", "not answering")


def test_restart_keeps_variables_on_other_tasks(fleet):
    graph = tf.Graph()
    with graph.as_default():
        kept = graphdist.shared_variable("kept", 1.0, fleet.device("local", 0))
        lost = graphdist.shared_variable("lost", 1.0, fleet.device("local", 1))
    with fleet.session("local", 0, graph=graph) as sess:
        graphdist.initialize_uninitialized(sess)
        sess.run([kept.assign(42.0), lost.assign(42.0)])
    fleet.restart("local", 1)
    with fleet.session("local", 0, graph=graph) as sess:
        assert graphdist.initialize_uninitialized(sess) == ["lost"]
        assert sess.run([kept, lost]) == [42.0, 1.0]


def test_reopening_session_survives_a_restart(fleet):
    graph, y = seed_graph(fleet)
    with fleet.reopening_session("local", 0, graph=graph) as sess:
        assert sess.run(y) == 238
        fleet.restart("local", 1)
        assert sess.run(y) == 238
        assert sess.reopened == 1


def test_detached_supervisor_restarts_a_dead_task_up_to_the_cap(state_dir):
    env = {"GRAPHDIST_STATE_DIR": state_dir}
    up = run_python(
        [
            "-m",
            "graphdist",
            "up",
            "--cluster",
            "local=2",
            "--detach",
            "--restart",
            "on-failure",
            "--max-restarts",
            "1",
        ],
        env=env,
    )
    assert up.returncode == 0, up.stderr
    try:
        state = os.path.join(state_dir, "fleet.json")
        first = read_json(state)["tasks"][1]["pid"]
        os.kill(first, signal.SIGKILL)
        second = _wait_for_new_pid(state, first)
        status = json.loads(run_python(["-m", "graphdist", "status", "--json"], env=env).stdout)
        assert status[1]["alive"] and status[1]["pid"] == second
        os.kill(second, signal.SIGKILL)  # the cap is 1: this one stays dead
        assert wait_gone([second], EVENTUALLY_S) == []
        log_path = os.path.join(state_dir, SUPERVISOR_LOG)
        _wait_for_log(log_path, lambda text: GAVE_UP in text or text.count(RESTARTING) > 1)
        # The supervisor has seen the death; give a (broken) one many polls to restart it anyway.
        time.sleep(10 * MONITOR_INTERVAL_S)
        with open(log_path, encoding="utf-8") as f:
            text = f.read()
        assert text.count(RESTARTING) == 1 and GAVE_UP in text, text
        assert read_json(state)["tasks"][1]["pid"] == second
        result = run_python(["-m", "graphdist", "status", "--json"], env=env)
        assert result.returncode == 1, result.stderr  # the supervisor gave up on a task
        assert "local-1 died 2 times within 60 s" in result.stderr
        status = json.loads(result.stdout)
        assert not status[1]["alive"] and status[0]["alive"]
        assert (status[1]["gave_up"], status[1]["restarts"]) == (True, 1)
    finally:
        down = run_python(["-m", "graphdist", "down"], env=env)
        assert down.returncode == 0, down.stderr


def _wait_for_log(path: str, done: Callable[[str], bool], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(path, encoding="utf-8") as f:
            if done(f.read()):
                return
        time.sleep(0.1)
    raise AssertionError(f"the supervisor did not react to the second death; see {path}")


def _wait_for_new_pid(state: str, old: int) -> int:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            pid = read_json(state)["tasks"][1]["pid"]
        except (OSError, ValueError):
            pid = old
        if pid != old:
            return int(pid)
        time.sleep(0.1)
    raise AssertionError("the supervisor did not restart the task")
