"""The run's heartbeat (graphdist/_distribute/heartbeat.py) on real processes: a task stopped by
SIGSTOP is frozen once it has been stopped for the timeout (its state, read from /proc), a task
whose gRPC server stops answering is frozen once it has been silent that long with probes that
expired (a process the heartbeat cannot see, as a task on another node), and neither a task
that never served nor a server that answers is ever called frozen. No TensorFlow: the server is
a bare gRPC server that answers every call, as TensorFlow's answers GetStatus."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import time
import types

import pytest

from graphdist import ArgumentError
from graphdist._distribute.heartbeat import (
    HEARTBEAT_TIMEOUT_S,
    MIN_HEARTBEAT_TIMEOUT_S,
    Heartbeat,
    check_heartbeat_timeout,
    process_state,
)
from graphdist._net.probe import Prober
from graphdist._ports import pick_free_ports, release_ports
from tests.busypool import pool_held
from tests.conftest import EVENTUALLY_S, sigstop, wait_gone

pytestmark = pytest.mark.timeout(60)

SERVER = """
import sys, time
from concurrent import futures
import grpc

class Answer(grpc.GenericRpcHandler):
    def service(self, details):
        return grpc.unary_unary_rpc_method_handler(lambda request, context: b"")

server = grpc.server(futures.ThreadPoolExecutor(2))
if sys.argv[2:] != ["no-methods"]:  # else no handler: every method UNIMPLEMENTED
    server.add_generic_rpc_handlers((Answer(),))
