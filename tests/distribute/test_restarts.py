"""A run that survives a dead worker, for real: the seed's CNN under MultiWorkerMirroredStrategy
through `graphdist run --max-restarts`, with worker-1 SIGKILLed by the plugin's fault injector
(``graphdist_faults``). The restarted attempt resumes from the chief's last backup, trains only
what was left and ends as accurate as an uninterrupted run; beyond the restart budget the run
fails with one line that names the task and how it failed. A frozen worker (SIGSTOP) is caught
by the launcher's heartbeat (in seconds, before TensorFlow's coordination service would) and
survived the same way. Nothing is left behind in any case."""

from __future__ import annotations

import os
import re
import sys

import numpy as np
import pytest

from tests.conftest import EVENTUALLY_S, QUIET_TF, REPO, wait_gone

# warm_agent: the subject is the restarts, not how tasks start (tests/distribute/test_warm.py)
pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(400),
    pytest.mark.usefixtures("warm_agent"),
]
EXAMPLES = os.path.join(REPO, "examples")
EPOCHS = 3
# What a resumed attempt says: the example's own line, or graphdist's resume helpers' one.
RESUMED = re.compile(r"^(resuming from epoch (\d+)|graphdist: resumed from )")


def train(out: os.PathLike[str]) -> list[str]:
    return [sys.executable, "seed_mwms_training.py", "--out", str(out), "--epochs", str(EPOCHS)]


def accuracy(lines: list[str]) -> float:
    [value] = [float(ln.split()[-1]) for ln in lines if ln.startswith("held-out accuracy")]
    return value


def epochs_done(lines: list[str]) -> list[int]:
    return [int(ln.split()[1].split("/")[0]) for ln in lines if re.match(r"epoch \d+/\d+ done", ln)]


def run(injector, out, **kwargs):
    return injector.run(train(out), workers=2, cwd=EXAMPLES, env=QUIET_TF, **kwargs)


def weights(folder: os.PathLike[str], task: str) -> list[np.ndarray]:
    with np.load(os.path.join(folder, f"weights-{task}.npz")) as data:
        return [data[k] for k in data.files]


def test_a_killed_worker_is_restarted_and_the_run_resumes_where_it_was(graphdist_faults, tmp_path):
    # The uninterrupted run: the seed's CNN on 2 workers, its real accuracy, identical weights on
    # both workers, and nothing left of the backup after success.
    whole = run(graphdist_faults, tmp_path / "whole")
    assert whole.returncode == 0, whole.describe()
    first = whole.lines_of("worker-0")
    assert epochs_done(first) == [1, 2, 3]
    assert "Number of devices: 2" in first and "starting from scratch" in first
    assert not [ln for ln in whole.lines if "graphdist: resumed from" in ln]
    a, b = weights(tmp_path / "whole", "worker-0"), weights(tmp_path / "whole", "worker-1")
    assert len(a) == 4 and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert accuracy(first) >= 0.90  # README: "The seed's CNN reaches 0.90" (measured 0.911)
    assert sorted(os.listdir(tmp_path / "whole")) == [
        "weights-worker-0.npz",
        "weights-worker-1.npz",
    ]

    # worker-1 dies once the chief has reported (and so backed up) epoch 2
    kill = graphdist_faults.kill("worker-1", after=rf"^epoch 2/{EPOCHS} done", of="worker-0")
    out = run(graphdist_faults, tmp_path / "killed", max_restarts=1, faults=[kill])
    assert out.returncode == 0, out.describe()
    assert [(i.task, i.attempt, i.confirmed) for i in out.injected] == [("worker-1", 0, True)]
    assert out.attempts == 2 and out.restart_values == [0, 1], out.describe()
    restarts = [ln for ln in out.launcher_lines() if "restarting the run" in ln]
    assert len(restarts) == 1 and "worker-1 was killed by SIGKILL (exit status 137)" in restarts[0]
    assert epochs_done(out.lines_of("worker-0", attempt=0)) == [1, 2]
    for task in ("worker-0", "worker-1"):
        again = out.lines_of(task, attempt=1)
        assert epochs_done(again) == [3], again  # only what was left
        resumed = [m for m in map(RESUMED.match, again) if m]
        assert resumed, again
        if resumed[0].group(2) is not None:
            assert int(resumed[0].group(2)) == 2
        assert "starting from scratch" not in again
    assert (
        abs(accuracy(out.lines_of("worker-0", attempt=1)) - accuracy(whole.lines_of("worker-0")))
        <= 0.01
    )
    # On CPU, with the example's seed-and-epoch data order, the weights are the same bit for bit.
    resumed_weights = weights(tmp_path / "killed", "worker-0")
    assert all(np.array_equal(x, y) for x, y in zip(a, resumed_weights, strict=True))
    assert out.leftovers == [] and whole.leftovers == []
    assert wait_gone([*out.pids, *whole.pids], EVENTUALLY_S) == []


def test_a_hung_worker_is_caught_by_the_heartbeat_and_the_run_resumes(graphdist_faults, tmp_path):
    # SIGSTOP, never SIGCONT: the launcher's heartbeat sees it stopped for its 3 s timeout, kills
    # it and starts the run again (TensorFlow's own heartbeat would take ~12 s: TF_FACTS).
    freeze = graphdist_faults.freeze("worker-1", after=rf"^epoch 1/{EPOCHS} done", of="worker-0")
    out = run(graphdist_faults, tmp_path, max_restarts=1, faults=[freeze], wait_s=300)
    assert out.returncode == 0, out.describe()
    [frozen] = out.injected
    assert frozen.confirmed and frozen.attempt == 0
    assert out.attempts == 2 and out.restart_values == [0, 1], out.describe()
    [restart] = [ln for ln in out.launcher_lines() if "restarting the run" in ln]
    assert "worker-1 was frozen (stopped (state T) for " in restart, restart
    for task in ("worker-0", "worker-1"):
        again = out.lines_of(task, attempt=1)
        assert epochs_done(again) == [2, 3], again
        assert any(RESUMED.match(ln) for ln in again), again
    assert out.leftovers == []
    assert wait_gone(out.pids, EVENTUALLY_S) == []


def test_with_ps_tasks_a_killed_worker_server_is_restarted_under_the_coordinator(
    graphdist_faults,
):
    # a parameter-server run's workers are graphdist servers (no COMMAND): found by their title
    kill = graphdist_faults.kill("worker-1", after=r"^step \d+/", of="chief-0")
    out = graphdist_faults.run(
        [sys.executable, "ps_training.py", "--mode", "custom"],
        chief=True,
        ps=1,
        workers=2,
        max_restarts=1,
        cwd=EXAMPLES,
        env=QUIET_TF,
        faults=[kill],
    )
    assert out.returncode == 0, out.describe()
    [killed] = out.injected
    assert killed.confirmed and out.attempts == 1  # the run itself went on: one attempt
    [line] = [ln for ln in out.launcher_lines() if "restarting the server of" in ln]
    assert "the server of worker-1 was killed by SIGKILL (exit status 137)" in line, line
    assert any(ln.startswith("held-out accuracy") for ln in out.lines_of("chief-0"))
    assert out.leftovers == []
    assert wait_gone(out.pids, EVENTUALLY_S) == []
