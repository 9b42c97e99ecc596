"""``graphdist run --backend slurm`` on a real Slurm cluster (tests/slurmbed.py): the tasks are
job steps on the allocation's nodes, restarted inside the same allocation (issue 37, point 3).

The launcher runs on the bed's login host (the controller, outside every partition) with
``--jobid`` of an allocation made by ``salloc --no-shell``, or inside an ``sbatch`` script."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest

from tests.conftest import is_gone, on_loopback, received_of, signals_by_default, wait_gone
from tests.net.test_ray_hosts import _cmdline, _weights
from tests.slurm.conftest import SHAPES

pytestmark = [pytest.mark.promise]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(REPO, "examples")
EPOCHS = 3
QUIET_TF = {"TF_CPP_MIN_LOG_LEVEL": "2"}
PRINT_CONFIG = (
    "import json, os; c = json.loads(os.environ['TF_CONFIG']); "
    "print(json.dumps({'node': os.environ['SLURMD_NODENAME'], 'task': c['task'], "
    "'cluster': c['cluster'], "
    "'restart': os.environ['GRAPHDIST_RESTART']}))"
)


def _graphdist(slurm: Any, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return slurm.run(
        None, [sys.executable, "-m", "graphdist", *args], timeout=timeout, env=QUIET_TF
    )


def _run_jsonl(
    slurm: Any, args: list[str], on_event: Callable[[dict[str, Any]], None], timeout: float = 300
) -> tuple[int, list[dict[str, Any]], list[str]]:
    """``graphdist run --backend slurm --output-format jsonl ARGS`` on the login host, each event
    handed to ``on_event`` as it comes: its exit status, the events and every line."""
    argv = [sys.executable, "-m", "graphdist", "run", "--backend", "slurm"]
    driver = slurm.popen(
        None,
        [*argv, "--output-format", "jsonl", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=QUIET_TF,
    )
    assert driver.stdout is not None
    events: list[dict[str, Any]] = []
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        for raw in driver.stdout:
            lines.append(raw)
            if raw.startswith("{"):
                events.append(json.loads(raw))
                on_event(events[-1])
            assert time.monotonic() < deadline, "".join(lines[-60:])
        code = driver.wait(60)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(30)
    return code, events, lines


def _steps(slurm: Any, jobid: int, *, nodes: bool = False) -> list[str]:
    """The graphdist steps of ``jobid`` in Slurm's queue (``nodes``: with their node list)."""
    form = "%i %j %N" if nodes else "%i %j"
    out = slurm.run(None, ["squeue", "-h", "-s", "-j", str(jobid), "-o", form]).stdout
    return [line for line in out.splitlines() if "graphdist-" in line]


@pytest.fixture
def alloc(slurm: Any) -> Any:
    """A 2-node allocation, cancelled after the test (and its processes checked gone)."""
    jobid = slurm.salloc(2)
    yield jobid
    pids = slurm.job_pids(jobid)
    slurm.scancel(jobid)
    assert wait_gone(pids, 20) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("slurm", SHAPES, indirect=True)
def test_each_task_runs_on_its_own_node_with_the_allocations_addresses(slurm, alloc):
    result = _graphdist(
        slurm, "run", "--backend", "slurm", "--jobid", str(alloc), "--workers", "2", "--",
        sys.executable, "-c", PRINT_CONFIG,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(ln.split("] ", 1)[1]) for ln in result.stdout.splitlines() if "] {" in ln]
    assert sorted(r["task"]["index"] for r in rows) == [0, 1]
    nodes = {r["task"]["index"]: r["node"] for r in rows}
    job = slurm.job(alloc)
    assert sorted(nodes.values()) == sorted(slurm.node(n).name for n in _expand(slurm, job))
    addresses = rows[0]["cluster"]["worker"]
    for i, address in enumerate(addresses):
        assert address.startswith(slurm.node(nodes[i]).address + ":"), (address, nodes)
    assert "graphdist: the run succeeded: 2 task(s) exited 0" in result.stdout
    assert _steps(slurm, alloc) == []  # every step of the run is gone


# Each task imports a preload (so that its node's warm agent step serves it), says so, waits.
WAITING_TASK = "import numpy, time; print('up', flush=True); time.sleep(300)"


