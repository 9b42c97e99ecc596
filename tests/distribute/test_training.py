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


def test_mwms_two_workers_identical_weights_real_accuracy_backup_dropped(tmp_path):
    out = tmp_path / "out"
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
        )
    )
    assert code == 0, err[-2000:]
    assert "[worker-0] Number of devices: 2" in lines
    assert "[worker-0] starting from scratch" in lines
    assert not [ln for ln in lines if "graphdist: resumed from" in ln]  # nothing to resume
    a = np.load(out / "weights-worker-0.npz")
    b = np.load(out / "weights-worker-1.npz")
    assert len(a.files) == 4
    assert all(np.array_equal(a[k], b[k]) for k in a.files)
    accuracy = [float(ln.split()[-1]) for ln in lines if "held-out accuracy" in ln]
    assert len(accuracy) == 2 and min(accuracy) > 0.5  # chance is 0.1
    # The backup (the chief's; worker 1's throw-away copies too) is gone after success.
    assert sorted(os.listdir(out)) == ["weights-worker-0.npz", "weights-worker-1.npz"]


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
    backup = tmp_path / "backup"
    assert os.listdir(backup / "chief"), "the chief's backup is kept for the rerun"

    code, lines, err = finish(launch(*argv))
    assert code == 0, err[-2000:]
    resumed = [ln for ln in lines if ln.startswith("[worker-0] resuming from epoch")]
    assert resumed, lines[:20]
    assert int(resumed[0].split()[4]) >= 2
    assert "[worker-0] starting from scratch" not in lines
    epoch = resumed[0].split()[4]
    assert f"[worker-0] graphdist: resumed from {backup} (after epoch {epoch})" in lines
    assert f"[worker-0] epoch {epochs}/{epochs} done" in " ".join(lines)
    assert not backup.exists()


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


@pytest.mark.parametrize(
    ("mode", "after", "resumed_from"),
    [
        ("fit", "[chief-0] epoch 2/3 done", "backup (after epoch 2)"),
        ("custom", "[chief-0] step 100/150 done", "checkpoints/ckpt-2"),
    ],
)
def test_parameter_server_run_resumes_after_its_ps_task_dies(tmp_path, mode, after, resumed_from):
    import psutil

    def is_ps(p: psutil.Process) -> bool:  # a fleet server's title: "graphdist ps:0 (fleet ...)"
        try:
            return " ".join(p.cmdline()).startswith("graphdist ps:0 ")
        except psutil.Error:
            return False

    proc = launch(
        *("--chief", "--ps", "1", "--workers", "2", "--max-restarts", "1", "--"),
        *(sys.executable, "ps_training.py", "--mode", mode, "--out", str(tmp_path)),
    )
    assert proc.stdout is not None
    lines, killed = [], []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if not killed and lines[-1] == after:
                killed = [p for p in psutil.Process(proc.pid).children(recursive=True) if is_ps(p)]
                assert len(killed) == 1, killed
                killed[0].kill()
        code, _, err = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, err[-2000:]
    assert killed, lines[-20:]
    assert sum("restarting the run" in ln for ln in lines) == 1
    assert f"[chief-0] graphdist: resumed from {tmp_path}/{resumed_from}" in lines
    assert any(ln.startswith("  attempt 1: ps-0 exited with code -9") for ln in lines), lines[-5:]
    accuracy = float([ln for ln in lines if "held-out accuracy" in ln][-1].split()[-1])
    assert accuracy > 0.5
    assert os.listdir(tmp_path) == ([] if mode == "fit" else ["checkpoints"])
    assert wait_gone([p.pid for p in killed], EVENTUALLY_S) == []
