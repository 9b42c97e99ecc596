"""RayFleet on a real multi-node Ray cluster (3 nodes simulated on this machine by
``ray.cluster_utils.Cluster``): servers on distinct nodes, the split graph, recovery by Ray.

The simulated nodes share this machine's address, so the servers stay on loopback without
``expose``; with ``--expose`` each listens on its node's address only (never a wildcard)."""

from __future__ import annotations

import os
import queue
import time

import pytest

import graphdist
from graphdist._graph.graphs import split_graph
from graphdist._net.exposure import is_loopback_ip
from tests.conftest import EVENTUALLY_S, listening
from tests.raycluster import simulated_cluster

# Ray reads its auth settings when it is imported: the tests import it once they are set.
# One worker runs them all, one after another: the module's three-node Ray cluster is then built
# once (7-10 s of several Ray processes) instead of once on each worker, two clusters at a time.
pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.xdist_group("ray_cluster"),
    pytest.mark.needs("ray", extra="ray"),
]


@pytest.fixture(scope="module")
def ray_cluster():
    with simulated_cluster([1, 1, 1]) as cluster:
        yield cluster


def test_three_servers_on_three_nodes_run_the_split_graph_and_recover(ray_cluster, monkeypatch):
    """... and at close the process's PYTHONBREAKPOINT is the user's again (ray.init sets its
    own, and Ray's shutdown leaves it)."""
    from graphdist._ray.fleet import RayFleet

    monkeypatch.setenv("PYTHONBREAKPOINT", "the.users.own_hook")
    with RayFleet("local=3", address=ray_cluster.address, strategy="STRICT_SPREAD") as fleet:
        assert os.environ["PYTHONBREAKPOINT"].startswith("ray."), "Ray's own hook: not set?"
        assert len(set(fleet.node_ids.values())) == 3
        assert {t.job for t in fleet.tasks} == {"local"}
        assert {t.task.host for t in fleet.tasks} == {"127.0.0.1"}  # one machine: loopback
        for task in fleet.tasks:
            server = [ip for ip, port in listening(task.pid) if port == task.task.port]
            assert server and all(is_loopback_ip(ip) for ip in server), (task, server)
        graph, y = split_graph(fleet.device("local", 0), fleet.device("local", 1))
        with fleet.session("local", 0, graph=graph) as sess:
            assert sess.run(y) == 238
        before = fleet.task("local", 1)
        old_pid, old_address, old_node = before.pid, before.address, before.node_id
        after = fleet.restart("local", 1)  # kills the actor; Ray brings it back by itself
        assert after.pid != old_pid
        assert (after.address, after.node_id) == (old_address, old_node)
        with fleet.session("local", 0, graph=graph) as sess:
            assert sess.run(y) == 238
        assert [h.status for h in fleet.health()] == ["alive"] * 3
    assert fleet.state is graphdist.FleetState.CLOSED
    assert os.environ["PYTHONBREAKPOINT"] == "the.users.own_hook"


@pytest.mark.timeout(240)
def test_alive_comes_from_ray_and_the_watcher_sees_each_kill(ray_cluster):
    """``alive`` while the actor runs; a kill shows at once (the guard fails the session's next
    run, the watcher reports the death with Ray's unknown exit code), and once Ray has brought
    the actor back a new pid answers; a second kill is a second death."""
    from graphdist._ray.fleet import RayFleet

    with RayFleet("local=2", address=ray_cluster.address) as fleet:
        task = fleet.task("local", 1)
        first = task.pid
        assert first is not None
        assert all(t.alive for t in fleet.tasks for _ in range(50))  # from what Ray last said
        graph, y = split_graph(fleet.device("local", 0), fleet.device("local", 1))
        sess = fleet.session("local", 0, graph=graph)
        assert sess.run(y) == 238
        deaths: queue.Queue[str] = queue.Queue()
        fleet.watch(lambda t: deaths.put(t.name))
        fleet.kill("local", 1)
        assert not (task.alive and task.pid == first)  # the killed process never counts again
        assert deaths.get(timeout=EVENTUALLY_S) == task.name
        with pytest.raises(graphdist.TaskFailedError) as info:
            sess.run(y)
        assert info.value.task == "local-1" and info.value.status in ("dead", "restarted")
        sess.close()
        second = back_with_a_new_pid(task, first)
        assert fleet.task("local", 0).alive
        with fleet.session("local", 0, graph=graph) as again:
            assert again.run(y) == 238
        fleet.kill("local", 1)
        assert deaths.get(timeout=EVENTUALLY_S) == task.name
        back_with_a_new_pid(task, second)
        exits = fleet.task_exits()
        assert [(e.task, e.pid, e.exitcode) for e in exits] == [
            (task.name, first, None),  # Ray does not say how an actor's process ended
            (task.name, second, None),
        ]
        assert [h.status for h in fleet.health()] == ["alive"] * 2


def back_with_a_new_pid(task, old, within_s=120.0):
    """Wait until Ray has brought ``task``'s actor back (alive, a pid other than ``old``)."""
    deadline = time.monotonic() + within_s
    while not (task.alive and task.pid != old) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert task.alive and task.pid not in (None, old), (task, task.pid, old)
    return task.pid


def test_unplaceable_fleet_fails_with_a_timeout_not_a_hang(ray_cluster):
    from graphdist._ray.fleet import RayFleet

    fleet = RayFleet(
        "local=4", address=ray_cluster.address, strategy="STRICT_SPREAD", start_timeout_s=5
    )
    with pytest.raises(graphdist.StartTimeoutError, match="could not place 4 servers"):
        fleet.start()
    fleet.close()


def test_servers_on_other_hosts_are_refused_before_any_actor_starts(ray_cluster, monkeypatch):
    from graphdist._ray import fleet as ray_backend

    # As if this process ran on another machine than every node of the cluster.
    monkeypatch.setattr(ray_backend, "driver_node", lambda: ("elsewhere", "203.0.113.9"))
    fleet = ray_backend.RayFleet("local=2", address=ray_cluster.address)
    with pytest.raises(graphdist.ClusterSpecError, match="expose=True") as info:
        fleet.start()
    assert "no authentication" in str(info.value)
    assert fleet.state is graphdist.FleetState.FAILED
    assert fleet.tasks == ()  # no actor was started
    fleet.close()


def test_counts_only():
    from graphdist._ray.fleet import RayFleet

    with pytest.raises(graphdist.ClusterSpecError, match="task counts"):
        RayFleet('{"local": ["h:1"]}')
    with pytest.raises(graphdist.ClusterSpecError, match="STRICT_SPREAD"):
        RayFleet("local=2", strategy="EVERYWHERE")


def test_cli_up_with_the_ray_backend_runs_until_ctrl_c(ray_cluster):
    """``--expose`` reaches the RayFleet: each server on its node's address, and only there."""
    import signal

    from tests.conftest import read_json_rows, start_graphdist

    proc = start_graphdist(
        "up",
        "--cluster",
        "local=2",
        "--backend",
        "ray",
        "--address",
        ray_cluster.address,
        "--expose",
        "--json",
    )
    try:
        rows = read_json_rows(proc)
        assert [(r["job"], r["task"]) for r in rows] == [("local", 0), ("local", 1)]
        for row in rows:
            host, port = row["address"].rsplit(":", 1)
            assert host == ray_cluster.head_node.node_ip_address, row
            server = [ip for ip, p in listening(row["pid"]) if p == int(port)]
            assert server in ([host], [f"::ffff:{host}"]), server  # never a wildcard
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130  # stopped by Ctrl-C, as a shell reports it (SIGTERM: 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