@contextlib.contextmanager
def _waiting_run(slurm: Any, jobid: int) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    """``graphdist run`` of :data:`WAITING_TASK` on two workers of job ``jobid``, from the login
    host, once both tasks said they are up: its process and its lines so far; killed at the end
    if it still runs."""
    driver = slurm.popen(
        None,
        [sys.executable, "-m", "graphdist", "run", "--backend", "slurm", "--jobid", str(jobid),
         "--workers", "2", "--output-format", "jsonl", "--", sys.executable, "-c", WAITING_TASK],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=QUIET_TF,
        preexec_fn=signals_by_default,  # the test sends it SIGHUP
    )  # fmt: skip
    assert driver.stdout is not None
    lines: list[str] = []
    try:
        while sum('"text": "up"' in line for line in lines) < 2:
            line = driver.stdout.readline()
            assert line, "".join(lines[-60:])
            lines.append(line)
        yield driver, lines
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(30)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("slurm", ["site"], indirect=True)
def test_a_run_whose_launcher_gets_sighup_leaves_no_step_in_the_allocation(slurm, alloc):
    """The login-node flow with the ssh session dropped: SIGHUP to ``graphdist run --jobid``
    ends it by that signal, and first cancels what it started in the allocation: its tasks'
    steps and its nodes' warm agent steps (before, the agents' steps, sruns of their own
    session, ran on until scancel). SIGTERM takes the same path."""
    with _waiting_run(slurm, alloc) as (driver, lines):
        assert _steps(slurm, alloc), "no step runs: nothing to leave"
        driver.send_signal(signal.SIGHUP)
        code = driver.wait(60)
    assert code == -signal.SIGHUP, (code, "".join(lines[-40:]))
    deadline = time.monotonic() + 20
    while _steps(slurm, alloc) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _steps(slurm, alloc) == [], _steps(slurm, alloc, nodes=True)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("slurm", ["site"], indirect=True)
def test_scancel_of_a_runs_job_leaves_no_process_on_any_node_warm_forked_tasks_included(slurm):
    """On a cgroup-tracked Slurm (the site shape), a run's tasks forked by their nodes' warm
    agents are in the job's cgroups (so ``scancel`` reaches them, not only their agents'
    steps); ``scancel`` of the job ends every process of it on every node and the run ends."""
    jobid = slurm.salloc(2)
    try:
        with _waiting_run(slurm, jobid) as (driver, lines):
            started = [json.loads(ln) for ln in lines if '"event": "task-started"' in ln]
            assert len(started) == 2 and all(e["warm"] for e in started), started
            command = f"{sys.executable} -c {WAITING_TASK}"
            tasks = [p for n in slurm.nodes for p in n.pids() if " ".join(_cmdline(p)) == command]
            assert len(tasks) == 2, lines[-20:]
            in_cgroups = slurm.cgroup_pids(jobid)
            assert set(tasks) <= set(in_cgroups), (tasks, in_cgroups)
            pids = slurm.job_pids(jobid)
            slurm.scancel(jobid)
            assert wait_gone(pids, 20) == []
            assert slurm.cgroup_pids(jobid) == []
            assert driver.wait(60) != 0, "".join(lines[-40:])
    finally:
        slurm.scancel(jobid)


def _is_command(pid: int, script: str) -> bool:
    """Whether ``pid`` is the task's command ``python SCRIPT ...``: a cold one's argv, or a warm
    one's (forked from its node's warm interpreter, its command line set to the command's)."""
    return " ".join(_cmdline(pid)).startswith(f"{sys.executable} {script} ")


def _expand(slurm: Any, job: dict[str, str]) -> list[str]:
    out = slurm.run(None, ["scontrol", "show", "hostnames", job["NodeList"]], check=True)
    return out.stdout.split()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("slurm", ["site"], indirect=True)
