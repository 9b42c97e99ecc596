"""LocalFleet end to end: real servers in real processes, real gRPC sessions."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

import graphdist
from graphdist._graph.graphs import split_graph
from graphdist._net.probe import wait_answering
from tests.conftest import (
    DOCUMENTED_FLEET_OPERATION_TIMEOUT_MS,
    EVENTUALLY_S,
    QUIET_TF,
    REPO,
    is_gone,
    processes_marked,
    run_python,
    wait_gone,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_fleet_exposes_cluster_tasks_pids_and_logs(graphdist_fleet):
    fleet = graphdist_fleet
    assert fleet.state is graphdist.FleetState.RUNNING
    assert [(t.job, t.index) for t in fleet.tasks] == [("local", 0), ("local", 1)]
    for t in fleet.tasks:
        assert t.alive and psutil.pid_exists(t.pid)
        assert fleet.target("local", t.index) == f"grpc://{t.address}"
        assert os.path.exists(t.log_path)
        assert any("server ready" in line for line in t.log_tail())
    assert "local-1" in repr(fleet.task("local", 1))
    assert len(set(fleet.pids)) == 2 and os.getpid() not in fleet.pids


def test_servers_run_in_processes_forked_from_one_fork_server(graphdist_fleet):
    parents = {psutil.Process(pid).ppid() for pid in graphdist_fleet.pids}
    assert len(parents) == 1
    (parent,) = parents
    assert parent != os.getpid()
    assert "forkserver" in " ".join(psutil.Process(parent).cmdline())


@pytest.mark.parametrize("master", [0, 1])
def test_split_graph_gives_238_through_every_task(graphdist_fleet, master):
    fleet = graphdist_fleet
    graph, y = split_graph(fleet.device("local", 0), fleet.device("local", 1))
    with fleet.session("local", master, graph=graph) as sess:
        assert sess.run(y) == 238


def test_split_is_real_when_folding_is_off(graphdist_fleet):
    fleet = graphdist_fleet
    graph, y = split_graph(fleet.device("local", 0), fleet.device("local", 1))
    config = graphdist.no_folding_config()
    with fleet.session("local", 0, graph=graph, config=config) as sess:
        result, placement = graphdist.run_traced(sess, y)
    assert result == 238
    assert placement.task_of("y2") == "local-0"
    assert placement.task_of("y1") == "local-1"
    assert placement.task_of("y") == "local-1"


def test_session_config_carries_the_timeout(graphdist_fleet):
    import tensorflow as tf

    with graphdist_fleet.session("local", 0, graph=tf.Graph(), operation_timeout_ms=4321) as s:
        assert s._config.operation_timeout_in_ms == 4321
    with graphdist_fleet.session("local", 1, graph=tf.Graph()) as s:
        assert s._config.operation_timeout_in_ms == DOCUMENTED_FLEET_OPERATION_TIMEOUT_MS


def test_readiness_wait_names_the_first_silent_server_and_how_many_answered(graphdist_fleet):
    live = [t.address for t in graphdist_fleet.tasks]
    with socket.socket() as silent:  # bound, never listening: connections are refused
        silent.bind(("127.0.0.1", 0))
        refused = f"127.0.0.1:{silent.getsockname()[1]}"
        assert wait_answering(live, 5.0) is None
        outcome = wait_answering([live[0], refused, live[1]], 0.5)
        assert outcome is not None
        assert (outcome.index, outcome.answered) == (1, 2)
        assert outcome.last_error and outcome.last_error.startswith("UNAVAILABLE")
        rounds = []

        def each_round(pending):
            rounds.append(list(pending))
            if len(rounds) == 2:
                raise graphdist.FleetStartError("the silent server's process died")

        with pytest.raises(graphdist.FleetStartError, match="process died"):
            wait_answering([live[0], refused], 30.0, each_round=each_round)
        assert rounds == [[0, 1], [1]]  # each round sees only the servers still silent


def test_fleet_device_is_checked_against_its_cluster(graphdist_fleet):
    fleet = graphdist_fleet
    gpus = len(graphdist.available_gpus())  # what its servers, on this machine, see
    if gpus:
        assert fleet.device("local", 1, gpu=0) == "/job:local/replica:0/task:1/device:GPU:0"
    with pytest.raises(graphdist.PlacementError, match=f"task local:1 has {gpus} GPU"):
        fleet.device("local", 1, gpu=gpus)
    assert fleet.device(task=0) == "/job:local/replica:0/task:0"
    with pytest.raises(graphdist.PlacementError, match="no task with index 5"):
        fleet.device("local", 5)
    with pytest.raises(graphdist.PlacementError, match="no job 'worker'"):
        fleet.check("/job:worker/task:0")
    with pytest.raises(graphdist.TaskNotFoundError, match="No task 7"):
        fleet.target("local", 7)


def test_close_is_idempotent_and_leaves_no_process(graphdist_fleet_factory):
    fleet = graphdist_fleet_factory("local=1,ps=1")
    pids = fleet.pids
    log_dir = fleet.log_dir
    assert len(pids) == 2
    fleet.close()
    fleet.close()
    assert fleet.state is graphdist.FleetState.CLOSED
    assert wait_gone(pids, EVENTUALLY_S) == []
    assert not os.path.exists(log_dir)
    with pytest.raises(graphdist.FleetClosedError):
        fleet.session("local", 0)


def test_explicit_port_in_use_raises_before_any_server_starts():
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    free = graphdist.Cluster.parse("x=1").address("x", 0)
    fleet = graphdist.LocalFleet({"local": [free, f"localhost:{port}"]})
    try:
        with pytest.raises(graphdist.PortInUseError) as info:
            fleet.start()
        assert info.value.port == port
        assert info.value.holder_pid == os.getpid()
        assert (
            f"Port {port} of task local-1 (localhost:{port}) is already in use by pid {os.getpid()}"
        ) in str(info.value)
        assert fleet.pids == []
    finally:
        holder.close()
        fleet.close()


def test_failed_start_names_the_task_shows_its_log_and_cleans_up(tmp_path):
    # A server whose cluster names a device filter that cannot parse fails inside TensorFlow.
    import tensorflow as tf

    bad = tf.compat.v1.ConfigProto(device_filters=["/job:local/tsk:9"])
    fleet = graphdist.LocalFleet("local=2", server_config=bad, log_dir=tmp_path)
    with pytest.raises(graphdist.FleetStartError) as info:
        fleet.start()
    err = info.value
    assert err.task in ("local-0", "local-1")
    assert err.address in str(err)
    # The log's last lines end with TensorFlow's own error (not just a traceback header, which
    # Python 3.13's longer tracebacks push out of the tail), and the message shows them.
    assert err.log_tail and "Invalid device filter: /job:local/tsk:9" in err.log_tail[-1]
    assert err.log_tail[-1] in str(err)
    assert fleet.state in (graphdist.FleetState.FAILED, graphdist.FleetState.CLOSED)
    assert all(is_gone(t.pid) for t in fleet.tasks if t.pid)


def test_non_local_host_is_refused():
    with pytest.raises(graphdist.ClusterSpecError, match="not an address of this machine"):
        graphdist.LocalFleet({"local": ["example.invalid:2020"]}).start()


@pytest.mark.parametrize("attempt", range(10))
def test_servers_exit_when_the_owner_is_killed(attempt):
    owner_code = textwrap.dedent(
        """
        import sys, time, graphdist
        fleet = graphdist.LocalFleet("local=2,ps=1").start()
        print(" ".join(map(str, fleet.pids)), flush=True)
        time.sleep(600)
        """
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", owner_code],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=REPO,
        env={**os.environ, **QUIET_TF},
    )
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline()
        servers = [int(p) for p in line.split()]
        assert len(servers) == 3, line
        helpers = [c.pid for c in psutil.Process(owner.pid).children(recursive=True)]
        assert set(servers) <= set(helpers)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(10)
        # Every server, the fork server and its resource tracker: nothing is left behind.
        assert wait_gone(helpers, EVENTUALLY_S) == []
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


# A fleet that cannot answer in time: a fresh process's fork server still imports TensorFlow
# (seconds) when a 10 ms start timeout runs out, so no server can have answered.
START_TIMEOUT_SCRIPT = """
import json, graphdist
fleet = graphdist.LocalFleet("local=2", start_timeout_s=0.01)
try:
    fleet.start()
