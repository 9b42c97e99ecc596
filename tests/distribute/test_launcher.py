"""The multi-worker launcher: TF_CONFIG per task, prefixed output, failure and timeout handling."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import sys
import threading
import time
from typing import Any

import psutil
import pytest

import graphdist
from graphdist._net.probe import Prober
from tests.conftest import EVENTUALLY_S, run_python, wait_gone

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
PY = sys.executable


def test_every_task_gets_its_tf_config_and_a_prefix():
    out = io.StringIO()
    code = (
        "import os, json; c = json.loads(os.environ['TF_CONFIG']); "
        "print(c['task']['type'], c['task']['index'], sorted(c['cluster']), "
        "os.environ['TF_USE_LEGACY_KERAS'])"
    )
    results = graphdist.run_command([PY, "-c", code], workers=2, chief=True, output=out)
    assert sorted(r.name for r in results) == ["chief-0", "worker-0", "worker-1"]
    assert all(r.exitcode == 0 for r in results)
    *lines, last = out.getvalue().splitlines()
    assert sorted(lines) == [
        "[chief-0] chief 0 ['chief', 'worker'] 1",
        "[worker-0] worker 0 ['chief', 'worker'] 1",
        "[worker-1] worker 1 ['chief', 'worker'] 1",
    ]
    assert last == "graphdist: the run succeeded: 3 task(s) exited 0 (chief-0, worker-0, worker-1)"


def test_a_run_whose_tasks_do_nothing_says_it_succeeded_in_one_line():
    """Issue 57: tasks that all exit 0 at once, no log folder, the library called: its one line
    says so (the CLI prints no other), and a jsonl run's run-ended event names the tasks."""
    out = io.StringIO()
    graphdist.run_command([PY, "-c", "pass"], workers=2, output=out)
    assert out.getvalue().splitlines() == [
        "graphdist: the run succeeded: 2 task(s) exited 0 (worker-0, worker-1)"
    ]
    ok = run_python(["-m", "graphdist", "run", "--workers", "1", "--", PY, "-c", "pass"])
    assert ok.returncode == 0 and ok.stderr == ""
    assert ok.stdout == "graphdist: the run succeeded: 1 task(s) exited 0 (worker-0)\n"
    jsonl = io.StringIO()
    graphdist.run_command([PY, "-c", "pass"], workers=1, output=jsonl, output_format="jsonl")
    ended = [json.loads(line) for line in jsonl.getvalue().splitlines()][-1]
    assert ended["event"] == "run-ended" and ended["ran"] == ["worker-0"], ended


def test_a_failing_task_stops_the_others_and_shows_its_last_lines():
    code = (
        "import os, sys, time\n"
        "print('hello from', os.environ['GRAPHDIST_TASK'], os.getpid(), flush=True)\n"
        "if os.environ['GRAPHDIST_TASK'] == 'worker-1':\n"
        "    print('about to fail', flush=True); sys.exit(7)\n"
        "time.sleep(60)\n"
    )
    out = io.StringIO()
    with pytest.raises(graphdist.TaskExitError) as info:
        graphdist.run_command([PY, "-c", code], workers=3, output=out)
    err = info.value
    assert err.failed.name == "worker-1" and err.failed.exitcode == 7
    assert "[worker-1] about to fail" in str(err)
    others = [r for r in err.results if r.name != "worker-1"]
    assert all(r.exitcode is not None and r.exitcode != 0 for r in others)
    # worker-1 may fail before the others have even printed: the launcher stops them anyway.
    pids = [r.pid for r in err.results]
    assert len(pids) == 3 and all(pids) and wait_gone(pids, EVENTUALLY_S) == []


# A task that fails (exit 3) on worker-1 in its first two attempts, records the pid of every
# attempt's process and checks, when it starts, that every process of the attempt before is gone.
FLAKY = """
import os, sys, time, json, psutil
k, task, folder = int(os.environ["GRAPHDIST_RESTART"]), os.environ["GRAPHDIST_TASK"], sys.argv[1]
with open(os.path.join(folder, f"{task}.{k}.pid"), "w") as f:
    json.dump([os.getpid(), json.loads(os.environ["TF_CONFIG"])["cluster"]], f)
left = []
for name in os.listdir(folder):
    if name.endswith(f".{k - 1}.pid"):
        with open(os.path.join(folder, name)) as f:
            pid = json.load(f)[0]
        if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            left.append(pid)
print(f"{task} attempt {k} leftovers {left}", flush=True)
if k:
    print(f"graphdist: resumed from step {10 * k}", flush=True)
time.sleep(0.3)
if task == "worker-1" and k < FAILS:
    print("failing", flush=True)
    sys.exit(3)
print("done", flush=True)
"""


