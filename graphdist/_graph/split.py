"""Split a graph over the tasks of a cluster: build it, then place every op by a plan.

:func:`split` calls a graph-building function inside a fresh (or given) graph, then gives every op
that the function did not place itself a device from a plan:

- :class:`ByName`: op name or name scope → task (the longest matching scope wins);
- :class:`RoundRobin`: top-level name scopes, in creation order, over the tasks;
- :class:`AutoPlan`: balances an estimated cost per op (from static shapes) across tasks while
  keeping the bytes that cross tasks low.

Ops that TensorFlow must colocate (a variable and its assign/read ops) stay together. Every device
is checked against the cluster, so a plan that names a missing task fails before anything runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from graphdist._cluster import Cluster, ClusterLike, Task
from graphdist._exceptions import PlacementError, SplitError
from graphdist._graph.placement import check_device, parse_device

if TYPE_CHECKING:
    import tensorflow as tf

__all__ = ["AutoPlan", "ByName", "Plan", "RoundRobin", "SplitError", "SplitGraph", "split"]

TaskRef = str | int | tuple[str, int] | Task
"""A task in a plan: ``"local:1"``, ``"/job:local/task:1"``, ``("local", 1)``, a :class:`Task`,
or a bare index when the cluster has one job."""


def resolve_task(ref: TaskRef, cluster: Cluster) -> Task:
    """Turn any :data:`TaskRef` into the cluster's :class:`Task`; raises PlacementError."""
    if isinstance(ref, Task):
        job, index = ref.job, ref.index
    elif isinstance(ref, tuple):
        job, index = ref
    elif isinstance(ref, int) and not isinstance(ref, bool):
        if len(cluster.jobs) != 1:
            raise PlacementError(
                f"Task {ref} names no job, and the cluster has several ({', '.join(cluster.jobs)})"
                "; write 'job:index'"
            )
        job, index = cluster.jobs[0], ref
    elif isinstance(ref, str) and ref.startswith("/"):
        spec = check_device(ref, cluster)
        if spec.task is None:
            raise PlacementError(f"Device {ref!r} names no task; add /task:N", ref)
        job, index = spec.job or cluster.jobs[0], spec.task
    elif isinstance(ref, str) and ":" in ref:
        job, _, index_text = ref.partition(":")
        if not index_text.isdigit():
            raise PlacementError(f"Task {ref!r} is not 'job:index'", ref)
        index = int(index_text)
    else:
        raise PlacementError(f"Cannot read a task from {ref!r}; write 'job:index'", str(ref))
    device = f"/job:{job}/task:{index}"
    check_device(device, cluster)
    return cluster.task(job, index)


def _device_of(task: Task) -> str:
    return f"/job:{task.job}/replica:0/task:{task.index}"


class Plan:
    """Decides a task for each op of a graph that has no device yet."""

    def assign(self, ops: Sequence[Any], cluster: Cluster) -> dict[str, Task]:
        raise NotImplementedError


class ByName(Plan):
    """Place ops by name: ``{"y2": "local:0", "layer1": "local:1"}``.

    A key matches an op of that exact name or any op inside that name scope; the longest key wins.
    Ops no key matches go to ``default`` (a task ref), or raise :class:`SplitError` if it is unset.
    A key that matches no op at all raises :class:`SplitError` (a typo should not pass quietly).
    """

    def __init__(self, rules: Mapping[str, TaskRef], default: TaskRef | None = None) -> None:
        if not rules and default is None:
            raise SplitError("A ByName plan needs at least one rule or a default")
        self.rules = dict(rules)
        self.default = default

    def assign(self, ops: Sequence[Any], cluster: Cluster) -> dict[str, Task]:
        tasks = {key: resolve_task(ref, cluster) for key, ref in self.rules.items()}
        default = resolve_task(self.default, cluster) if self.default is not None else None
        used: set[str] = set()
        out: dict[str, Task] = {}
        by_length = sorted(tasks, key=len, reverse=True)
        for op in ops:
            key = next((k for k in by_length if op.name == k or op.name.startswith(k + "/")), None)
            if key is not None:
                used.add(key)
                out[op.name] = tasks[key]
            elif default is not None:
                out[op.name] = default
            else:
                raise SplitError(
                    f"Op {op.name!r} matches no rule of the plan; add a rule for it or its scope, "
                    "or pass default="
                )
        unused = sorted(set(tasks) - used)
        if unused:
            raise SplitError(
                f"Plan rule(s) {', '.join(map(repr, unused))} match no op of the graph; the ops "
                f"are: {', '.join(op.name for op in ops[:20])}" + (" ..." if len(ops) > 20 else "")
            )
        return out


