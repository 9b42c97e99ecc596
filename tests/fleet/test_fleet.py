"""LocalFleet end to end: real servers in real processes, real gRPC sessions."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap

import psutil
import pytest

import graphdist
from graphdist._graph.graphs import SPLIT_GRAPH_RESULT, split_graph
from tests.conftest import (
    DOCUMENTED_OPERATION_TIMEOUT_MS,
    EVENTUALLY_S,
    QUIET_TF,
    REPO,
    is_gone,
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
    assert "local:1" in repr(fleet.task("local", 1))
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
        assert sess.run(y) == SPLIT_GRAPH_RESULT


def test_split_is_real_when_folding_is_off(graphdist_fleet):
    fleet = graphdist_fleet
    graph, y = split_graph(fleet.device("local", 0), fleet.device("local", 1))
    config = graphdist.no_folding_config()
    with fleet.session("local", 0, graph=graph, config=config) as sess:
        result, placement = graphdist.run_traced(sess, y)
    assert result == SPLIT_GRAPH_RESULT
    assert placement.task_of("y2") == "local:0"
    assert placement.task_of("y1") == "local:1"
    assert placement.task_of("y") == "local:1"


def test_session_config_carries_the_timeout(graphdist_fleet):
    tf = pytest.importorskip("tensorflow")
    with graphdist_fleet.session("local", 0, graph=tf.Graph(), operation_timeout_ms=4321) as s:
        assert s._config.operation_timeout_in_ms == 4321
    with graphdist_fleet.session("local", 1, graph=tf.Graph()) as s:
        assert s._config.operation_timeout_in_ms == DOCUMENTED_OPERATION_TIMEOUT_MS


def test_fleet_device_is_checked_against_its_cluster(graphdist_fleet):
    fleet = graphdist_fleet
    assert fleet.device("local", 1, gpu=0) == "/job:local/replica:0/task:1/device:GPU:0"
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
        assert str(port) in str(info.value)
        assert fleet.pids == []
    finally:
        holder.close()
        fleet.close()


def test_failed_start_names_the_task_shows_its_log_and_cleans_up(tmp_path):
    # A server whose cluster names a device filter that cannot parse fails inside TensorFlow.
    tf = pytest.importorskip("tensorflow")
    bad = tf.compat.v1.ConfigProto(device_filters=["/job:local/tsk:9"])
    fleet = graphdist.LocalFleet("local=2", server_config=bad, log_dir=tmp_path)
    with pytest.raises(graphdist.FleetStartError) as info:
        fleet.start()
    err = info.value
    assert err.task in ("local:0", "local:1")
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


# -- readiness: a ready signal first, then a real gRPC answer ------------------------------------


def test_start_returns_only_once_every_server_answers_grpc(graphdist_fleet_factory):
    from graphdist._fleet.probe import Prober

    fleet = graphdist_fleet_factory("local=3,ps=1")
    for task in fleet.tasks:
        with Prober(task.address) as prober:  # no retry, no wait: it answers right now
            assert prober.probe(5.0), prober.last_error


class _GetStatusServer:
    """A gRPC server on 127.0.0.1 that answers TensorFlow's GetStatus with empty bytes."""

    def __init__(self):
        import concurrent.futures

        import grpc

        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
        answer = grpc.unary_unary_rpc_method_handler(lambda request, context: b"")
        self.server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "tensorflow.WorkerService", {"GetStatus": answer}
                ),
            )
        )
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def stop(self):
        self.server.stop(None)


class _Starting:
    """A made-up starting task: its address, the owner's end of its ready channel (or None)."""

    def __init__(self, address, channel=None, alive=True):
        self.address = address
        self.channel = channel
        self.is_alive = alive


def _wait(tasks, timeout_s):
    from graphdist._fleet.probe import wait_serving

    return wait_serving(
        tasks,
        address=lambda t: t.address,
        ready_fd=lambda t: None if t.channel is None else t.channel.fileno(),
        alive=lambda t: t.is_alive,
        timeout_s=timeout_s,
    )


def _free_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_ready_signal_alone_is_not_ready_a_grpc_answer_is():
    server = _GetStatusServer()
    pairs = [socket.socketpair() for _ in range(3)]
    try:
        up = _Starting(server.address, pairs[0][0])
        silent = _Starting(_free_address(), pairs[1][0])  # says it is up; nothing answers there
        polled = _Starting(server.address)  # no channel: called until it answers
        waiting = _Starting(server.address, pairs[2][0])  # never says anything
        for _, theirs in pairs[:2]:
            theirs.send(b"R")
        outcome = _wait([up, silent, polled], timeout_s=1.5)
        assert (outcome.ready, outcome.late, outcome.exited) == (2, silent, None)
        assert "UNAVAILABLE" in outcome.last_error or "DEADLINE" in outcome.last_error
        outcome = _wait([waiting], timeout_s=0.3)
        assert (outcome.ready, outcome.late) == (0, waiting)
        assert outcome.last_error == "it never said its server was up"
    finally:
        server.stop()
        for ours, theirs in pairs:
            ours.close()
            theirs.close()


