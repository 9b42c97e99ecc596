"""``graphdist run --backend ray`` whose task Ray's memory monitor kills: the run says it ran out
of memory in Ray's words (issue 55, point 3). A Ray instance of the run's own, its threshold
(``RAY_memory_usage_threshold``) 6 points above this machine's use when the test starts; the
task's command then allocates 6 GB, 10 MB at a time, so that the monitor (every 100 ms) kills
its worker whatever the other processes here do meanwhile."""

from __future__ import annotations

import sys

import psutil
import pytest

from tests.distribute.test_run_ray import _graphdist

pytestmark = [
    pytest.mark.integration,
    pytest.mark.xdist_group("ray_cluster"),  # one Ray at a time: memory is the point here
    pytest.mark.needs("ray", extra="ray"),
]

HOG = (
    "import time; print('up', flush=True); time.sleep(0.5); "
    "b = [bytearray(10 << 20) for _ in range(600) if not time.sleep(0.005)]; time.sleep(30)"
)


@pytest.mark.timeout(180)
def test_a_task_rays_memory_monitor_killed_is_named_out_of_memory_in_rays_words() -> None:
    memory = psutil.virtual_memory()
    threshold = min(0.97, 1 - memory.available / memory.total + 0.06)
    env = {"RAY_memory_usage_threshold": f"{threshold:.3f}", "RAY_memory_monitor_refresh_ms": "100"}
    result = _graphdist(
        "run", "--backend", "ray", "--workers", "1", "--preload", "none", "--",
        sys.executable, "-c", HOG, env=env,
    )  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "worker-0 ran out of memory (Ray's memory monitor killed its worker: node " in out, out
    assert "over its threshold of" in out and "is gone" not in out, out
