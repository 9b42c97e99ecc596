"""GPU pinning: which physical GPUs each server process of a fleet may see.

A TensorFlow process grabs every visible GPU. Pinning gives each task its own through
``CUDA_VISIBLE_DEVICES`` in its server process, set before TensorFlow initialises its devices:
round-robin over the machine's GPUs (``"round-robin"``) or explicit (``{"worker:0": [0, 1]}``).
A task pinned to nothing sees no GPU at all. Device strings with ``gpu:N`` are then checked
against what each task has (inside a task, ``gpu:0`` is its first pinned GPU):
:func:`task_gpu_counts` says what a fleet's tasks have, as far as it is known.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence

from graphdist._cluster import Cluster
from graphdist._exceptions import ClusterSpecError

__all__ = ["GpuPlan", "available_gpus", "plan_gpus", "task_gpu_counts"]

GpuPlan = str | Mapping[str, Sequence[int]] | Mapping[tuple[str, int], Sequence[int]] | None


def available_gpus() -> list[int]:
    """Physical GPU ids this process may use: ``CUDA_VISIBLE_DEVICES`` if set, else those
    ``nvidia-smi -L`` lists, else none."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [int(x) for x in visible.split(",") if x.strip().isdigit()]
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [i for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def _key(key: str | tuple[str, int], cluster: Cluster) -> tuple[str, int]:
    if isinstance(key, tuple):
        job, index = key
    else:
        job, _, index_text = key.partition(":")
        if not index_text.isdigit():
            raise ClusterSpecError(f"GPU plan key {key!r} is not 'job:index'", key)
        index = int(index_text)
    cluster.task(job, index)  # raises naming what exists
    return job, index


def plan_gpus(
    plan: GpuPlan, cluster: Cluster, gpus: Sequence[int] | None = None
) -> dict[tuple[str, int], list[int]] | None:
    """Each task's physical GPU ids under ``plan`` (``None``: no pinning, every task sees all).

    ``"round-robin"`` deals ``gpus`` (default :func:`available_gpus`) to the tasks in order;
    with fewer GPUs than tasks they are shared, and with none every task gets none. Raises
    ClusterSpecError for an unknown plan, task, or negative GPU id.
    """
    if plan is None:
        return None
    tasks = [(t.job, t.index) for t in cluster]
    if isinstance(plan, str):
        if plan != "round-robin":
            raise ClusterSpecError(f"GPU plan {plan!r} is not 'round-robin' or a mapping", plan)
        ids = list(available_gpus() if gpus is None else gpus)
        return {t: ([ids[i % len(ids)]] if ids else []) for i, t in enumerate(tasks)}
    out: dict[tuple[str, int], list[int]] = {t: [] for t in tasks}
    for key, wanted in plan.items():
        chosen = [int(i) for i in wanted]
        if any(i < 0 for i in chosen):
            raise ClusterSpecError(f"GPU ids for {key!r} must be >= 0, not {chosen}", key)
        out[_key(key, cluster)] = chosen
    return out


def task_gpu_counts(
    pinned: Mapping[tuple[str, int], Sequence[int]] | None,
    cluster: Cluster,
    *,
    here: bool,
    gpus: Sequence[int] | None = None,
) -> dict[tuple[str, int], int] | None:
    """How many GPUs each task's server has, as far as its fleet knows: those ``pinned`` to it
    (:func:`plan_gpus`); unpinned servers on this machine (``here``) see every GPU this process
    may use (``gpus``, default :func:`available_gpus`: none on a machine without one), since
    they inherit its environment; ``None`` for servers elsewhere (a Ray node, a Slurm node, a
    host: unknown, so their GPUs are not checked)."""
    if pinned is not None:
        return {task: len(ids) for task, ids in pinned.items()}
    if not here:
        return None
    count = len(available_gpus() if gpus is None else gpus)
    return {(t.job, t.index): count for t in cluster}
