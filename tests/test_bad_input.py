"""A corpus of malformed inputs: each gives its typed error; the CLI prints one line, exits 2,
shows no traceback and leaves no process running. Hypothesis generates more."""

from __future__ import annotations

import json
import os
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import graphdist
from graphdist._cli.main import EXIT_USAGE
from tests.conftest import processes_marked, run_python

GOOD = {"worker": ["h:1", "h:2"], "chief": ["h:3"]}

CLUSTER_SPECS = [
    {},
    {"local": []},
    {"local": ["h:1", "h:1"]},
    {"local": ["h:0"]},
    {"local": ["h:65536"]},
    {"local": ["h:-1"]},
    {"local": ["h:port"]},
    {"local": ["nohost"]},
    {"local": [":2020"]},
    {"local": ["grpc://h:1"]},
    {"local": ["fe80::1:80"]},
    {"local": ["[::1:80"]},
    {"local": ["h h:80"]},
    {"1job": ["h:1"]},
    {"jo-b": ["h:1"]},
    {"": ["h:1"]},
    {"local": {"-1": "h:1"}},
    {"local": {"one": "h:1"}},
    {"local": None},
    {"local": [42]},
    "local=-1",
    "local=0",
    "local=x",
    "local=2,local=3",
    "=2",
    "local=99999",
    "{",
    "[1, 2]",
    "",
    "/does/not/exist.json",
    "plainword",
    3.5,
]

DEVICES = [
    "/job:local/tsk:1",
    "/job:local/task:-1",
    "/job:local/task:one",
    "/job:local/task:1/task:1",
    "/job:-local",
    "/job:local/gpu:0/cpu:0",
    "/job:local/device:GPU",
    "/job:local/replica:x",
    "/job:local/gpu:a",
    "/job:local/device:%:0",
    "/job:local/foo:1",
    "/job:local/task:1:2",
    12,
]

CHECKED_DEVICES = [
    "/job:ps/task:0",
    "/job:worker/task:2",
    "/job:worker/replica:3/task:0",
    "/task:0",
]

TF_CONFIGS = [
    "",
    "not json",
    "[]",
    '"worker"',
    json.dumps({"task": {"type": "worker", "index": 0}}),
    json.dumps({"cluster": GOOD}),
    json.dumps({"cluster": GOOD, "task": "worker:0"}),
    json.dumps({"cluster": GOOD, "task": {"type": "worker"}}),
    json.dumps({"cluster": GOOD, "task": {"index": 0}}),
    json.dumps({"cluster": GOOD, "task": {"type": "worker", "index": 2}}),
    json.dumps({"cluster": GOOD, "task": {"type": "worker", "index": -1}}),
    json.dumps({"cluster": GOOD, "task": {"type": "worker", "index": "0"}}),
    json.dumps({"cluster": GOOD, "task": {"type": "master", "index": 0}}),
    json.dumps({"cluster": GOOD, "task": {"type": "evaluator", "index": 1}}),
    json.dumps(
        {"cluster": {**GOOD, "chief": ["h:3", "h:4"]}, "task": {"type": "chief", "index": 0}}
    ),
    json.dumps({"cluster": {**GOOD, "evaluator": ["h:9"]}, "task": {"type": "worker", "index": 0}}),
    json.dumps({"cluster": {"worker": ["h:1", "h:1"]}, "task": {"type": "worker", "index": 0}}),
    json.dumps({"cluster": "worker=2", "task": {"type": "worker", "index": 0}}),
    json.dumps({"cluster": GOOD, "task": {"type": "worker", "index": 0}, "extra": 1}),
    json.dumps({"cluster": GOOD, "task": {"type": "worker", "index": 0}, "rpc_layer": 5}),
]

