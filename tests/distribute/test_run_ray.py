"""``graphdist run --backend ray`` on this machine (a Ray instance of its own, on loopback) and
its bad input; the run across hosts, with a worker killed on another host, is in
tests/net/test_ray_hosts.py."""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import subprocess
import sys
import time
from typing import Any

import pytest

from graphdist._proc.marks import marked
from tests.conftest import EVENTUALLY_S, QUIET_TF, wait_gone

pytestmark = [pytest.mark.integration, pytest.mark.needs("ray", extra="ray")]

PRINT_TASK = "import json, os; print(json.dumps(json.loads(os.environ['TF_CONFIG'])))"


def _graphdist(
    *argv: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    base = {**os.environ, "RAY_ADDRESS": "local"}  # never a cluster another test started
    return subprocess.run(
        [sys.executable, "-m", "graphdist", *argv],
        env={**base, **QUIET_TF, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd="/",
    )


@pytest.mark.timeout(180)
def test_each_task_runs_in_a_ray_actor_with_its_tf_config(tmp_path: object) -> None:
    """Two workers through a Ray instance of the run's own: each prints a TF_CONFIG of one
    cluster, on loopback, with its own task; the run's lines and its exit are as for a local
    run, and the task starts in the run's working folder."""
    result = _graphdist(
        "run", "--backend", "ray", "--workers", "2", "--", sys.executable, "-c", PRINT_TASK
    )
    assert result.returncode == 0, result.stderr[-3000:]
    configs = {}
    for line in result.stdout.splitlines():
        if line.startswith("[worker-"):
            name, text = line.split("] ", 1)
            configs[name[1:]] = json.loads(text)
    assert sorted(configs) == ["worker-0", "worker-1"], result.stdout
    clusters = [c["cluster"] for c in configs.values()]
    assert clusters[0] == clusters[1] and len(clusters[0]["worker"]) == 2
    assert all(a.startswith("127.0.0.1:") for a in clusters[0]["worker"]), clusters
    assert [configs[f"worker-{i}"]["task"]["index"] for i in range(2)] == [0, 1]
    assert "graphdist: the run succeeded: 2 task(s) exited 0" in result.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--address", "10.0.0.1:6379"], "--address"),
        (["--working-dir", "/"], "--working-dir"),
        (["--backend", "ray", "--working-dir", "/no/such/dir"], "an existing folder"),
        (["--backend", "ray", "--address", "127.0.0.1:1"], "Cannot reach a Ray cluster at"),
    ],
)
def test_bad_ray_runs_are_one_line_and_exit_2(argv: list[str], named: str) -> None:
    result = _graphdist("run", *argv, "--", sys.executable, "-c", "pass")
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and named in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(120)
def test_the_runs_timeout_bounds_a_placement_ray_cannot_make() -> None:
    """``--timeout 15`` on a Ray instance too small for the run (one CPU a task; this machine's
    Ray has os.cpu_count() of them): the run ends when its deadline does, told as the timeout,
    not after Ray's own 180 s placement limit (the fallback) as a StartTimeoutError."""
    workers = str((os.cpu_count() or 1) + 1)
    began = time.monotonic()
    result = _graphdist(
        "run", "--backend", "ray", "--workers", workers, "--timeout", "15", "--",
        sys.executable, "-c", "pass",
    )  # fmt: skip
    took = time.monotonic() - began
    assert result.returncode == 1, result.stderr[-3000:]
    said = result.stdout + result.stderr
    assert "did not finish within 15 s (placing attempt 1)" in said, said[-3000:]
    assert "StartTimeoutError" not in said, said[-3000:]
    assert took < 90, f"the 15 s deadline ended the run after {took:.0f} s"


