"""``graphdist.SlurmFleet`` on a real Slurm cluster (tests/slurmbed.py): one server per node of
an allocation as a Slurm step, the same Fleet interface and lifecycle as the other backends
(issue 37, point 2). The owner runs on the bed's login host, outside the allocation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

import pytest

from graphdist._proc import oom
from tests.conftest import EVENTUALLY_S, on_loopback, read_json, received_of, wait_gone
from tests.net.test_hosts import SPLIT_GRAPH
from tests.net.test_ray_hosts import ATTACHED, _step
from tests.slurm.conftest import SHAPES

pytestmark = [pytest.mark.promise]

DRIVER = (
    SPLIT_GRAPH
    + r"""
def run():
    with fleet.session("local", 0, graph, config=graphdist.no_folding_config()) as sess:
        return int(sess.run(y))

jobid = sys.argv[1]
try:
    graphdist.SlurmFleet({"local": {0: "10.9.9.9:1"}}, jobid=jobid)
except graphdist.ClusterSpecError as exc:
    say(step="foreign", error=str(exc))
t = time.monotonic()
fleet = graphdist.SlurmFleet("local=2", jobid=jobid)
fleet.start()
say(step="up", cluster=fleet.cluster.as_dict(), nodes={t.name: t.node for t in fleet.tasks},
    pids={t.name: t.pid for t in fleet.tasks}, seconds=time.monotonic() - t)
say(step="run", result=run(), health=[h.ok for h in fleet.health()])
sys.stdin.readline()  # the test killed local-1's server on its node
t = time.monotonic()
try:
    say(step="killed", error=None, result=run())
except graphdist.TaskFailedError as exc:
    say(step="killed", error=type(exc).__name__, text=str(exc), seconds=time.monotonic() - t)
fleet.restart("local", 1)
say(step="back", result=run(), pid=fleet.task("local", 1).pid,
    restarts=fleet.task("local", 1).restarts)
sys.stdin.readline()  # the test cancelled the whole job
t = time.monotonic()
try:
    say(step="cancelled", error=None, result=run())
except graphdist.GraphdistError as exc:
    say(step="cancelled", error=type(exc).__name__, text=str(exc), seconds=time.monotonic() - t)
