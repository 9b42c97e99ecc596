"""Unit tests of the cluster model (no TensorFlow process is started)."""

from __future__ import annotations

import json

import pytest

from graphdist import Cluster, ClusterSpecError, Task
from graphdist._net.ports import release_ports

SEED = {"local": ["localhost:2020", "localhost:2021"]}


def test_dict_form_keeps_addresses_and_orders_tasks():
    c = Cluster.parse({"worker": ["h:2", "h:3"], "ps": ["h:1"]})
    assert c.jobs == ("ps", "worker")
    assert [(t.job, t.index, t.address) for t in c.tasks] == [
        ("ps", 0, "h:1"),
        ("worker", 0, "h:2"),
        ("worker", 1, "h:3"),
    ]
    assert c.address("worker", 1) == "h:3"
    assert c.target("ps", 0) == "grpc://h:1"
    assert len(c) == 3


def test_json_text_file_and_tf_config_style_forms_agree(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(SEED))
    expected = Cluster(SEED)
    assert Cluster.parse(json.dumps(SEED)) == expected
    assert Cluster.parse(str(path)) == expected
    assert Cluster.parse(path) == expected
    assert Cluster.parse({"cluster": SEED, "task": {"type": "local", "index": 0}}) == expected
    assert Cluster.parse(expected) is expected


def test_round_trip_through_dict_and_json():
    c = Cluster.parse(SEED)
    assert c.as_dict() == SEED
    assert Cluster.parse(c.to_json()) == c


def test_sparse_indices_are_kept():
    c = Cluster({"worker": {0: "h:1", 3: "h:2"}})
    assert c.task_indices("worker") == (0, 3)
    assert c.as_dict() == {"worker": {0: "h:1", 3: "h:2"}}
    assert c.is_sparse


def test_compact_counts_choose_distinct_free_loopback_ports():
    c = Cluster.parse("local=2, ps=1")
    try:
        assert c.jobs == ("local", "ps")
        assert [t.host for t in c.tasks] == ["localhost"] * 3
        assert len({t.port for t in c.tasks}) == 3
    finally:
        release_ports(t.port for t in c.tasks)


def test_task_properties():
    t = Task("worker", 1, "[::1]:2222")
    assert (t.host, t.port, t.name, t.target) == ("[::1]", 2222, "worker-1", "grpc://[::1]:2222")


@pytest.mark.parametrize(
    ("spec", "quoted"),
    [
        ({}, "no jobs"),
        ({"local": []}, "'local'"),
        ({"local": ["h:1", "h:1"]}, "'h:1'"),
        ({"local": ["h:1"], "ps": ["H:1"]}, "'H:1'"),
        ({"local": ["h:0"]}, "port 0"),
        ({"local": ["h:65536"]}, "port 65536"),
        ({"local": ["h:http"]}, "'http'"),
        ({"local": ["h"]}, "Task address 'h' has no port"),
        ({"local": ["grpc://h:1"]}, "'grpc://h:1'"),
        ({"local": ["::1:80"]}, "'::1:80'"),
        ({"1local": ["h:1"]}, "'1local'"),
        ({"lo cal": ["h:1"]}, "'lo cal'"),
        ({"local": {"-1": "h:1"}}, "negative task index -1"),
        ({"local": {"x": "h:1"}}, "task index 'x'"),
        ({"local": 5}, "maps to int 5"),
        ("local=-1", "asks for -1 tasks; the count must be a whole number >= 1"),
        ("local=0", "asks for 0 tasks"),
        ("local=two", "count 'two', which is not a whole number"),
        ("local=2,local=1", "Job 'local' is named twice"),
        ("9x=1", "Job name '9x' is not valid"),
        ("local=5000", "asks for 5000 tasks; at most 1024 per job"),
        ("{not json", "not valid JSON"),
        ("/no/such/file.json", "/no/such/file.json"),
        ("   ", "empty"),
        ("whatever", "Cannot read a cluster from 'whatever'"),
        (42, "from int 42"),
    ],
)
def test_bad_specs_raise_typed_errors_quoting_the_value(spec, quoted):
    with pytest.raises(ClusterSpecError) as info:
        Cluster.parse(spec)
    assert quoted in str(info.value)


def test_unknown_job_and_task_are_named():
    c = Cluster.parse(SEED)
    with pytest.raises(ClusterSpecError, match="No task with index 5 in job 'local'"):
        c.task("local", 5)
    with pytest.raises(ClusterSpecError, match="No job named 'ps'"):
        c.task("ps", 0)


def test_to_cluster_spec_matches_tensorflow():
    import tensorflow as tf

    spec = Cluster.parse(SEED).to_cluster_spec()
    assert isinstance(spec, tf.train.ClusterSpec)
    assert spec.as_dict() == SEED
    assert Cluster.parse(spec) == Cluster(SEED)
