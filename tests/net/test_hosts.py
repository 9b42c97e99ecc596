"""Many hosts, for real: ``graphdist serve`` on two hosts of a bed of network namespaces
(tests/hostbed.py), each host with its own address, and clients on a member host and on a third
host that is no member of the cluster.

What a server on a host address promises (members only, graphdist/_net/members.py): the
cluster's own hosts and the ``--allow`` list get in, every other machine's connection is closed
at accept and logged with its address; servers reach each other (the split graph needs task 0
to call task 1). And the client of such servers (``graphdist.connect``) names the task and its
host when a server dies.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import QUIET_TF, wait_gone

pytestmark = [pytest.mark.promise]

READY_S = 90.0  # a server's TensorFlow import on a busy 2-core machine

# The seeds' split graph (x + 300 on task 0, x - 66 on task 1: 238) and a JSON line printer:
# the start of every script the host tests run on a host. These graph-mode clients import
# TensorFlow as graphdist's servers do (graphdist._proc.lean: without Keras and SciPy, which
# they never use): 3.6 instead of 6.0 CPU-s per client on this machine, and the suite runs
# some 50 of them.
SPLIT_GRAPH = r"""
import json, os, signal, sys, time
from graphdist._proc import lean
lean.install()
import graphdist
import tensorflow as tf

tf.compat.v1.disable_eager_execution()
graph = tf.Graph()
with graph.as_default():
    x = tf.constant(2)
    with tf.device("/job:local/task:1"):
        y2 = x - 66
    with tf.device("/job:local/task:0"):
        y = x + 300 + y2

def say(**kv):
    print(json.dumps(kv), flush=True)
"""

# A client of the served cluster, run on a host: prints one JSON line per step. argv: the
# cluster file; with "then-kill PID" it kills PID after the first run, runs again and prints
# the error.
CLIENT = (
    SPLIT_GRAPH
    + r"""
t = time.monotonic()
try:
    fleet = graphdist.connect(sys.argv[1], timeout_s=8)
except graphdist.GraphdistError as exc:
    say(step="connect", error=type(exc).__name__, text=str(exc), seconds=time.monotonic() - t)
    sys.exit(0)
with fleet, fleet.session("local", 0, graph, config=graphdist.no_folding_config()) as sess:
    say(step="run", result=int(sess.run(y)))
    if len(sys.argv) > 3:
        os.kill(int(sys.argv[3]), signal.SIGKILL)
        t = time.monotonic()
        try:
            sess.run(y)
            say(step="again", error=None)
        except graphdist.GraphdistError as exc:
            say(step="again", error=type(exc).__name__, text=str(exc),
                seconds=time.monotonic() - t)
"""
)


def _assert_refused_at_once(refused: dict[str, Any], host: str) -> None:
    """A client that is no member fails at once, told it was refused (issue 39): it waited out
    connect's timeout (8 s here, 60 s by default) and got StartTimeoutError (Socket closed)."""
    assert refused["error"] == "FleetStartError", refused
    assert refused["text"].startswith(f"Refused by {host}"), refused
    assert "(not a member)" in refused["text"], refused
    assert refused["seconds"] < 4.0, refused  # the timeout is 8 s


