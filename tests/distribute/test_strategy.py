"""Strategy, batch size, sharding and chief-only checkpoint helpers."""

from __future__ import annotations

import os

import pytest
import tensorflow as tf

import graphdist

CLUSTER = {"worker": ["localhost:1", "localhost:2"]}


def test_without_tf_config_the_default_strategy_on_cpu(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    strategy = graphdist.strategy_from_environment()
    assert strategy is tf.distribute.get_strategy()
    assert graphdist.global_batch_size(64, strategy) == 64


def test_bad_tf_config_fails_before_any_strategy(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["h:1"]}, "task": {"type": "worker"}}')
    with pytest.raises(graphdist.TFConfigError, match="lacks index"):
        graphdist.strategy_from_environment()


def test_ps_cluster_on_a_worker_says_only_the_chief_builds_it(monkeypatch):
    cluster = {"chief": ["h:1"], "worker": ["h:2"], "ps": ["h:3"]}
    monkeypatch.setenv("TF_CONFIG", graphdist.tf_config(cluster, "worker:0").to_json())
    with pytest.raises(graphdist.GraphdistError, match="only the chief"):
        graphdist.strategy_from_environment()


def test_shard_sets_the_policy_explicitly():
    ds = graphdist.shard(tf.data.Dataset.range(4), "data")
    policy = ds.options().experimental_distribute.auto_shard_policy
    assert policy == tf.data.experimental.AutoShardPolicy.DATA
    with pytest.raises(ValueError, match="BYTES"):
        graphdist.shard(ds, "BYTES")


def test_checkpoint_dir_is_real_on_the_chief_and_throwaway_elsewhere(tmp_path):
    base = tmp_path / "ckpt"
    chief = graphdist.tf_config(CLUSTER, "worker:0")
    other = graphdist.tf_config(CLUSTER, "worker:1")
    assert graphdist.is_chief(chief) and not graphdist.is_chief(other)
    assert graphdist.checkpoint_dir(base, chief) == str(base)
    throwaway = graphdist.checkpoint_dir(base, other)
    assert throwaway != str(base) and os.path.isdir(throwaway)
    assert not str(throwaway).startswith(str(base))