t = time.monotonic()
fleet.close()
say(step="closed", seconds=time.monotonic() - t, state=fleet.state.value)
"""
)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("slurm", SHAPES, indirect=True)
def test_a_slurm_fleet_serves_runs_fails_fast_restarts_and_leaves_no_step(slurm, tmp_path):
    jobid = slurm.salloc(2)
    driver = slurm.popen(
        None,
        [sys.executable, "-c", DRIVER, str(jobid)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={"TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert driver.stdin is not None
    try:
        foreign = _step(driver, "foreign")
        nodes = slurm.run(None, ["squeue", "-h", "-j", str(jobid), "-o", "%N"]).stdout.strip()
        assert "10.9.9.9" in foreign["error"] and "not a node of Slurm job" in foreign["error"]
        assert nodes.split("[")[0] in foreign["error"], foreign  # the allocation's nodes named

        up = _step(driver, "up")
        by_name = {n.name: n for n in slurm.nodes}
        assert len(set(up["nodes"].values())) == 2, up  # one server per node
        for name, address in zip(("local-0", "local-1"), up["cluster"]["local"], strict=True):
            assert address.startswith(by_name[up["nodes"][name]].address + ":"), up
        ran = _step(driver, "run")
        assert ran["result"] == 238 and ran["health"] == [True, True], ran

        node = by_name[up["nodes"]["local-1"]]
        os.kill(up["pids"]["local-1"], signal.SIGKILL)  # the server on its node
        driver.stdin.write("\n")
        driver.stdin.flush()
        killed = _step(driver, "killed")
        assert killed["error"] == "TaskFailedError", killed
        assert "local-1" in killed["text"] and node.name in killed["text"], killed
        assert killed["seconds"] < 5, killed
        back = _step(driver, "back")
        assert back["result"] == 238 and back["restarts"] == 1, back
        assert back["pid"] != up["pids"]["local-1"]

        slurm.scancel(jobid)  # returns at once: Slurm ends the steps a moment later
        servers = [back["pid"], up["pids"]["local-0"]]
        assert wait_gone(servers, EVENTUALLY_S) == [], "scancel left the fleet's servers"
        driver.stdin.write("\n")  # a run once they are gone (a run before could still succeed)
        driver.stdin.flush()
        cancelled = _step(driver, "cancelled")
        assert cancelled["error"] == "TaskFailedError" and cancelled["seconds"] < 15, cancelled
        closed = _step(driver, "closed")
        assert closed["state"] == "closed" and closed["seconds"] < 15, closed
        _ended_leaving_nothing(slurm, driver, [back["pid"], up["pids"]["local-0"]])
    finally:
        _stop(driver)
        slurm.scancel(jobid)


def _ended_leaving_nothing(slurm: Any, driver: subprocess.Popen[str], pids: list[int]) -> None:
    """The driver exited 0, the servers ``pids`` are gone and no graphdist step is left."""
    assert driver.wait(30) == 0
    assert wait_gone(pids, 20) == []
    left = slurm.run(None, ["squeue", "-h", "-s", "-o", "%i %j"]).stdout
    assert "graphdist-" not in left, left


def _stop(driver: subprocess.Popen[str]) -> None:
    if driver.poll() is None:
        driver.kill()
        driver.wait(30)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tls", [False, True], ids=["members", "tls"])
@pytest.mark.parametrize("slurm", ["site"], indirect=True)
def test_up_detach_on_slurm_serves_from_the_login_host_and_down_leaves_no_step(
    slurm, tmp_path, tls
):
    """``graphdist up --backend slurm --jobid J --detach`` on the login host (outside the
    allocation): one server step per node at the node's address, a client attached on the login
    host runs the split graph (238), ``status`` shows both alive, and ``down`` stops the
    supervisor and every step of it (issue 37, point 2: --detach on Slurm was untried). With
    ``--tls`` the client's folder is printed with the nodes' addresses, the rows show those
    (not the aliases), the attached client goes through the supervisor's gateway, and ``down``
    removes the credentials with the state."""
    jobid = slurm.salloc(2)
    state = str(tmp_path / "state")
    env = {"TF_CPP_MIN_LOG_LEVEL": "2"}

    def gd(*args: str) -> subprocess.CompletedProcess[str]:
        return slurm.run(None, [sys.executable, "-m", "graphdist", *args], env=env, timeout=180)

    pids: list[int] = []
    try:
        up = gd(
            "up", "--backend", "slurm", "--jobid", str(jobid), "--cluster", "local=2",
            "--detach", "--json", "--state-dir", state, *(["--tls"] if tls else []),
        )  # fmt: skip
        assert up.returncode == 0, up.stderr
        rows = json.loads(up.stdout)
        if tls:
            client_folder = os.path.join(state, "tls", "credentials", "client")
            assert f"the client's credentials are in {client_folder}" in up.stderr, up.stderr
            said = json.loads(up.stderr.split("CLUSTER being ", 1)[1].split(")\n", 1)[0])
            assert said == {"local": [r["address"] for r in rows]}, (said, rows)
        assert [(r["job"], r["task"], r["alive"]) for r in rows] == [
            ("local", 0, True),
            ("local", 1, True),
        ], rows
        record = read_json(os.path.join(state, "fleet.json"))
        pids = [record["supervisor"]["pid"], *(t["pid"] for t in record["tasks"])]
        addresses = {n.address for n in slurm.nodes}
        hosts = {r["address"].rsplit(":", 1)[0] for r in rows}
        assert len(hosts) == 2 and hosts <= addresses, (rows, addresses)  # one per node
        client = slurm.popen(
            None,
            [sys.executable, "-c", ATTACHED, state],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        assert _step(client, "run")["result"] == 238
        assert client.wait(60) == 0
        status = gd("status", "--json", "--state-dir", state)
        assert status.returncode == 0, status.stderr
        assert [r["alive"] for r in json.loads(status.stdout)] == [True, True]
    finally:
        down = gd("down", "--state-dir", state)
        slurm.scancel(jobid)
    assert down.returncode == 0, down.stderr
    assert wait_gone(pids, EVENTUALLY_S) == []
    assert not os.path.exists(state)
    left = slurm.run(None, ["squeue", "-h", "-s", "-o", "%i %j"]).stdout
    assert "graphdist-" not in left, left


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tls", [False, True], ids=["members", "tls"])
@pytest.mark.parametrize("slurm", ["site"], indirect=True)
def test_up_in_the_foreground_on_slurm_stops_every_step_on_ctrl_c(slurm, tls):
    """``graphdist up --backend slurm`` in a login host's terminal: Ctrl-C (SIGINT) ends it
    with 130 and leaves no step of the fleet in the allocation. With ``--tls`` it first says
    where the client's credentials are and names the nodes' addresses to connect to."""
    jobid = slurm.salloc(2)
    argv = [sys.executable, "-m", "graphdist", "up", "--backend", "slurm"]
    argv += ["--jobid", str(jobid), "--cluster", "local=2", "--json"] + (["--tls"] if tls else [])
    up = slurm.popen(
        None,
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={"TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert up.stdout is not None
    try:
        lines = []
        for line in up.stdout:
            lines.append(line)
            if "fleet running; press Ctrl-C" in line:
                break
        assert lines and "fleet running" in lines[-1], "".join(lines)
        said = "".join(lines)
        if tls:
            assert "TLS mode; the client's credentials are in " in said, said
            named = [n.address for n in slurm.nodes if n.compute and f'"{n.address}:' in said]
            assert len(named) == 2, said  # the nodes' addresses, not the loopback aliases
        running = slurm.run(None, ["squeue", "-h", "-s", "-j", str(jobid), "-o", "%j"]).stdout
        assert running.count("graphdist-") == 2, running  # one server step per node
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 130, up.stdout.read()
        left = slurm.run(None, ["squeue", "-h", "-s", "-j", str(jobid), "-o", "%j"]).stdout
        assert "graphdist-" not in left, left
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(30)
        slurm.scancel(jobid)


TLS_DRIVER = (
    SPLIT_GRAPH
    + r"""