def _client(host: Any, cluster_file: str, *extra: str) -> list[dict[str, Any]]:
    result = host.run(
        [sys.executable, "-c", CLIENT, cluster_file, *extra],
        env={**os.environ, **QUIET_TF},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


class Served:
    """``graphdist serve`` of local:0 on hosts[0] and local:1 on hosts[1]: members only, with
    ``allow``; or (``tls``) in TLS mode, with the credentials ``graphdist certs`` made."""

    def __init__(
        self, hosts: Any, folder: str, allow: str | None = None, *, tls: bool = False
    ) -> None:
        port = random.randint(20000, 40000)  # the namespaces are the test's own: all ports free
        self.cluster = {"local": [f"{hosts[0].address}:{port}", f"{hosts[1].address}:{port}"]}
        self.path = os.path.join(folder, f"cluster-{port}.json")
        with open(self.path, "w") as f:
            json.dump(self.cluster, f)
        self.creds = os.path.join(folder, f"creds-{port}")
        self.logs = [os.path.join(folder, f"serve-{port}-{i}.log") for i in range(2)]
        self.procs: list[subprocess.Popen[Any]] = []
        if tls:
            made = subprocess.run(
                [sys.executable, "-m", "graphdist", "certs", "--cluster", self.path,
                 "--out", self.creds],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert made.returncode == 0, made.stderr
        for i in range(2):
            argv = [sys.executable, "-m", "graphdist", "serve", "--cluster", self.path]
            argv += ["--job", "local", "--task", str(i)] + (["--allow", allow] if allow else [])
            argv += ["--tls", self.host_creds(hosts[i])] if tls else []
            with open(self.logs[i], "wb") as log:
                self.procs.append(
                    hosts[i].popen(argv, stdout=log, stderr=subprocess.STDOUT, env=os.environ)
                )
        deadline = time.monotonic() + READY_S
        while not all("ready at" in self.log(i) for i in range(2)):
            for i, p in enumerate(self.procs):
                assert p.poll() is None, f"serve {i} exited {p.returncode}: {self.log(i)[-2000:]}"
            assert time.monotonic() < deadline, [self.log(i)[-2000:] for i in range(2)]
            time.sleep(0.2)

    def host_creds(self, host: Any) -> str:
        return os.path.join(self.creds, "hosts", host.address)

    @property
    def client_creds(self) -> str:
        return os.path.join(self.creds, "client")

    def log(self, i: int) -> str:
        with open(self.logs[i], errors="replace") as f:
            return f.read()

    def gateway_pids(self, i: int) -> list[int]:
        """The serve process's children: its TLS gateway (none without TLS)."""
        path = f"/proc/{self.procs[i].pid}/task/{self.procs[i].pid}/children"
        with open(path) as f:
            return [int(p) for p in f.read().split()]

    def stop(self) -> None:
        """SIGTERM both serve processes; then they and their gateways are gone."""
        gateways = [pid for i in range(2) if self.procs[i].poll() is None
                    for pid in self.gateway_pids(i)]  # fmt: skip
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        assert wait_gone([p.pid for p in self.procs] + gateways, 10) == []


@pytest.fixture
def served(hosts: Any, tmp_path: Any) -> Iterator[Served]:
    fleet = Served(hosts, str(tmp_path), allow=None)
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.mark.timeout(240)
def test_members_run_the_split_graph_and_another_host_is_refused_and_logged(
    hosts: Any, served: Served
) -> None:
    """Two hosts serving, a client on a member host: 238 (task 0 reaches task 1 across hosts).
    A client on the third host: both servers close its connections (``connect`` names them)
    and each server's log names the third host's address."""
    (ran,) = _client(hosts[0], served.path)
    assert ran == {"step": "run", "result": 238}
    (refused,) = _client(hosts[2], served.path)
    _assert_refused_at_once(refused, hosts[0].address)
    for address in served.cluster["local"]:
        assert address in refused["text"]
    for i in range(2):
        assert f"refused a connection from {hosts[2].address}" in served.log(i)


@pytest.mark.timeout(240)
def test_an_allowed_host_runs_and_a_killed_server_is_named_with_its_host(
    hosts: Any, tmp_path: Any
) -> None:
    """``--allow`` lets the third host in: 238. Then the server on the second host is killed
    (SIGKILL): the client's next run fails within seconds with TaskFailedError naming local-1
    and its host's address."""
    served = Served(hosts, str(tmp_path), allow=hosts[2].address)
    try:
        steps = _client(hosts[2], served.path, "then-kill", str(served.procs[1].pid))
        assert steps[0] == {"step": "run", "result": 238}, steps
        again = steps[1]
        assert again["error"] == "TaskFailedError", again
        assert f"local-1 at {served.cluster['local'][1]} is dead" in again["text"], again
        assert again["seconds"] < 5.0, again
        assert "refused a connection" not in served.log(0)
    finally:
        served.stop()


# An exposed LocalFleet on host 1 whose cluster names host 1's address: its own process prints
# the cluster and keeps the fleet until its stdin closes. argv: host 1's address, the allowed one.
EXPOSED_FLEET = r"""
import json, random, sys
import graphdist

ports = random.sample(range(20000, 40000), 2)  # the namespace is the test's own: all ports free
cluster = {"local": [f"{sys.argv[1]}:{p}" for p in ports]}
with graphdist.LocalFleet(cluster, expose=True, allow=[sys.argv[2]]) as fleet:
    print(json.dumps({"cluster": cluster, "pids": fleet.pids, "logs": [t.log_path for t in fleet]}),
          flush=True)
    sys.stdin.read()
"""


@pytest.mark.timeout(240)
def test_an_exposed_fleet_lets_in_its_allow_list_only(hosts: Any, tmp_path: Any) -> None:
    """``LocalFleet(expose=True, allow=[host 3])`` on host 1: host 3 runs the split graph on it,
    host 2 (neither a member nor allowed) is refused; closing the fleet leaves no server."""
    fleet = hosts[0].popen(
        [sys.executable, "-c", EXPOSED_FLEET, hosts[0].address, hosts[2].address],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **QUIET_TF},
    )
    try:
        line = fleet.stdout.readline() if fleet.stdout else ""
        assert line, f"the fleet did not start (exit {fleet.poll()})"
        facts = json.loads(line)
        path = str(tmp_path / "cluster.json")
        with open(path, "w") as f:
            json.dump(facts["cluster"], f)
        (ran,) = _client(hosts[2], path)
        assert ran == {"step": "run", "result": 238}
        (refused,) = _client(hosts[1], path)
        _assert_refused_at_once(refused, hosts[0].address)
        logs = ""
        for log_path in facts["logs"]:
            with open(log_path, errors="replace") as f:
                logs += f.read()
        assert f"refused a connection from {hosts[1].address}" in logs
    finally:
        if fleet.stdin:
            fleet.stdin.close()
        fleet.wait(60)
    for pid in facts["pids"]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# An exposed LocalFleet of one server on a loopback host (local=1: localhost and a free port) on
# host 1: no host of its cluster is another machine, so its member list is empty. Prints the
# port, pids and logs; keeps the fleet until its stdin closes.
EXPOSED_LOOPBACK_FLEET = r"""
import json, sys
import graphdist

with graphdist.LocalFleet("local=1", expose=True) as fleet:
    print(json.dumps({"port": fleet.tasks[0].task.port, "pids": fleet.pids,
                      "logs": [t.log_path for t in fleet]}), flush=True)
    sys.stdin.read()
"""

# What a gRPC server answers a client's HTTP/2 preface with, from the host this runs on: its own
# SETTINGS frame ("settings"), or a connection closed at once ("closed"). argv: address, port.
H2_HELLO = r"""
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
try:
    head = s.recv(9)
except (ConnectionResetError, socket.timeout) as exc:
    head = b""
print("settings" if len(head) == 9 and head[3] == 4 else f"closed {head!r}")
"""


def _hello(host: Any, address: str, port: int) -> str:
    result = host.run(
        [sys.executable, "-c", H2_HELLO, address, str(port)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip()


@pytest.mark.timeout(240)
def test_an_exposed_fleet_on_loopback_hosts_has_no_members_and_lets_in_no_other_machine(
    hosts: Any,
) -> None:
    """``LocalFleet("local=1", expose=True)`` on host 1 listens on every interface with an empty
    member list: host 2's connection to host 1's address is closed at accept and logged, while
    host 1's own processes get the server's answer (the same-user rule), on loopback and on its
    address. What an empty list must never be: no members asked (every machine let in)."""
    fleet = hosts[0].popen(
        [sys.executable, "-c", EXPOSED_LOOPBACK_FLEET],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **QUIET_TF},
    )
    facts: dict[str, Any] = {"pids": []}
    try:
        line = fleet.stdout.readline() if fleet.stdout else ""
        assert line, f"the fleet did not start (exit {fleet.poll()})"
        facts = json.loads(line)
        port = facts["port"]
        assert _hello(hosts[0], "127.0.0.1", port) == "settings"
        assert _hello(hosts[0], hosts[0].address, port) == "settings"  # exposed: every interface
        assert _hello(hosts[1], hosts[0].address, port).startswith("closed")
        with open(facts["logs"][0], errors="replace") as f:
            log = f.read()
        assert f"refused a connection from {hosts[1].address}: not a member" in log, log[-2000:]
    finally:
        if fleet.stdin:
            fleet.stdin.close()
        fleet.wait(60)
    for pid in facts["pids"]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