@pytest.mark.timeout(180)
def test_a_working_dir_is_shipped_to_the_tasks(tmp_path: Any) -> None:
    """``--working-dir DIR``: Ray ships DIR to each task's node and the task starts in its copy,
    so a relative script path works although the run itself is started in ``/``."""
    (tmp_path / "hello.py").write_text("print('hello from the shipped folder')\n")
    result = _graphdist(
        "run", "--backend", "ray", "--workers", "1", "--working-dir", str(tmp_path), "--",
        sys.executable, "hello.py",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "[worker-0] hello from the shipped folder" in result.stdout


LISTEN_TASK = (
    "import json, os\n"
    "import tensorflow as tf\n"
    "from graphdist._net.exposure import listening_sockets\n"
    "c = json.loads(os.environ['TF_CONFIG'])\n"
    "t = c['task']\n"
    "s = tf.distribute.Server(tf.train.ClusterSpec(c['cluster']), t['type'], t['index'])\n"
    "print('LISTENING', json.dumps(sorted(set(h for h, _ in listening_sockets(os.getpid())))))\n"
)


@pytest.mark.promise
@pytest.mark.timeout(180)
def test_a_ray_run_tasks_server_listens_on_loopback_only() -> None:
    """Where a Ray run's task really listens, read from the OS in the task's own process: its
    server (TensorFlow binds every interface by default) is held to loopback by the bind shim
    the task inherits on its node. Red when the actor drops the shim (planted: _CommandActor
    without shim_env), which bound 0.0.0.0."""
    result = _graphdist(
        "run", "--backend", "ray", "--workers", "1", "--", sys.executable, "-c", LISTEN_TASK
    )
    assert result.returncode == 0, result.stderr[-3000:]
    [line] = [ln for ln in result.stdout.splitlines() if "LISTENING" in ln]
    hosts = json.loads(line.split("LISTENING ", 1)[1])
    ips = [ipaddress.ip_address(h) for h in hosts]
    mapped = [getattr(ip, "ipv4_mapped", None) or ip for ip in ips]  # ::ffff:127.0.0.1 too
    assert mapped and all(ip.is_loopback for ip in mapped), hosts


WARM_TASK = (
    "import os, sys\n"
    "warm = 'tensorflow' in sys.modules  # imported before the script's own import: forked warm\n"
    "import tensorflow as tf\n"
    "restart, name = os.environ['GRAPHDIST_RESTART'], os.environ['GRAPHDIST_TASK']\n"
    "print('WARM' if warm else 'COLD', restart, flush=True)\n"
    "sys.exit(3 if (restart, name) == ('0', 'worker-1') else 0)\n"
)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("preload", ["auto", "none"])
def test_ray_tasks_run_warm_on_their_node_across_a_restart_and_leave_nothing(
    tmp_path: Any, preload: str
) -> None:
    """Each Ray node's warm agent forks the run's tasks (TensorFlow already imported when the
    script starts), in both attempts: worker-1 exits 3 in the first, the run restarts, and the
    agent serves again. ``--preload none``: every task a fresh process, and said why. Once the
    run is over, no agent or warm interpreter is left. Red if the actor ran the command cold
    (planted: warm=None in start_task) or the agent outlived the run."""
    script = tmp_path / "task.py"
    script.write_text(WARM_TASK)
    mark = {"GRAPHDIST_TEST_MARK": secrets.token_hex(8)}  # every process of the run inherits it
    result = _graphdist(
        "run", "--backend", "ray", "--workers", "2", "--max-restarts", "1", "--preload", preload,
        "--output-format", "jsonl", "--", sys.executable, str(script), timeout=200, env=mark,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    events = [json.loads(ln) for ln in result.stdout.splitlines() if ln.startswith("{")]
    tasks = [e for e in events if e["event"] == "task-started"]
    lines = sorted(
        e["text"] for e in events if e["event"] == "line" and e["text"][:4] in ("WARM", "COLD")
    )
    restarting = [e for e in events if e["event"] == "restarting"]
    assert len(restarting) == 1 and "exited with code 3" in restarting[0]["cause"]["how"]
    assert len(tasks) == 4, tasks
    if preload == "auto":
        assert all(e["warm"] and e["cold_because"] is None for e in tasks), tasks
        assert lines == ["WARM 0", "WARM 0", "WARM 1", "WARM 1"], lines
    else:
        assert all(not e["warm"] and "--preload none" in e["cold_because"] for e in tasks)
        assert lines == ["COLD 0", "COLD 0", "COLD 1", "COLD 1"], lines
    [(key, value)] = mark.items()
    assert wait_gone(marked(value, env=key), EVENTUALLY_S) == []


@pytest.mark.timeout(240)
@pytest.mark.parametrize("preload", ["auto", "none"])
def test_ray_tasks_report_their_steps_warm_or_cold_across_a_restart(
    tmp_path: Any, preload: str
) -> None:
    """graphdist.step on Ray: each task's records cross its guard in its actor (a warm task's
    through its node client's channel, handed to the agent's session) and come back as the
    same progress events as a local run's, with the steps done again after the restart. Red if
    the actor read no report (planted: no report_fd) or the client kept its channel."""
    from tests.distribute.test_progress import STEPS

    script = tmp_path / "task.py"
    script.write_text(STEPS)
    result = _graphdist(
        "run", "--backend", "ray", "--workers", "2", "--max-restarts", "1", "--preload", preload,
        "--output-format", "jsonl", "--", sys.executable, str(script), timeout=200,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    events = [json.loads(ln) for ln in result.stdout.splitlines() if ln.startswith("{")]
    started = [e["warm"] for e in events if e["event"] == "task-started"]
    assert started == [preload == "auto"] * 4
    shown = [e for e in events if e["event"] == "progress"]
    for task, first_end in (("worker-0", 60), ("worker-1", 41)):
        mine = [e for e in shown if e["task"] == task]
        assert [e["step"] for e in mine if e["attempt"] == 1][-1] == first_end, mine
        assert [e["step"] for e in mine if e["attempt"] == 2][-1] == 60, mine
        assert [(e["attempt"], e["redone"]) for e in mine if e["redone"]] == [(2, first_end - 20)]