fleet = graphdist.SlurmFleet("local=2", jobid=sys.argv[1], tls=True)
fleet.start()
with fleet.session("local", 0, graph, config=graphdist.no_folding_config()) as sess:
    own = int(sess.run(y))
say(step="up", cluster=fleet.real_cluster.as_dict(), client=fleet.tls_client, own=own,
    tls_dir=fleet.tls_dir, nodes={t.name: t.node for t in fleet.tasks},
    pids={t.name: t.pid for t in fleet.tasks})
sys.stdin.readline()
fleet.close()
say(step="closed", state=fleet.state.value)
"""
)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("slurm", ["site"], indirect=True)
def test_a_slurm_fleet_in_tls_mode_is_reached_by_its_credentials_only(slurm, tmp_path):
    """``SlurmFleet(tls=True)``: each step's ``serve --tls -`` gets its node's credentials on
    srun's stdin and keeps none on disk once its gateway read them; the login host's driver
    runs 238 through its own gateway; only the gateway listens on each node's address; a plain
    TensorFlow client on the login host is refused (it is a member by address, and TLS mode
    lets in by certificate only); close leaves no step and no credentials."""
    jobid = slurm.salloc(2)
    driver = slurm.popen(
        None,
        [sys.executable, "-c", TLS_DRIVER, str(jobid)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={"TF_CPP_MIN_LOG_LEVEL": "2"},
    )  # fmt: skip
    assert driver.stdin is not None
    try:
        up = _step(driver, "up")
        assert up["own"] == 238, up
        by_name = {n.name: n for n in slurm.nodes}
        for name, address in zip(("local-0", "local-1"), up["cluster"]["local"], strict=True):
            node = by_name[up["nodes"][name]]
            assert address.startswith(node.address + ":"), up
            port = address.rsplit(":", 1)[1]
            listening = node.run(["ss", "-Hltn"]).stdout.splitlines()
            outside = [
                row.split()[3]
                for row in listening
                if row.split()[3].endswith(f":{port}") and not on_loopback(row.split()[3])
            ]
            assert outside == [address], listening  # the gateway, never the server
            # the received credentials, by their writers' pids (the node's: one file system
            # here, where other tests' TLS runs write folders of the same name)
            assert received_of(node.pids()) == []
        path = str(tmp_path / "cluster.json")
        with open(path, "w") as f:
            json.dump(up["cluster"], f)
        plain = slurm.run(
            None,
            [sys.executable, "-c", SPLIT_GRAPH + PLAIN_CLIENT, path],
            env={"TF_CPP_MIN_LOG_LEVEL": "2"},
        )
        assert '"refused": true' in plain.stdout, plain.stdout + plain.stderr
        driver.stdin.write("\n")
        driver.stdin.flush()
        assert _step(driver, "closed")["state"] == "closed"
        assert driver.wait(30) == 0
        assert wait_gone(list(up["pids"].values()), 20) == []
        left = slurm.run(None, ["squeue", "-h", "-s", "-o", "%i %j"]).stdout
        assert "graphdist-" not in left, left
        assert not os.path.exists(up["tls_dir"]), up["tls_dir"]
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(30)
        slurm.scancel(jobid)


PLAIN_CLIENT = r"""
try:
    graphdist.connect(sys.argv[1], timeout_s=5)
    say(refused=False)