def _tasks_or_all(tasks: Iterable[TaskRef] | None, cluster: Cluster) -> list[Task]:
    resolved = [resolve_task(t, cluster) for t in tasks] if tasks is not None else list(cluster)
    if not resolved:
        raise SplitError("The plan has no tasks to place ops on")
    return resolved


class RoundRobin(Plan):
    """Deal top-level name scopes (an op without a scope is its own unit), in creation order,
    over ``tasks`` (default: every task of the cluster)."""

    def __init__(self, tasks: Iterable[TaskRef] | None = None) -> None:
        self.tasks = list(tasks) if tasks is not None else None

    def assign(self, ops: Sequence[Any], cluster: Cluster) -> dict[str, Task]:
        tasks = _tasks_or_all(self.tasks, cluster)
        units: dict[str, Task] = {}
        out: dict[str, Task] = {}
        for op in ops:
            unit = op.name.split("/")[0]
            if unit not in units:
                units[unit] = tasks[len(units) % len(tasks)]
            out[op.name] = units[unit]
        return out


_FREE_OPS = {
    "Const",
    "Identity",
    "Placeholder",
    "PlaceholderWithDefault",
    "NoOp",
    "VariableV2",
    "VarHandleOp",
    "ReadVariableOp",
    "Assign",
    "AssignVariableOp",
    "IsVariableInitialized",
    "VarIsInitializedOp",
    "Shape",
}


def _num_elements(tensor: Any) -> int:
    shape = tensor.shape
    if shape.rank is None:
        return 1
    n = 1
    for dim in shape.as_list():
        n *= dim if dim is not None else 1
    return n


def _bytes(tensor: Any) -> int:
    size = getattr(tensor.dtype, "size", 4) or 4
    return _num_elements(tensor) * size


def estimate_cost(op: Any) -> float:
    """A rough FLOP count of ``op`` from static shapes (0 for sources, reads and assigns)."""
    if op.type in _FREE_OPS:
        return 0.0
    if op.type in ("MatMul", "BatchMatMulV2", "BatchMatMul") and len(op.inputs) == 2:
        a = op.inputs[0]
        out = _num_elements(op.outputs[0]) if op.outputs else 1
        ta = bool(op.get_attr("transpose_a")) if op.type == "MatMul" else False
        dims = a.shape.as_list() if a.shape.rank else [1]
        k = dims[-2] if ta and len(dims) >= 2 else dims[-1]
        return 2.0 * out * (k or 1)
    out = sum(_num_elements(t) for t in op.outputs)
    ins = sum(_num_elements(t) for t in op.inputs)
    return float(max(out, ins, 1))


