"""A local run's task killed by the kernel's OOM killer reads as out of memory, with its cgroup's
limit, and a run that runs out of memory at each of its last two starts gives up in one line
(issue 55, point 3): the launcher runs in a memory cgroup of the test's own, as under a
container's or systemd's memory limit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.proc.test_oom import memory_cgroup

pytestmark = [pytest.mark.promise, pytest.mark.timeout(120)]

HOG = (
    "import time; print('up', flush=True); time.sleep(0.3); "
    "b = [bytearray(10 << 20) for _ in range(200)]"
)


def test_a_task_the_oom_killer_ended_is_named_and_the_run_gives_up_after_two_starts():
    with memory_cgroup(300 << 20) as (folder, path):
        procs = os.path.join(folder, "cgroup.procs")
        launcher = [
            sys.executable, "-m", "graphdist", "run", "--workers", "1", "--max-restarts", "5",
            "--preload", "none", "--", sys.executable, "-c", HOG,
        ]  # fmt: skip
        done = subprocess.run(
            ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *launcher],
            capture_output=True,
            text=True,
            timeout=100,
        )
        out = done.stdout + done.stderr
        assert done.returncode == 137, out  # the task's own status: killed by SIGKILL
        oom = f"the kernel's OOM killer; limit 300 MiB of memory cgroup {path}"
        assert f"worker-0 ran out of memory ({oom})" in out, out
        assert out.count("restarting the run") == 1, out
        assert "ran out of memory at each of its last 2 starts" in out, out
        with open(procs) as f:
            assert f.read().split() == []  # nothing of the run is left in the cgroup
