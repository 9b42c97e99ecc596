"""The devices a graph's ops ask for, checked against a fleet's cluster before a step: the
devices TensorFlow merges from every way of writing them (a graph built in process, no server)
through ``check_ops`` (its rule: tests/graph/test_placement.py), the guard's look at new ops
only, what a fleet knows of its GPUs and the eager-mode hint."""

from __future__ import annotations

from typing import Any

import pytest
import tensorflow as tf

from graphdist import PlacementError
from graphdist._cluster import Cluster
from graphdist._fleet import guard as guard_module
from graphdist._graph import session as session_module
from graphdist._graph.placement import check_ops
from graphdist._proc.gpus import task_gpu_counts
from tests.fleet.test_status import FakeFleet

tf1 = tf.compat.v1
TWO = Cluster({"local": ["h:1", "h:2"]})
NO_GPU = {("local", 0): 0, ("local", 1): 0}


def refusal(ops: list[tuple[str, str]], **kw: Any) -> PlacementError:
    with pytest.raises(PlacementError) as info:
        check_ops(ops, TWO, **kw)
    return info.value


# -- what TensorFlow merges: every way of writing a device (a graph, no server) -----------------


def ops_of(graph: tf.Graph) -> list[tuple[str, str]]:
    return [(op.name, op.device) for op in graph.get_operations()]


def test_devices_however_written_reach_the_check_as_tensorflow_merged_them():
    graph = tf.Graph()
    with graph.as_default():
        with tf1.device("/job:local/task:1"):
            x = tf.constant(1.0, name="x")
            with tf1.device("cpu:0"):  # merged: /job:local/task:1/device:CPU:0
                tf.identity(x, name="on_cpu")
        with tf1.colocate_with(x):
            tf.identity(x, name="colocated")  # takes x's device
        with tf1.device(lambda op: "/job:local/task:0" if op.type == "Identity" else ""):
            tf.identity(x, name="by_function")
    check_ops(ops_of(graph), TWO)
    assert dict(ops_of(graph))["colocated"] == "/job:local/task:1"
    with graph.as_default(), tf1.device(lambda op: "/job:local/task:3"):
        tf.identity(x, name="by_bad_function")
    assert refusal(ops_of(graph)).op == "by_bad_function"


def test_a_replica_device_setters_missing_ps_is_named():
    graph = tf.Graph()
    setter = tf1.train.replica_device_setter(ps_tasks=1, worker_device="/job:local/task:0")
    with graph.as_default(), tf1.device(setter):
        tf1.Variable(1.0, name="weights")
    error = refusal(ops_of(graph))
    assert error.op == "weights" and error.device == "/job:ps/task:0"


def test_a_short_gpu_string_on_a_cpu_fleet_is_named():
    graph = tf.Graph()
    with graph.as_default(), tf1.device("gpu:0"):
        tf.constant(1.0, name="c")
    assert refusal(ops_of(graph), gpus=NO_GPU).device == "/device:GPU:0"


# -- the guard: new ops only, before the step ---------------------------------------------------


class CountingGraph:
    """A real graph whose ``get_operations`` calls are counted (the guard's only O(ops) read)."""

    def __init__(self) -> None:
        self.graph = tf.Graph()
        self.reads = 0

    @property
    def version(self) -> int:
        return self.graph.version

    def get_operations(self) -> list[Any]:
        self.reads += 1
        return self.graph.get_operations()


class FakeSession:
    def __init__(self, graph: Any) -> None:
        self.graph = graph


class GpuFleet(FakeFleet):
    """A FakeFleet whose tasks' GPU counts the test sets (and whose reads it counts)."""

    def __init__(self, gpus: dict[tuple[str, int], int] | None) -> None:
        super().__init__()
        self.gpu_counts, self.gpu_reads = gpus, 0

    def _task_gpus(self) -> dict[tuple[str, int], int] | None:
        self.gpu_reads += 1
        return self.gpu_counts


def guarded(gpus: dict[tuple[str, int], int] | None = None, **kw: Any) -> tuple[Any, Any, Any]:
    fleet = GpuFleet(gpus)
    guard = guard_module.SessionGuard(fleet, fleet.task("local", 0), **kw)
    graph = CountingGraph()
    return guard, graph, FakeSession(graph)