except graphdist.GraphdistError as exc:
    say(refused=True, error=type(exc).__name__)
"""


# A server of a fleet in a small allocation, then a 1.6 GB tensor on it (random: nothing to
# fold away); argv: the job's id.
OOM_DRIVER = r"""
import json, sys, time
from graphdist._proc import lean
lean.install()
import graphdist
import tensorflow as tf

def say(**kv):
    print(json.dumps(kv), flush=True)

tf.compat.v1.disable_eager_execution()
graph = tf.Graph()
with graph.as_default(), tf.device("/job:local/task:0"):
    total = tf.reduce_sum(tf.random.uniform([400_000_000]))
fleet = graphdist.SlurmFleet("local=1", jobid=sys.argv[1])
fleet.start()
say(step="up", node=fleet.task("local", 0).node, pid=fleet.task("local", 0).pid)
t = time.monotonic()
try:
    with fleet.session("local", 0, graph) as sess:
        say(step="ran", error=None, result=float(sess.run(total)))
except graphdist.GraphdistError as exc:
    say(step="ran", error=type(exc).__name__, text=str(exc), seconds=time.monotonic() - t)
health = fleet.health()
say(step="health", ok=[h.ok for h in health], details=[h.detail for h in health])
fleet.close()
say(step="closed", state=fleet.state.value)
"""

#: The allocation's memory: room for a server (530-560 MiB RSS idle, TF_FACTS), none for a
#: 1.6 GB tensor.
OOM_MEM = "--mem=700M"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("slurm", ["site"], indirect=True)
def test_a_slurm_fleets_server_over_its_jobs_memory_limit_is_named_out_of_memory(slurm):
    """On a cgroup-tracked Slurm (the site shape), a server whose step goes over its job's
    --mem is killed by the kernel and srun exits 1: the session's TaskFailedError and the
    fleet's health say it ran out of memory over the job's limit on its node and was killed by
    SIGKILL (the kernel's record agrees; not `exited with code 1`, srun's own status), the task
    is dead, and close leaves no step and no process."""
    kernel = oom.OomWatch()  # the kernel's record, to check the words against
    jobid = slurm.salloc(1, OOM_MEM)
    driver = slurm.popen(
        None,
        [sys.executable, "-c", OOM_DRIVER, str(jobid)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={"TF_CPP_MIN_LOG_LEVEL": "2"},
    )  # fmt: skip
    try:
        up = _step(driver, "up")
        ran = _step(driver, "ran")
        words = f"ran out of memory (over its Slurm job's memory limit on node {up['node']})"
        assert ran["error"] == "TaskFailedError", ran
        assert words in ran["text"] and "local-0" in ran["text"], ran
        assert "killed by SIGKILL" in ran["text"] and "code 1" not in ran["text"], ran
        if kernel.readable:  # the kernel's OOM killer did end the server
            assert kernel.killed(up["pid"]) is not None, ran
        health = _step(driver, "health")
        assert health["ok"] == [False] and words in health["details"][0], health
        assert _step(driver, "closed")["state"] == "closed"
        _ended_leaving_nothing(slurm, driver, [up["pid"]])
    finally:
        _stop(driver)
        kernel.close()
        pids = slurm.job_pids(jobid)
        slurm.scancel(jobid)
        assert wait_gone(pids, 20) == []