server.add_insecure_port(sys.argv[1])
server.start()
print("serving", flush=True)
time.sleep(120)
"""


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def processes():
    started: list[subprocess.Popen] = []

    def start(argv: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()
    assert wait_gone([p.pid for p in started], EVENTUALLY_S) == []


@pytest.mark.parametrize("bad", [1.9, 0, -3, math.nan, math.inf, "3", True])
def test_a_timeout_below_the_floor_or_not_a_finite_number_is_refused_naming_both(bad):
    with pytest.raises(ArgumentError, match="heartbeat_timeout_s must be") as info:
        check_heartbeat_timeout(bad)
    assert info.value.name == "heartbeat_timeout_s"
    if isinstance(bad, float | int) and not isinstance(bad, bool) and math.isfinite(bad):
        assert f"at least {MIN_HEARTBEAT_TIMEOUT_S:g} s" in str(info.value)
    assert check_heartbeat_timeout(None) is None
    assert check_heartbeat_timeout(2) == 2.0 and HEARTBEAT_TIMEOUT_S >= MIN_HEARTBEAT_TIMEOUT_S


def test_run_command_refuses_a_bad_heartbeat_before_anything_starts():
    from graphdist._distribute.launcher import run_command

    with pytest.raises(ArgumentError, match=r"at least 2 s, not 1\.5"):
        run_command([sys.executable, "-c", "raise SystemExit(3)"], heartbeat_timeout_s=1.5)


def test_a_stopped_task_is_frozen_once_stopped_for_the_timeout_and_a_thaw_resets_it(processes):
    sleeper = processes(["sleep", "60"])
    clock = Clock()
    heartbeat = Heartbeat(2.0, clock=clock, thread=False)
    heartbeat.watch("worker-1", None, lambda: [sleeper.pid])
    sleeper.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + EVENTUALLY_S
    while process_state(sleeper.pid) != "T":  # the kernel shows it at once
        assert time.monotonic() < deadline
        time.sleep(0.01)
    heartbeat.check()
    clock.now = 1.0
    heartbeat.check()
    sleeper.send_signal(signal.SIGCONT)  # stopped for 1 s only: a pause, not a freeze
    while process_state(sleeper.pid) == "T":
        time.sleep(0.01)
    clock.now = 2.5
    heartbeat.check()
    assert heartbeat.frozen() == {}
    sleeper.send_signal(signal.SIGSTOP)
    while process_state(sleeper.pid) != "T":
        time.sleep(0.01)
    for clock.now in (3.0, 4.0, 4.9):
        heartbeat.check()
        assert heartbeat.frozen() == {}
    clock.now = 5.0
    heartbeat.check()
    assert heartbeat.frozen() == {"worker-1": "stopped (state T) for 2.0 s"}
    heartbeat.close()


def test_a_silent_server_is_frozen_and_an_answering_one_never_is(processes):
    ports = pick_free_ports(2)
    address = f"127.0.0.1:{ports[0]}"
    server = processes([sys.executable, "-c", SERVER, address])
    assert server.stdout is not None and server.stdout.readline() == "serving\n"
    never = f"127.0.0.1:{ports[1]}"  # nothing listens: a task whose server never started
    sleeper = processes(["sleep", "60"])
    with Heartbeat(2.0, interval_s=0.2) as heartbeat:
        # pids None: the server's process cannot be seen (a task on another node), so its
        # silence alone can tell, not its state
        heartbeat.watch("worker-1", address, lambda: None)
        heartbeat.watch("worker-2", never, lambda: [sleeper.pid])
        time.sleep(3.0)  # more than the timeout: answering, and never served, are not frozen
        assert heartbeat.frozen() == {}
        server.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        deadline = stopped + 10.0  # bound: between the 2 s timeout and the 10 s of TF's own
        while "worker-1" not in heartbeat.frozen():
            assert time.monotonic() < deadline, heartbeat.frozen()
            time.sleep(0.05)
        found = time.monotonic() - stopped
        frozen = heartbeat.frozen()
    assert frozen["worker-1"].startswith(f"its server at {address} did not answer for "), frozen
    assert found >= 2.0  # never before the timeout
    assert "worker-2" not in frozen
    release_ports(ports)


@pytest.mark.integration
def test_a_real_server_whose_compute_pool_is_all_taken_is_not_frozen(
    graphdist_fleet_factory, tmp_path
):
    """A TensorFlow server whose compute-pool threads all sit in kernels answers no GetStatus
    (what the heartbeat probed before: a busy ParameterServerStrategy worker was killed as
    frozen, CI 2026-12-06); the heartbeat's liveness call is answered all the same, and it
    finds the same server frozen by its silence once it is stopped."""
    fleet = graphdist_fleet_factory("local=2")
    task = fleet.task("local", 1)
    with Heartbeat(2.0, interval_s=0.2) as heartbeat:
        # pids None: its server's answers alone tell (a task on another node)
        heartbeat.watch("worker-1", task.address, lambda: None)
        time.sleep(1.0)  # it has answered, idle
        with pool_held(fleet, "local", 1, str(tmp_path)) as held:
            with Prober(task.address) as status:
                assert not status.probe(1.0), "GetStatus answered: the pool is not taken"
            time.sleep(4.0)  # twice the timeout
            assert heartbeat.frozen() == {}
            os.kill(task.pid, signal.SIGSTOP)
            try:
                deadline = time.monotonic() + 10.0
                while "worker-1" not in heartbeat.frozen():
                    assert time.monotonic() < deadline, heartbeat.frozen()
                    time.sleep(0.05)
            finally:
                os.kill(task.pid, signal.SIGCONT)
    assert "error" not in held, held.get("error")


def test_the_liveness_call_counts_unimplemented_as_its_answer_and_nothing_else(processes):
    """The liveness call's answer is gRPC's own UNIMPLEMENTED (a server with no handler at
    all, as TensorFlow's has none for it); GetStatus's is not. A stopped server times out and a
    closed port is refused: neither is an answer."""
    ports = pick_free_ports(2)
    address, closed = (f"127.0.0.1:{port}" for port in ports)
    server = processes([sys.executable, "-c", SERVER, address, "no-methods"])
    assert server.stdout is not None and server.stdout.readline() == "serving\n"
    with Prober(address, alive=True) as alive, Prober(address) as status:
        assert alive.probe(2.0) and alive.last_error is None
        assert not status.probe(2.0) and (status.last_error or "").startswith("UNIMPLEMENTED")
        sigstop(server.pid)  # a bare SIGSTOP lets its threads answer until it takes hold
        assert not alive.probe(0.5)
        assert (alive.last_error or "").startswith("DEADLINE_EXCEEDED"), alive.last_error
        server.send_signal(signal.SIGCONT)
        assert alive.probe(2.0)
    with Prober(closed, alive=True) as nothing:
        assert not nothing.probe(0.5)
        assert (nothing.last_error or "").startswith("UNAVAILABLE"), nothing.last_error
    release_ports(ports)


def test_a_servers_pid_on_another_machine_is_never_read_here(processes):
    """A Slurm server's pid is its pid on its node: a process of this machine that has the
    same pid and is stopped (Ctrl-Z) says nothing of it, and must not get the server killed as
    frozen; a LocalFleet's pids are this machine's, and their state counts."""
    from graphdist._distribute.supervise import _server_processes
    from graphdist._fleet.command import SlurmFleet
    from graphdist._local.fleet import LocalFleet
    from graphdist._ray.fleet import RayFleet

    assert LocalFleet.pids_here and not SlurmFleet.pids_here and not RayFleet.pids_here
    here = processes(["sleep", "60"])  # has the pid the node's server has, stopped
    server = types.SimpleNamespace(pid=here.pid, alive=True)
    here.send_signal(signal.SIGSTOP)
    with Heartbeat(2.0, interval_s=0.2) as heartbeat:
        heartbeat.watch("ps-0", None, _server_processes(SlurmFleet, server))
        heartbeat.watch("worker-0", None, _server_processes(LocalFleet, server))
        time.sleep(3.0)  # more than the timeout
        frozen = heartbeat.frozen()
    assert list(frozen) == ["worker-0"], frozen  # the local one's stop is seen; not the other


def test_a_server_that_goes_away_is_not_frozen_but_a_task_between_two_programs(processes):
    """`sh -c 'python a.py; python b.py'`: a.py's server answered, then nothing listens while
    b.py starts. Refused calls are no freeze (a frozen process keeps its socket and times out)."""
    [port] = pick_free_ports(1)
    address = f"127.0.0.1:{port}"
    server = processes([sys.executable, "-c", SERVER, address])
    assert server.stdout is not None and server.stdout.readline() == "serving\n"
    sleeper = processes(["sleep", "60"])  # the task's processes live on
    with Heartbeat(2.0, interval_s=0.2) as heartbeat:
        heartbeat.watch("worker-1", address, lambda: [sleeper.pid])
        time.sleep(1.0)
        server.kill()
        server.wait()
        time.sleep(4.0)  # twice the timeout with every call refused
        assert heartbeat.frozen() == {}
    release_ports([port])


@pytest.mark.parametrize(
    ("value", "words"),
    [("1", "at least 2 s, not 1.0"), ("nan", "finite number"), ("inf", "finite number")],
)
def test_the_cli_refuses_a_heartbeat_below_the_floor_in_one_line(value, words, run_cli):
    proc = run_cli("run", "--heartbeat-timeout", value, "--", "true")
    assert proc.returncode == 2 and proc.stdout == ""
    [line] = proc.stderr.splitlines()
    assert line.startswith("Error: --heartbeat-timeout must be") and words in line, line


def test_the_cli_takes_off_for_no_heartbeat():
    launcher = [sys.executable, "-m", "graphdist", "run", "--workers", "1"]
    proc = subprocess.run(
        [*launcher, "--heartbeat-timeout", "off", "--", sys.executable, "-c", "pass"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr


def test_a_stopped_server_is_named_by_its_state_and_a_short_stop_is_no_freeze(processes):
    """A SIGSTOPped task is silent too: its state names it (not its silence), and once it runs
    again after a stop shorter than the timeout, its silence counts from then."""
    [port] = pick_free_ports(1)
    address = f"127.0.0.1:{port}"
    server = processes([sys.executable, "-c", SERVER, address])
    assert server.stdout is not None and server.stdout.readline() == "serving\n"
    with Heartbeat(2.0, interval_s=0.2) as heartbeat:
        heartbeat.watch("worker-1", address, lambda: [server.pid])
        time.sleep(1.0)
        server.send_signal(signal.SIGSTOP)
        time.sleep(1.6)  # under the timeout: a pause
        server.send_signal(signal.SIGCONT)
        time.sleep(2.5)
        assert heartbeat.frozen() == {}
        server.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10.0
        while not heartbeat.frozen():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        frozen = heartbeat.frozen()
    assert frozen["worker-1"].startswith("stopped (state T) for "), frozen
    release_ports([port])


# -- issue 41: a debugger's tracing stop, and the miss count -----------------------------------

_PTRACE_ATTACH, _PTRACE_DETACH, _WALL = 16, 17, 0x40000000


def _ptrace(request: int, tid: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    libc.ptrace.restype = ctypes.c_long
    if libc.ptrace(request, tid, None, None) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def _attach_every_thread(pid: int) -> list[int]:
    """What ``gdb -p PID`` does: PTRACE_ATTACH to every thread, each waited into its stop."""
    attached: list[int] = []
    while True:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        new = [t for t in tids if t not in attached]
        if not new:
            return attached
        for tid in sorted(new, key=lambda t: t != pid):  # the leader first
            try:
                _ptrace(_PTRACE_ATTACH, tid)
            except PermissionError as e:
                for done in attached:
                    _ptrace(_PTRACE_DETACH, done)
                pytest.skip(f"ptrace not allowed here: {e}")
            attached.append(tid)
            os.waitpid(tid, _WALL)


def _detach(tids: list[int]) -> None:
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):
            _ptrace(_PTRACE_DETACH, tid)


@pytest.mark.timeout(20)
def test_a_debuggers_tracing_stop_is_no_freeze_but_a_signal_stop_is(processes):
    """/proc state ``t`` (ptrace-attached, as ``gdb -p`` leaves a task) is left alone; ``T``
    (SIGSTOP) is frozen after the timeout. Red if ``t`` were read as ``T``."""
    traced, stopped = processes(["sleep", "60"]), processes(["sleep", "60"])
    tids = _attach_every_thread(traced.pid)
    try:
        assert process_state(traced.pid) == "t"
        stopped.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + EVENTUALLY_S
        while process_state(stopped.pid) != "T":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        clock = Clock()
        heartbeat = Heartbeat(2.0, clock=clock, thread=False)
        heartbeat.watch("worker-1", None, lambda: [traced.pid])
        heartbeat.watch("worker-2", None, lambda: [stopped.pid])
        for clock.now in (0.0, 1.0, 2.0, 5.0, 10.0):
            heartbeat.check()
        assert heartbeat.frozen() == {"worker-2": "stopped (state T) for 2.0 s"}
        heartbeat.close()
    finally:
        _detach(tids)


@pytest.mark.timeout(30)
def test_a_server_under_a_debugger_is_not_frozen_by_its_silence(processes):
    """``gdb -p`` on a worker: every thread traced, so its server answers nothing, as a frozen
    one; it is still no freeze (it was killed 3 s after the attach when only ``T`` counted),
    and once the debugger detaches its silence counts afresh."""
    [port] = pick_free_ports(1)
    address = f"127.0.0.1:{port}"
    server = processes([sys.executable, "-c", SERVER, address])
    assert server.stdout is not None and server.stdout.readline() == "serving\n"
    with Heartbeat(2.0, interval_s=0.2) as heartbeat:
        heartbeat.watch("worker-1", address, lambda: [server.pid])
        time.sleep(1.0)  # it answered
        tids = _attach_every_thread(server.pid)
        try:
            assert process_state(server.pid) == "t"
            time.sleep(3.5)  # well past the timeout, every probe unanswered
            assert heartbeat.frozen() == {}
        finally:
            _detach(tids)
        time.sleep(1.0)
        assert heartbeat.frozen() == {}
    release_ports([port])


class _Probe:
    """A stand-in probe in flight: ``answered`` None (no outcome yet), True, or False (its
    deadline expired)."""

    def __init__(self) -> None:
        self.answered: bool | None = None

    def done(self) -> bool:
        return self.answered is not None

    def cancel(self) -> None:
        pass


class _Prober:
    """A stand-in for graphdist._net.probe.Prober: hands out :class:`_Probe`s."""

    last_error = "DEADLINE_EXCEEDED: Deadline Exceeded"

    def __init__(self) -> None:
        self.sent: list[_Probe] = []
        self._call = self

    def future(self, request: bytes, timeout: float) -> _Probe:
        self.sent.append(_Probe())
        return self.sent[-1]

    @staticmethod
    def _outcome(probe: _Probe) -> bool:
        return bool(probe.answered)

    def close(self) -> None:
        pass


@pytest.mark.timeout(10)
def test_a_server_that_answered_is_frozen_at_misses_expired_probes_not_one_fewer():
    """Answered once, then silent past the timeout: MISSES - 1 expired probes are no freeze,
    MISSES are. Red for an off-by-one either way in the miss count."""
    from graphdist._distribute.heartbeat import MISSES

    clock = Clock()
    heartbeat = Heartbeat(2.0, clock=clock, thread=False)
    heartbeat.watch("worker-1", "127.0.0.1:1", lambda: None)
    prober = _Prober()
    heartbeat._tasks["worker-1"].prober = prober
    heartbeat.check()  # t=0: the first probe
    prober.sent[-1].answered = True
    clock.now = 0.5
    heartbeat.check()  # it answered: silent from 0.5
    # MISSES - 1 probes expire, the last when it has been silent for the timeout (2.5 s): each
    # expiry is a look that decides, none of them a freeze
    for i in range(MISSES - 1):
        prober.sent[-1].answered = False
        clock.now = 2.5 - 0.1 * (MISSES - 2 - i)
        heartbeat.check()
        assert heartbeat.frozen() == {}, clock.now
    assert len(prober.sent) == MISSES + 1
    prober.sent[-1].answered = False  # the MISSES-th expires
    clock.now = 2.7
    heartbeat.check()
    assert heartbeat.frozen() == {"worker-1": "its server at 127.0.0.1:1 did not answer for 2.2 s"}
    heartbeat.close()