class AutoPlan(Plan):
    """Greedy balancing: each op with a cost goes, in creation order, to the task where
    ``load + cost + transfer_weight * bytes_from_other_tasks`` is lowest; free ops (constants,
    variables, reads) then follow their first consumer. ``tasks`` defaults to every task.
    """

    def __init__(self, tasks: Iterable[TaskRef] | None = None, transfer_weight: float = 1.0):
        if transfer_weight < 0:
            raise SplitError(f"transfer_weight must be >= 0, not {transfer_weight!r}")
        self.tasks = list(tasks) if tasks is not None else None
        self.transfer_weight = transfer_weight

    def assign(self, ops: Sequence[Any], cluster: Cluster) -> dict[str, Task]:
        tasks = _tasks_or_all(self.tasks, cluster)
        load = [0.0] * len(tasks)
        placed: dict[str, int] = {}
        names = {op.name for op in ops}
        for op in ops:
            cost = estimate_cost(op)
            if cost == 0.0:
                continue
            scores = []
            for i in range(len(tasks)):
                moved = sum(
                    _bytes(t) for t in op.inputs if t.op.name in placed and placed[t.op.name] != i
                )
                scores.append(load[i] + cost + self.transfer_weight * moved)
            best = min(range(len(tasks)), key=lambda i: (scores[i], i))
            placed[op.name] = best
            load[best] += cost
        # Free ops: with their first placed consumer, else their producer, else the least loaded.
        for op in ops:
            if op.name in placed:
                continue
            consumers = [c for t in op.outputs for c in t.consumers() if c.name in placed]
            producers = [t.op for t in op.inputs if t.op.name in placed and t.op.name in names]
            if consumers:
                placed[op.name] = placed[consumers[0].name]
            elif producers:
                placed[op.name] = placed[producers[0].name]
            else:
                placed[op.name] = min(range(len(tasks)), key=lambda i: (load[i], i))
        return {name: tasks[i] for name, i in placed.items()}


@dataclass(frozen=True)
class SplitGraph:
    """What :func:`split` built: the ``graph``, the build function's ``outputs`` and the device
    every op was given (``devices``: op name → device string)."""

    graph: Any
    outputs: Any
    devices: Mapping[str, str]

    def ops_on(self, job: str, index: int) -> list[str]:
        """Names of the ops placed on ``job:index``."""
        return sorted(
            name
            for name, dev in self.devices.items()
            if (parse_device(dev).job, parse_device(dev).task) == (job, index)
        )


def split(
    build: Callable[[], Any],
    plan: Plan | Mapping[str, TaskRef],
    cluster: ClusterLike,
    *,
    graph: tf.Graph | None = None,
) -> SplitGraph:
    """Build ``build()`` in ``graph`` (default a new one) and place every op by ``plan``.

    ``plan`` is a :class:`Plan` or a mapping (taken as :class:`ByName`). Ops that ``build`` placed
    itself keep their device (it is checked against the cluster). Raises :class:`SplitError` for
    a plan that does not fit the graph and :class:`PlacementError` for a task the cluster lacks;
    the cluster itself is checked first (an empty one raises ClusterSpecError).
    """
    import tensorflow as tf

    cluster = Cluster.parse(cluster)
    if isinstance(plan, Mapping):
        plan = ByName(plan)
    graph = graph if graph is not None else tf.Graph()
    before = {op.name for op in graph.get_operations()}
    with graph.as_default():
        outputs = build()
    new_ops = [op for op in graph.get_operations() if op.name not in before]
    if not new_ops:
        raise SplitError("The build function created no ops")
    for op in new_ops:
        if op.device:
            check_device(op.device, cluster)
    free = [op for op in new_ops if not op.device]
    chosen = plan.assign(free, cluster) if free else {}
    for op in free:
        op._set_device(_device_of(chosen[op.name]))
    _honour_colocation(new_ops, graph)
    devices = {op.name: parse_device(op.device).to_string() for op in new_ops}
    return SplitGraph(graph, outputs, devices)


def _honour_colocation(ops: Sequence[Any], graph: Any) -> None:
    """Give an op that must be colocated with another (``loc:@name``), or that takes a resource
    or ref variable as input (an assign or read of a resource variable carries no ``loc:@``),
    that op's device. Ops come in creation order, so a chain of handles follows its source."""
    for op in ops:
        others = [
            t.op
            for t, wanted in zip(op.inputs, op._input_types, strict=True)
            if wanted.name == "resource" or wanted._is_ref_dtype
        ]
        for group in op.colocation_groups():
            target = group.decode()[len("loc:@") :]
            if target != op.name:
                try:
                    others.append(graph.get_operation_by_name(target))
                except KeyError:
                    continue
        for other in others:
            if other.device and other.device != op.device:
                op._set_device(other.device)
