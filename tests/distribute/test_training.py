"""The seeds' tf.distribute training, for real, through `graphdist run`."""

from __future__ import annotations

import os
import subprocess
import sys

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


@pytest.mark.parametrize(
    ("mode", "after", "resumed_from"),
    [
        # the custom loop's resume_checkpoint is tested in one process: test_resume.py
        ("fit", "[chief-0] epoch 2/3 done", "backup (after epoch 2)"),
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
    assert any(ln.startswith("  attempt 1: ps-0 was killed by SIGKILL") for ln in lines), lines[-5:]
    accuracy = float([ln for ln in lines if "held-out accuracy" in ln][-1].split()[-1])
    assert accuracy > 0.5
    assert os.listdir(tmp_path) == ([] if mode == "fit" else ["checkpoints"])
    # Every variable lives on the ps task, in the resumed attempt as in the first.
    devices = [ln.split(" on ")[-1] for ln in lines if "] variable " in ln]
    assert len(devices) >= 4
    assert all(d == "/job:ps/replica:0/task:0/device:CPU:0" for d in devices)
    assert wait_gone([p.pid for p in killed], EVENTUALLY_S) == []