CLI_ARGS = [
    ["up", "--cluster", "local=-1"],
    ["up", "--cluster", "{bad"],
    ["up", "--cluster", '{"local": ["localhost:0"]}'],
    ["up", "--cluster", '{"local": ["example.invalid:2020"]}'],
    ["up", "--cluster", "local=1", "--start-timeout", "-3"],
    ["up", "--cluster", "local=1", "--restart", "always"],
    ["up", "--cluster", "local=1", "--restart", "on-failure"],
    ["up", "--cluster", "local=1", "--max-restarts", "-1"],
    ["up", "--cluster", "local=1", "--start-timeout", "soon"],
    ["up"],
    ["launch"],
    [],
    ["status", "--bogus"],
    ["tf-config", "--cluster", "worker=2", "--task", "worker:7"],
    ["tf-config", "--cluster", "worker=2", "--task", "worker"],
    ["tf-config", "--cluster", "worker=2"],
    ["demo", "--master", "two"],
]


def test_the_corpus_has_at_least_fifty_inputs():
    total = len(CLUSTER_SPECS) + len(DEVICES) + len(CHECKED_DEVICES) + len(TF_CONFIGS)
    assert total + len(CLI_ARGS) >= 50


@pytest.mark.parametrize("spec", CLUSTER_SPECS, ids=repr)
def test_bad_cluster_specs(spec):
    with pytest.raises(graphdist.ClusterSpecError):
        graphdist.Cluster.parse(spec)


@pytest.mark.parametrize("text", DEVICES, ids=repr)
def test_bad_device_strings(text):
    with pytest.raises(graphdist.PlacementError):
        graphdist.parse_device(text)


@pytest.mark.parametrize("text", CHECKED_DEVICES)
def test_devices_outside_the_cluster(text):
    with pytest.raises(graphdist.PlacementError):
        graphdist.check_device(text, graphdist.Cluster(GOOD))


