"""A server dials only its own cluster (issue 38): the shim checks ``connect()``.

A TensorFlow server runs whatever graph a client sends, and a session's ``cluster_def`` names the
workers its master dials. So a client that may use one server (another user through a member
host's exposed server, say) could name a loopback-only fleet of the server's own user as job
``victim`` and run ops there: the server would be a proxy past members-only and the same-user
rule. The servers graphdist starts (LocalFleet, ``graphdist serve``) carry the list of their
cluster's task addresses, and the shim refuses any other TCP ``connect()``.

The attack tests go red without the fix: with ``GRAPHDIST_DIAL`` left out of a server's
environment (no dial list from ``_net/policy.py``) or the
``connect`` interposer removed from ``loopback.c``, the same session runs its op on fleet B in
about 0.1 s (measured by hand: ``42``, and the marker file written by B). The control test below
keeps that proof in the suite: it runs the very attack against a fleet started without the list
and sees it succeed, so a broken attack (a wrong address, a wrong job) cannot pass as a refusal.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from graphdist._cluster import Cluster
from graphdist._exceptions import ClusterSpecError, LoopbackUnavailableError
from graphdist._net import members
from graphdist._net.loopback import loopback_library
from graphdist._net.members import DIAL_ENV, check_enforced, dial_addresses
from graphdist._net.policy import NetPolicy
from graphdist._ports import pick_free_ports, release_ports
from tests.conftest import QUIET_TF, REPO, wait_gone

OPERATION_TIMEOUT_MS = 3000  # a refused dial fails at the operation timeout: keep it short


# ---- the list ----------------------------------------------------------------------------------


def test_the_dial_list_is_every_address_of_every_task_loopback_included() -> None:
    cluster = Cluster.parse({"a": ["localhost:2222", "127.0.0.2:2223"], "b": ["[::1]:2224"]})
    found = dial_addresses(cluster)
    loopback = {
        info[4][0] for info in socket.getaddrinfo("localhost", 2222, type=socket.SOCK_STREAM)
    }
    expected = [f"[{ip}]:2222" if ":" in ip else f"{ip}:2222" for ip in loopback]
    assert sorted(found) == sorted([*expected, "127.0.0.2:2223", "[::1]:2224"])
    assert NetPolicy().servers(cluster).lists() == {DIAL_ENV: ",".join(found)}


def test_a_host_that_does_not_resolve_is_a_one_line_error() -> None:
    cluster = Cluster.parse({"a": ["no-such-host.invalid:2222"]})
    with pytest.raises(ClusterSpecError, match=r"no-such-host.invalid.*does not resolve"):
        dial_addresses(cluster)


def test_a_server_does_not_start_where_the_dial_list_is_not_in_force(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """This test process has no shim: a server here with GRAPHDIST_DIAL set must not start."""
    monkeypatch.delenv(members.ALLOW_ENV, raising=False)
    monkeypatch.setenv(DIAL_ENV, "127.0.0.1:2222")
    with pytest.raises(LoopbackUnavailableError, match="dial only its own cluster's tasks"):
        check_enforced("/job:local/task:0")
    monkeypatch.setattr(members, "shim_dial", lambda: 2)
    with pytest.raises(LoopbackUnavailableError, match="reads 2 entries instead of 1"):
        check_enforced("/job:local/task:0")
    monkeypatch.setattr(members, "shim_dial", lambda: 1)
    check_enforced("/job:local/task:0")
    monkeypatch.delenv(DIAL_ENV)
    monkeypatch.setattr(members, "shim_dial", lambda: None)
    check_enforced("/job:local/task:0")  # no list asked for: nothing to check


# ---- the shim in a real process: connect() itself ---------------------------------------------

_CONNECTS = textwrap.dedent(
    """
    import errno, json, socket, sys
    out = {}
    def tcp(name, family, address):
        s = socket.socket(family, socket.SOCK_STREAM)
        try:
            s.connect(address)
            out[name] = "connected"
        except OSError as exc:
            out[name] = errno.errorcode.get(exc.errno, str(exc.errno))
        finally:
            s.close()
    listed, other, unix = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    tcp("listed", socket.AF_INET, ("127.0.0.1", listed))
    tcp("other", socket.AF_INET, ("127.0.0.1", other))
    tcp("listed_mapped", socket.AF_INET6, ("::ffff:127.0.0.1", listed))
    tcp("other_mapped", socket.AF_INET6, ("::ffff:127.0.0.1", other))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
        u.connect(("127.0.0.1", other))
        out["udp"] = "connected"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as u:
        u.connect(unix)
        out["unix"] = "connected"
    print(json.dumps(out))
    """
)


@pytest.fixture
def listeners(tmp_path: Path) -> Iterator[tuple[int, int, str]]:
    """Two TCP listeners on 127.0.0.1 (one to be on the list, one not) and a unix one."""
    socks = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = str(tmp_path / "unix.sock")
    unix.bind(path)
    unix.listen()
    try:
        yield socks[0].getsockname()[1], socks[1].getsockname()[1], path
    finally:
        for s in [*socks, unix]:
            s.close()


def _connects(listeners: tuple[int, int, str], dial: str | None) -> tuple[dict[str, str], str]:
    env = {"PATH": os.environ.get("PATH", ""), "LD_PRELOAD": loopback_library()}
    if dial is not None:
        env[DIAL_ENV] = dial
    result = subprocess.run(
        [sys.executable, "-S", "-E", "-c", _CONNECTS, *map(str, listeners)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    answers: dict[str, str] = json.loads(result.stdout)
    return answers, result.stderr


@pytest.mark.timeout(60)
def test_connect_to_an_address_off_the_list_is_refused_and_logged(listeners) -> None:
    listed, other, _ = listeners
    answers, log = _connects(listeners, f"127.0.0.1:{listed},[::1]:{listed}")
    assert answers == {
        "listed": "connected",
        "other": "ECONNREFUSED",
        "listed_mapped": "connected",  # v4-mapped compares as IPv4
        "other_mapped": "ECONNREFUSED",
        "udp": "connected",  # not TCP: not checked
        "unix": "connected",  # a fork server's socket, a ready notice: not checked
    }
    assert f"graphdist: refused to dial 127.0.0.1:{other}: not a task of this server's" in log
    assert log.count("refused to dial") == 1, log  # one line per address per interval


@pytest.mark.timeout(60)
def test_without_the_list_connect_is_untouched_and_a_malformed_one_refuses_all(listeners) -> None:
    """Unset: run tasks and Ray actors (user code) dial anything. Malformed: fail closed."""
    answers, log = _connects(listeners, None)
    assert set(answers.values()) == {"connected"} and not log
    answers, log = _connects(listeners, "localhost:2222")
    assert answers["listed"] == answers["other"] == answers["listed_mapped"] == "ECONNREFUSED"
    assert answers["udp"] == answers["unix"] == "connected"
    assert log.count("GRAPHDIST_DIAL is malformed") == 1, log


# ---- the attack: a session's cluster_def names another fleet of the same user ------------------


def _attack(target: str, proxy: str, victim: str, marker: Path) -> tuple[Any, float]:
    """Through ``target`` (the server at ``proxy``), a session whose cluster_def names the
    server at ``victim`` as job ``victim``, writing ``marker`` there: (the error or the run's
    result, seconds)."""
    import tensorflow as tf

    cluster_def = tf.train.ClusterSpec({"proxy": [proxy], "victim": [victim]}).as_cluster_def()
    graph = tf.Graph()
    with graph.as_default(), tf.device("/job:victim/task:0"):
        write = tf.io.write_file(str(marker), "written by the victim's server")
    config = tf.compat.v1.ConfigProto(
        cluster_def=cluster_def, operation_timeout_in_ms=OPERATION_TIMEOUT_MS
    )
    started = time.monotonic()
    try:
        with tf.compat.v1.Session(target, graph=graph, config=config) as sess:
            outcome: Any = sess.run(write)
    except tf.errors.OpError as exc:
        outcome = exc
    return outcome, time.monotonic() - started


def _log_text(fleet: Any) -> str:
    return "\n".join(line for t in fleet.tasks for line in t.log_tail(50))


@pytest.fixture(scope="module")
def victim() -> Iterator[Any]:
    """Fleet B: the victim, a loopback-only fleet of the same user."""
    from graphdist._local.fleet import LocalFleet

    fleet = LocalFleet("local=1").start()
    pids = list(fleet.pids)
    try:
        yield fleet
    finally:
        fleet.close()
        assert wait_gone(pids, 30) == []


@pytest.fixture(scope="module")
def proxy() -> Iterator[Any]:
    """Fleet A: the server the client may use (two tasks: it dials its own second task)."""
    from graphdist._local.fleet import LocalFleet

    fleet = LocalFleet("local=2").start()
    pids = list(fleet.pids)
    try:
        yield fleet
    finally:
        fleet.close()
        assert wait_gone(pids, 30) == []


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_session_cannot_make_a_fleet_server_dial_another_fleet(
    proxy: Any, victim: Any, tmp_path: Path
) -> None:
    import tensorflow as tf

    marker = tmp_path / "victim-ran"
    a, b = proxy.cluster.task("local", 0), victim.cluster.task("local", 0)
    outcome, took = _attack(proxy.target("local", 0), a.address, b.address, marker)
    # the master retries the refused dial until the operation timeout: DeadlineExceeded
    assert isinstance(outcome, tf.errors.DeadlineExceededError), outcome
    assert took < OPERATION_TIMEOUT_MS / 1000 + 10, took
    assert not marker.exists()  # B never ran the op
    assert f"graphdist: refused to dial 127.0.0.1:{b.port}: not a task" in _log_text(proxy)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_fleet_still_dials_its_own_tasks(proxy: Any) -> None:
    from graphdist._graph.graphs import split_graph

    graph, y = split_graph(proxy.device("local", 0), proxy.device("local", 1))
    for master in (0, 1):
        with proxy.session("local", master, graph=graph) as sess:
            assert sess.run(y) == 238
    log = _log_text(proxy)  # the attack test's refusal may be there: none of the fleet's own
    assert not any(
        f"refused to dial {ip}:{t.port}:" in log
        for ip in ("127.0.0.1", "[::1]")
        for t in proxy.cluster
    )


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_control_without_the_dial_list_the_same_attack_runs_on_the_victim(
    victim: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fix taken out (no GRAPHDIST_DIAL for fleet A's server): the attack above succeeds,
    B writes the marker. What makes the refusal above mean something."""
    from graphdist._local.fleet import LocalFleet
    from graphdist._net import policy

    monkeypatch.setattr(policy, "dial_list", lambda cluster: None)
    marker = tmp_path / "victim-ran"
    with LocalFleet("local=1") as open_fleet:
        pids = list(open_fleet.pids)
        a, b = open_fleet.cluster.task("local", 0), victim.cluster.task("local", 0)
        outcome, took = _attack(open_fleet.target("local", 0), a.address, b.address, marker)
    assert wait_gone(pids, 30) == []
    assert outcome is None, outcome  # write_file returns nothing
    assert marker.exists() and took < OPERATION_TIMEOUT_MS / 1000


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_graphdist_serve_dials_only_its_cluster(victim: Any, tmp_path: Path) -> None:
    import tensorflow as tf

    (port,) = pick_free_ports(1)
    release_ports([port])
    address = f"127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "graphdist", "serve"),
            *("--cluster", json.dumps({"local": [address]}), "--job", "local", "--task", "0"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, **QUIET_TF},
    )
    try:
        assert proc.stderr is not None
        line, deadline = "", time.monotonic() + 90
        while "ready at" not in line and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "serve exited before it was ready"
        assert "ready at" in line, line
        with open(f"/proc/{proc.pid}/environ", "rb") as f:
            environ = dict(
                entry.split("=", 1) for entry in f.read().decode().split("\0") if "=" in entry
            )
        assert environ[DIAL_ENV] == ",".join(dial_addresses(Cluster.parse({"local": [address]})))
        marker = tmp_path / "victim-ran"
        b = victim.cluster.task("local", 0)
        outcome, _ = _attack(f"grpc://{address}", address, b.address, marker)
        assert isinstance(outcome, tf.errors.DeadlineExceededError), outcome
        assert not marker.exists()
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=30)
        assert proc.returncode == 0
        assert f"refused to dial 127.0.0.1:{b.port}: not a task" in rest, rest[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
