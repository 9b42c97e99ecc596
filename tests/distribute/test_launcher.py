"""The multi-worker launcher: TF_CONFIG per task, prefixed output, failure and timeout handling."""

from __future__ import annotations

import io
import json
import os
import sys

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
    lines = sorted(out.getvalue().splitlines())
    assert lines == [
        "[chief-0] chief 0 ['chief', 'worker'] 1",
        "[worker-0] worker 0 ['chief', 'worker'] 1",
        "[worker-1] worker 1 ['chief', 'worker'] 1",
    ]


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


def test_timeout_stops_everything():
    with pytest.raises(graphdist.LaunchTimeoutError, match="worker-0, worker-1") as info:
        graphdist.run_command([PY, "-c", "import time; time.sleep(60)"], workers=2, timeout_s=2)
    assert all(r.exitcode is not None for r in info.value.results)


def test_ps_tasks_are_servers_that_stop_when_the_run_ends():
    code = (
        "import os, json; c = json.loads(os.environ['TF_CONFIG']); print(json.dumps(c['cluster']))"
    )
    out = io.StringIO()
    results = graphdist.run_command([PY, "-c", code], workers=2, ps=1, chief=True, output=out)
    assert [r.name for r in results] == ["chief-0"]
    cluster = json.loads(out.getvalue().split("] ", 1)[1])
    assert sorted(cluster) == ["chief", "ps", "worker"]
    for address in cluster["ps"] + cluster["worker"]:
        with Prober(address) as prober:
            assert not prober.probe(0.5)  # the servers were stopped with the run


def test_ps_servers_answer_while_the_run_lasts():
    code = (
        "import os, json\n"
        "from graphdist._net.probe import Prober\n"
        "c = json.loads(os.environ['TF_CONFIG'])['cluster']\n"
        "print(all(Prober(a).probe(2.0) for a in c['ps'] + c['worker']))\n"
    )
    out = io.StringIO()
    graphdist.run_command([PY, "-c", code], workers=2, ps=1, chief=True, output=out)
    assert out.getvalue().strip() == "[chief-0] True"


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
    ],
)
def test_cli_usage_errors(argv, fragment):
    result = run_python(["-m", "graphdist", *argv])
    assert result.returncode == 2
    assert result.stderr.startswith("Error: ") and fragment in result.stderr


IMPORT_TF = "import tensorflow"


def test_cli_exit_status_follows_the_tasks():
    ok = run_python(["-m", "graphdist", "run", "--workers", "2", "--", PY, "-c", "print(1)"])
    assert ok.returncode == 0 and sorted(ok.stdout.split()) == [
        "1",
        "1",
        "[worker-0]",
        "[worker-1]",
    ]
    code = "import os, sys; sys.exit(os.environ['GRAPHDIST_TASK'] == 'worker-0')"
    bad = run_python(["-m", "graphdist", "run", "--workers", "2", "--", PY, "-c", code])
    assert bad.returncode == 1 and "worker-0 exited with code 1" in bad.stderr
    # a `python` that is not graphdist's (the venv's base interpreter, without TensorFlow):
    # the error says so and what to run instead
    bare = os.path.join(sys.base_prefix, "bin", "python3")
    lost = run_python(["-m", "graphdist", "run", "--workers", "1", "--", bare, "-c", IMPORT_TF])
    assert lost.returncode == 1 and "No module named 'tensorflow'" in lost.stderr, lost.stderr
    assert f"graphdist run -- {sys.executable}" in lost.stderr, lost.stderr
    three = run_python(["-m", "graphdist", "run", "--workers", "2", "--", PY, "-c", "exit(3)"])
    assert three.returncode == 3, three.stderr  # the task's own code, as torchrun gives it
    assert "Traceback" not in bad.stderr
