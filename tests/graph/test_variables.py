"""Shared variables: exact names, shared by sessions and client processes, initialized once."""

from __future__ import annotations

import pytest
import tensorflow as tf

import graphdist

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_exact_name_even_inside_a_scope_and_get_or_create():
    graph = tf.Graph()
    with graph.as_default(), tf.name_scope("model"):
        v = graphdist.shared_variable("weights", 1.0, "/job:local/task:0")
        again = graphdist.shared_variable("weights", 1.0, "/job:local/task:0", graph=graph)
    assert v.op.name == "weights"
    assert again is v
    with pytest.raises(graphdist.GraphdistError, match="already declared on"):
        graphdist.shared_variable("weights", 1.0, "/job:local/task:1", graph=graph)
    with graph.as_default():
        tf.constant(1, name="taken")
    with pytest.raises(graphdist.GraphdistError, match="non-variable op"):
        graphdist.shared_variable("taken", 1.0, "/job:local/task:0", graph=graph)


def test_initialize_once_never_resets_a_shared_value(graphdist_fleet):
    fleet = graphdist_fleet

    def declare():
        graph = tf.Graph()
        with graph.as_default():
            v = graphdist.shared_variable("init_once", 10.0, fleet.device("local", 0))
        return graph, v

    graph1, v1 = declare()
    with fleet.session("local", 0, graph=graph1) as s1:
        assert graphdist.initialize_uninitialized(s1) == ["init_once"]
        s1.run(v1.assign_add(5.0))
        assert graphdist.initialize_uninitialized(s1) == []
    # A second graph and session (as another client would build) sees 15 and initializes nothing.
    graph2, v2 = declare()
    with fleet.session("local", 1, graph=graph2) as s2:
        assert graphdist.initialize_uninitialized(s2) == []
        assert s2.run(v2) == 15.0
        # The trap graphdist avoids: the global initializer resets the shared value.
        with graph2.as_default():
            s2.run(tf.compat.v1.global_variables_initializer())
        assert s2.run(v2) == 10.0


def test_initialize_uninitialized_leaves_an_initialized_variable_alone(graphdist_fleet):
    # Two variables, one already initialized and changed since: only the other is initialized.
    fleet = graphdist_fleet
    graph = tf.Graph()
    with graph.as_default():
        kept = graphdist.shared_variable("init_kept", 1.0, fleet.device("local", 0))
        fresh = graphdist.shared_variable("init_fresh", 2.0, fleet.device("local", 1))
    with fleet.session("local", 0, graph=graph) as sess:
        sess.run(kept.initializer)
        sess.run(kept.assign(42.0))
        assert graphdist.initialize_uninitialized(sess) == ["init_fresh"]
        assert sess.run([kept, fresh]) == [42.0, 2.0]
        assert graphdist.initialize_uninitialized(sess) == []
