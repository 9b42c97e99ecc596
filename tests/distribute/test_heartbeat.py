"""The run's heartbeat (graphdist/_distribute/heartbeat.py) on real processes: a task stopped by
SIGSTOP is frozen once it has been stopped for the timeout (its state, read from /proc), a task
whose gRPC server stops answering is frozen once it has been silent that long with probes that
expired (a process the heartbeat cannot see, as a task on another node), and neither a task
that never served nor a server that answers is ever called frozen. No TensorFlow: the server is
a bare gRPC server that answers every call, as TensorFlow's answers GetStatus."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import time

import pytest

from graphdist import ArgumentError
from graphdist._distribute.heartbeat import (
    HEARTBEAT_TIMEOUT_S,
    MIN_HEARTBEAT_TIMEOUT_S,
    Heartbeat,
    check_heartbeat_timeout,
    process_state,
)
from graphdist._net.ports import pick_free_ports, release_ports
from tests.conftest import EVENTUALLY_S, wait_gone

pytestmark = pytest.mark.timeout(60)

SERVER = """
import sys, time
from concurrent import futures
import grpc

class Answer(grpc.GenericRpcHandler):
    def service(self, details):
        return grpc.unary_unary_rpc_method_handler(lambda request, context: b"")

server = grpc.server(futures.ThreadPoolExecutor(2))
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
def test_the_cli_refuses_a_heartbeat_below_the_floor_in_one_line(value, words):
    proc = subprocess.run(
        [sys.executable, "-m", "graphdist", "run", "--heartbeat-timeout", value, "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
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
