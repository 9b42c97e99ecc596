"""The seeds' tf.distribute training, for real, through `graphdist run`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import EVENTUALLY_S, QUIET_TF, REPO, wait_gone

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
EXAMPLES = os.path.join(REPO, "examples")


def launch(*args: str, env: dict[str, str] | None = None, **popen) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "graphdist", "run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=EXAMPLES,
        env={**os.environ, **QUIET_TF, **(env or {})},
        **popen,
    )


def finish(proc: subprocess.Popen[str]) -> tuple[int, list[str], str]:
    out, err = proc.communicate(timeout=240)
    return proc.returncode, out.splitlines(), err


def test_mwms_two_workers_identical_weights_real_accuracy_chief_only_checkpoints(tmp_path):
    out, scratch = tmp_path / "out", tmp_path / "scratch"  # scratch: the workers' TMPDIR
    scratch.mkdir()
    code, lines, err = finish(
        launch(
            "--workers",
            "2",
            "--",
            sys.executable,
            "seed_mwms_training.py",
            "--epochs",
            "4",
            "--out",
            str(out),
            env={"TMPDIR": str(scratch)},
        )
    )
    assert code == 0, err[-2000:]
    assert "[worker-0] Number of devices: 2" in lines
    a = np.load(out / "weights-worker-0.npz")
    b = np.load(out / "weights-worker-1.npz")
    assert len(a.files) == 4
    assert all(np.array_equal(a[k], b[k]) for k in a.files)
    accuracy = [float(ln.split()[-1]) for ln in lines if "held-out accuracy" in ln]
    assert len(accuracy) == 2 and min(accuracy) > 0.5  # chance is 0.1
    # Chief-only checkpoints: worker 0 saved into the real folder, worker 1 into a throw-away one
    # in its TMPDIR (removed when it exited); the real folder holds the chief's last two saves.
    saved_to = {
        ln.split("]")[0][1:]: ln.split(" saving checkpoints to ")[1]
        for ln in lines
        if " saving checkpoints to " in ln
    }
    real = str(out / "checkpoints")
    assert saved_to["worker-0"] == real, saved_to
    throwaway = saved_to["worker-1"]
    assert os.path.dirname(throwaway) == str(scratch), saved_to
    assert os.path.basename(throwaway).startswith("graphdist-ckpt-throwaway-")
    assert not os.path.exists(throwaway)
    assert not [n for n in os.listdir(scratch) if n.startswith("graphdist-ckpt-throwaway-")]
    assert sorted(os.listdir(real)) == [
        "checkpoint",
        "ckpt-3.data-00000-of-00001",
        "ckpt-3.index",
        "ckpt-4.data-00000-of-00001",
        "ckpt-4.index",
    ]


def test_killed_worker_then_rerun_resumes_from_the_last_checkpoint(tmp_path):
    epochs = 10
    argv = [
        "--workers",
        "2",
        "--",
        sys.executable,
        "seed_mwms_training.py",
        "--epochs",
        str(epochs),
        "--out",
        str(tmp_path),
    ]
    proc = launch(*argv)
    assert proc.stdout is not None
    pids: dict[str, int] = {}
    try:
        for line in proc.stdout:
            if " pid " in line and line.startswith("[worker-"):
                pids[line.split()[2]] = int(line.split()[-1])
            if line.startswith("[worker-0] epoch 2/"):
                break
        os.kill(pids["worker-1"], signal.SIGKILL)
        code, _, err = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 128 + 9 and "worker-1 exited with code -9" in err  # as a shell reports it
    assert wait_gone(pids.values(), EVENTUALLY_S) == []

    code, lines, err = finish(launch(*argv))
    assert code == 0, err[-2000:]
    resumed = [ln for ln in lines if ln.startswith("[worker-0] resuming from epoch")]
    assert resumed, lines[:20]
    assert int(resumed[0].split()[4]) >= 2
    assert "[worker-0] starting from scratch" not in lines
    assert f"[worker-0] epoch {epochs}/{epochs} done" in " ".join(lines)


@pytest.mark.parametrize("mode", ["custom", "fit"])
def test_parameter_server_training_keeps_variables_on_the_ps(mode):
    code, lines, err = finish(
        launch(
            "--chief",
            "--ps",
            "1",
            "--workers",
            "2",
            "--",
            sys.executable,
            "ps_training.py",
            "--mode",
            mode,
        )
    )
    assert code == 0, err[-2000:]
    devices = [ln.split(" on ")[-1] for ln in lines if "] variable " in ln]
    assert len(devices) == 4
    assert all(d == "/job:ps/replica:0/task:0/device:CPU:0" for d in devices)
    accuracy = float(next(ln for ln in lines if "held-out accuracy" in ln).split()[-1])
    assert accuracy > 0.5
