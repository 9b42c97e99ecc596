"""The Slurm bed (tests/slurmbed.py) is what tests under Slurm stand on: a real slurmctld and
three slurmds, each node a host with its own name and address; jobs (srun, salloc, sbatch) run
on the nodes Slurm gives them, and scancel, requeue, the warning signal and a lost node behave
as Slurm promises, within bounds measured here. The bed leaves nothing behind, not even when its
creator died without closing it. And graphdist's own Slurm use, end to end: ``srun -N2 graphdist
serve --slurm worker=2`` serves on the two nodes, a client on a member node runs the split graph
(238), a host outside the job is refused, scancel stops every process of it."""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.conftest import QUIET_TF, is_gone, wait_gone
from tests.net import test_deploy_hosts as deploy
from tests.net import test_hosts as net_hosts
from tests.slurmbed import (
    CRED_EXPIRE_S,
    KILL_WAIT_S,
    SlurmBed,
    _folder_pids,
    require_slurmbed,
    sweep_stale,
)

pytestmark = [pytest.mark.promise]

GRAPHDIST = os.path.join(os.path.dirname(sys.executable), "graphdist")
READY_S = 90.0  # a server's TensorFlow import on a busy 2-core machine
# A killed node is "not responding" after MessageTimeout (5 s) of refused pings and a ping
# cycle (measured: 6-8 s), DOWN after a second cycle (measured: 8-16 s): the bounds leave room
# for a loaded machine.
NOT_RESPONDING_S = 25.0
DOWN_S = 45.0
# slurmctld tests time limits and warning signals every 30 s (PERIODIC_TIMEOUT).
SIGNAL_S = 45.0

# A task's view of where it runs: one JSON line.
WHERE = r"""
import json, os, socket
import psutil
print(json.dumps({
    "task": int(os.environ["SLURM_PROCID"]),
    "job": int(os.environ["SLURM_JOB_ID"]),
    "node": os.environ["SLURMD_NODENAME"],
    "hostname": socket.gethostname(),
    "resolved": socket.gethostbyname(socket.gethostname()),
    "addresses": sorted(
        a.address for addrs in psutil.net_if_addrs().values() for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ),
    "uid": os.getuid(),
}), flush=True)
"""


def _rows(stdout: str) -> list[dict[str, Any]]:
    return sorted(
        (json.loads(line) for line in stdout.splitlines() if line.startswith("{")),
        key=lambda row: row["task"],
    )


def _wait(what: str, check: Any, timeout_s: float, poll_s: float = 0.1) -> float:
    """Wait until ``check()`` is true; return how long it took, fail naming ``what`` after
    ``timeout_s``."""
    t = time.monotonic()
    while not check():
        assert time.monotonic() - t < timeout_s, f"no {what} after {timeout_s:g} s"
        time.sleep(poll_s)
    return time.monotonic() - t


@pytest.mark.timeout(60)
def test_every_node_is_idle_at_an_address_of_its_own(slurm: SlurmBed) -> None:
    assert slurm.node_states() == {n.name: "idle" for n in slurm.nodes}
    addresses = {slurm.controller.address}
    for node in slurm.nodes:
        shown = slurm.run(None, ["scontrol", "-o", "show", "node", node.name], check=True)
        assert f"NodeAddr={node.address} " in shown.stdout, shown.stdout
        assert "State=IDLE " in shown.stdout, shown.stdout
        addresses.add(node.address)
    assert len(addresses) == 4
    # the controller (the login host) is in no partition
    partition = slurm.run(None, ["scontrol", "-o", "show", "partition"], check=True).stdout
    assert slurm.controller.name not in partition


@pytest.mark.timeout(60)
def test_srun_runs_a_task_on_each_of_three_hosts(slurm: SlurmBed) -> None:
    """``srun -N3``: three tasks, on three hosts, each with its node's name as hostname and
    address, the name resolving to it, run as root."""
    rows = _rows(slurm.srun([sys.executable, "-c", WHERE], "-N3").stdout)
    assert [row["task"] for row in rows] == [0, 1, 2], rows
    assert sorted(row["node"] for row in rows) == [n.name for n in slurm.nodes]
    for row in rows:
        node = slurm.node(row["node"])
        assert row["hostname"] == node.name
        assert row["addresses"] == [node.address]
        assert row["resolved"] == node.address
        assert row["uid"] == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("slurm", ["site"], indirect=True)
