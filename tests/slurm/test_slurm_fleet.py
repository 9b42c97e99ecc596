"""``graphdist.SlurmFleet`` on a real Slurm cluster (tests/slurmbed.py): one server per node of
an allocation as a Slurm step, the same Fleet interface and lifecycle as the other backends
(issue 37, point 2). The owner runs on the bed's login host, outside the allocation."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import wait_gone
from tests.net.test_hosts import SPLIT_GRAPH
from tests.net.test_ray_hosts import _step

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

        slurm.scancel(jobid)
        driver.stdin.write("\n")
        driver.stdin.flush()
        cancelled = _step(driver, "cancelled")
        assert cancelled["error"] == "TaskFailedError" and cancelled["seconds"] < 15, cancelled
        closed = _step(driver, "closed")
        assert closed["state"] == "closed" and closed["seconds"] < 15, closed
        assert driver.wait(30) == 0
        assert wait_gone([back["pid"], up["pids"]["local-0"]], 20) == []
        left = slurm.run(None, ["squeue", "-h", "-s", "-o", "%i %j"]).stdout
        assert "graphdist-" not in left, left
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(30)
        slurm.scancel(jobid)
