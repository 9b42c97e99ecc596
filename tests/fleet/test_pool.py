"""The fork server's pool of spares (graphdist._proc.forkserver_pool): a warm start and a
restart take pre-forked children, the pool refills, spares never accumulate and die with their
owner, and the fork server's own output stays out of the owner's stderr.

Each scenario runs in a fresh process: a pool's size depends on its fork server's history, and
killing an owner must not touch the test process's own fleets."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import textwrap

import pytest

from graphdist._distribute.heartbeat import process_state
from graphdist._exceptions import ArgumentError
from graphdist._proc.forkserver_pool import DEFAULT_SPARES, MAX_SPARES, SPARES_ENV, spares_wanted
from tests.conftest import (
    EVENTUALLY_S,
    anchored_group,
    is_gone,
    run_python,
    sigstop,
    start_python,
    wait_gone,
)
from tests.sigtrace import watching

pytestmark = pytest.mark.integration

# Helpers for the scripts: the fork server's children, read from the OS (psutil).
HELPERS = textwrap.dedent(
    """
    import json, os, sys, time
    import psutil
    import graphdist
    from graphdist._proc import forkserver

    def fork_server():
        (server,) = forkserver._servers.values()
        return psutil.Process(server._forkserver_pid)

    def title(proc):
        return " ".join(proc.cmdline())

    def spares():
        return {c.pid for c in fork_server().children() if title(c).startswith("graphdist spare")}

    def wait_spares(n, timeout=30):
        deadline = time.monotonic() + timeout
        while len(spares()) != n:
            assert time.monotonic() < deadline, (n, spares())
            time.sleep(0.05)
        return spares()
    """
)

MECHANISM = HELPERS + textwrap.dedent(
    """
    with graphdist.LocalFleet("local=1"):  # the fork server is up: the pool fills
        pass
    before = wait_spares(4)  # GRAPHDIST_SPARES=4
    with graphdist.LocalFleet("local=3") as fleet:
        assert set(fleet.pids) <= before, (fleet.pids, before)  # handed over, not forked
        for pid in fleet.pids:
            proc = psutil.Process(pid)
            assert proc.ppid() == fork_server().pid
            assert title(proc).startswith("graphdist local:"), title(proc)
        with fleet.session("local", 0) as sess:
            assert sess.list_devices()
        ready = wait_spares(4)  # refilled while the fleet runs
        assert not ready & set(fleet.pids)
        fleet.restart("local", 1)
        new = fleet.pids[1]
        assert new in ready, (new, ready)  # a restart takes a spare too
        with open(os.path.join(fleet.log_dir, "local-1.log")) as f:
            assert "graphdist: server ready" in f.read()
        print("SERVERS", json.dumps(fleet.pids))
    for _ in range(20):  # fleets come and go: the spares do not accumulate
        with graphdist.LocalFleet("local=2"):
            pass
    left = wait_spares(4)
    time.sleep(0.6)  # longer than the refill's idle wait: nothing more is forked
    assert fork_server().children() and {c.pid for c in fork_server().children()} == left
    assert len(forkserver._servers) == 1
    print("OK")
    """
)


@pytest.mark.timeout(240)
def test_warm_start_and_restart_hand_over_spares_that_refill_and_never_accumulate():
    result = run_python(["-c", MECHANISM], timeout=220, env={SPARES_ENV: "4"})
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr
    servers = json.loads(result.stdout.split("SERVERS", 1)[1].splitlines()[0])
    assert wait_gone(servers, EVENTUALLY_S) == []


OWNER = HELPERS + textwrap.dedent(
    """
    fleet = graphdist.LocalFleet("local=2").start()
    wait_spares(3)
    print(json.dumps([fork_server().pid, *fleet.pids, *spares()]), flush=True)
    time.sleep(600)
    """
)


@pytest.mark.timeout(180)
def test_spares_die_with_their_owner(monkeypatch):
    monkeypatch.setenv(SPARES_ENV, "3")
    proc = start_python("-c", OWNER)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.communicate(timeout=30)
        pids = json.loads(line)
        assert len(pids) == 1 + 2 + 3 and not any(is_gone(p) for p in pids)
        proc.send_signal(signal.SIGKILL)  # no exit hook runs
        proc.wait(30)
        assert wait_gone(pids, EVENTUALLY_S) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


CLOSED = HELPERS + textwrap.dedent(
    """
    with graphdist.LocalFleet("local=1"):
        pass
    print(json.dumps([fork_server().pid, *wait_spares(2)]), flush=True)
    """
)


@pytest.mark.timeout(180)
def test_spares_are_gone_when_their_owner_exits():
    result = run_python(["-c", CLOSED], timeout=160, env={SPARES_ENV: "2"})
    assert result.returncode == 0, result.stdout + result.stderr
    pids = json.loads(result.stdout.splitlines()[-1])
    assert len(pids) == 3
    assert wait_gone(pids, EVENTUALLY_S) == []


NO_POOL = HELPERS + textwrap.dedent(
    """
    with graphdist.LocalFleet("local=2") as fleet:
        assert len(fleet.pids) == 2
        time.sleep(1.0)  # longer than the refill's idle wait
        assert spares() == set(), spares()
    print("OK")
    """
)


@pytest.mark.timeout(180)
def test_no_spares_with_zero():
    result = run_python(["-c", NO_POOL], timeout=160, env={SPARES_ENV: "0"})
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr


def test_spares_setting_is_checked():
    assert spares_wanted({}) == DEFAULT_SPARES
    assert spares_wanted({SPARES_ENV: "0"}) == 0
    assert spares_wanted({SPARES_ENV: str(MAX_SPARES)}) == MAX_SPARES
    for bad in ("-1", "two", "1.5", str(MAX_SPARES + 1)):
        with pytest.raises(ArgumentError, match=repr(bad)) as info:
            spares_wanted({SPARES_ENV: bad})
        assert info.value.name == SPARES_ENV and info.value.value == bad


# TensorFlow's import-time lines come from the fork server (and absl prints its pre-init
# warning whatever TF_CPP_MIN_LOG_LEVEL says).
QUIET = textwrap.dedent(
    """
    import os
    import graphdist
    from graphdist._proc import forkserver
    with graphdist.LocalFleet("local=1") as fleet:
        log = os.path.join(forkserver.owner_socket_dir(), forkserver.FORK_SERVER_LOG)
        print("LOG", os.path.exists(log) and "absl::InitializeLog" in open(log).read())
        with open(os.path.join(fleet.log_dir, "local-0.log")) as f:
            print("SERVER_LOG", "graphdist: server ready" in f.read())
    """
)
PRE_INIT = "absl::InitializeLog"


@pytest.mark.timeout(240)
def test_fork_server_output_goes_to_its_log_unless_asked_for():
    env = {"TF_CPP_MIN_LOG_LEVEL": "0"}
    quiet = run_python(["-c", QUIET], timeout=110, env={**env, "GRAPHDIST_TF_LOGS": "0"})
    assert quiet.returncode == 0, quiet.stdout + quiet.stderr
    assert PRE_INIT not in quiet.stderr and "cuda" not in quiet.stderr.lower(), quiet.stderr
    assert "LOG True" in quiet.stdout and "SERVER_LOG True" in quiet.stdout, quiet.stdout
    live = run_python(["-c", QUIET], timeout=110, env={**env, "GRAPHDIST_TF_LOGS": "1"})
    assert live.returncode == 0, live.stdout + live.stderr
    assert PRE_INIT in live.stderr and "LOG False" in live.stdout, live.stdout + live.stderr


# One gRPC completion queue per CPU (graphdist._local.fleet.GRPC_QUEUES_ENV), not TensorFlow's 64:
# a server's threads show it; an empty setting counts as none (TensorFlow would read it as 0
# queues and die of SIGFPE at its first call to another task).
QUEUES = textwrap.dedent(
    """
    import psutil
    import graphdist
    import tensorflow as tf
    from graphdist._local.fleet import grpc_queues
    tf.compat.v1.disable_eager_execution()
    with graphdist.LocalFleet("local=2") as fleet, graphdist.LocalFleet(
        "local=1", env={"TF_GRPC_WORKER_CACHE_QUEUES": "64"}
    ) as tf_default:
        ours = psutil.Process(fleet.pids[0]).num_threads()  # idle, as theirs
        theirs = psutil.Process(tf_default.pids[0]).num_threads()
        with tf.device(fleet.device("local", 0)):
            x = tf.constant(2.0) * 3
        with tf.device(fleet.device("local", 1)):
            y = x + 1
        with fleet.session("local", 0) as sess:
            assert sess.run(y) == 7.0  # task 0 called task 1
        print("THREADS", ours, theirs, grpc_queues())
    """
)


@pytest.mark.timeout(180)
def test_servers_get_one_grpc_queue_per_cpu_and_an_empty_setting_is_none():
    result = run_python(["-c", QUEUES], timeout=160, env={"TF_GRPC_WORKER_CACHE_QUEUES": ""})
    assert result.returncode == 0, result.stdout + result.stderr
    ours, theirs, queues = map(int, result.stdout.split("THREADS", 1)[1].split())
    # one polling thread per queue (give or take gRPC's own few, started as it needs them)
    assert theirs - ours >= 64 - queues - 4, (ours, theirs, queues)


@pytest.mark.timeout(10)
def test_the_pool_holds_the_setting_or_the_most_servers_run_at_once_at_most_max_spares():
    """The pool's size: max(GRAPHDIST_SPARES, the most servers run at once), at most
    MAX_SPARES (32), none with 0. Red for an off-by-one at either bound."""
    from graphdist._proc.forkserver_pool import _Pool

    def target(spares: int, busiest: int) -> int:
        pool = _Pool(spares)
        pool.busiest = busiest
        return pool.target()

    assert target(DEFAULT_SPARES, 0) == DEFAULT_SPARES
    assert target(8, 7) == 8 and target(8, 8) == 8 and target(8, 9) == 9
    assert target(3, 12) == 12 and target(1, 1) == 1
    assert target(1, MAX_SPARES - 1) == MAX_SPARES - 1
    assert target(1, MAX_SPARES) == MAX_SPARES
    assert target(1, MAX_SPARES + 1) == MAX_SPARES and target(8, 100) == MAX_SPARES
    assert target(MAX_SPARES, 0) == MAX_SPARES and target(MAX_SPARES, MAX_SPARES + 5) == MAX_SPARES
    assert target(0, 0) == 0 and target(0, 12) == 0  # 0: the pool is off, however busy
    assert MAX_SPARES == 32


# A fork server's stand-in (no TensorFlow): it forks a spare that does what a pool's spare does
# first (server.prepare_spare, tied to OWNER), and stays alive.
SPARE = textwrap.dedent(
    """
    import os, sys, time
    from graphdist._proc import forkserver_exit, server
    forkserver_exit.OWNER = int(sys.argv[1])
    if os.fork() == 0:
        server.prepare_spare()
        print("SPARE", os.getpid(), flush=True)
        time.sleep(60)
        os._exit(0)
    time.sleep(60)
    """
)


@pytest.mark.timeout(30)
def test_a_spare_dies_with_its_owner_while_its_fork_server_lives_on():
    """The owner is not the spare's parent: its death signal covers the fork server only, so the
    spare's own owner watch must end it. Here the fork server lives on (SIGSTOPped, as a
    debugger or a swapped-out fork server would be) when the owner dies: the spare is gone all
    the same. Red if prepare_spare no longer watched the owner (its pidfd)."""
    import subprocess

    owner = subprocess.Popen(["sleep", "60"])
    with anchored_group() as group:  # see the next test
        fork_server = start_python("-c", SPARE, str(owner.pid), group=group)
        spare = None
        try:
            assert fork_server.stdout is not None
            line = fork_server.stdout.readline()
            assert line.startswith("SPARE "), (line, fork_server.communicate(timeout=10))
            spare = int(line.split()[1])
            assert not is_gone(spare)
            sigstop(fork_server.pid)  # stopped before the owner dies, not just signalled
            owner.kill()
            owner.wait()
            assert wait_gone([spare], 5.0) == [], "the spare outlived its owner"
            assert fork_server.poll() is None  # its fork server is still there
        finally:
            owner.kill()
            owner.wait()
            if spare is not None and not is_gone(spare):
                os.kill(spare, signal.SIGKILL)
            fork_server.send_signal(signal.SIGCONT)
            fork_server.kill()
            fork_server.wait(10)


@pytest.mark.timeout(180)
def test_a_pools_spares_die_with_their_owner_while_the_fork_server_is_stopped(monkeypatch):
    """The real pool: its fork server SIGSTOPped (alive, so no spare's death signal fires, and
    its own owner watch cannot run) when the owner is SIGKILLed: every spare is gone all the
    same, each by its own owner watch. Red if a spare skipped prepare_spare or its pidfd watch.
    The owner and its fork server live in an anchored group (tests/conftest.py): in the suite's
    own group, orphaned under CI, the stopped fork server would be continued by any exit that
    is a link of that group to the rest of the session (tests/test_sigtrace.py)."""
    monkeypatch.setenv(SPARES_ENV, "2")
    with anchored_group() as group:
        proc = start_python("-c", OWNER.replace("wait_spares(3)", "wait_spares(2)"), group=group)
        fork_server = None
        pids: list[int] = []
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line, proc.communicate(timeout=30)
            fork_server, *pids = json.loads(line)
            spares = pids[2:]
            assert len(spares) == 2 and not any(is_gone(p) for p in [fork_server, *pids])
            with watching(fork_server) as signals:
                sigstop(fork_server)
                proc.send_signal(signal.SIGKILL)
                proc.wait(30)
                assert wait_gone(spares, 5.0) == [], "spares outlived their owner"
                # still stopped: nothing else continued it, nothing else ended the spares
                stop_held = process_state(fork_server) == "T"
                assert stop_held, f"the stopped fork server was continued: {signals.describe()}"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
            for pid in [*pids, fork_server]:
                if pid is not None and not is_gone(pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
                        os.kill(pid, signal.SIGKILL)
        assert wait_gone([p for p in [*pids, fork_server] if p is not None], EVENTUALLY_S) == []