@pytest.mark.parametrize("text", TF_CONFIGS, ids=lambda t: t[:60])
def test_bad_tf_configs(text, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", text)
    with pytest.raises(graphdist.TFConfigError):
        graphdist.parse_tf_config()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv", CLI_ARGS, ids=" ".join)
def test_bad_cli_arguments(argv, tmp_path):
    mark = uuid.uuid4().hex
    env = {"GRAPHDIST_STATE_DIR": str(tmp_path / "state"), "GRAPHDIST_TEST_MARK": mark}
    result = run_python(["-m", "graphdist", *argv], env=env)
    assert result.returncode == EXIT_USAGE, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.stderr
    assert not os.path.exists(tmp_path / "state" / "fleet.json")
    assert processes_marked(mark) == []


# -- fuzzing: every input is either accepted, and then means what it says, or a typed error --


def mostly(good, bad):
    """Mostly ``good``, sometimes ``bad``: most inputs must reach the accepting path. (``bad`` is
    not on an end of the range: Hypothesis draws those most.)"""
    return st.integers(0, 9).flatmap(lambda i: bad if i == 3 else good)


# Device parts by the field they set, with its value (the short TYPE:N form upper-cases the
# known types).
GOOD_DEVICE_PARTS = {
    "job": [("job:local", "local"), ("job:Worker_2", "Worker_2")],
    "replica": [("replica:0", 0), ("replica:12", 12)],
    "task": [("task:0", 0), ("task:7", 7)],
    "device": [
        ("gpu:1", ("GPU", 1)),
        ("CPU:0", ("CPU", 0)),
        ("gpu", ("GPU", None)),
        ("tpu:*", ("TPU", None)),
        ("device:GPU:3", ("GPU", 3)),
        ("device:XLA_CPU:0", ("XLA_CPU", 0)),
        ("device:cpu:*", ("CPU", None)),
    ],
}
BAD_DEVICE_PARTS = [
    "tsk:1",
    "task:-1",
    "task:one",
    "task:1:2",
    "job:-local",
    "job:",
    "replica:x",
    "gpu:a",
    "device:GPU",
    "device:%:0",
    "foo:1",
    "job:a:b",
]


@st.composite
def device_texts(draw):
    """A device string of known parts in any order, with the spec it must parse to; None when it
    must be rejected (it has a bad part, or names a field twice)."""
    fields: dict[str, object] = {}
    parts: list[str] = []
    for field, choices in GOOD_DEVICE_PARTS.items():
        if draw(st.booleans()):
            text, value = draw(st.sampled_from(choices))
            fields[field] = value
            parts.append(text)
    ok = True
    extra = draw(st.sampled_from(["", "", "", "bad", "twice"]))
    if extra == "bad":
        parts.append(draw(st.sampled_from(BAD_DEVICE_PARTS)))
        ok = False
    elif extra == "twice" and fields:
        field = draw(st.sampled_from(sorted(fields)))
        parts.append(draw(st.sampled_from(GOOD_DEVICE_PARTS[field]))[0])
        ok = False
    parts = draw(st.permutations(parts))
    text = draw(st.sampled_from(["", "/", " /"])) + "/".join(parts)
    if not ok:
        return text, None
    dtype, dindex = fields.pop("device", (None, None))
    return text, graphdist.DeviceSpec(**fields, device_type=dtype, device_index=dindex)


def _check_parsed_device(text, spec):
    assert isinstance(spec, graphdist.DeviceSpec)
    assert graphdist.parse_device(str(spec)) == spec
    assert graphdist.normalize_device(str(spec)) == str(spec)
    for field in ("job", "replica", "task"):  # a field the text names is in the canonical string
        value = getattr(spec, field)
        assert (value is None) == (f"/{field}:" not in str(spec))
        if value is not None:
            assert f"/{field}:{value}" in str(spec) and f"{field}:" in text


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_any_text_is_a_device_or_a_placement_error(text):
    try:
        spec = graphdist.parse_device(text)
    except graphdist.PlacementError:
        return
    _check_parsed_device(text, spec)


@settings(max_examples=300, deadline=None)
@given(device_texts())
def test_device_like_text_parses_to_what_it_names_or_is_a_placement_error(case):
    text, expected = case
    if expected is None:
        with pytest.raises(graphdist.PlacementError):
            graphdist.parse_device(text)
        return
    spec = graphdist.parse_device(text)
    assert spec == expected
    _check_parsed_device(text, spec)


addresses = mostly(
    st.builds(
        "{}:{}".format,
        st.sampled_from(["h", "Host-1.example", "localhost", "10.0.0.1", "[::1]"]),
        st.integers(1, 65535),
    ),
    st.sampled_from(["fe80::1:80", "a b:80", ":80", "h:0", "h:65536", "h:-1", "h:x", "h", 7]),
)
job_values = mostly(
    st.lists(addresses, min_size=1, max_size=3)
    | addresses
    | st.dictionaries(st.sampled_from(["0", "1", "3"]), addresses, min_size=1, max_size=3),
    st.sampled_from([[], {}, {"-1": "h:1"}, {"x": "h:1"}, None]),
)
job_names = mostly(
    st.sampled_from(["local", "worker", "ps", "chief", "w_2"]),
    st.sampled_from(["1job", "jo-b", "", "a b"]),
)
cluster_maps = st.dictionaries(job_names, job_values, max_size=3)


def _expected_tasks(jobs):
    """{job: {index: address}} as the input spells it (a lone address is task 0)."""
    out = {}
    for job, value in jobs.items():
        if isinstance(value, str):
            value = [value]
        items = value.items() if isinstance(value, dict) else enumerate(value)
        out[job] = {int(index): address for index, address in items}
    return out


def _check_parsed_cluster(cluster, jobs):
    assert isinstance(cluster, graphdist.Cluster)
    assert cluster.jobs == tuple(sorted(jobs))
    got: dict[str, dict[int, str]] = {}
    for task in cluster:
        got.setdefault(task.job, {})[task.index] = task.address
    assert got == _expected_tasks(jobs)
    assert len(cluster) == sum(len(tasks) for tasks in got.values())
    assert graphdist.Cluster.parse(cluster.to_json()) == cluster
    assert graphdist.Cluster.parse(cluster.as_dict()) == cluster


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_any_text_is_a_cluster_or_a_cluster_spec_error(text):
    if os.path.exists(text.strip()) or "=" in text:
        return  # files on this machine and count specs (which reserve real ports) are not fuzzed
    try:
        cluster = graphdist.Cluster.parse(text)
    except graphdist.ClusterSpecError:
        return
    data = json.loads(text)  # accepted text that is no file and no count spec is JSON
    wrapped = isinstance(data.get("cluster"), dict)  # TF_CONFIG style; else "cluster" is a job
    _check_parsed_cluster(cluster, data["cluster"] if wrapped else data)


@settings(max_examples=300, deadline=None)
@given(cluster_maps, st.booleans(), st.booleans())
def test_cluster_like_mappings_parse_to_their_tasks_or_a_cluster_spec_error(jobs, as_text, wrap):
    spec = {"cluster": jobs} if wrap else jobs
    try:
        cluster = graphdist.Cluster.parse(json.dumps(spec) if as_text else spec)
    except graphdist.ClusterSpecError:
        return
    _check_parsed_cluster(cluster, jobs)


def _check_parsed_tf_config(config, data):
    assert isinstance(config, graphdist.TFConfig)
    assert config.cluster == graphdist.Cluster.parse(data["cluster"])
    assert (config.task_type, config.task_index) == (data["task"]["type"], data["task"]["index"])
    if config.task_type == "evaluator":
        assert config.task_index == 0 and "evaluator" not in config.cluster
    else:
        assert config.task_index in config.cluster.task_indices(config.task_type)
    assert "chief" not in config.cluster or config.cluster.num_tasks("chief") == 1
    assert (config.rpc_layer, config.environment) == (
        data.get("rpc_layer"),
        data.get("environment"),
    )
    assert graphdist.parse_tf_config(config.to_json()) == config


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=8),
        lambda children: (
            st.lists(children, max_size=3)
            | st.dictionaries(st.text(max_size=8), children, max_size=3)
        ),
        max_leaves=8,
    )
)
def test_any_json_is_a_tf_config_or_a_tf_config_error(value):
    try:
        config = graphdist.parse_tf_config(json.dumps(value))
    except graphdist.TFConfigError:
        return
    _check_parsed_tf_config(config, value)