def _flaky(tmp_path, fails: int) -> list[str]:
    script = tmp_path / "flaky.py"
    script.write_text(FLAKY.replace("FAILS", str(fails)))
    folder = tmp_path / "pids"
    folder.mkdir()
    return [PY, str(script), str(folder)]


def test_a_run_restarts_as_a_group_until_it_succeeds_and_says_so(tmp_path):
    out = io.StringIO()
    logs = tmp_path / "logs"
    results = graphdist.run_command(
        _flaky(tmp_path, fails=2), workers=2, max_restarts=2, output=out, log_dir=logs
    )
    assert sorted(r.name for r in results) == ["worker-0", "worker-1"]
    assert all(r.exitcode == 0 for r in results)
    text = out.getvalue()
    for k in range(3):  # every attempt: both tasks, a fresh TF_CONFIG, nothing of the one before
        for task in ("worker-0", "worker-1"):
            assert f"[{task}] {task} attempt {k} leftovers []" in text
    assert text.count("every task was stopped; restarting the run at once (restart 1") == 1
    assert text.count("every task was stopped; restarting the run in 0.5 s (restart 2") == 1
    assert "restart 1 of at most 2 within 60 s" in text and "restart 2 of at most 2" in text
    summary = text[text.index("graphdist: run summary: 3 attempt(s)") :].splitlines()
    assert summary[0].endswith("every task exited 0")
    assert summary[1].startswith("  attempt 1: worker-1 exited with code 3 at ")
    assert summary[1].endswith("attempt 2 resumed from step 10")
    assert summary[2].startswith("  attempt 2: worker-1 exited with code 3 at ")
    clusters = set()
    for k in range(3):
        with open(tmp_path / "pids" / f"worker-0.{k}.pid") as f:
            clusters.add(json.dumps(json.load(f)[1], sort_keys=True))
        for task in ("worker-0", "worker-1"):  # each task's whole output, every attempt
            log = (logs / "run-1" / f"attempt-{k + 1}" / f"{task}.log").read_text()
            assert log.startswith(f"{task} attempt {k} ")
    assert summary[3] == f"  logs: {logs / 'run-1'}"
    assert (logs / "run-1" / "summary.txt").read_text().splitlines() == summary[:4]
    exits = json.loads((logs / "run-1" / "exits.json").read_text())
    assert [(e["attempt"], e["exitcode"]) for e in exits if e["task"] == "worker-1"] == [
        (1, 3),
        (2, 3),
        (3, 0),
    ]
    assert len(exits) == 6
    assert len(clusters) == 3  # fresh ports each time
    pids = [json.loads(p.read_text())[0] for p in (tmp_path / "pids").iterdir()]
    assert len(pids) == 6 and wait_gone(pids, EVENTUALLY_S) == []


def test_beyond_its_restarts_a_run_fails_naming_the_task_how_and_the_count(tmp_path):
    out = io.StringIO()
    with pytest.raises(graphdist.TaskExitError) as info:
        graphdist.run_command(_flaky(tmp_path, fails=5), workers=2, max_restarts=1, output=out)
    first = str(info.value).splitlines()[0]
    assert first == (
        "Task worker-1 exited with code 3 in attempt 2; gave up on the run after 1 restart(s) "
        "(at most 1 within 60 s); raise max_restarts or restart_window_s to allow more; its last "
        "lines:"
    )
    assert info.value.failed.exitcode == 3
    assert "graphdist: run summary: 2 attempt(s)" in out.getvalue()
    pids = [json.loads(p.read_text())[0] for p in (tmp_path / "pids").iterdir()]
    assert len(pids) == 4 and wait_gone(pids, EVENTUALLY_S) == []


def test_without_restarts_a_failure_ends_the_run_as_before(tmp_path):
    out = io.StringIO()
    with pytest.raises(graphdist.TaskExitError) as info:
        graphdist.run_command(_flaky(tmp_path, fails=1), workers=2, output=out)
    assert "gave up" not in str(info.value) and "run summary" not in out.getvalue()


