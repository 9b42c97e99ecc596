"""Where a RayFleet's servers and the Ray instance graphdist starts listen: loopback, unless the
fleet is exposed, and then each server on its node's address only (never a wildcard)."""

from __future__ import annotations

import contextlib
import json
import textwrap
import uuid

import psutil
import pytest

import graphdist
from graphdist._graph.graphs import split_graph
from graphdist._net.exposure import is_loopback_ip
from graphdist._ray.nodes import plan_hosts
from tests.conftest import EVENTUALLY_S, listening, processes_marked, wait_gone
from tests.fleet.conftest import processes_of as _processes_of
from tests.net.netns import OUTSIDE_IP, connects, non_loopback_addresses, run_python_in_netns

# Ray is a declared test dependency (setup.cfg's `ray` extra, which `make test` installs): a test
# that needs it and cannot import it skips as a promise does, a failure in CI (tests/conftest.py).
needs_ray = pytest.mark.needs("ray", extra="ray")
DRIVER = ("driver-node", "10.0.0.1")


# -- the decision, as a pure function of where Ray placed the bundles -----------------------------


def test_one_loopback_node_binds_loopback():
    assert plan_hosts([("n1", "127.0.0.1")] * 2, ("n1", "127.0.0.1"), expose=False) == [
        "127.0.0.1",
        "127.0.0.1",
    ]


def test_the_drivers_own_node_on_a_network_address_still_binds_loopback():
    nodes = [(DRIVER[0], DRIVER[1])] * 3
    assert plan_hosts(nodes, DRIVER, expose=False) == ["127.0.0.1"] * 3


def test_simulated_nodes_sharing_the_drivers_address_bind_loopback():
    nodes = [("n1", DRIVER[1]), ("n2", DRIVER[1]), (DRIVER[0], DRIVER[1])]
    assert plan_hosts(nodes, DRIVER, expose=False) == ["127.0.0.1"] * 3


def test_servers_on_other_hosts_need_expose_and_the_error_says_why():
    nodes = [(DRIVER[0], DRIVER[1]), ("n2", "10.0.0.2"), ("n3", "10.0.0.3")]
    with pytest.raises(graphdist.ClusterSpecError) as info:
        plan_hosts(nodes, DRIVER, expose=False)
    text = str(info.value)
    for needed in ("10.0.0.2, 10.0.0.3", "over the network", "no authentication", "expose=True"):
        assert needed in text
    assert info.value.value == ["10.0.0.2", "10.0.0.3"]


def test_one_node_that_is_not_the_drivers_needs_expose():
    with pytest.raises(graphdist.ClusterSpecError, match="expose=True"):
        plan_hosts([("n2", "10.0.0.2")] * 2, DRIVER, expose=False)


def test_a_ray_client_driver_may_be_anywhere():
    with pytest.raises(graphdist.ClusterSpecError, match="Ray client"):
        plan_hosts([("n1", "10.0.0.2")], None, expose=False)
    assert plan_hosts([("n1", "127.0.0.1")], None, expose=False) == ["127.0.0.1"]


def test_expose_binds_each_node_address_never_a_wildcard():
    nodes = [(DRIVER[0], DRIVER[1]), ("n2", "10.0.0.2"), ("n2", "10.0.0.2")]
    hosts = plan_hosts(nodes, DRIVER, expose=True)
    assert hosts == ["10.0.0.1", "10.0.0.2", "10.0.0.2"]
    assert plan_hosts([DRIVER], DRIVER, expose=True) == ["10.0.0.1"]  # one node: the same rule
    assert plan_hosts([("n1", "127.0.0.1")], None, expose=True) == ["127.0.0.1"]


def test_ipv6_node_addresses_are_refused_where_the_shim_cannot_bind_them():
    with pytest.raises(graphdist.ClusterSpecError, match="IPv6"):
        plan_hosts([("n1", "fd00::2")], ("n1", "fd00::2"), expose=True)
    with pytest.raises(graphdist.ClusterSpecError, match="IPv6"):
        plan_hosts([("n1", "fd00::2")], ("n1", "fd00::2"), expose=False)


def test_no_bundles_no_hosts():
    assert plan_hosts([], DRIVER, expose=False) == []


# -- real Ray instances on this machine ---------------------------------------------------------


def _listening(procs: dict[int, psutil.Process]) -> dict[int, tuple[str, list[tuple[str, int]]]]:
    """``pid`` → (name, listening TCP sockets) of each process that is still there."""
    out = {}
    for pid, proc in procs.items():
        with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
            out[pid] = (proc.name(), listening(pid))
    return out


@needs_ray
@pytest.mark.promise
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_the_ray_graphdist_starts_and_its_servers_listen_on_loopback_only(ray_env):
    import ray

    from graphdist._ray.fleet import RayFleet

    driver = psutil.Process()
    before = {p.pid for p in driver.children(recursive=True)}
    with RayFleet("local=2") as fleet:
        assert ray.util.get_node_ip_address() == "127.0.0.1"
        assert {t.task.host for t in fleet.tasks} == {"127.0.0.1"}
        graph, y = split_graph(fleet.device("local", 0), fleet.device("local", 1))
        with fleet.session("local", 0, graph=graph) as sess:
            assert sess.run(y) == 238
        for task in fleet.tasks:
            sockets = listening(fleet.task(task.job, task.index).pid)
            assert task.task.port in {port for _, port in sockets}, sockets
            assert all(is_loopback_ip(ip) for ip, _ in sockets), (task, sockets)

        # Every process of that Ray instance: what the driver started (GCS, raylet, monitors,
        # and below the raylet its agents and workers) and whatever names its temp folder.
        started = {p.pid: p for p in driver.children(recursive=True) if p.pid not in before}
        procs = {**started, **_processes_of(ray_env)}
        seen = _listening(procs)
        names = {name for name, _ in seen.values()}
        assert {"gcs_server", "raylet"} <= names, names
        assert {t.pid for t in fleet.tasks} <= set(seen), seen
        ray_sockets = [s for _, sockets in seen.values() for s in sockets]
        ray_sockets += listening(driver.pid)  # the driver's own core worker
        assert len(ray_sockets) >= 5, seen  # GCS, raylet (2), both servers at least
        exposed = {
            pid: v for pid, v in seen.items() if not all(is_loopback_ip(ip) for ip, _ in v[1])
        }
        assert exposed == {}
        assert all(is_loopback_ip(ip) for ip, _ in listening(driver.pid))
        for address in non_loopback_addresses():
            reachable = [p for _, p in ray_sockets if connects(address, p)]
            assert reachable == [], (address, reachable)
    assert fleet.state is graphdist.FleetState.CLOSED
    assert not ray.is_initialized()  # close() shut down the Ray it started
    assert wait_gone(procs, EVENTUALLY_S) == []


