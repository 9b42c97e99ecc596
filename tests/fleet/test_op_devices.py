"""On a real fleet: every device a graph's ops ask for, however it was written, is checked
before TensorFlow sees the step, in one line naming the op (issue 57); the fleet and its
sessions go on working. And eager execution, forgotten, is said in one line with the fix."""

from __future__ import annotations

import textwrap
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import tensorflow as tf

import graphdist
from graphdist._graph.graphs import split_graph
from tests.conftest import processes_marked, run_python, wait_gone

pytestmark = pytest.mark.integration
tf1 = tf.compat.v1


def refused_twice(fleet: Any, build: Callable[[], Any], **session: Any) -> graphdist.PlacementError:
    """The PlacementError a session of ``fleet`` raises for the graph ``build`` makes, the same
    on its next run too; TensorFlow's error is not in it (TensorFlow never saw the step)."""
    graph = tf.Graph()
    with graph.as_default():
        fetch = build()
    with fleet.session("local", 0, graph=graph, **session) as sess:
        errors = []
        for _ in range(2):
            with pytest.raises(graphdist.PlacementError) as info:
                sess.run(fetch)
            errors.append(info.value)
        assert not sess._closed  # not broken: a mistake in the graph, not a failed task
    first, again = errors
    assert str(first) == str(again) and "\n" not in str(first)
    assert first.__cause__ is None and first.__context__ is None
    return first


def still_works(fleet: Any) -> None:
    """Every task answers and a new session runs the seeds' split graph: 238."""
    assert all(h.ok for h in fleet.health())
    graph, y = split_graph(fleet.device("local", 0), fleet.device("local", 1))
    with fleet.session("local", 1, graph=graph) as sess:
        assert sess.run(y) == 238


TASKS = "(it has /job:local/task:0, /job:local/task:1)"


@pytest.mark.timeout(120)
def test_a_raw_string_on_a_task_the_fleet_lacks_is_one_line_naming_the_op(graphdist_fleet):
    def build() -> Any:
        x = tf.constant(2.0, name="x")
        with tf1.device("/job:local/task:2"):
            return tf.add(x, x, name="add_1")

    error = refused_twice(graphdist_fleet, build)
    assert (
        str(error)
        == f"Op 'add_1' asks for /job:local/task:2, which this fleet does not have {TASKS}"
    )
    assert (error.op, error.device) == ("add_1", "/job:local/task:2")
    still_works(graphdist_fleet)


@pytest.mark.timeout(120)
def test_an_op_added_after_good_steps_is_refused_before_the_next(graphdist_fleet):
    graph = tf.Graph()
    with graph.as_default(), tf1.device("/job:local/task:1"):
        y = tf.constant(2.0) + 300.0
    with graphdist_fleet.session("local", 0, graph=graph) as sess:
        assert sess.run(y) == 302.0
        with graph.as_default(), tf1.device(lambda op: "/job:local/task:7"):  # a device function
            tf.identity(y, name="later")
        with pytest.raises(
            graphdist.PlacementError, match=r"^Op 'later' asks for /job:local/task:7"
        ):
            sess.run(y)
    still_works(graphdist_fleet)


@pytest.mark.timeout(120)
def test_a_replica_device_setters_missing_ps_is_named(graphdist_fleet):
    def build() -> Any:
        setter = tf1.train.replica_device_setter(ps_tasks=1, worker_device="/job:local/task:0")
        with tf1.device(setter):
            weights = tf1.Variable(1.0, name="weights")
            return weights * 3.0

    error = refused_twice(graphdist_fleet, build)
    assert (
        str(error)
        == f"Op 'weights' asks for /job:ps/task:0, which this fleet does not have {TASKS}"
    )
    still_works(graphdist_fleet)


@pytest.mark.timeout(120)
def test_a_gpu_the_tasks_lack_is_named_and_soft_placement_runs_it(graphdist_fleet):
    have = len(graphdist.available_gpus())  # its servers, on this machine, see those: 0 on CPUs

    def build() -> Any:
        with tf1.device("/job:local/task:1"), tf1.device(f"gpu:{have}"):
            return tf.add(tf.constant(2.0, name="two"), 1.0, name="on_gpu")

    error = refused_twice(graphdist_fleet, build)
    lacks = (
        "its tasks have no GPU; place the op on a CPU, or allow soft placement in the session's "
        "config"
        if have == 0
        else f"/job:local/task:1 has {have} GPU(s)"
    )
    assert str(error) == (
        f"Op 'two' asks for /job:local/task:1/device:GPU:{have}, which this fleet does not have "
        f"({lacks})"
    )
    soft = tf1.ConfigProto(allow_soft_placement=True)  # TensorFlow puts it on a device it has
    graph = tf.Graph()
    with graph.as_default():
        fetch = build()
    with graphdist_fleet.session("local", 0, graph=graph, config=soft) as sess:
        assert sess.run(fetch) == 3.0
    still_works(graphdist_fleet)


EAGER = textwrap.dedent(
    """
    import tensorflow.compat.v1 as tf  # eager execution left on: the mistake

    import graphdist

    with graphdist.LocalFleet("local=2") as fleet:
        y = tf.constant(2.0) + 300.0  # eager: runs here, at once
        with fleet.session("local", 0) as sess:
            try:
                sess.run(y)
            except graphdist.PlacementError as exc:
                print("ERROR", exc)
        graph = tf.Graph()  # a graph made explicitly works under eager too
        with graph.as_default(), tf.device(fleet.device("local", 1)):
            z = tf.constant(2.0) + 300.0
        with fleet.session("local", 0, graph=graph) as sess:
            print("RESULT", sess.run(z))
    """
)


@pytest.mark.timeout(120)
def test_a_session_run_under_eager_execution_says_what_to_call(tmp_path):
    script = tmp_path / "eager.py"
    script.write_text(EAGER, encoding="utf-8")
    mark = f"op-devices-{uuid.uuid4().hex}"
    done = run_python([str(script)], env={"GRAPHDIST_TEST_MARK": mark})
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert (
        "ERROR Eager execution is on: TensorFlow ran each op at once in this process, not in "
        "this session's graph; call tf.compat.v1.disable_eager_execution() right after "
        "importing TensorFlow"
    ) in lines
    assert "RESULT 302.0" in lines
    assert wait_gone(processes_marked(mark), 10) == []
