"""A preemption notice to ``graphdist run`` (SIGUSR1, Slurm's customary warning signal): every
task gets SIGTERM, TensorFlow's ``PreemptionCheckpointHandler`` saves at one agreed step and
every worker exits 42, and the run goes on at once from that step: zero steps lost, none done
twice (issue 37, point 4)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

import pytest

from tests.conftest import wait_gone

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "examples", "preemptible_training.py")


def steps_of(events: list[dict[str, Any]], task: str = "worker-0") -> list[int]:
    """The steps ``task`` printed, in order (every attempt's)."""
    return [
        int(e["text"].split()[1])
        for e in events
        if e.get("event") == "line" and e.get("task") == task and e["text"].startswith("step ")
    ]


def check_no_step_lost(events: list[dict[str, Any]], steps: int) -> None:
    """Every step from 1 to ``steps`` done once, each attempt after a preemption resuming from
    the last step done before it."""
    done = steps_of(events)
    assert done == list(range(1, steps + 1)), done
    resumed = [e["text"] for e in events if e.get("event") == "resumed"]
    assert resumed, events[-20:]


@pytest.mark.timeout(240)
@pytest.mark.usefixtures("warm_agent")  # the subject is the notice, not how tasks start
def test_a_preemption_notice_saves_and_resumes_with_no_step_lost(tmp_path):
    argv = [sys.executable, "-m", "graphdist", "run", "--workers", "2", "--output-format"]
    argv += ["jsonl", "--", sys.executable, SCRIPT, "--out", str(tmp_path), "--steps", "80"]
    run = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert run.stdout is not None
    events: list[dict[str, Any]] = []
    pids: list[int] = []
    try:
        for line in run.stdout:
            events.append(json.loads(line))
            if events[-1].get("event") == "task-exited":
                pids.append(events[-1]["pid"])
            if not any(e.get("event") == "preemption-notice" for e in events) and steps_of(events)[
                -1:
            ] == [10]:
                run.send_signal(signal.SIGUSR1)
        assert run.wait(60) == 0, run.stderr.read()[-3000:]
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(30)
    kinds = [e["event"] for e in events if e["event"] != "line"]
    assert "preemption-notice" in kinds and "preempted" in kinds, kinds
    notice = next(e for e in events if e["event"] == "preemption-notice")
    assert notice["signal"] == "SIGUSR1" and notice["tasks"] == ["worker-0", "worker-1"]
    preempted = next(e for e in events if e["event"] == "preempted")
    assert preempted["code"] == 42, preempted
    assert [e["attempt"] for e in events if e["event"] == "attempt-started"] == [1, 2]
    check_no_step_lost(events, 80)
    assert wait_gone(pids, 10) == []