# Run in a network namespace with OUTSIDE_IP: the user's own Ray on that node address, then a
# loopback RayFleet and an exposed one on it; prints as JSON where each server listens and who
# could connect to it.
RAY_IN_NETNS = textwrap.dedent(
    """
    import json
    import ray
    from graphdist._ray.fleet import RayFleet
    from graphdist._graph.graphs import split_graph
    from tests.conftest import listening
    from tests.net.netns import connects, non_loopback_addresses

    outside = non_loopback_addresses()
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    node_ip = ray.util.get_node_ip_address()
    facts = {"outside": outside, "node_ip": node_ip, "loopback": []}

    def where(task):
        port = task.task.port
        return {
            "host": task.task.host,
            "server": [ip for ip, p in listening(task.pid) if p == port],
            "reached": {h: connects(h, port) for h in ["127.0.0.1", *outside]},
        }

    with RayFleet("local=2") as fleet:
        graph, y = split_graph(fleet.device("local", 0), fleet.device("local", 1))
        with fleet.session("local", 0, graph=graph) as sess:
            facts["computed"] = bool(sess.run(y) == 238)
        facts["loopback"] = [where(task) for task in fleet.tasks]
        # Ray's own core worker in the actor's process still answers (it keeps the node address)
        task = fleet.tasks[0]
        facts["actor_answers"] = ray.get(task.actor.pid.remote(), timeout=30) == task.pid
    with RayFleet("local=1", expose=True) as fleet:
        facts["exposed"] = [where(task) for task in fleet.tasks]
    facts["ray_kept"] = ray.is_initialized()  # not the fleets' to shut down
    ray.shutdown()
    print(json.dumps(facts))
    """
)


@needs_ray
@pytest.mark.promise
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_ray_node_on_a_network_address_still_gets_loopback_servers(ray_env):
    """On a Ray node whose address is the test's own (a network namespace), a fleet's servers
    still listen on loopback only; an exposed one listens on the node's address only."""
    mark = f"netns-ray-{uuid.uuid4().hex}"
    result = run_python_in_netns(RAY_IN_NETNS, env={"GRAPHDIST_TEST_MARK": mark}, timeout_s=280)
    assert result.returncode == 0, result.stderr[-3000:]
    facts = json.loads(result.stdout.splitlines()[-1])
    assert facts["outside"] == [OUTSIDE_IP] and facts["node_ip"] == OUTSIDE_IP, facts
    assert facts["computed"] and facts["actor_answers"] and facts["ray_kept"], facts
    assert len(facts["loopback"]) == 2
    for where in facts["loopback"]:
        assert where["host"] == "127.0.0.1", facts
        assert where["server"] and all(is_loopback_ip(ip) for ip in where["server"]), facts
        assert where["reached"] == {"127.0.0.1": True, OUTSIDE_IP: False}, facts
    (exposed,) = facts["exposed"]
    assert exposed["host"] == OUTSIDE_IP
    assert exposed["server"] in ([f"::ffff:{OUTSIDE_IP}"], [OUTSIDE_IP]), facts
    assert exposed["reached"] == {"127.0.0.1": False, OUTSIDE_IP: True}, facts  # node's only
    assert wait_gone(processes_marked(mark), EVENTUALLY_S) == []


@needs_ray
@pytest.mark.timeout(60)
def test_a_ray_client_servers_failure_names_its_cause_not_an_unreachable_cluster(
    ray_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``ray://`` head that answers but whose client server fails to start the client's own
    server process: Ray raises ConnectionAbortedError whose first line is only "Initialization
    failure from server:" and whose last line is the cause. The error says the cluster answered,
    names that cause and where the logs are, and does not advise starting a cluster (CI,
    2026-12-04: the first line alone hid why). ray_env although no Ray starts: Ray fixes its
    auth mode at its first import in a process (tests/fleet/conftest.py)."""
    import ray

    from graphdist._ray import nodes as raynodes

    reply = (
        "Initialization failure from server:\nTraceback (most recent call last):\n"
        '  File "proxier.py", line 778, in Datapath\n'
        "RuntimeError: Proxy failed to Connect to backend! Check `ray_client_server.err`\n"
    )

    def init(*args: object, **kwargs: object) -> None:
        raise ConnectionAbortedError(reply)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(graphdist.ArgumentError) as caught:
        raynodes.connect_ray("ray://10.0.0.1:10001")
    text = str(caught.value)
    assert "The Ray cluster at ray://10.0.0.1:10001 answered" in text, text
    assert "RuntimeError: Proxy failed to Connect to backend!" in text, text
    assert "ray_client_server*.err" in text and "ray start --head" not in text, text