def test_restart_arguments_are_checked_before_anything_starts(tmp_path):
    with pytest.raises(graphdist.ArgumentError, match="max_restarts"):
        graphdist.run_command([PY, "-c", "1"], max_restarts=-1)
    with pytest.raises(graphdist.ArgumentError, match="restart_window_s"):
        graphdist.run_command([PY, "-c", "1"], restart_window_s=0)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(graphdist.ArgumentError, match=r"Cannot keep logs in .*: Not a directory"):
        graphdist.run_command([PY, "-c", "1"], log_dir=blocker / "logs")


def test_timeout_stops_everything():
    with pytest.raises(graphdist.LaunchTimeoutError, match="worker-0, worker-1") as info:
        graphdist.run_command([PY, "-c", "import time; time.sleep(60)"], workers=2, timeout_s=2)
    assert all(r.exitcode is not None for r in info.value.results)


# The chief finds the process listening on each ps/worker server's port while the run is on.
SERVER_PIDS = (
    "import os, json, psutil\n"
    "cluster = json.loads(os.environ['TF_CONFIG'])['cluster']\n"
    "ports = {int(a.rsplit(':', 1)[1]) for a in cluster['ps'] + cluster['worker']}\n"
    "pids = {c.laddr.port: c.pid for c in psutil.net_connections('tcp')\n"
    "        if c.status == psutil.CONN_LISTEN and c.laddr.port in ports}\n"
    "print(json.dumps({'cluster': cluster, 'pids': sorted(pids.values())}))\n"
)


def test_ps_tasks_are_servers_that_stop_when_the_run_ends():
    out = io.StringIO()
    results = graphdist.run_command(
        [PY, "-c", SERVER_PIDS], workers=2, ps=1, chief=True, output=out
    )
    assert [r.name for r in results] == ["chief-0"]
    seen = json.loads(out.getvalue().splitlines()[0].split("] ", 1)[1])
    assert sorted(seen["cluster"]) == ["chief", "ps", "worker"]
    pids = seen["pids"]
    assert len(set(pids)) == 3 and os.getpid() not in pids  # one server process per task
    assert wait_gone(pids, EVENTUALLY_S) == []  # the servers were stopped with the run
    for address in seen["cluster"]["ps"] + seen["cluster"]["worker"]:
        with Prober(address) as prober:
            assert not prober.probe(0.5)  # ... and nothing else answers at their addresses


def test_ps_servers_answer_while_the_run_lasts():
    code = (
        "import os, json\n"
        "from graphdist._net.probe import Prober\n"
        "c = json.loads(os.environ['TF_CONFIG'])['cluster']\n"
        "print(all(Prober(a).probe(2.0) for a in c['ps'] + c['worker']))\n"
    )
    out = io.StringIO()
    graphdist.run_command([PY, "-c", code], workers=2, ps=1, chief=True, output=out)
    assert out.getvalue().splitlines() == [
        "[chief-0] True",
        "graphdist: the run succeeded: 1 task(s) exited 0 (chief-0); 3 server task(s) served it "
        "(worker-0, worker-1, ps-0)",
    ]


def _task_identity(scale):
    import json

    task = json.loads(os.environ["TF_CONFIG"])["task"]
    return task["type"], task["index"] * scale