def test_a_process_that_ends_before_it_is_up_is_reported_at_once():
    server = _GetStatusServer()
    ours, theirs = socket.socketpair()
    ours2, theirs2 = socket.socketpair()
    try:
        ended = _Starting(server.address, ours, alive=False)
        up = _Starting(server.address, ours2)
        theirs2.send(b"R")
        theirs.close()  # the process ended: its end of the channel closed, no byte sent
        outcome = _wait([up, ended], timeout_s=30)
        assert outcome.exited is ended and outcome.late is None
    finally:
        server.stop()
        for s in (ours, ours2, theirs2):
            s.close()


def test_a_server_that_dies_while_starting_is_named_and_nothing_is_left(tmp_path):
    # local:1 cannot open its log (the path is a folder): its process ends before its server
    # exists, while local:0 starts normally.
    (tmp_path / "local-1.log").mkdir()
    fleet = graphdist.LocalFleet("local=2", log_dir=tmp_path)
    with pytest.raises(graphdist.FleetStartError) as info:
        fleet.start()
    assert info.value.task == "local:1"
    assert "exited with code 1 while starting" in str(info.value)
    assert fleet.state in (graphdist.FleetState.FAILED, graphdist.FleetState.CLOSED)
    assert all(is_gone(t.pid) for t in fleet.tasks if t.pid)


def test_a_dead_fork_server_is_replaced():
    code = textwrap.dedent(
        """
        import os, signal, psutil, graphdist
        fleet = graphdist.LocalFleet("local=1").start()
        first = psutil.Process(fleet.pids[0]).ppid()
        fleet.close()
        os.kill(first, signal.SIGKILL)
        psutil.Process(first).wait(30)
        fleet = graphdist.LocalFleet("local=2").start()
        second = {psutil.Process(p).ppid() for p in fleet.pids}
        fleet.close()
        assert second != {first} and len(second) == 1, (first, second)
        print("OK")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, **QUIET_TF},
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-2000:]


def test_servers_get_the_malloc_settings_unless_the_owner_chose_its_own():
    from graphdist._fleet.forkserver import MALLOC_TUNABLES, _fork_server_env

    env, added = _fork_server_env("")
    if "GLIBC_TUNABLES" in os.environ:
        assert added == [] and env["GLIBC_TUNABLES"] == os.environ["GLIBC_TUNABLES"]
    else:
        assert added == ["GLIBC_TUNABLES"] and env["GLIBC_TUNABLES"] == MALLOC_TUNABLES
    assert "LD_PRELOAD" not in env
    env, _ = _fork_server_env("/lib/shim.so")
    assert env["LD_PRELOAD"] == "/lib/shim.so"


def test_a_server_process_handle_reads_its_status_once_whichever_thread_asks():
    import struct
    import threading

    from graphdist._fleet.forkserver import FORK_FAILED, ServerProcess

    status_r, status_w = os.pipe()
    owner_end, child_end = socket.socketpair()
    handle = ServerProcess("x", status_r, owner_end)
    assert handle.is_alive() and handle.exitcode is None  # not forked yet: not dead either
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(handle.pid)) for _ in range(4)]
    for t in threads:
        t.start()
    os.write(status_w, struct.pack("q", 4321))
    for t in threads:
        t.join(10)
    assert seen == [4321] * 4
    checks = [threading.Thread(target=lambda: handle.join(10)) for _ in range(3)]
    for t in checks:
        t.start()
    os.write(status_w, struct.pack("q", -9))
    for t in checks:
        t.join(15)
    assert (handle.pid, handle.exitcode, handle.is_alive()) == (4321, -9, False)
    assert handle.ready_fd == owner_end.fileno()  # the channel outlives the status pipe
    handle.close_channel()
    assert handle.ready_fd is None
    os.close(status_w)
    child_end.close()

    # A fork server that dies before it forks: the status pipe ends with no pid.
    status_r, status_w = os.pipe()
    owner_end, child_end = socket.socketpair()
    orphan = ServerProcess("y", status_r, owner_end)
    os.close(status_w)
    assert (orphan.pid, orphan.exitcode) == (None, FORK_FAILED)
    child_end.close()