TF_JOBS = ["chief", "worker", "ps", "local"]
tf_clusters = mostly(
    st.dictionaries(st.sampled_from(TF_JOBS), st.integers(1, 3), min_size=1, max_size=3).map(
        lambda counts: {**counts, "chief": 1} if "chief" in counts else counts
    ),
    st.sampled_from([{"chief": 2}, {"evaluator": 1}, {"worker": 1, "evaluator": 1}]),
).map(
    lambda counts: {
        job: [f"h{i}:{port}" for port in range(2000, 2000 + n)]
        for i, (job, n) in enumerate(sorted(counts.items()))
    }
)
tf_tasks = st.fixed_dictionaries(
    {
        "type": mostly(st.sampled_from([*TF_JOBS, "evaluator"]), st.sampled_from(["master", ""])),
        "index": mostly(st.integers(0, 3), st.sampled_from([-1, "0", True, None])),
    }
)
tf_extras = st.fixed_dictionaries(
    {}, optional={"rpc_layer": mostly(st.just("grpc"), st.just(5)), "environment": st.just("cloud")}
)


@settings(max_examples=300, deadline=None)
@given(tf_clusters, tf_tasks, tf_extras)
def test_tf_config_like_json_is_what_it_says_or_a_tf_config_error(jobs, task, extras):
    data = {"cluster": jobs, "task": task, **extras}
    try:
        config = graphdist.parse_tf_config(json.dumps(data))
    except graphdist.TFConfigError:
        return
    _check_parsed_tf_config(config, data)