def test_run_function_returns_each_tasks_result():
    values = graphdist.run_function(_task_identity, 10, workers=2, output=io.StringIO())
    assert values == {"worker-0": ("worker", 0), "worker-1": ("worker", 10)}


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["run", "--workers", "0", "--", "true"], "workers must be a whole number >= 1"),
        (["run", "--workers", "1", "--ps", "1", "--", "true"], "--chief"),
        (["run", "--workers", "1"], "No command"),
        (["run", "--workers", "1", "--timeout", "0", "--", "true"], "--timeout"),
        (["run", "--workers", "1", "--", "no-such-command-here"], "'no-such-command-here'"),
        (["run", "--max-restarts", "-1", "--", "true"], "--max-restarts must be a whole number"),
        (["run", "--max-restarts", "x", "--", "true"], "--max-restarts: invalid int value"),
        (
            ["run", "--max-restarts", "1", "--restart-window", "0", "--", "true"],
            "--restart-window must be a finite",
        ),
        (["run", "--restart-window", "5", "--", "true"], "--restart-window does nothing without"),
        (["run", "--min-uptime", "5", "--", "true"], "--min-uptime does nothing without"),
        (["run", "--min-uptime", "-1", "--max-restarts", "1", "--", "true"], "--min-uptime must"),
        (["run", "--preemption-exit-code", "300", "--", "true"], "--preemption-exit-code must"),
        (["run", "--output-format", "xml", "--", "true"], "invalid choice: 'xml'"),
        (["up", "--cluster", "a=1", "--max-restarts", "2"], "--max-restarts does nothing without"),
        (["up", "--cluster", "a=1", "--address", "h:1"], "--address is an option of the ray"),
        (["run", "--log-dir", "/proc/no/such", "--", "true"], "Cannot keep logs in /proc/no/such"),
    ],
)
def test_cli_usage_errors(argv, fragment, run_cli):
    result = run_cli(*argv)
    assert result.returncode == 2
    assert result.stderr.startswith("Error: ") and fragment in result.stderr


IMPORT_TF = "import tensorflow"


def test_cli_exit_status_follows_the_tasks():
    ok = run_python(["-m", "graphdist", "run", "--workers", "2", "--", PY, "-c", "print(1)"])
    lines = ok.stdout.splitlines()
    assert ok.returncode == 0 and sorted(lines[:-1]) == ["[worker-0] 1", "[worker-1] 1"]
    assert lines[-1] == "graphdist: the run succeeded: 2 task(s) exited 0 (worker-0, worker-1)"
    code = "import os, sys; sys.exit(os.environ['GRAPHDIST_TASK'] == 'worker-0')"
    bad = run_python(["-m", "graphdist", "run", "--workers", "2", "--", PY, "-c", code])
    assert bad.returncode == 1 and "worker-0 exited with code 1" in bad.stderr
    # a `python` that is not graphdist's (the venv's base interpreter, without TensorFlow):
    # the error says so and what to run instead
    bare = os.path.join(sys.base_prefix, "bin", "python3")
    lost = run_python(["-m", "graphdist", "run", "--workers", "1", "--", bare, "-c", IMPORT_TF])
    assert lost.returncode == 1 and "No module named 'tensorflow'" in lost.stderr, lost.stderr
    # the hint is a whole command, the user's options kept: followed, it succeeds (issue 57)
    hint = re.search(r"Run `(graphdist run [^`]*)`", lost.stderr)
    assert hint is not None, lost.stderr
    followed = shlex.split(hint.group(1))
    assert followed[:6] == ["graphdist", "run", "--workers", "1", "--", sys.executable]
    again = run_python(["-m", *followed])
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[-1].startswith("graphdist: the run succeeded: 1 task(s)")
    three = run_python(["-m", "graphdist", "run", "--workers", "2", "--", PY, "-c", "exit(3)"])
    assert three.returncode == 3, three.stderr  # the task's own code, as torchrun gives it
    assert "Traceback" not in bad.stderr


def test_a_task_killed_by_a_signal_makes_the_run_exit_128_plus_n():
    code = (
        "import os, signal, time\n"
        "if os.environ['GRAPHDIST_TASK'] == 'worker-1':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(30)\n"
    )
    result = run_python(["-m", "graphdist", "run", "--workers", "2", "--", PY, "-c", code])
    assert result.returncode == 128 + 9  # as a shell reports it
    assert "Error: Task worker-1 was killed by SIGKILL (exit status 137)" in result.stderr


def test_a_death_reported_after_a_peers_error_exit_is_named_the_cause(tmp_path):
    """A peer's death makes the others fail fast, and which exit reaches the launcher first is
    a race it cannot see: on Slurm, under load, the srun of a worker that exited 1 because its
    peer was SIGKILLed ended before the dead one's (CI, 2026-12-05). Here worker-0 exits 1 as
    soon as worker-1 says it dies, and worker-1 is SIGKILLed 0.3 s later: the run names
    worker-1, killed by SIGKILL, as the cause."""
    flag = tmp_path / "dying"
    code = (
        "import os, pathlib, signal, sys, time\n"
        f"flag = pathlib.Path({str(flag)!r})\n"
        "if os.environ['GRAPHDIST_TASK'] == 'worker-1':\n"
        "    flag.write_text('x')\n"
        "    time.sleep(0.3)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "while not flag.exists():\n"
        "    time.sleep(0.01)\n"
        "sys.exit(1)\n"
    )
    with pytest.raises(graphdist.TaskExitError) as info:
        graphdist.run_command([PY, "-c", code], workers=2, output=io.StringIO())
    assert info.value.failed.name == "worker-1", str(info.value)
    assert str(info.value).startswith("Task worker-1 was killed by SIGKILL"), str(info.value)


