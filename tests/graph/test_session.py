"""Bounded waits: session configs always carry an operation timeout, fleets a start timeout."""

from __future__ import annotations

import pytest
import tensorflow as tf

import graphdist
from tests.conftest import DOCUMENTED_OPERATION_TIMEOUT_MS, DOCUMENTED_START_TIMEOUT_S


def test_default_timeout_fills_an_unset_field_with_the_documented_bound():
    assert 0 < graphdist.DEFAULT_OPERATION_TIMEOUT_MS == DOCUMENTED_OPERATION_TIMEOUT_MS
    assert graphdist.session_config().operation_timeout_in_ms == DOCUMENTED_OPERATION_TIMEOUT_MS
    unset = tf.compat.v1.ConfigProto(operation_timeout_in_ms=0)
    assert graphdist.session_config(unset).operation_timeout_in_ms == (
        DOCUMENTED_OPERATION_TIMEOUT_MS
    )
    with graphdist.session(graph=tf.Graph()) as sess:  # what the real session is given
        assert sess._config.operation_timeout_in_ms == DOCUMENTED_OPERATION_TIMEOUT_MS


def test_fleet_default_start_timeout_is_the_documented_bound():
    assert 0 < graphdist.DEFAULT_START_TIMEOUT_S == DOCUMENTED_START_TIMEOUT_S
    fleet = graphdist.LocalFleet({"local": ["localhost:2222"]})  # never started
    assert fleet.start_timeout_s == DOCUMENTED_START_TIMEOUT_S


def test_caller_timeout_is_kept_and_explicit_argument_wins():
    cfg = tf.compat.v1.ConfigProto(operation_timeout_in_ms=1234, log_device_placement=True)
    out = graphdist.session_config(cfg)
    assert out.operation_timeout_in_ms == 1234
    assert out.log_device_placement
    assert graphdist.session_config(cfg, operation_timeout_ms=99).operation_timeout_in_ms == 99
    assert cfg.operation_timeout_in_ms == 1234  # the caller's proto is not modified


@pytest.mark.parametrize("bad", [0, -5, 1.5, True])
def test_bad_timeout_is_rejected(bad):
    with pytest.raises(ValueError, match="operation_timeout_ms"):
        graphdist.session_config(operation_timeout_ms=bad)


def test_in_process_session_runs_the_seed_graph():
    from graphdist._graph.graphs import split_graph

    graph, y = split_graph(None, None)
    with graphdist.session(graph=graph) as sess:
        assert sess.run(y) == 238


@pytest.mark.parametrize(
    ("target", "words"),
    [
        (
            "localhost:2222",
            "session target 'localhost:2222' names no protocol: TensorFlow takes "
            "'grpc://localhost:2222'",
        ),
        ("http://localhost:2222", "TensorFlow takes 'grpc://localhost:2222'"),
        (2222, "session target must be a string such as 'grpc://localhost:2222', not 2222"),
    ],
)
def test_a_target_without_grpc_is_refused_naming_what_to_pass(target, words):
    """issue 39: graphdist.session("localhost:2222") surfaced as TensorFlow's "No session
    factory registered for the given session options", which names no cause."""
    with pytest.raises(graphdist.ArgumentError) as info:
        graphdist.session(target)
    assert words in str(info.value)
    assert info.value.name == "target" and info.value.value == target
