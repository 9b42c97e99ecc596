"""Servers accept connections from loopback only, unless exposure is asked for explicitly.

What a connection from a network address finds is checked in a network namespace the test makes,
whose one non-loopback address is the test's own (tests/net/netns.py): the same on every
machine, with a network or none, and never the machine's real interfaces."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import uuid

import psutil
import pytest

import graphdist
from graphdist._graph.graphs import split_graph
from graphdist._ports import pick_free_ports, release_ports
from tests.conftest import (
    EVENTUALLY_S,
    QUIET_TF,
    REPO,
    listening,
    processes_marked,
    run_python,
    wait_gone,
)
from tests.net.netns import OUTSIDE_IP, run_python_in_netns

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


# Run in a network namespace with OUTSIDE_IP: a loopback-only fleet and an exposed one; prints
# as JSON who could connect where (each port from 127.0.0.1, localhost and every non-loopback
# address of the namespace) and every pid it started. The exposure warning goes to stderr.
FLEETS_IN_NETNS = textwrap.dedent(
    """
    import json, logging, os
    import graphdist
    from tests.net.netns import connects, non_loopback_addresses

    logging.basicConfig(level=logging.WARNING)
    outside = non_loopback_addresses()
    facts = {"outside": outside, "pids": [os.getpid()], "loopback": [], "exposed": []}

    def reach(fleet, key):
        facts["pids"] += fleet.pids
        for task in fleet.tasks:
            port = task.task.port
            hosts = ["127.0.0.1", "localhost", *outside]
            facts[key].append({h: connects(h, port) for h in hosts})

    with graphdist.LocalFleet("local=2") as fleet:
        reach(fleet, "loopback")
    with graphdist.LocalFleet("local=1", expose=True) as fleet:
        reach(fleet, "exposed")
    print(json.dumps(facts))
    """
)


@pytest.mark.promise
def test_servers_refuse_network_addresses_unless_exposed_which_really_exposes():
    """In a namespace whose only network address is the test's own: a fleet's servers answer
    on loopback and not on that address; ``expose=True`` (which warns) answers on it."""
    mark = f"netns-fleets-{uuid.uuid4().hex}"
    result = run_python_in_netns(FLEETS_IN_NETNS, env={"GRAPHDIST_TEST_MARK": mark}, timeout_s=150)
    assert result.returncode == 0, result.stderr[-3000:]
    facts = json.loads(result.stdout.splitlines()[-1])
    assert facts["outside"] == [OUTSIDE_IP]
    assert len(facts["loopback"]) == 2
    for reached in facts["loopback"]:
        assert reached == {"127.0.0.1": True, "localhost": True, OUTSIDE_IP: False}, facts
    assert [r[OUTSIDE_IP] for r in facts["exposed"]] == [True], facts
    assert "no authentication" in result.stderr
    assert wait_gone(facts["pids"], EVENTUALLY_S) == []
    assert wait_gone(processes_marked(mark), EVENTUALLY_S) == []


def test_non_loopback_host_needs_expose():
    with pytest.raises(graphdist.ClusterSpecError, match="expose=True"):
        graphdist.LocalFleet({"local": [f"{socket.gethostname()}:23456"]}).start()


# Run in a network namespace with OUTSIDE_IP: `graphdist up --detach`, then who can connect to
# each task's port, then `graphdist down`; prints the facts as JSON.
DETACHED_IN_NETNS = textwrap.dedent(
    """
    import json, subprocess, sys
    from tests.net.netns import connects, non_loopback_addresses

    def graphdist(*args):
        return subprocess.run([sys.executable, "-m", "graphdist", *args],
                              capture_output=True, text=True, timeout=120)

    outside = non_loopback_addresses()
    facts = {"outside": outside, "reached": []}
    up = graphdist("up", "--cluster", "local=2", "--detach")
    facts["up"] = [up.returncode, up.stderr[-2000:]]
    try:
        if up.returncode == 0:
            rows = json.loads(graphdist("status", "--json").stdout)
            for row in rows:
                port = int(row["address"].rsplit(":", 1)[1])
                facts["reached"].append({h: connects(h, port) for h in ["127.0.0.1", *outside]})
    finally:
        down = graphdist("down")
        facts["down"] = [down.returncode, down.stderr[-2000:]]
    print(json.dumps(facts))
    """
)


@pytest.mark.promise
def test_detached_cli_fleet_is_loopback_only(state_dir):
    """`graphdist up --detach` in a namespace whose only network address is the test's own:
    every task answers on loopback, none on that address."""
    mark = f"netns-detached-{uuid.uuid4().hex}"
    env = {"GRAPHDIST_STATE_DIR": state_dir, "GRAPHDIST_TEST_MARK": mark}
    result = run_python_in_netns(DETACHED_IN_NETNS, env=env, timeout_s=300)
    assert result.returncode == 0, result.stderr[-3000:]
    facts = json.loads(result.stdout.splitlines()[-1])
    assert facts["up"][0] == 0 and facts["down"][0] == 0, facts
    assert facts["outside"] == [OUTSIDE_IP]
    assert facts["reached"] == [{"127.0.0.1": True, OUTSIDE_IP: False}] * 2, facts
    assert wait_gone(processes_marked(mark), EVENTUALLY_S) == []


def test_no_mechanism_is_a_clear_error_not_a_silent_exposure(tmp_path):
    code = textwrap.dedent(
        """
        import graphdist
        try:
            graphdist.LocalFleet("local=1").start()
        except graphdist.LoopbackUnavailableError as exc:
            print("refused:", exc)
        """
    )
    env = {"XDG_CACHE_HOME": str(tmp_path), "CC": "/bin/false"}
    result = run_python(["-c", code], env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("refused: Cannot build graphdist's bind shim: /bin/false")
    # no way around it to advise: an exposed fleet needs the shim as much (members only)
    assert "expose" not in result.stdout.split("(", 1)[0]
    assert "exposed ones included" in result.stdout
    assert not os.listdir(tmp_path / "graphdist")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cc", ["/nonexistent/cc", "", "no-such-compiler-here -O2", "'unclosed"])
@pytest.mark.parametrize(
    "argv",
    [
        ["up", "--cluster", "local=1"],
        ["up", "--cluster", "local=1", "--expose"],
        ["serve", "--cluster", '{"local": ["localhost:1"]}', "--job", "local", "--task", "0"],
    ],
)
def test_a_compiler_that_cannot_run_is_one_line_naming_cc(tmp_path, cc, argv):
    """``CC=/nonexistent/cc`` was a FileNotFoundError traceback; no compiler at all advised
    ``--expose``, which serve lacks and which needs the shim too. Now one line naming CC (or
    its absence) and what to do, for every command, and nothing started."""
    env = {"XDG_CACHE_HOME": str(tmp_path), "CC": cc, **QUIET_TF}
    if cc == "":
        env["PATH"] = str(tmp_path)  # no cc, no gcc
    result = subprocess.run(
        [sys.executable, "-m", "graphdist", *argv],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert result.returncode != 0
    *_, said = result.stderr.splitlines()  # up --expose warns of the exposure first
    assert "Traceback" not in result.stderr, result.stderr
    assert said.startswith("Error: Cannot build graphdist's bind shim: "), result.stderr
    if cc:
        assert f"CC={cc!r} names no program that can be run" in result.stderr, result.stderr
    else:
        assert "no C compiler (cc/gcc on PATH, or CC)" in result.stderr, result.stderr
    assert "--expose" not in said and "expose=True" not in said


# -- verified, not assumed (the shim's effect is checked after every start) ----------------------


def test_check_listening_refuses_wildcards_and_foreign_addresses():
    from graphdist._net.exposure import check_listening

    ok = [("127.0.0.1", 1), ("::1", 2), ("::ffff:127.0.0.3", 3)]
    assert check_listening("w:0", "a", None, sockets=ok) == ok
    for bad in ("0.0.0.0", "::", "10.1.2.3", "::ffff:10.1.2.3"):
        with pytest.raises(graphdist.ExposedServerError, match="listens on") as info:
            check_listening("w:0", "a", None, sockets=[*ok, (bad, 4)])
        assert info.value.sockets == [(bad, 4)] and info.value.task == "w:0"
    # an address the fleet was told to use is fine; a port filter ignores the process's others
    assert check_listening("w:0", "a", None, ["10.1.2.3"], sockets=[("::ffff:10.1.2.3", 4)])
    assert check_listening("w:0", "a", None, sockets=[("0.0.0.0", 9), ("127.0.0.1", 4)], port=4)


def test_sockets_that_cannot_be_read_are_a_refusal_not_a_pass():
    from graphdist._net.exposure import check_listening

    proc = psutil.Popen(["sleep", "0"])
    proc.wait()
    with pytest.raises(graphdist.ExposedServerError, match="Cannot check"):
        check_listening("w:0", "a", proc.pid)
    with pytest.raises(graphdist.ExposedServerError, match="process id is unknown"):
        check_listening("w:0", "a", None)


def test_a_shim_that_does_nothing_is_caught_and_the_fleet_stopped(monkeypatch):
    """The loader may skip or load a library that does not interpose bind(): the servers then
    listen on every interface. The start must refuse and leave nothing running."""
    import graphdist._local.fleet as local
    from graphdist._net import policy

    inert = "libm.so.6"  # loads fine, interposes nothing
    monkeypatch.setattr(local, "loopback_library", lambda: inert)
    # without graphdist's shim its servers would also fail their dial check (check_enforced,
    # tests/net/test_dial.py): no dial list, so that the listening check is what catches it
    monkeypatch.setattr(policy, "dial_list", lambda cluster: None)
    fleet = graphdist.LocalFleet("local=2")
    with pytest.raises(
        graphdist.ExposedServerError, match=r"listens on \[::\]:|listens on 0\.0\.0\.0:"
    ) as info:
        fleet.start()
    assert fleet.state is graphdist.FleetState.FAILED
    assert info.value.sockets and all(ip in ("0.0.0.0", "::") for ip, _ in info.value.sockets)
    assert wait_gone([p for p in fleet.pids if p], EVENTUALLY_S) == []
    assert all(not t.alive for t in fleet.tasks)


def damage(path: str, how: str) -> None:
    os.chmod(path, 0o600)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        if how == "empty":
            f.truncate(0)
        elif how == "truncated":
            f.truncate(size // 2)
        else:
            f.write(b"\x00not an ELF file" * 64)


def binds_loopback(path: str) -> bool:
    probe = "import socket; s = socket.socket(); s.bind(('0.0.0.0', 0)); print(s.getsockname()[0])"
    bound = subprocess.run(
        [sys.executable, "-S", "-c", probe],
        env={"LD_PRELOAD": path},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return bound.stdout.strip() == "127.0.0.1"


def test_a_broken_cached_shim_is_rebuilt_and_servers_stay_on_loopback(
    tmp_path, monkeypatch, caplog
):
    from graphdist._net.loopback import loopback_library

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = loopback_library()
    size = os.path.getsize(path)
    for how in ("empty", "truncated", "garbage"):
        damage(path, how)
        assert not binds_loopback(path), how  # the damage is real: the loader skips the file
        caplog.clear()
        assert loopback_library() == path
        assert "building it again" in caplog.text, how
        assert os.path.getsize(path) == size and binds_loopback(path), how
    # End to end: a fleet started over a damaged cache still listens on loopback only.
    damage(path, "garbage")
    code = textwrap.dedent(
        """
        import json, psutil, graphdist
        with graphdist.LocalFleet("local=1") as fleet:
            pid = fleet.tasks[0].pid
            found = [c.laddr.ip for c in psutil.Process(pid).net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN]
        print(json.dumps(found))
        """
    )
    result = run_python(["-c", code], env={"XDG_CACHE_HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    listening_on = json.loads(result.stdout.splitlines()[-1])
    assert listening_on and all(ip in ("127.0.0.1", "::ffff:127.0.0.1") for ip in listening_on)


def test_eight_processes_building_the_shim_at_once_all_get_a_working_one(tmp_path):
    code = (
        "import sys; sys.path.insert(0, '.');"
        "from graphdist._net.loopback import loopback_library; print(loopback_library())"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        for _ in range(8)
    ]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), [err for _, err in outputs]
    paths = {out.strip() for out, _ in outputs}
    assert len(paths) == 1
    (path,) = paths
    assert binds_loopback(path)
    assert sorted(os.listdir(os.path.dirname(path))) == [os.path.basename(path)]


def test_a_users_own_preload_is_kept_after_the_shim():
    from graphdist._net.loopback import with_preload

    assert with_preload("/c/shim.so", None) == "/c/shim.so"
    assert (
        with_preload("/c/shim.so", "libtcmalloc.so /x/y.so") == "/c/shim.so:libtcmalloc.so:/x/y.so"
    )
    assert with_preload("/c/shim.so", "/c/shim.so:a.so") == "/c/shim.so:a.so"


def test_serve_refuses_a_wildcard_address_without_bind_all(run_cli):
    (port,) = pick_free_ports(1)
    cluster = json.dumps({"w": [f"0.0.0.0:{port}"]})
    result = run_cli("serve", "--cluster", cluster, "--job", "w", "--task", "0")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("Error:") and "wildcard" in lines[-1] and "--bind-all" in lines[-1]
    assert "Traceback" not in result.stderr
    release_ports([port])


def test_mixed_loopback_and_network_hosts_are_refused_before_anything_starts():
    host = socket.gethostname()
    fleet = graphdist.LocalFleet({"w": ["127.0.0.1:23456", f"{host}:23457"]})
    with pytest.raises(graphdist.ClusterSpecError, match="Task w-1 is on "):
        fleet.start()
    assert fleet.tasks == ()


def test_one_port_under_two_names_is_refused_before_anything_starts():
    (port,) = pick_free_ports(1)
    try:
        for other in ("127.0.0.1", "[::1]"):
            fleet = graphdist.LocalFleet({"local": [f"localhost:{port}", f"{other}:{port}"]})
            with pytest.raises(graphdist.ClusterSpecError, match="both on port") as info:
                fleet.start()
            assert "local-0" in str(info.value) and "local-1" in str(info.value)
            assert fleet.tasks == ()
    finally:
        release_ports([port])


def test_a_task_whose_own_process_does_not_listen_is_not_ready(graphdist_fleet):
    """Readiness is proven by the task's own pid owning the listening socket, not by whoever
    answers at its address."""
    import types

    real = graphdist_fleet.tasks[0]
    other = subprocess.Popen(["sleep", "60"])  # a live process that listens on nothing
    try:
        impostor = types.SimpleNamespace(
            job="local", index=1, name="local-1", address=real.address, pid=other.pid
        )
        with pytest.raises(graphdist.FleetStartError, match="not the process listening"):
            graphdist_fleet._check_listening(impostor, frozenset())
    finally:
        other.kill()
        other.wait()
    graphdist_fleet._check_listening(real, frozenset())  # the real one passes


def test_an_ipv6_loopback_cluster_starts_and_stays_on_loopback():
    ports = pick_free_ports(2)
    release_ports(ports)
    cluster = {"local": [f"[::1]:{port}" for port in ports]}
    with graphdist.LocalFleet(cluster) as fleet:
        graph, y = split_graph(fleet.device("local", 0), fleet.device("local", 1))
        with fleet.session("local", 0, graph=graph) as sess:
            assert sess.run(y) == 238
        for task in fleet.tasks:
            assert listening(task.pid) == [("::1", task.task.port)]


def test_a_port_another_process_holds_on_ipv6_loopback_is_refused():
    """localhost is 127.0.0.1 and ::1; the task's server listens on 127.0.0.1 only, and a
    client tries ::1 first: with another process listening at [::1]:PORT, the task's sessions
    would reach that one. The port check before the start (a bind of [::] at the port) refuses
    it, naming the holder; nothing is started."""
    (port,) = pick_free_ports(1)  # held: the fleet's claim takes it over
    other = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    try:
        try:
            other.bind(("::1", port))
        except OSError:
            pytest.skip("no IPv6 loopback on this machine")
        other.listen(1)
        fleet = graphdist.LocalFleet({"local": [f"localhost:{port}"]})
        with pytest.raises(graphdist.PortInUseError, match=f"in use by pid {os.getpid()}") as info:
            fleet.start()
        assert info.value.port == port and info.value.task == "local-0"
        pids = [t.pid for t in fleet.tasks if t.pid is not None]
        assert wait_gone(pids, EVENTUALLY_S) == []
    finally:
        other.close()
        release_ports([port])
