"""TF_CONFIG from a cluster, and every malformed TF_CONFIG named precisely."""

from __future__ import annotations

import json

import pytest

import graphdist

CLUSTER = {"chief": ["h:1"], "worker": ["h:2", "h:3"], "ps": ["h:4"]}


@pytest.mark.parametrize("task", ["chief:0", "worker:1", "ps:0", "evaluator:0"])
def test_tf_config_for_every_task_type(task):
    cfg = graphdist.tf_config(CLUSTER, task)
    kind, index = task.split(":")
    data = json.loads(cfg.to_json())
    assert data == {"cluster": CLUSTER, "task": {"type": kind, "index": int(index)}}
    assert graphdist.parse_tf_config(cfg.to_json()) == cfg


def test_chief_rules():
    assert graphdist.tf_config(CLUSTER, "chief", 0).is_chief
    assert not graphdist.tf_config(CLUSTER, "worker", 0).is_chief
    assert graphdist.tf_config({"worker": ["h:1", "h:2"]}, "worker:0").is_chief


def test_environment_variable_is_read(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", graphdist.tf_config(CLUSTER, "worker:1").to_json())
    cfg = graphdist.parse_tf_config()
    assert (cfg.task_type, cfg.task_index) == ("worker", 1)


def test_cluster_resolver_matches_tensorflow():
    resolver = graphdist.cluster_resolver(graphdist.tf_config(CLUSTER, "worker:1"))
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    assert resolver.cluster_spec().as_dict() == CLUSTER
