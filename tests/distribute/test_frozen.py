"""Frozen tasks under `graphdist run`, found by the launcher's heartbeat in seconds rather than by
TensorFlow (~12 s for MultiWorkerMirroredStrategy's coordination service; the operation timeout
for a ParameterServerStrategy coordinator), for real: restart.py's small training scripts (a
backup or checkpoint every 20 steps), a task frozen by the plugin's fault injector. Each test
asserts the mechanism that found it (the stopped state, or the server's silence, in the
launcher's own words), a bound between the heartbeat's 3 s and TensorFlow's 12 s, that the run
resumed and succeeded, and that nothing is left (processes, the freezer's cgroup)."""

from __future__ import annotations

import os
import re
import sys

import pytest

from graphdist._faults.freezer import freezer_root
from tests.conftest import EVENTUALLY_S, QUIET_TF, REPO, wait_gone

# warm_agent: the subject is the freezes, not how tasks start (tests/distribute/test_warm.py)
pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(240),
    pytest.mark.usefixtures("warm_agent"),
]
BENCH = os.path.join(REPO, "benchmarks")
STEPS, SAVE_EVERY, FAULT_AT = 80, 20, 30
NOTICED_BOUND_S = 9.0
"""The fault to the launcher's restart line: the heartbeat's 3 s (and its 0.5 s looks) on a
loaded machine is well under it; TensorFlow's own 10 s heartbeat plus its checks is over it."""


def _run(injector, tmp_path, script, fault, **kwargs):
    argv = [sys.executable, os.path.join(BENCH, script), "--out", str(tmp_path)]
    argv += ["--steps", str(STEPS), "--save-every", str(SAVE_EVERY)]
    return injector.run(
        argv, max_restarts=1, cwd=BENCH, env=QUIET_TF, faults=[fault], wait_s=200, **kwargs
    )


def _restart_line(out, words):
    [line] = [o for o in out.output if o.task is None and words in o.text]
    return line


def _check_clean(out):
    assert out.leftovers == [], out.describe()
    assert wait_gone(out.pids, EVENTUALLY_S) == []


def _resumed_after(out, task):
    lines = out.lines_of(task, attempt=1)
    [step] = [int(m.group(1)) for m in map(re.compile(r"resumed at step (\d+)").match, lines) if m]
    return step


@pytest.mark.promise
def test_a_worker_hung_in_native_code_is_found_by_its_silence_and_the_run_resumes(
    graphdist_faults, tmp_path
):
    if freezer_root() is None:
        pytest.skip("a hang is a cgroup v2 freezer: needs a writable cgroup v2 hierarchy (root)")
    before = set(os.listdir(freezer_root()))
    hang = graphdist_faults.hang("worker-1", after=rf"^step {FAULT_AT}$", of="worker-0")
    out = _run(graphdist_faults, tmp_path, "_restart_task.py", hang, workers=2)
    assert out.returncode == 0, out.describe()
    [hung] = out.injected
    assert hung.confirmed and hung.attempt == 0 and out.attempts == 2, out.describe()
    line = _restart_line(out, "restarting the run")
    # no stopped state to see: the server's silence found it
    assert "worker-1 was frozen (its server at " in line.text, line.text
    assert "did not answer for " in line.text and "and was killed" in line.text
    assert line.at_s - hung.at_s < NOTICED_BOUND_S, (line.at_s - hung.at_s, line.text)
    # from the last backup before the hang took hold: a cgroup freeze lands some steps after
    # the line it follows on a loaded machine (CI: the backup at 40 of a fault at 30)
    last = max(
        int(t.split()[1]) for t in out.lines_of("worker-0", attempt=0) if t.startswith("step ")
    )
    assert max(SAVE_EVERY, last - SAVE_EVERY) <= _resumed_after(out, "worker-0") <= last
    # (TensorFlow may log after it: the coordination service of a worker that ends last says
    # the other "crashed" when it simply exited first)
    assert "training done" in out.lines_of("worker-0", attempt=1)
    _check_clean(out)
    assert set(os.listdir(freezer_root())) == before  # the hang's cgroup is gone


def test_a_frozen_ps_task_is_killed_and_the_run_resumes_from_its_checkpoint(
    graphdist_faults, tmp_path
):
    freeze = graphdist_faults.freeze("ps-0", after=rf"^step {FAULT_AT}$", of="chief-0")
    out = _run(graphdist_faults, tmp_path, "_restart_ps_task.py", freeze, chief=True, ps=1)
    assert out.returncode == 0, out.describe()
    [frozen] = out.injected
    assert frozen.confirmed and out.attempts == 2, out.describe()
    line = _restart_line(out, "restarting the run")
    assert "ps-0 was frozen (stopped (state T) for " in line.text, line.text
    assert line.at_s - frozen.at_s < NOTICED_BOUND_S, (line.at_s - frozen.at_s, line.text)
    assert SAVE_EVERY <= _resumed_after(out, "chief-0") <= FAULT_AT
    assert "training done" in out.lines_of("chief-0", attempt=1)
    _check_clean(out)


def test_a_frozen_ps_worker_server_is_killed_and_restarted_under_the_coordinator(
    graphdist_faults, tmp_path
):
    freeze = graphdist_faults.freeze("worker-1", after=rf"^step {FAULT_AT}$", of="chief-0")
    out = _run(graphdist_faults, tmp_path, "_restart_ps_task.py", freeze, chief=True, ps=1)
    assert out.returncode == 0, out.describe()
    [frozen] = out.injected
    assert frozen.confirmed and out.attempts == 1, out.describe()  # the run itself went on
    line = _restart_line(out, "on its address")
    assert "the server of worker-1 was frozen (stopped (state T) for " in line.text, line.text
    assert line.at_s - frozen.at_s < NOTICED_BOUND_S, (line.at_s - frozen.at_s, line.text)
    assert "training done" in out.lines_of("chief-0")
    _check_clean(out)