def test_the_site_shape_breaks_the_name_assumptions(slurm: SlurmBed) -> None:
    """The bed's second shape, as sites run Slurm: each node's Slurm name is no host name (it
    resolves on no host), and every node's host name is one, this machine's own, so that
    nothing can find a node by its host name."""
    rows = _rows(slurm.srun([sys.executable, "-c", WHERE], "-N3").stdout)
    assert sorted(row["node"] for row in rows) == [n.name for n in slurm.nodes]
    assert {row["hostname"] for row in rows} == {socket.gethostname()}, rows
    assert sorted(a for row in rows for a in row["addresses"]) == sorted(
        n.address for n in slurm.nodes
    )
    for where in (None, slurm.nodes[0]):
        for node in slurm.nodes:
            looked = slurm.run(where, ["getent", "hosts", node.name])
            assert looked.returncode != 0, (where, node, looked.stdout)


@pytest.mark.timeout(60)
def test_an_allocation_runs_steps(slurm: SlurmBed) -> None:
    """``salloc --no-shell -N2``: a job of two nodes, running; ``srun --jobid`` runs a step on
    both; scancel ends it."""
    jobid = slurm.salloc(2)
    try:
        job = slurm.job(jobid)
        assert job["JobState"] == "RUNNING", job
        rows = _rows(slurm.srun([sys.executable, "-c", WHERE], jobid=jobid).stdout)
        assert [row["job"] for row in rows] == [jobid, jobid]
        allocated = slurm.run(
            None, ["scontrol", "show", "hostnames", job["NodeList"]], check=True
        ).stdout.split()
        assert sorted(row["node"] for row in rows) == sorted(allocated)
        assert len(set(allocated)) == 2
    finally:
        slurm.scancel(jobid)
    assert slurm.wait_job(jobid, "CANCELLED") == "CANCELLED"


@pytest.mark.timeout(60)
def test_a_batch_script_runs_to_completion(slurm: SlurmBed) -> None:
    jobid = slurm.sbatch(
        '#!/bin/bash\necho "batch on $(hostname) job $SLURM_JOB_ID"\nsrun hostname\n', "-N2"
    )
    assert slurm.wait_job(jobid, ("COMPLETED", "FAILED"), 30) == "COMPLETED", slurm.output(jobid)
    job = slurm.job(jobid)
    assert job["ExitCode"] == "0:0"
    out = slurm.output(jobid).split("\n")
    assert f"batch on {job['BatchHost']} job {jobid}" in out, out
    nodes = slurm.run(None, ["scontrol", "show", "hostnames", job["NodeList"]], check=True)
    assert sorted(line for line in out if line.startswith("gdn-")) == nodes.stdout.split()


@pytest.mark.timeout(60)
def test_scancel_stops_every_process_of_a_job(slurm: SlurmBed) -> None:
    """A batch job with a step on two nodes and a background process of its script: scancel
    ends all of them (each pid gone), the slurmstepds too, and the job is CANCELLED."""
    jobid = slurm.sbatch("#!/bin/bash\nsrun sleep 600 &\nsleep 600 &\nwait\n", "-N2")
    sleeps: list[int] = []

    def three_sleeps() -> bool:
        sleeps[:] = [
            pid
            for pid in slurm.job_pids(jobid)
            if "sleep 600" in " ".join(_cmdline(pid)) and "srun" not in _cmdline(pid)[0]
        ]
        return len(sleeps) == 3

    _wait("three sleeps", three_sleeps, 30)
    pids = slurm.job_pids(jobid)
    assert any(_cmdline(p)[0].startswith("slurmstepd") for p in pids), pids
    t = time.monotonic()
    slurm.scancel(jobid)
    assert wait_gone(pids, KILL_WAIT_S + 20) == [], [(p, _cmdline(p)) for p in pids]
    gone_s = time.monotonic() - t
    assert slurm.wait_job(jobid, "CANCELLED") == "CANCELLED"
    assert slurm.job_pids(jobid) == []
    print(f"scancel: {len(pids)} processes gone in {gone_s:.2f} s")


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")[:-1] or [""]
    except OSError:
        return [""]


