"""graphdist.attach(): the Python handle on a fleet that `graphdist up --detach` started."""

from __future__ import annotations

import contextlib
import json
import os
import time

import pytest

import graphdist
from graphdist import _ports as ports
from graphdist._detached import control
from graphdist._detached.state import CONTROL_SOCKET
from graphdist._detached.supervisor import SupervisorSpec
from graphdist._graph.graphs import split_graph
from tests.conftest import EVENTUALLY_S, read_json, run_python, wait_gone

TIMEOUT_MS = 1500


def test_supervisor_spec_round_trips_and_refuses_what_it_does_not_know(tmp_path):
    spec = SupervisorSpec(str(tmp_path), {"local": ["localhost:2020"]}, restart="on-failure")
    assert SupervisorSpec.from_json(spec.to_json()) == spec
    assert spec.command()[-1] == spec.to_json()
    with pytest.raises(ValueError, match="bogus"):
        SupervisorSpec.from_json(json.dumps({**json.loads(spec.to_json()), "bogus": 1}))
    with pytest.raises(ValueError, match="cluster"):
        SupervisorSpec.from_json(json.dumps({"state_dir": str(tmp_path)}))
    with pytest.raises(ValueError, match="restart"):
        SupervisorSpec(str(tmp_path), {}, restart="always")
    with pytest.raises(ValueError, match="max_restarts"):
        SupervisorSpec(str(tmp_path), {}, max_restarts=-1)
    with pytest.raises(ValueError, match="restart_window_s"):
        SupervisorSpec(str(tmp_path), {}, restart_window_s=0)
    # A spec from before the restart window existed still reads, with the documented 60 s.
    old = {k: v for k, v in json.loads(spec.to_json()).items() if k != "restart_window_s"}
    assert SupervisorSpec.from_json(json.dumps(old)).restart_window_s == 60.0


def test_control_channel_answers_and_carries_errors_even_on_a_long_path(tmp_path):
    state_dir = os.path.join(str(tmp_path), "x" * 120)  # longer than a socket address allows
    os.makedirs(state_dir)

    def handler(req):
        if req["op"] == "restart":
            raise graphdist.TaskNotFoundError("no task 7", req["job"], req["index"])
        if req["op"] == "kill":
            raise RuntimeError("boom")
        return {"ok": True, "echo": req}

    server = control.ControlServer(state_dir, handler).start()
    try:
        path = os.path.join(state_dir, CONTROL_SOCKET)
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"
        assert control.request(state_dir, {"op": "ping"}, 5)["echo"] == {"op": "ping"}
        with pytest.raises(graphdist.TaskNotFoundError, match="no task 7"):
            control.request(state_dir, {"op": "restart", "job": "local", "index": 7}, 5)
        with pytest.raises(graphdist.FleetError, match="boom"):
            control.request(state_dir, {"op": "kill", "job": "local", "index": 0}, 5)
    finally:
        server.close()
    assert not os.path.exists(path)
    with pytest.raises(graphdist.FleetError, match="Cannot reach the supervisor"):
        control.request(state_dir, {"op": "ping"}, 5)


def test_attach_to_an_empty_folder_names_it(state_dir):
    with pytest.raises(graphdist.StateError, match="No detached fleet") as info:
        graphdist.attach(state_dir)
    assert state_dir in str(info.value) and info.value.state_dir == state_dir


def test_attach_uses_the_cli_default_folder(state_dir, monkeypatch):
    monkeypatch.setenv("GRAPHDIST_STATE_DIR", state_dir)
    with pytest.raises(graphdist.StateError, match=state_dir):
        graphdist.attach()