except graphdist.StartTimeoutError as exc:
    print(json.dumps({
        "ready": exc.ready, "expected": exc.expected, "task": exc.task, "address": exc.address,
        "timeout_s": exc.timeout_s, "message": str(exc), "state": fleet.state.value,
        "local-0": fleet.cluster.address("local", 0),
    }))
"""


@pytest.mark.timeout(90)
def test_a_start_timeout_is_a_start_timeout_error_with_the_true_counts(tmp_path):
    mark = f"start-timeout-{os.getpid()}-{tmp_path.name}"
    result = run_python(["-c", START_TIMEOUT_SCRIPT], env={"GRAPHDIST_TEST_MARK": mark})
    assert result.returncode == 0, result.stderr
    error = json.loads(result.stdout)
    assert (error["ready"], error["expected"], error["timeout_s"]) == (0, 2, 0.01)
    assert (error["task"], error["address"]) == ("local-0", error["local-0"])
    assert error["message"].startswith(
        f"0 of 2 servers answered within 0.01 s; local-0 at {error['local-0']} did not"
    )
    assert error["message"].endswith(
        "did not (never probed: its process had not started yet); raise start_timeout_s if the "
        "machine is slow"
    )  # a fresh fork server is still importing TensorFlow: no server was forked in 0.01 s
    assert error["state"] == "failed"
    # the failed start stopped its servers, and its fork server left with its owner
    assert wait_gone(processes_marked(mark), EVENTUALLY_S) == []


@pytest.mark.timeout(90)
def test_close_sigkills_a_server_that_sigterm_does_not_stop(graphdist_fleet_factory):
    """A stopped (SIGSTOP) server keeps SIGTERM pending and never acts on it, as one that
    ignores SIGTERM: close() SIGKILLs it once grace_s has passed; the other dies of SIGTERM."""
    fleet = graphdist_fleet_factory("local=2")
    stuck, other = fleet.task("local", 0), fleet.task("local", 1)
    fleet.kill("local", 0, signal.SIGSTOP)
    deadline = time.monotonic() + EVENTUALLY_S
    while psutil.Process(stuck.pid).status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, "the server did not stop on SIGSTOP"
        time.sleep(0.01)
    fleet.close(grace_s=0.5)
    assert wait_gone([stuck.pid, other.pid], EVENTUALLY_S) == []
    assert (stuck.exitcode, other.exitcode) == (-signal.SIGKILL, -signal.SIGTERM)


@pytest.mark.parametrize("tensorflow_first", [True, False], ids=["tensorflow-first", "graphdist"])
def test_a_closed_fleet_and_its_sessions_still_referenced_at_exit_end_cleanly(tensorflow_first):
    # A script's module-level fleet and sessions are collected while the interpreter tears its
    # modules down: __del__ must not trip over globals that are already gone (importing
    # TensorFlow first changes the order: the fleet goes late), and a session's close (which
    # TensorFlow's __del__ calls again) must not start a thread then: on Python 3.11 that hangs
    # the exit for ever.
    first = "import tensorflow" if tensorflow_first else ""
    code = first + textwrap.dedent(
        """
        import graphdist
        from graphdist._graph.graphs import split_graph
        with graphdist.LocalFleet("local=2") as fleet:
            graph, y = split_graph(fleet.device("local", 0), fleet.device("local", 1))
            with fleet.session("local", 1, graph=graph) as closed_by_the_script:
                print(closed_by_the_script.run(y))
            left_open = fleet.session("local", 0, graph=graph)
            print(left_open.run(y))
        print("closed", fleet.state.value)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=REPO,
        env={**os.environ, **QUIET_TF},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["238", "238", "closed", "closed"]
    assert "Exception ignored" not in result.stderr, result.stderr


def test_readiness_wait_probes_a_server_only_once_it_may_answer(graphdist_fleet):
    # A fleet's servers are forked one after another and probed as each is forked: a server
    # whose process does not exist yet is not probed (nor counted), however its address answers.
    live = [t.address for t in graphdist_fleet.tasks]
    outcome = wait_answering(live, 0.3, may_answer=lambda i: i == 0)
    assert outcome is not None
    assert (outcome.index, outcome.answered, outcome.last_error) == (1, 1, None)
    asked: list[int] = []

    def may_answer(i):
        asked.append(i)
        return i == 0 or asked.count(1) > 2  # server 1 "is forked" at its third look

    assert wait_answering(live, 5.0, may_answer=may_answer) is None
    assert asked == [0, 1, 1, 1]  # 0 answered in the first round; 1 was probed once allowed