# Attempt 1: every task exits 42, as TensorFlow's PreemptionCheckpointHandler makes them after a
# SIGTERM (the workers agree on a step, save, and exit with it); attempt 2 finishes.
PREEMPTED = (
    "import os, sys, time\n"
    "k = int(os.environ['GRAPHDIST_RESTART'])\n"
    "print('attempt', k, flush=True)\n"
    "if k == 0:\n"
    "    time.sleep(0.2 if os.environ['GRAPHDIST_TASK'] == 'worker-0' else 0.8)\n"
    "    sys.exit(42)\n"
)


def test_a_preempted_attempt_restarts_at_once_and_spends_no_restart(tmp_path):
    """max_restarts=0: a failure would end the run, yet a preemption (every task exits 42,
    one after the other) restarts it at once and the summary names it."""
    out = io.StringIO()
    results = graphdist.run_command([PY, "-c", PREEMPTED], workers=2, output=out, log_dir=tmp_path)
    assert [r.exitcode for r in results] == [0, 0]
    text = out.getvalue()
    assert (
        "graphdist: attempt 1 was preempted: every task exited with code 42; restarting the run "
        "at once (a preemption spends no restart)"
    ) in text
    assert "[worker-0] attempt 1" in text and "[worker-1] attempt 1" in text
    summary = (tmp_path / "run-1" / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("graphdist: run summary: 2 attempt(s)")
    assert summary[1] == "  attempt 1: preempted (every task exited 42)"
    events = [
        json.loads(line) for line in (tmp_path / "run-1" / "events.jsonl").read_text().splitlines()
    ]
    kinds = [e["event"] for e in events if e["event"] not in ("task-started", "task-exited")]
    assert kinds == ["attempt-started", "preempted", "attempt-started", "run-ended"]
    assert wait_gone([r.pid for r in results], EVENTUALLY_S) == []


def test_one_task_exiting_with_the_preemption_code_alone_is_a_failure(monkeypatch):
    from graphdist._distribute import supervise

    monkeypatch.setattr(supervise, "PREEMPTION_WAIT_S", 1.0)
    code = (
        "import os, sys, time\n"
        "if os.environ['GRAPHDIST_TASK'] == 'worker-1':\n"
        "    sys.exit(42)\n"
        "time.sleep(60)\n"
    )
    with pytest.raises(graphdist.TaskExitError) as info:
        graphdist.run_command([PY, "-c", code], workers=2, output=io.StringIO(), timeout_s=90)
    # worker-0 never exits with 42: after PREEMPTION_WAIT_S the first exit is a failure
    assert info.value.failed.name == "worker-1" and info.value.failed.exitcode == 42


def test_a_run_that_keeps_failing_at_start_gives_up_early_and_says_so():
    out = io.StringIO()
    with pytest.raises(graphdist.TaskExitError) as info:
        graphdist.run_command(
            [PY, "-c", "raise SystemExit(5)"], workers=1, max_restarts=50, output=out
        )
    first = str(info.value).splitlines()[0]
    assert first.startswith(
        "Task worker-0 exited with code 5 in attempt 3; gave up on the run: it failed 3 times in "
        "a row within 10 s of starting, a start-up failure that restarts will not fix"
    ), first
    assert out.getvalue().count("restarting the run ") == 2


@pytest.mark.parametrize(
    ("command", "error"),
    [
        (["-c", "import graphdist_no_such_module"], "ModuleNotFoundError: No module named "),
        (["-c", "def broken(:"], "SyntaxError: "),
        (["/nonexistent/train.py"], "can't open file '/nonexistent/train.py'"),
        (["-m", "graphdist_no_such_module"], "No module named graphdist_no_such_module"),
        (["-m", "graphdist_no_such.module"], "Error while finding module specification for "),
    ],
)
def test_a_task_that_cannot_start_spends_no_restart(command, error):
    """Every task of an attempt dying at start of an error that no restart fixes (a missing
    module, a syntax error, a script that is not there) ends the run in its first attempt, with
    the error named once, instead of spending restarts and printing its traceback each time."""
    out = io.StringIO()
    with pytest.raises(graphdist.TaskExitError) as info:
        graphdist.run_command([PY, *command], workers=2, max_restarts=5, output=out)
    first = str(info.value).splitlines()[0]
    assert " in attempt 1; gave up on the run: it failed within 10 s of starting with " in first
    assert error in first and "an error that restarts will not fix;" in first, first
    assert "restarting the run" not in out.getvalue()


def _needs_a_missing_package():
    import graphdist_no_such_package  # noqa: F401  (a dependency this Python lacks)


def test_a_function_that_cannot_start_spends_no_restart_as_a_script_does():
    """Must-show 3 of issue 57: run_function's start-up failure that no restart fixes (the
    function's dependency is missing) is found as a script's is: the first attempt ends it."""
    out = io.StringIO()
    with pytest.raises(graphdist.TaskExitError) as info:
        graphdist.run_function(_needs_a_missing_package, workers=2, max_restarts=5, output=out)
    first = str(info.value).splitlines()[0]
    assert " in attempt 1; gave up on the run: it failed within 10 s of starting with " in first
    assert "No module named 'graphdist_no_such_package'" in first, first
    assert "restarting the run" not in out.getvalue()
    assert wait_gone([r.pid for r in info.value.results if r.pid], EVENTUALLY_S) == []


@pytest.mark.parametrize("preload", ["none", "auto"])
def test_ps_shows_each_guard_with_its_task(preload: str, tmp_path: Any) -> None:
    """Each task's guard carries its task's name on its command line: `ps` tells them apart,
    cold (the launcher's child) or warm (the warm interpreter's). The tasks end once both
    guards were seen."""
    seen: dict[str, list[str]] = {}
    done = tmp_path / "seen"
    # numpy: a preload (warm with auto)
    code = f"import numpy, os, time\nwhile not os.path.exists({str(done)!r}): time.sleep(0.05)"

    def look() -> None:
        deadline = time.monotonic() + 60
        while len(seen) < 2 and time.monotonic() < deadline:
            for proc in psutil.Process().children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    cmd = " ".join(proc.cmdline()).split()  # a warm guard's title: one string
                    if "--name" in cmd:
                        seen[cmd[cmd.index("--name") + 1]] = cmd
            time.sleep(0.05)
        done.write_text("")

    watcher = threading.Thread(target=look)
    watcher.start()
    out = io.StringIO()
    graphdist.run_command(
        [PY, "-c", code], workers=2, output=out, timeout_s=90, preload=preload, log_dir=tmp_path
    )
    watcher.join()
    assert sorted(seen) == ["worker-0", "worker-1"]
    events = [json.loads(line) for line in (tmp_path / "run-1" / "events.jsonl").open()]
    warm = [e["warm"] for e in events if e["event"] == "task-started"]
    assert warm == [preload == "auto"] * 2, events


@pytest.mark.parametrize("expose", [False, True])
def test_an_exposed_local_run_still_loads_the_shim_with_the_members(expose):
    """issue 38: ``run --expose`` (local) loaded no shim at all, so its tasks' servers listened
    on every interface and let every machine in. Exposed or not, each task's process has the
    shim loaded (its own exported function answers) with a member list; exposed, the wildcard
    bind is kept for the shim to check members at ``accept()``."""
    out = io.StringIO()
    code = (
        "import os; from graphdist._net.members import shim_members; "
        "print(shim_members(), os.environ.get('GRAPHDIST_BIND_ADDR'), "
        "repr(os.environ.get('GRAPHDIST_ALLOW')))"
    )
    results = graphdist.run_command([PY, "-c", code], workers=1, expose=expose, output=out)
    assert [r.exitcode for r in results] == [0], out.getvalue()
    line, succeeded = out.getvalue().splitlines()
    assert succeeded.startswith("graphdist: the run succeeded"), succeeded
    if expose:  # loopback hosts: no member but this host's own processes
        assert line == "[worker-0] 0 * ''", line
    else:
        assert line == "[worker-0] -2 127.0.0.1 None", line