@pytest.mark.timeout(90)
def test_a_requeued_job_starts_again(slurm: SlurmBed) -> None:
    """``scontrol requeue`` of a ``--requeue`` batch job kills its processes and runs it again,
    SLURM_RESTART_COUNT 1, once its credential expired (cred_expire, 5 s) and the scheduler
    ran."""
    jobid = slurm.sbatch(
        '#!/bin/bash\necho "start ${SLURM_RESTART_COUNT:-0}"\nexec sleep 600\n',
        "--requeue",
        "--open-mode=append",
    )
    _wait("first start", lambda: "start 0" in slurm.output(jobid), 30)
    pids = slurm.job_pids(jobid)
    t = time.monotonic()
    slurm.requeue(jobid)
    assert wait_gone(pids, KILL_WAIT_S + 20) == []
    _wait("second start", lambda: "start 1" in slurm.output(jobid), 60)
    again_s = time.monotonic() - t
    try:
        job = slurm.job(jobid)
        assert job["Restarts"] == "1", job
        assert job["JobState"] == "RUNNING", job
        assert again_s >= CRED_EXPIRE_S, again_s
    finally:
        slurm.scancel(jobid)
    slurm.wait_job(jobid, "CANCELLED")
    print(f"requeue: running again after {again_s:.1f} s")


