"""A corpus of malformed inputs: each gives its typed error; the CLI prints one line, exits 2,
shows no traceback and leaves no process running. Hypothesis generates more."""

from __future__ import annotations

import contextlib
import json
import os
import uuid

import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import graphdist
from graphdist._cli import EXIT_USAGE
from tests.conftest import run_python

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
    assert _processes_marked(mark) == []


def _processes_marked(mark: str) -> list[int]:
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("GRAPHDIST_TEST_MARK") == mark:
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_any_text_is_a_device_or_a_placement_error(text):
    try:
        spec = graphdist.parse_device(text)
    except graphdist.PlacementError:
        return
    assert graphdist.parse_device(str(spec)) == spec


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_any_text_is_a_cluster_or_a_cluster_spec_error(text):
    if os.path.exists(text.strip()) or "=" in text:
        return  # files on this machine and count specs (which reserve real ports) are not fuzzed
    with contextlib.suppress(graphdist.ClusterSpecError):
        graphdist.Cluster.parse(text)


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
    with contextlib.suppress(graphdist.TFConfigError):
        graphdist.parse_tf_config(json.dumps(value))