def seed_graph(fleet):
    return split_graph(fleet.device("local", 0), fleet.device("local", 1))


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_attached_fleet_runs_kills_restarts_detaches_and_closes(state_dir):
    env = {"GRAPHDIST_STATE_DIR": state_dir}
    up = run_python(["-m", "graphdist", "up", "--cluster", "local=2", "--detach"], env=env)
    assert up.returncode == 0, up.stderr
    state_file = os.path.join(state_dir, "fleet.json")
    record = read_json(state_file)
    supervisor = record["supervisor"]["pid"]
    # the ports `up` picked are the supervisor's now: no lock file of theirs stays (issue 57)
    picked = [int(t["address"].rsplit(":", 1)[1]) for t in record["tasks"]]
    assert [p for p in picked if os.path.lexists(ports._lock_path(p))] == []
    try:
        assert oct(os.stat(os.path.join(state_dir, CONTROL_SOCKET)).st_mode & 0o777) == "0o600"
        with graphdist.attach(state_dir, operation_timeout_ms=TIMEOUT_MS) as fleet:
            assert isinstance(fleet, graphdist.Fleet)
            assert fleet.state is graphdist.FleetState.RUNNING
            assert fleet.cluster == graphdist.Cluster(record["cluster"])
            assert [t.pid for t in fleet.tasks] == [t["pid"] for t in record["tasks"]]
            assert fleet.target("local", 1) == f"grpc://{record['tasks'][1]['address']}"
            assert all(t.alive and t.exitcode is None and t.restarts == 0 for t in fleet.tasks)
            assert os.path.isfile(fleet.task("local", 0).log_path)
            graph, y = seed_graph(fleet)
            with fleet.session("local", 0, graph=graph) as sess:
                assert sess.run(y) == 238
            with fleet.session_for(y, graph=graph) as sess:
                assert sess.run(y) == 238
            assert [h.status for h in fleet.health()] == ["alive", "alive"]

            old_pid = fleet.task("local", 1).pid
            with fleet.session("local", 0, graph=graph) as sess:
                fleet.kill("local", 1)
                assert wait_gone([old_pid], EVENTUALLY_S) == []
                health = fleet.health()
                assert [h.status for h in health] == ["alive", "dead"]
                assert "was killed by SIGKILL" in str(health[1])
                assert [t.pid for t in fleet.dead_tasks()] == [old_pid]
                with pytest.raises(graphdist.TaskFailedError) as info:
                    sess.run(y)
            assert (info.value.task, info.value.status) == ("local-1", "dead")

            task = fleet.restart("local", 1)
            new_pid = read_json(state_file)["tasks"][1]["pid"]
            assert new_pid != old_pid and task.pid == new_pid and task.restarts == 1
            assert task.alive and task.exitcode is None
            with fleet.session("local", 0, graph=graph) as sess:
                assert sess.run(y) == 238
            with pytest.raises(graphdist.TaskNotFoundError):
                fleet.restart("local", 7)
        # Leaving the with block detaches: the fleet keeps running.
        assert fleet.state is graphdist.FleetState.CLOSED
        with pytest.raises(graphdist.FleetClosedError):
            fleet.session("local", 0)
        pids = [supervisor, *(t["pid"] for t in read_json(state_file)["tasks"])]
        assert wait_gone(pids, 1.0) == pids  # every one still alive

        again = graphdist.attach(state_dir)
        again.detach()
        assert wait_gone(pids, 1.0) == pids
        status = run_python(["-m", "graphdist", "status", "--json"], env=env)
        assert [r["pid"] for r in json.loads(status.stdout)] == pids[1:]

        last = graphdist.attach(state_dir)
        last.close()
        assert wait_gone(pids, EVENTUALLY_S) == []
        assert last.state is graphdist.FleetState.CLOSED and not os.path.exists(state_dir)
        last.close()  # idempotent
        with pytest.raises(graphdist.StateError, match="No detached fleet"):
            graphdist.attach(state_dir)
    finally:
        down = run_python(["-m", "graphdist", "down"], env=env)
        assert down.returncode == 0 or "No detached fleet" in down.stderr, down.stderr


def _spares_of(supervisor: int) -> set[int]:
    """The spare server processes under a supervisor (its fork server's pool), read from the OS."""
    import psutil

    found = set()
    for proc in psutil.Process(supervisor).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if " ".join(proc.cmdline()).startswith("graphdist spare"):
                found.add(proc.pid)
    return found


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_a_detached_fleet_keeps_a_spare_per_server_not_the_notebook_default(state_dir):
    """A detached 2-server fleet keeps 2 spares (what restarting both takes), not the 8 that a
    process starting fleets of any size keeps; GRAPHDIST_SPARES still wins where it is set (0:
    none)."""
    for given, expected in ((None, 2), ("0", 0)):
        env = {"GRAPHDIST_STATE_DIR": state_dir}
        if given is not None:
            env["GRAPHDIST_SPARES"] = given
        up = run_python(["-m", "graphdist", "up", "--cluster", "local=2", "--detach"], env=env)
        assert up.returncode == 0, up.stderr
        supervisor = read_json(os.path.join(state_dir, "fleet.json"))["supervisor"]["pid"]
        try:
            deadline = time.monotonic() + EVENTUALLY_S
            while len(_spares_of(supervisor)) < expected and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(3.0)  # the pool refills in idle moments of 0.3 s: it would have grown
            spares = _spares_of(supervisor)
            assert len(spares) == expected, (given, spares)
        finally:
            down = run_python(["-m", "graphdist", "down"], env=env)
            assert down.returncode == 0, down.stderr
        assert wait_gone([supervisor, *spares], EVENTUALLY_S) == []