@pytest.mark.timeout(120)
def test_the_warning_signal_reaches_the_batch_script(slurm: SlurmBed) -> None:
    """``--signal=B:USR1@60`` with a one-minute limit: due at once; slurmctld looks every 30 s,
    so USR1 reaches the batch script (which exits 0 on it) within about 30 s."""
    jobid = slurm.sbatch(
        "#!/bin/bash\n"
        "trap 'echo \"USR1 after $SECONDS s\"; exit 0' USR1\n"
        'echo "started"\n'
        "while true; do sleep 0.1; done\n",
        "--time=1",
        "--signal=B:USR1@60",
    )
    state = slurm.wait_job(jobid, ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED"), SIGNAL_S)
    out = slurm.output(jobid)
    assert state == "COMPLETED", out
    m = re.search(r"USR1 after (\d+) s", out)
    assert m, out
    print(f"warning signal: after {m.group(1)} s")


@pytest.mark.timeout(120)
def test_a_killed_node_is_noticed_and_its_job_requeued(slurm: SlurmBed) -> None:
    """The node of a ``--requeue`` job is lost (its slurmd and every process on it killed):
    Slurm marks it not responding, then DOWN, within the bounds, and requeues the job; once its
    slurmd starts again the node is idle (ReturnToService=2) and the job runs there again."""
    node = slurm[2]
    jobid = slurm.sbatch(
        '#!/bin/bash\necho "start ${SLURM_RESTART_COUNT:-0} on $(hostname)"\nexec sleep 600\n',
        "--requeue",
        "--open-mode=append",
        f"--nodelist={node.name}",
    )
    restarted = False
    try:
        _wait("first start", lambda: f"start 0 on {node.name}" in slurm.output(jobid), 30)
        killed = slurm.kill_node(node)
        t = time.monotonic()
        assert slurm.daemon_pids[f"slurmd-{node.name}"] in killed
        assert node.pids() == []

        def state() -> str:
            return slurm.node_states()[node.name]

        not_responding_s = _wait("not responding", lambda: state().endswith("*"), NOT_RESPONDING_S)
        down_s = not_responding_s + _wait("DOWN", lambda: state().startswith("down"), DOWN_S)
        others = slurm.node_states()  # the other nodes stay in service
        assert not [n for n in slurm.nodes[:2] if others[n.name][-1:] == "*"], others
        assert not [n for n in slurm.nodes[:2] if others[n.name].startswith("down")], others
        assert slurm.wait_job(jobid, "PENDING", 30) == "PENDING"
        assert slurm.job(jobid)["Restarts"] == "1"
        t_restart = time.monotonic()
        slurm.restart_node(node)
        restarted = True
        back_s = time.monotonic() - t_restart
        _wait("second start", lambda: f"start 1 on {node.name}" in slurm.output(jobid), 60)
        print(
            f"lost node: not responding after {not_responding_s:.1f} s, DOWN after "
            f"{down_s:.1f} s; idle {back_s:.2f} s after its slurmd started "
            f"again; {time.monotonic() - t:.1f} s in all"
        )
    finally:
        if not restarted and is_gone(slurm.daemon_pids[f"slurmd-{node.name}"]):
            slurm.restart_node(node)
        slurm.scancel(jobid)
    slurm.wait_job(jobid, "CANCELLED")
    slurm.wait_nodes("idle")


@pytest.mark.timeout(240)
def test_graphdist_serve_as_a_slurm_step(slurm: SlurmBed, tmp_path: Any) -> None:
    """The user's command, as servers/slurm.sbatch has it: ``srun -N2 graphdist serve --slurm
    worker=2 --port-base PORT`` on two nodes. Each server is ready at its node's name and
    listens on its node's address only; a client on a member node runs the split graph across
    both (238); a client on the third node, outside the job, is refused and the servers log its
    address; scancel stops every process of the job."""
    port = random.randint(20000, 40000)  # each host has ports of its own
    members, outside = slurm.nodes[:2], slurm.nodes[2]
    name = f"gdserve-{port}"
    log_path = str(tmp_path / "srun.log")
    with open(log_path, "wb") as log:
        srun = slurm.srun_popen(
            [GRAPHDIST, "serve", "--slurm", "worker=2", "--port-base", str(port)],
            "-N2",
            f"--nodelist={','.join(m.name for m in members)}",
            f"--job-name={name}",
            "--label",
            env=QUIET_TF,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def text() -> str:
        with open(log_path, errors="replace") as f:
            return f.read()

    def ready(task: int) -> str:
        return next(
            (ln for ln in text().splitlines() if ln.startswith(f"{task}: ") and "ready at" in ln),
            "",
        )

    jobid = None
    try:
        t = time.monotonic()
        while not (ready(0) and ready(1)):
            assert srun.poll() is None, f"srun exited {srun.returncode}: {text()[-3000:]}"
            assert time.monotonic() - t < READY_S, text()[-3000:]
            time.sleep(0.2)
        ready_s = time.monotonic() - t
        (jobid,) = slurm.job_ids(name)
        servers = []
        for i, node in enumerate(members):
            line = ready(i)
            assert f"/job:worker/task:{i} ready at grpc://{node.name}:{port}" in line, line
            assert f"listening on {node.address}," in line, line
            assert deploy._listeners(node, port) == [f"{node.address}:{port}"]
            m = re.search(r"pid (\d+)\)", line)
            assert m, line
            assert int(m.group(1)) in node.pids(), (line, node)
            servers.append(int(m.group(1)))
        cluster_file = str(tmp_path / "cluster.json")
        with open(cluster_file, "w") as f:
            json.dump({"worker": [f"{m.name}:{port}" for m in members]}, f)
        t = time.monotonic()
        with ThreadPoolExecutor(2) as pool:  # two TensorFlow imports at once
            member = pool.submit(deploy._client, members[0], cluster_file, "worker")
            other = pool.submit(net_hosts._client, outside, cluster_file)
            assert member.result() == 238
            (refused,) = other.result()
        clients_s = time.monotonic() - t
        assert refused["error"] == "FleetStartError", refused
        assert "(not a member)" in refused["text"] and refused["seconds"] < 4.0, refused
        for i in range(2):
            assert any(
                ln.startswith(f"{i}: ") and f"refused a connection from {outside.address}" in ln
                for ln in text().splitlines()
            ), text()[-3000:]
        pids = slurm.job_pids(jobid)
        assert set(servers) <= set(pids), (servers, pids)
        t = time.monotonic()
        slurm.scancel(jobid)
        jobid_done = jobid
        jobid = None
        assert wait_gone(pids, KILL_WAIT_S + 20) == [], [(p, _cmdline(p)) for p in pids]
        gone_s = time.monotonic() - t
        srun.wait(30)
        assert slurm.wait_job(jobid_done, "CANCELLED") == "CANCELLED"
        assert slurm.job_pids(jobid_done) == []
    finally:
        if jobid is not None:
            slurm.scancel(jobid)
        if srun.poll() is None:
            srun.kill()
            srun.wait(10)
    print(
        f"graphdist serve under srun: ready {ready_s:.1f} s, clients {clients_s:.1f} s, "
        f"scancel to gone {gone_s:.2f} s"
    )


def _only_job(bed: SlurmBed) -> int:
    ids = bed.job_ids()
    return ids[0] if len(ids) == 1 else 0


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout


def _assert_nothing_left(bed: SlurmBed, pids: list[int]) -> None:
    assert [p for p in pids if not is_gone(p)] == []
    netns = _ip("netns", "list")
    assert not [ns for ns in bed.hosts.namespaces if ns in netns], netns
    assert bed.key not in _ip("-o", "link")
    assert not os.path.exists(bed.folder)
    assert _folder_pids(bed.folder) == []


@pytest.mark.timeout(60)
def test_closing_leaves_nothing() -> None:
    """A bed with a job step running: close() kills every daemon and job process (each pid
    gone), deletes the namespaces and links, removes the folder, and never touched /etc/hosts
    or /etc/netns."""
    require_slurmbed()
    with open("/etc/hosts", "rb") as f:
        etc_hosts = f.read()
    netns_etc = sorted(os.listdir("/etc/netns")) if os.path.isdir("/etc/netns") else None
    bed = SlurmBed(2)
    try:
        step = bed.srun_popen(["sleep", "600"], "-N2", stdout=subprocess.DEVNULL)
        _wait("the step", lambda: len(bed.job_pids(_only_job(bed))) == 4, 30)  # 2 stepd, 2 sleep
        pids = [*bed.daemon_pids.values(), step.pid]
        for node in (bed.controller, *bed.nodes):
            pids += node.pids()
        assert len(set(pids)) >= 9, pids  # munged, slurmctld, 2 slurmd, srun, 2 stepd, 2 sleep
    finally:
        bed.close()
    _assert_nothing_left(bed, pids)
    with open("/etc/hosts", "rb") as f:
        assert f.read() == etc_hosts
    assert (sorted(os.listdir("/etc/netns")) if os.path.isdir("/etc/netns") else None) == netns_etc
    bed.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        bed.run(None, ["true"])
    print(f"bed of 2 nodes: made in {bed.start_s:.2f} s, closed in {bed.close_s:.2f} s")


@pytest.mark.timeout(60)
def test_the_bed_of_a_dead_run_is_swept() -> None:
    """A bed whose creator dies with a job running: the next sweep (any bed made does one)
    kills its daemons and job, deletes its hosts and removes its folder."""
    require_slurmbed()
    owner = subprocess.Popen(["sleep", "600"])
    try:
        stale = SlurmBed(1, owner_pid=owner.pid)
        jobid = stale.sbatch("#!/bin/sh\nexec sleep 600\n")
        stale.wait_job(jobid, "RUNNING")
        _wait("the job's process", lambda: stale.job_pids(jobid), 30)
        pids = [*stale.daemon_pids.values(), *stale.job_pids(jobid)]
    finally:
        owner.kill()
        owner.wait()
    assert os.path.basename(stale.folder).startswith(f"gdslurm-{owner.pid}-")
    swept = sweep_stale()  # (or by a bed another test process makes meanwhile)
    assert not os.path.exists(stale.folder), swept
    _assert_nothing_left(stale, pids)
    stale.close()  # nothing left to close, nothing left over


@pytest.mark.timeout(60)
def test_two_beds_at_once_stay_apart() -> None:
    """Two beds made at once (as by two xdist workers): names, hosts, folders and clusters of
    their own; each one's srun runs on its own node only."""
    require_slurmbed()
    with ThreadPoolExecutor(2) as pool:
        beds = list(pool.map(lambda _: SlurmBed(1), range(2)))
    try:
        a, b = beds
        assert a.key != b.key and a.folder != b.folder
        assert a[0].name != b[0].name and a[0].address != b[0].address
        for bed in beds:
            assert bed.node_states() == {bed[0].name: "idle"}
            (row,) = _rows(bed.srun([sys.executable, "-c", WHERE], "-N1").stdout)
            assert (row["node"], row["addresses"]) == (bed[0].name, [bed[0].address])
    finally:
        for bed in beds:
            bed.close()