def test_a_run_inside_an_sbatch_script_finds_its_allocation(slurm):
    """No --jobid: SLURM_JOB_ID, set by sbatch, names the allocation; the batch script runs on
    the allocation's first node, the launcher there."""
    script = (
        "#!/bin/bash\n"
        f"export TF_CPP_MIN_LOG_LEVEL=2\n"
        f"{sys.executable} -m graphdist run --backend slurm --workers 2 -- "
        f'{sys.executable} -c "{PRINT_CONFIG}"\n'
    )
    jobid = slurm.sbatch(script, "-N", "2")
    state = slurm.wait_job(jobid, ("COMPLETED", "FAILED", "CANCELLED"), timeout_s=90)
    out = slurm.output(jobid)
    assert state == "COMPLETED", out[-3000:]
    rows = [json.loads(ln.split("] ", 1)[1]) for ln in out.splitlines() if "] {" in ln]
    assert len({r["node"] for r in rows}) == 2, out[-3000:]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "words"),
    [
        ([], "runs inside a Slurm allocation, and SLURM_JOB_ID is not set"),
        (["--jobid", "999999"], "Slurm's `scontrol show job --oneliner 999999` failed"),
        (["--jobid", "x1"], "--jobid must be a Slurm job's number"),
        (["--workers", "3", "--jobid", "ALLOC"], "The run needs 3 task(s) and Slurm job"),
        (["--ntasks-per-node", "0", "--jobid", "ALLOC"], "--ntasks-per-node must be"),
    ],
)
@pytest.mark.parametrize("slurm", ["site"], indirect=True)
def test_bad_slurm_runs_are_one_line_and_exit_2_with_nothing_started(slurm, alloc, args, words):
    args = [str(alloc) if a == "ALLOC" else a for a in args]
    result = _graphdist(slurm, "run", "--backend", "slurm", *args, "--", "true", timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    errors = result.stderr.strip().splitlines()
    assert len(errors) == 1 and words in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert _steps(slurm, alloc) == []
    if "needs 3" in words:  # names the allocation's nodes
        assert all(n in errors[0] for n in _expand(slurm, slurm.job(alloc))), errors[0]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("slurm", ["site"], indirect=True)
def test_a_worker_killed_on_its_node_restarts_in_the_allocation_with_the_same_weights(
    slurm, alloc, tmp_path
):
    """The seeds' MWMS script, one worker per node, each task forked warm from its node's warm
    interpreter. The command of worker-1 SIGKILLed on its node after epoch 2: the group
    restarts inside the same allocation, resumes from the chief's backup, and its final
    weights equal an uninterrupted local (cold) run's, bit for bit."""
    script = os.path.join(EXAMPLES, "seed_mwms_training.py")
    train = [sys.executable, script, "--epochs", str(EPOCHS), "--out"]
    out = str(slurm.jobs_dir)
    whole = subprocess.run(
        [sys.executable, "-m", "graphdist", "run", "--workers", "2", "--preload", "none", "--",
         *train, os.path.join(out, "whole")],
        env={**os.environ, **QUIET_TF},
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    killed: list[int] = []
    node_of: dict[str, str] = {}

    def kill_after_epoch_2(event: dict[str, Any]) -> None:
        if event.get("event") == "attempt-started" and not node_of:
            node_of.update(event["nodes"])
        text = event.get("text", "") if event.get("event") == "line" else ""
        if not killed and event.get("task") == "worker-1" and text.startswith(f"epoch 2/{EPOCHS}"):
            node = slurm.node(node_of["worker-1"])
            killed.extend(p for p in node.pids() if _is_command(p, script))
            os.kill(killed[0], signal.SIGKILL)

    args = ["--jobid", str(alloc), "--workers", "2", "--max-restarts", "1", "--log-dir", out]
    code, events, lines = _run_jsonl(
        slurm, [*args, "--", *train, os.path.join(out, "killed")], kill_after_epoch_2
    )
    assert code == 0 and len(killed) == 1, "".join(lines[-60:])
    started = [e for e in events if e.get("event") == "attempt-started"]
    assert len(started) == 2 and all(e["backend"] == "slurm" for e in started), started
    assert all(len(set(e["nodes"].values())) == 2 for e in started), started
    restarting = [e for e in events if e.get("event") == "restarting"]
    assert len(restarting) == 1 and restarting[0]["cause"]["task"] == "worker-1", restarting
    assert "SIGKILL" in restarting[0]["cause"]["how"], restarting
    tasks = [e for e in events if e.get("event") == "task-started"]  # forked on their nodes
    assert len(tasks) == 4 and all(e["warm"] for e in tasks), tasks
    assert any(e.get("event") == "resumed" for e in events), "".join(lines[-60:])
    a = _weights(os.path.join(out, "whole", "weights-worker-0.npz"))
    b = _weights(os.path.join(out, "killed", "weights-worker-0.npz"))
    assert len(a) == 4 and all((x == y).all() for x, y in zip(a, b, strict=True))
    assert _steps(slurm, alloc) == []
    assert all(is_gone(p) for p in killed)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("slurm", ["site"], indirect=True)
def test_a_tls_run_trains_behind_the_nodes_gateways_and_restarts_with_fresh_credentials(
    slurm, alloc, tmp_path
):
    """``run --backend slurm --tls``: each task's step gets its node's credentials on srun's
    stdin, starts its gateway and keeps none on disk; every TF_CONFIG names the nodes' loopback
    aliases; while the workers train, only a gateway listens on the node's address at the
    tasks' ports. Worker-1 killed on its node: the run restarts (new ports, new credentials),
    resumes and succeeds, and no step, gateway or credential of either attempt is left."""
    from graphdist._net.gateway import alias

    script = os.path.join(EXAMPLES, "seed_mwms_training.py")
    train = [
        sys.executable,
        script,
        "--epochs",
        str(EPOCHS),
        "--out",
        os.path.join(slurm.jobs_dir, "tls"),
    ]
    seen: dict[str, Any] = {"clusters": []}
    killed: list[int] = []

    def look(event: dict[str, Any]) -> None:
        if event.get("event") == "attempt-started":
            seen["clusters"].append(event["cluster"])
            seen["nodes"] = event["nodes"]
        text = event.get("text", "") if event.get("event") == "line" else ""
        if not killed and event.get("task") == "worker-1" and text.startswith(f"epoch 1/{EPOCHS}"):
            node = slurm.node(seen["nodes"]["worker-1"])
            seen["listening"] = node.run(["ss", "-Hltn"]).stdout.splitlines()
            # the received credentials, by their writers' pids (the node's: one file system
            # here, where other tests' TLS runs write folders of the same name)
            seen["received"] = received_of(node.pids())
            killed.extend(p for p in node.pids() if _is_command(p, script))
            guard = psutil.Process(killed[0]).parent()
            session = guard.parent() if guard else None
            seen["forked_by"] = _cmdline(session.pid if session else 0)
            seen["agent"] = _cmdline(session.ppid() if session else 0)
            os.kill(killed[0], signal.SIGKILL)

    args = ["--jobid", str(alloc), "--tls", "--workers", "2", "--max-restarts", "1"]
    code, events, lines = _run_jsonl(slurm, [*args, "--", *train], look)
    assert code == 0 and len(killed) == 1, "".join(lines[-60:])
    # every task of both attempts forked from its node's warm agent, behind its gateway
    started = [e for e in events if e.get("event") == "task-started"]
    assert len(started) == 4 and all(e["warm"] for e in started), started
    # the guard's parent a session of the node's agent (the one warm agent, on a node)
    assert " ".join(seen["forked_by"]) == "graphdist-warm-session", seen["forked_by"]
    assert "node_agent_main" in " ".join(seen["agent"]), seen["agent"]
    first, second = seen["clusters"]
    node = slurm.node(seen["nodes"]["worker-1"])
    assert {a.rsplit(":", 1)[0] for a in first["worker"]} == {
        alias(slurm.node(n).address) for n in seen["nodes"].values()
    }, first
    assert first != second, (first, second)  # a new attempt: new ports
    ports = {a.rsplit(":", 1)[1] for a in first["worker"]}
    outside = [
        row.split()[3]
        for row in seen["listening"]
        if row.split()[3].rsplit(":", 1)[1] in ports and not on_loopback(row.split()[3])
    ]
    assert len(outside) == 1 and outside[0].startswith(node.address + ":"), seen["listening"]
    assert seen["received"] == [], seen["received"]
    assert any(e.get("event") == "resumed" for e in events), "".join(lines[-60:])
    # each worker's steps came back from its node, with its wait in the step's collectives
    waits = {(e["attempt"], e["task"]): e["wait_s"] for e in events if e.get("event") == "progress"}
    assert {task for _, task in waits} == {"worker-0", "worker-1"}, waits
    assert {attempt for attempt, _ in waits} == {1, 2} and None not in waits.values(), waits
    assert _steps(slurm, alloc) == []
    assert all(is_gone(p) for p in killed)
    gateways = [p for n in slurm.nodes for p in n.pids() if "graphdist._net.gateway" in _cmdline(p)]
    assert wait_gone(gateways, 5) == [], gateways  # they end with their tasks' steps


@pytest.mark.timeout(300)
@pytest.mark.parametrize("slurm", ["site"], indirect=True)
def test_a_frozen_worker_is_found_from_the_login_host_and_its_step_cancelled(slurm, alloc):
    """The launcher on the login host, outside the allocation: a worker SIGSTOPped on its node is
    found by the heartbeat's probes (its node's server stops answering) within the timeout and a
    few probes, its step is cancelled (SIGKILL reaches a stopped process), and the run restarts."""
    code = (
        "import os, time, tensorflow as tf, json\n"
        "c = json.loads(os.environ['TF_CONFIG'])\n"
        "t = c['task']\n"
        "s = tf.distribute.Server(tf.train.ClusterSpec(c['cluster']), t['type'], t['index'])\n"
        "print('serving', os.getpid(), flush=True)\n"
        "if os.environ['GRAPHDIST_RESTART'] == '0': time.sleep(120)\n"
    )
    stopped: list[tuple[int, float]] = []
    noticed: list[float] = []
    serving: dict[str, int] = {}
    node_of: dict[str, str] = {}

    def freeze_worker_1(event: dict[str, Any]) -> None:
        if event.get("event") == "attempt-started" and not node_of:
            node_of.update(event["nodes"])
        text = event.get("text", "") if event.get("event") == "line" else ""
        if event.get("attempt") == 1 and text.startswith("serving "):
            serving[event["task"]] = int(text.split()[1])
        if not stopped and len(serving) == 2:
            time.sleep(1.0)  # the heartbeat has had an answer from each
            os.kill(serving["worker-1"], signal.SIGSTOP)
            stopped.append((serving["worker-1"], time.monotonic()))
        if event.get("event") == "restarting" and not noticed:
            noticed.append(time.monotonic())

    args = ["--jobid", str(alloc), "--workers", "2", "--max-restarts", "1"]
    code_, events, lines = _run_jsonl(
        slurm, [*args, "--", sys.executable, "-c", code], freeze_worker_1
    )
    assert code_ == 0 and stopped, "".join(lines[-60:])
    restarting = [e for e in events if e.get("event") == "restarting"]
    assert len(restarting) == 1, "".join(lines[-60:])
    cause = restarting[0]["cause"]
    assert cause["task"] == "worker-1" and "frozen" in cause["how"], cause
    # the heartbeat's 3 s and its probes, not TensorFlow's own ~12 s (TF_FACTS)
    assert noticed[0] - stopped[0][1] < 8.0, noticed[0] - stopped[0][1]
    assert wait_gone([stopped[0][0]], 10) == []
    assert _steps(slurm, alloc) == []


UP_THEN_SLEEP = (
    "import os, time; print('up', flush=True); "
    "time.sleep(60 * (os.environ['GRAPHDIST_RESTART'] == '0'))"
)


def _run_losing_worker_1s_node(slurm: Any, nodes: int) -> tuple[int, list[Any], list[str], Any]:
    """A 2-worker run in an allocation of ``nodes`` nodes (``--no-kill``: a lost node does not
    end the job) whose worker-1's node is lost (its slurmd and every process killed) once it
    runs; the node is brought back after. The launcher exits within 5 s of its run's end: it
    does not wait for the steps Slurm still lists on the lost node (its wait for steps to end
    is 10 s; Slurm lists them until it calls the node down)."""
    jobid = slurm.salloc(nodes, "--no-kill")
    lost: list[Any] = []
    node_of: dict[str, str] = {}
    ended: list[float] = []

    def lose_worker_1s_node(event: dict[str, Any]) -> None:
        if event.get("event") == "run-ended":
            ended.append(time.monotonic())
        if event.get("event") == "attempt-started" and not node_of:
            node_of.update(event["nodes"])
        text = event.get("text", "") if event.get("event") == "line" else ""
        if not lost and event.get("task") == "worker-1" and text == "up":
            lost.append(slurm.node(node_of["worker-1"]))
            slurm.kill_node(lost[0])

    try:
        args = ["--jobid", str(jobid), "--workers", "2", "--max-restarts", "2"]
        code, events, lines = _run_jsonl(
            slurm, [*args, "--", sys.executable, "-c", UP_THEN_SLEEP], lose_worker_1s_node
        )
        assert lost, "".join(lines[-60:])
        assert len(ended) == 1 and time.monotonic() - ended[0] < 5.0, "".join(lines[-60:])
        # every step is gone but those on the lost node: Slurm ends them once it calls it down
        left = [s for s in _steps(slurm, jobid, nodes=True) if lost[0].name not in s]
        assert left == [], left
        return code, events, lines, lost[0]
    finally:
        for node in lost:
            slurm.restart_node(node)
        slurm.scancel(jobid)


# graphdist's cancel_steps(wait_s=0) on the login host, timed: prints its seconds
CANCEL_ONE = (
    "import sys, time\n"
    "from graphdist._proc.slurm import cancel_steps\n"
    "t = time.monotonic()\n"
    "cancel_steps(sys.argv[1], sys.argv[2], wait_s=0.0)\n"
    "print(time.monotonic() - t)\n"
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("slurm", ["site"], indirect=True)
def test_a_step_is_cancelled_at_once_while_another_node_of_its_job_does_not_answer(slurm):
    """While a node of the job does not answer and Slurm has not called it down yet, Slurm
    holds each ``scancel`` of the job's steps for its MessageTimeout (5 s on this bed; 6.0 s
    measured), steps on other nodes included, though they get the signal at once.
    ``cancel_steps(wait_s=0)``, the stop of one task of a broken attempt (a frozen task on a
    dead machine: one such wait per task before), returns at once, and the step ends."""
    jobid = slurm.salloc(2, "--no-kill")
    healthy, lost = (slurm.node(n) for n in _expand(slurm, slurm.job(jobid)))
    steps = []
    for i, node in enumerate((healthy, lost)):
        srun = ["srun", f"--jobid={jobid}", "--overlap", "-N1", "-w", node.name]
        srun += [f"--job-name=graphdist-t-{i}", "sleep", "300"]
        out = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        steps.append(slurm.popen(None, srun, **out))
    killed = False
    try:
        deadline = time.monotonic() + 30
        while len(_steps(slurm, jobid)) < 2:
            assert time.monotonic() < deadline, _steps(slurm, jobid, nodes=True)
            time.sleep(0.2)
        slurm.kill_node(lost)
        killed = True
        cancel = [sys.executable, "-c", CANCEL_ONE, str(jobid), "graphdist-t-0"]
        done = slurm.run(None, cancel, timeout=60, env=QUIET_TF)
        assert done.returncode == 0, done.stderr[-3000:]
        took = float(done.stdout.split()[-1])
        assert took < 2.0, f"cancel_steps took {took:.1f} s: it waited for scancel"
        assert steps[0].wait(30) != 0  # the healthy node's step got the signal
    finally:
        for proc in steps:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        slurm.scancel(jobid)  # first: a node back before Slurm calls it down stays the job's
        if killed:
            slurm.restart_node(lost)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("slurm", ["site"], indirect=True)
def test_a_lost_node_restarts_the_run_on_the_nodes_left(slurm):
    code, events, lines, lost = _run_losing_worker_1s_node(slurm, 3)
    assert code == 0, "".join(lines[-60:])
    started = [e for e in events if e.get("event") == "attempt-started"]
    assert len(started) == 2 and lost.name not in started[-1]["nodes"].values(), started


@pytest.mark.timeout(300)
@pytest.mark.parametrize("slurm", ["site"], indirect=True)
def test_a_lost_node_ends_the_run_in_one_line_when_the_nodes_left_are_too_few(slurm):
    """Two nodes for two tasks, one lost: the next attempt cannot be placed; the run ends at
    once with one line naming the lost node, and its summary (not a wait on Slurm)."""
    t0 = time.monotonic()
    code, events, lines, lost = _run_losing_worker_1s_node(slurm, 2)
    assert code == 1, "".join(lines[-60:])
    ended = [e for e in events if e.get("event") == "run-ended"]
    assert len(ended) == 1 and ended[0]["outcome"].startswith("failed"), ended
    errors = [ln for ln in lines if ln.startswith("Error:")]
    assert len(errors) == 1 and "cannot be placed" in errors[0] and lost.name in errors[0], lines
    assert time.monotonic() - t0 < 60


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tls", [False, True], ids=["members", "tls"])
@pytest.mark.parametrize("slurm", ["site"], indirect=True)
def test_a_ps_run_on_slurm_survives_a_worker_server_killed_on_its_node(slurm, tmp_path, tls):
    """``--chief --ps 1 --workers 2`` on 3 nodes, 2 tasks a node at most: the coordinator a
    step, the ps and worker servers ``graphdist serve`` steps (a SlurmFleet). A worker server
    killed on its node mid-training is restarted on its node and port, the coordinator carries
    on, and the run ends with the example's accuracy. With ``--tls`` the servers and the
    coordinator share the attempt's credentials (the servers at the nodes' aliases)."""
    jobid = slurm.salloc(3)
    killed: list[int] = []
    target: list[tuple[str, str]] = []
    agents: list[str] = []
    chief_node: list[str] = []

    def kill_a_worker_server(event: dict[str, Any]) -> None:
        if event.get("event") == "attempt-started" and not target:
            target.append((event["nodes"]["worker-1"], event["cluster"]["worker"][1]))
            chief_node.append(event["nodes"]["chief-0"])
        text = event.get("text", "") if event.get("event") == "line" else ""
        if not killed and target and text.startswith("step "):
            agents.extend(s for s in _steps(slurm, jobid, nodes=True) if "-warm-" in s)
            node, address = target[0]
            port = address.rsplit(":", 1)[1]
            out = slurm.node(node).run(["ss", "-Hltnp", f"sport = :{port}"])
            rows = [  # the server's (TLS mode: not the gateway's on the node's address)
                r
                for r in out.stdout.splitlines()
                if r.split()[3].replace("[::ffff:", "").replace("]", "") == address
            ]
            assert len(rows) == 1, (address, out.stdout)
            row = rows[0]
            killed.append(int(row.split("pid=")[1].split(",")[0]))
            os.kill(killed[0], signal.SIGKILL)

    try:
        args = ["--jobid", str(jobid), "--ntasks-per-node", "2", "--chief", "--ps", "1"]
        args += ["--workers", "2", "--max-restarts", "2", *(["--tls"] if tls else [])]
        args += ["--", sys.executable, os.path.join(EXAMPLES, "ps_training.py"), "--mode", "custom"]
        code, events, lines = _run_jsonl(slurm, args, kill_a_worker_server)
        assert code == 0 and len(killed) == 1, "".join(lines[-60:])
        # one warm agent: on the coordinator's node, none on the nodes of servers only
        assert len(agents) == 1 and agents[0].endswith(chief_node[0]), agents
        restarting = [e for e in events if e.get("event") == "restarting"]
        assert restarting and restarting[0]["scope"] == "server", restarting
        outcome = [
            e for e in events if e.get("event") == "line" and "accuracy" in e.get("text", "")
        ]
        assert outcome and float(outcome[-1]["text"].split()[-1]) > 0.5, "".join(lines[-40:])
        assert _steps(slurm, jobid) == []
    finally:
        slurm.scancel(jobid)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("slurm", ["site"], indirect=True)
def test_the_example_batch_script_trains_on_the_allocation(slurm):
    """examples/slurm_mwms.sbatch as a user submits it: the seeds' MWMS training on two nodes,
    one worker each, both workers' weights saved and the run's logs kept."""
    with open(os.path.join(EXAMPLES, "slurm_mwms.sbatch")) as f:
        script = f.read()
    out = os.path.join(slurm.jobs_dir, "example")
    script = script.replace("set -euo pipefail", f"set -euo pipefail\ncd {REPO}", 1)
    env = f"export OUT={out} PYTHON={sys.executable} EPOCHS=1\n"
    jobid = slurm.sbatch(script.replace("set -euo pipefail", env + "set -euo pipefail", 1))
    state = slurm.wait_job(jobid, ("COMPLETED", "FAILED", "CANCELLED"), timeout_s=240)
    text = slurm.output(jobid)
    assert state == "COMPLETED", text[-3000:]
    assert "graphdist: the run succeeded: 2 task(s) exited 0" in text, text[-3000:]
    assert sorted(f for f in os.listdir(out) if f.startswith("weights-")) == [
        "weights-worker-0.npz",
        "weights-worker-1.npz",
    ]
    assert os.path.exists(os.path.join(out, "logs", "run-1", "summary.txt"))


# Up, then over its memory limit at once: a task that runs out of memory at every start (cold:
# 1 GB; warm, numpy a preload: 2 GB, its node's warm step holding TensorFlow too).
HOG = (
    "import {} time; print('up', flush=True); time.sleep(0.3); "
    "b = [bytearray(10 << 20) for _ in range({})]"
)
#: Cold, its own step: srun's word. Warm, in the node's warm step: the node kernel's record.
OOM_CASES = {
    "cold": ("--mem=400M", HOG.format("", 100), ["--preload", "none"], "over its Slurm job's"),
    "warm": ("--mem=1500M", HOG.format("numpy,", 200), [], "the kernel's OOM killer; limit"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("slurm", ["site"], indirect=True)
@pytest.mark.parametrize("case", sorted(OOM_CASES))
def test_a_task_over_its_steps_memory_limit_is_named_out_of_memory_and_not_restarted_blindly(
    slurm, case
):
    """On a cgroup-tracked Slurm (the site shape), a task over its job's --mem is killed by the
    kernel: a cold one's srun then exits 1 and says so; a warm one (forked in its node's warm
    step) dies by SIGKILL, which its node's kernel log explains. graphdist reports either as
    out of memory (not `exited with code 1` or `killed by SIGKILL`), ranks it as a death, and,
    out of memory at its start twice, gives up on the run in one line instead of spending
    every restart; no step is left."""
    mem, hog, preload, words = OOM_CASES[case]
    jobid = slurm.salloc(1, mem)
    try:
        result = _graphdist(
            slurm, "run", "--backend", "slurm", "--jobid", str(jobid), "--workers", "1",
            "--max-restarts", "5", *preload, "--", sys.executable, "-c", hog,
        )  # fmt: skip
        out = result.stdout + result.stderr
        assert result.returncode != 0, out
        assert f"worker-0 ran out of memory ({words}" in out, out
        assert "exited with code 1" not in out and "was killed by SIGKILL" not in out, out
        assert out.count("restarting the run") == 1, out  # the second start's OOM: it gives up
        assert "ran out of memory at each of its last 2 starts" in out, out
        assert _steps(slurm, jobid) == []
    finally:
        pids = slurm.job_pids(jobid)
        slurm.scancel(jobid)
        assert wait_gone(pids, 20) == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
@pytest.mark.parametrize("slurm", ["site"], indirect=True)
def test_a_restarted_run_on_slurm_reports_each_tasks_steps_from_its_node(slurm, alloc, warm):
    """Each task's progress records come from its node on the step's stderr (the node's guard
    or warm client writes them there, the local guard relays them), with the same fields as a
    local run's: both attempts' steps, and the steps redone after worker-1 exits 3. What a task
    writes on its stderr is still its output, a line of the task."""
    from tests.distribute.test_progress import STEPS

    script = STEPS + "print('done', file=__import__('sys').stderr)\n"
    args = ["--jobid", str(alloc), "--workers", "2", "--max-restarts", "1"]
    args += [] if warm else ["--preload", "none"]
    code, events, lines = _run_jsonl(
        slurm, [*args, "--", sys.executable, "-c", script], lambda e: None
    )
    assert code == 0, "".join(lines[-60:])
    started = [e for e in events if e["event"] == "task-started"]
    assert len(started) == 4 and {e["warm"] for e in started} == {warm}, started
    shown = [e for e in events if e["event"] == "progress"]
    for task, first_end in (("worker-0", 60), ("worker-1", 41)):
        mine = [e for e in shown if e["task"] == task]
        assert [e["step"] for e in mine if e["attempt"] == 1][-1] == first_end, mine
        assert [e["step"] for e in mine if e["attempt"] == 2][-1] == 60, mine
        (again,) = [e for e in mine if e["redone"]]
        assert (again["attempt"], again["step"], again["redone"]) == (2, 21, first_end - 20)
    (ended,) = [e for e in events if e["event"] == "run-ended"]
    assert (ended["steps"], ended["redone"]) == ({"worker-0": 60, "worker-1": 60}, 40 + 21)
    said = [e for e in events if e["event"] == "line" and e["text"] == "done"]
    assert len(said) == 3, "".join(lines[-60:])  # worker-0 twice, worker-1 once
    assert not [
        e for e in events if e["event"] == "line" and e["text"].startswith(("pid ", "progress "))
    ]
    assert _steps(slurm, alloc) == []
