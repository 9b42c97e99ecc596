"""Preemption and requeue on a real Slurm cluster (issue 37, point 4): Slurm's warning signal to
the batch script (as ``--signal=B:USR1@S`` sends it) reaches every task as SIGTERM, which
TensorFlow's ``PreemptionCheckpointHandler`` saves on, and the run goes on in the same
allocation; a requeued job (``scontrol requeue``) starts the script again in the next allocation
and resumes from the same checkpoint: zero steps lost, none done twice, each counted as a
preemption, never as a failure."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import pytest

from tests.distribute.test_preemption import SCRIPT, steps_of

pytestmark = [pytest.mark.promise]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 100


def _events(slurm: Any, jobid: int) -> list[dict[str, Any]]:
    events = []
    for line in slurm.output(jobid).splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:  # a line being written
                break
    return events


def _wait(slurm: Any, jobid: int, until: Any, what: str, timeout_s: float = 120) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        events = _events(slurm, jobid)
        if until(events):
            return events
        assert time.monotonic() < deadline, f"no {what}: {slurm.output(jobid)[-3000:]}"
        time.sleep(0.2)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("slurm", ["site"], indirect=True)
def test_a_warning_then_a_requeue_lose_no_step(slurm, tmp_path):
    out = os.path.join(slurm.jobs_dir, "preempt")
    script = (
        "#!/bin/bash\n"
        "export TF_CPP_MIN_LOG_LEVEL=2\n"
        f"cd {REPO}\n"
        # exec: the launcher is the batch script, which Slurm's B: warning signal reaches
        f"exec {sys.executable} -m graphdist run --backend slurm --workers 2 "
        f"--output-format jsonl -- {sys.executable} {SCRIPT} --out {out} --steps {STEPS} "
        "--step-time 0.1\n"
    )
    jobid = slurm.sbatch(script, "-N", "2", "--requeue", "--open-mode=append")
    try:
        _wait(slurm, jobid, lambda ev: len(steps_of(ev)) >= 10, "step 10")
        slurm.scancel(jobid, "--batch", "--signal=USR1")  # as --signal=B:USR1@S does
        _wait(
            slurm,
            jobid,
            lambda ev: any(e.get("attempt") == 2 and e.get("event") == "resumed" for e in ev),
            "attempt 2 resumed",
        )
        seen = len(steps_of(_events(slurm, jobid)))
        _wait(slurm, jobid, lambda ev: len(steps_of(ev)) >= seen + 10, "10 more steps")
        slurm.requeue(jobid)
        state = slurm.wait_job(jobid, ("COMPLETED", "FAILED", "CANCELLED"), timeout_s=240)
        events = _events(slurm, jobid)
        text = slurm.output(jobid)
        assert state == "COMPLETED", text[-4000:]
    finally:
        if slurm.job_state(jobid) not in ("COMPLETED", "FAILED", "CANCELLED", None):
            slurm.scancel(jobid)
    assert steps_of(events) == list(range(1, STEPS + 1)), steps_of(events)  # once each, in order
    kinds = [e["event"] for e in events if e["event"] != "line"]
    assert kinds.count("preemption-notice") == 1, kinds
    preempted = [e for e in events if e["event"] == "preempted"]
    assert preempted and preempted[0]["attempt"] == 1 and preempted[0]["code"] == 42, preempted
    assert "gave-up" not in kinds and "restarting" not in kinds, kinds  # never a failure
    resumed = [e["text"] for e in events if e["event"] == "resumed" and e["task"] == "worker-0"]
    assert len(resumed) == 2, resumed  # after the notice, and in the requeued job
    ended = [e["outcome"] for e in events if e["event"] == "run-ended"]
    assert ended and ended[-1] == "every task exited 0", ended
    # the requeued job's run ends as a preemption: its tasks saved and exited 42 (their guards
    # once took a multi-threaded command's zombie main thread for gone and exited 143 unreaped)
    exits = [e for e in events if e["event"] in ("task-started", "task-exited", "run-ended")]
    assert ended[:-1] == ["preempted (stopped by SIGTERM)"], exits
