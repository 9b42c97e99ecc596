"""Session configs always carry a bounded operation timeout."""

from __future__ import annotations

import pytest

import graphdist

tf = pytest.importorskip("tensorflow")


def test_default_timeout_fills_an_unset_field():
    assert graphdist.session_config().operation_timeout_in_ms == (
        graphdist.DEFAULT_OPERATION_TIMEOUT_MS
    )


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
    from graphdist._graphs import split_graph

    graph, y = split_graph(None, None)
    with graphdist.session(graph=graph) as sess:
        assert sess.run(y) == 238
