"""Graph splitting plans, master choice and placement evidence (the picture, TensorBoard)."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

import graphdist
from graphdist._graph.graphs import SPLIT_GRAPH_RESULT

pytestmark = pytest.mark.timeout(120)
CLUSTER = graphdist.Cluster({"local": ["h:1", "h:2"]})
FOUR = graphdist.Cluster({"worker": ["h:1", "h:2", "h:3", "h:4"], "ps": ["h:5"]})


def seed_build():
    x = tf.constant(2, name="x")
    y2 = tf.subtract(x, 66, name="y2")
    y1 = tf.add(x, 300, name="y1")
    return tf.add(y1, y2, name="y")


def test_by_name_plan_places_ops_and_scopes():
    plan = graphdist.ByName({"y2": "local:0", "y": 1}, default="local:1")
    placed = graphdist.split(seed_build, plan, CLUSTER)
    assert placed.devices["y2"] == "/job:local/replica:0/task:0"
    assert placed.devices["y"] == "/job:local/replica:0/task:1"


def test_plan_default_and_longest_scope_wins():
    def build():
        with tf.name_scope("a"):
            with tf.name_scope("b"):
                inner = tf.constant(1.0, name="c")
            outer = tf.identity(inner, name="d")
        return tf.identity(outer, name="out")

    plan = graphdist.ByName({"a": "local:0", "a/b": "local:1"}, default="/job:local/task:1")
    placed = graphdist.split(build, plan, CLUSTER)
    assert placed.ops_on("local", 0) == ["a/d"]
    assert placed.ops_on("local", 1) == ["a/b/c", "out"]


def test_plan_errors_are_typed_and_name_the_culprit():
    with pytest.raises(graphdist.SplitError, match="'nosuchop'"):
        graphdist.split(seed_build, graphdist.ByName({"nosuchop": "local:0"}, default=0), CLUSTER)
    with pytest.raises(graphdist.SplitError, match="matches no rule"):
        graphdist.split(seed_build, {"y": "local:0"}, CLUSTER)
    with pytest.raises(graphdist.PlacementError, match="no task with index 7"):
        graphdist.split(seed_build, graphdist.ByName({"y": "local:7"}, default=0), CLUSTER)
    with pytest.raises(graphdist.PlacementError, match="no job 'ps'"):
        graphdist.split(seed_build, graphdist.RoundRobin(["ps:0"]), CLUSTER)
    with pytest.raises(graphdist.ClusterSpecError, match="no jobs"):
        graphdist.split(seed_build, graphdist.RoundRobin(), {})
    with pytest.raises(graphdist.SplitError, match="no tasks"):
        graphdist.split(seed_build, graphdist.RoundRobin([]), CLUSTER)


def test_round_robin_deals_top_level_scopes():
    def build():
        outs = []
        for i in range(4):
            with tf.name_scope(f"part{i}"):
                outs.append(tf.square(tf.constant(float(i)), name="sq"))
        return outs

    placed = graphdist.split(build, graphdist.RoundRobin(["worker:0", "worker:1"]), FOUR)
    assert [placed.devices[f"part{i}/sq"][-1] for i in range(4)] == ["0", "1", "0", "1"]


def test_auto_plan_balances_products_and_keeps_sources_with_consumers():
    def build():
        outs = []
        for i in range(4):
            with tf.name_scope(f"p{i}"):
                a = tf.ones([64, 64], name="a")
                outs.append(tf.matmul(a, a, name="ab"))
        return tf.add_n(outs, name="total")

    placed = graphdist.split(build, graphdist.AutoPlan(["worker:0", "worker:1"]), FOUR)
    tasks = [placed.devices[f"p{i}/ab"] for i in range(4)]
    assert sorted(tasks).count("/job:worker/replica:0/task:0") == 2
    for i in range(4):
        assert placed.devices[f"p{i}/a"] == placed.devices[f"p{i}/ab"]


@pytest.mark.parametrize(
    "plan",
    [graphdist.RoundRobin(), graphdist.ByName({"v": "ps:0"}, default="worker:1")],
    ids=["round-robin", "by-name"],
)
def test_variables_stay_with_their_assign_ops(plan):
    def build():
        v = tf.compat.v1.Variable(1.0, name="v")
        return v.assign_add(1.0), v.read_value()

    placed = graphdist.split(build, plan, FOUR)
    v_device = placed.devices["v"]
    assign, read = placed.outputs
    # Top-level names, outside the "v" scope: only the colocation of the handle keeps them there.
    assert not assign.op.name.startswith("v/") and assign.op.type == "AssignAddVariableOp"
    assert placed.devices[assign.op.name] == v_device
    handle_users = [
        op.name for op in placed.graph.get_operations() if any(t.op.name == "v" for t in op.inputs)
    ]
    assert assign.op.name in handle_users and len(handle_users) >= 4  # assign, read, init, ...
    assert {name: placed.devices[name] for name in handle_users} == dict.fromkeys(
        handle_users, v_device
    )
    assert placed.devices[read.op.inputs[0].op.name] == v_device


def test_master_for_picks_the_owner_of_the_fetches():
    graph, y = graphdist._graph.graphs.split_graph("/job:local/task:0", "/job:local/task:1")
    assert graphdist.master_for(y, CLUSTER).index == 1
    assert graphdist.master_for([graph.get_tensor_by_name("y2:0")], CLUSTER).index == 0
    assert graphdist.master_for([], CLUSTER).index == 0


def test_the_split_graph_result_is_the_seeds_238():
    """The seeds printed 238 ((2 + 300) + (2 - 66)); every test compares with that literal, so
    the constant and the graph are checked against the seeds, not against each other."""
    assert SPLIT_GRAPH_RESULT == 238
    graph, y = graphdist._graph.graphs.split_graph(None, None)
    with graphdist.session(graph=graph) as sess:  # in this process: no server
        assert sess.run(y) == 238


@pytest.mark.integration
def test_split_seed_graph_runs_238_on_the_chosen_master(graphdist_fleet):
    plan = graphdist.ByName({"y2": "local:0"}, default="local:1")
    placed = graphdist.split(seed_build, plan, graphdist_fleet.cluster)
    with graphdist_fleet.session_for(placed.outputs, graph=placed.graph) as sess:
        assert sess._target == graphdist_fleet.target("local", 1).encode()
        assert sess.run(placed.outputs) == 238


def traced_seed_placement(fleet):
    graph, y = graphdist._graph.graphs.split_graph(
        fleet.device("local", 0), fleet.device("local", 1)
    )
    with fleet.session("local", 0, graph=graph, config=graphdist.no_folding_config()) as sess:
        _, placement = graphdist.run_traced(sess, y)
    return placement


@pytest.mark.integration
def test_placement_dot_picture_and_tensorboard_log(graphdist_fleet, tmp_path):
    placement = traced_seed_placement(graphdist_fleet)
    dot = placement.to_dot()
    assert '"y2" [label="y2\\nSub\\nlocal-0"' in dot and '"y1" -> "y";' in dot
    path = placement.write_picture(tmp_path / "g.dot")
    assert path.endswith("g.dot")
    with open(path, encoding="utf-8") as f:
        assert f.read() == dot
    logdir = placement.write_tensorboard(tmp_path / "tb")
    events = [f for f in os.listdir(logdir) if f.startswith("events.out.tfevents")]
    assert len(events) == 1
    kinds = set()
    for event in tf.compat.v1.train.summary_iterator(os.path.join(logdir, events[0])):
        kinds.add(event.WhichOneof("what"))
    assert {"graph_def", "tagged_run_metadata"} <= kinds


@pytest.mark.integration
def test_placement_svg_picture(graphdist_fleet, tmp_path):
    if shutil.which("dot") is None:  # nothing installs system packages: report the skip
        pytest.skip("Graphviz 'dot' not installed (apt-get install graphviz); SVG picture untested")
    placement = traced_seed_placement(graphdist_fleet)
    svg = placement.write_picture(tmp_path / "g.svg")
    with open(svg, encoding="utf-8") as f:
        text = f.read()
    assert "<svg" in text and ">y2</text>" in text and ">local-1</text>" in text


def test_svg_picture_without_graphviz_says_in_one_line_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "no-graphviz-here"))
    assert shutil.which("dot") is None
    placement = graphdist.Placement({"y": "/job:local/task:0"}, {"y": ""})
    with pytest.raises(graphdist.GraphdistError) as info:
        placement.write_picture(tmp_path / "g.svg")
    message = str(info.value)
    assert "\n" not in message and "apt-get install graphviz" in message, message
    assert ".dot" in message  # the way out that needs no Graphviz
    assert not (tmp_path / "g.svg").exists()


def test_picture_format_errors_are_clear(tmp_path):
    placement = graphdist.Placement({"y": "/job:local/task:0"}, {"y": ""})
    with pytest.raises(graphdist.GraphdistError, match=r"\.bmp"):
        placement.write_picture(tmp_path / "x.bmp")


@pytest.mark.integration
def test_split_result_matches_a_local_session(graphdist_fleet_factory):
    rng = np.random.default_rng(1)
    mats = [rng.standard_normal((48, 48)).astype(np.float32) for _ in range(8)]

    def build():
        prods = []
        for i in range(4):
            with tf.name_scope(f"prod{i}"):
                prods.append(tf.matmul(tf.constant(mats[2 * i]), tf.constant(mats[2 * i + 1])))
        return tf.add_n(prods)

    local = tf.Graph()
    with local.as_default():
        out = build()
    with graphdist.session(graph=local) as sess:
        expected = sess.run(out)
    fleet = graphdist_fleet_factory("worker=4")
    placed = graphdist.split(build, graphdist.AutoPlan(), fleet.cluster)
    config = graphdist.no_folding_config()
    with fleet.session_for(placed.outputs, graph=placed.graph, config=config) as sess:
        result, placement = graphdist.run_traced(sess, placed.outputs)
    assert np.allclose(result, expected, rtol=1e-4, atol=1e-4)
    assert len({placement.task_of(f"prod{i}/MatMul") for i in range(4)}) == 4