def test_a_step_without_new_ops_reads_no_op_and_new_ops_are_checked_before_the_next():
    guard, graph, sess = guarded()
    with graph.graph.as_default(), tf1.device("/job:local/task:1"):
        y = tf.constant(2.0, name="y")
    guard._needed(sess)
    assert graph.reads == 1
    for _ in range(3):
        guard._needed(sess)
    assert graph.reads == 1  # no new op: an int compare, no read of the graph
    with graph.graph.as_default(), tf1.device("/job:local/task:2"):
        tf.identity(y, name="too_far")
    for _ in range(2):  # the op stays in the graph: every step is refused, before TensorFlow
        with pytest.raises(PlacementError, match=r"^Op 'too_far' asks for /job:local/task:2"):
            guard._needed(sess)
    assert guard.broken is None  # a mistake in the graph, not a failed task


def test_the_tasks_a_run_needs_follow_the_devices_the_checked_ops_name():
    guard, graph, sess = guarded()
    guard._ran = True
    with graph.graph.as_default():
        tf.constant(1.0, name="anywhere")
    assert [t.index for t in guard._needed(sess)] == [0]
    with graph.graph.as_default(), tf1.device("/job:local/task:1"):
        tf.constant(1.0, name="on_1")
    assert [t.index for t in guard._needed(sess)] == [0, 1]


def test_gpus_are_read_only_for_gpu_devices_and_not_checked_under_soft_placement():
    guard, graph, sess = guarded(NO_GPU)
    with graph.graph.as_default(), tf1.device("/job:local/task:1"):
        tf.constant(1.0)
    guard._needed(sess)
    assert guard.fleet.gpu_reads == 0  # no GPU asked for: nvidia-smi is never run for it
    with graph.graph.as_default(), tf1.device("/job:local/task:1/gpu:0"):
        tf.constant(1.0, name="on_gpu")
    with pytest.raises(PlacementError, match="its tasks have no GPU"):
        guard._needed(sess)
    soft, graph, sess = guarded(NO_GPU, soft_placement=True)  # TensorFlow puts it on a CPU
    with graph.graph.as_default(), tf1.device("/job:local/task:1/gpu:0"):
        tf.constant(1.0)
    soft._needed(sess)


# -- what a fleet knows of its tasks' GPUs --------------------------------------------------------


def test_gpu_counts_come_from_pinning_else_this_machine_for_servers_here_else_unknown():
    pinned = {("local", 0): [0, 1], ("local", 1): []}
    assert task_gpu_counts(pinned, TWO, here=False) == {("local", 0): 2, ("local", 1): 0}
    assert task_gpu_counts(None, TWO, here=True, gpus=[]) == NO_GPU  # a CPU-only machine
    assert task_gpu_counts(None, TWO, here=True, gpus=[3, 5]) == {
        ("local", 0): 2,
        ("local", 1): 2,
    }
    assert task_gpu_counts(None, TWO, here=False) is None  # Ray, Slurm, hosts: unknown


def test_a_fleets_device_refuses_a_gpu_of_its_cpu_only_machine(monkeypatch):
    fleet = FakeFleet()
    fleet.pids_here = True
    monkeypatch.setattr("graphdist._proc.gpus.available_gpus", lambda: [])
    with pytest.raises(PlacementError, match="task local:1 has 0 GPU"):
        fleet.device("local", 1, gpu=0)
    assert fleet.device("local", 1, cpu=0) == "/job:local/replica:0/task:1/device:CPU:0"


# -- eager execution: one line that says what to call -------------------------------------------


EMPTY = RuntimeError("The Session graph is empty. Add operations to the graph before calling run.")
EAGER_FETCH = AttributeError("Tensor.graph is undefined when eager execution is enabled.")


def test_eager_execution_is_named_with_the_call_that_turns_it_off(monkeypatch):
    from tensorflow.python.eager import context

    monkeypatch.setattr(context, "default_execution_mode", context.EAGER_MODE)
    error = session_module.eager_error(EMPTY)
    assert str(error) == (
        "Eager execution is on: TensorFlow ran each op at once in this process, not in this "
        "session's graph; call tf.compat.v1.disable_eager_execution() right after importing "
        "TensorFlow"
    )
    assert isinstance(session_module.eager_error(EAGER_FETCH), PlacementError)
    assert session_module.eager_error(RuntimeError("something else")) is None
    monkeypatch.setattr(context, "default_execution_mode", context.GRAPH_MODE)
    assert session_module.eager_error(EMPTY) is None  # graph mode: TensorFlow's words stand
