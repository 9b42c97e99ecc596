"""Unit and property tests of the device-placement DSL."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphdist import (
    Cluster,
    DeviceSpec,
    PlacementError,
    check_device,
    device,
    normalize_device,
    parse_device,
)

CLUSTER = Cluster({"local": ["h:1", "h:2"], "ps": ["h:3"]})


def test_build_canonical_string():
    assert device("local", task=1, gpu=0) == "/job:local/replica:0/task:1/device:GPU:0"
    assert device("local", 0) == "/job:local/replica:0/task:0"
    assert device("ps", cpu=0, replica=None) == "/job:ps/device:CPU:0"
    assert device("w", 2, device_type="tpu", index=None) == "/job:w/replica:0/task:2/device:TPU:*"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("/job:local/task:0/gpu:0", DeviceSpec("local", None, 0, "GPU", 0)),
        ("/job:local/task:1", DeviceSpec("local", None, 1)),
        ("/job:local/replica:0/task:1/device:GPU:0", DeviceSpec("local", 0, 1, "GPU", 0)),
        ("/device:CPU:0", DeviceSpec(device_type="CPU", device_index=0)),
        ("/cpu:0", DeviceSpec(device_type="CPU", device_index=0)),
        ("/GPU:1", DeviceSpec(device_type="GPU", device_index=1)),
        ("gpu", DeviceSpec(device_type="GPU")),
        ("/gpu:*", DeviceSpec(device_type="GPU")),
        ("/device:gpu:2", DeviceSpec(device_type="GPU", device_index=2)),
        ("/device:XLA_CPU:0", DeviceSpec(device_type="XLA_CPU", device_index=0)),
        ("job:local/task:0", DeviceSpec("local", None, 0)),
        ("", DeviceSpec()),
        (None, DeviceSpec()),
    ],
)
def test_parse_every_tensorflow_form(text, expected):
    assert parse_device(text) == expected


def test_normalize_the_seed_short_form():
    assert normalize_device("/job:local/task:0/gpu:0") == "/job:local/task:0/device:GPU:0"


@pytest.mark.parametrize(
    "text",
    [
        "/job:local/tsk:1",
        "/job:local/task:-1",
        "/job:local/task:x",
        "/job:local/task:1/task:2",
        "/job:1local",
        "/job:local/gpu:0/cpu:0",
        "/job:local/device:GPU",
        "/job:local/replica:r",
        "/job:local/gpu:a",
        "/job:local/device:9x:0",
    ],
)
def test_malformed_strings_raise_placement_error(text):
    with pytest.raises(PlacementError) as info:
        parse_device(text)
    assert text in str(info.value)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("/job:worker/task:0", "no job 'worker'"),
        ("/job:local/task:5", "no task with index 5 in job 'local'"),
        ("/job:ps/task:1", "no task with index 1 in job 'ps'"),
        ("/job:local/replica:1/task:0", "replica 1"),
        ("/task:0", "names a task but no job"),
    ],
)
def test_check_against_cluster_before_tensorflow(text, fragment):
    with pytest.raises(PlacementError, match=fragment):
        check_device(text, CLUSTER)


def test_check_accepts_valid_and_local_devices():
    assert check_device("/job:local/task:1/gpu:0", CLUSTER).task == 1
    assert check_device("/cpu:0", CLUSTER).device_type == "CPU"
    single = Cluster({"local": ["h:1", "h:2"]})
    assert check_device("/task:1", single).task == 1


def test_check_gpu_counts_when_known():
    gpus = {("local", 0): 1, ("local", 1): 0, ("ps", 0): 0}
    check_device("/job:local/task:0/gpu:0", CLUSTER, gpus=gpus)
    with pytest.raises(PlacementError, match="has 0 GPU"):
        check_device("/job:local/task:1/gpu:0", CLUSTER, gpus=gpus)
    with pytest.raises(PlacementError, match="has 1 GPU"):
        check_device("/job:local/task:0/gpu:1", CLUSTER, gpus=gpus)


def test_builder_rejects_two_device_kinds():
    with pytest.raises(PlacementError, match="at most one"):
        device("local", 0, gpu=0, cpu=0)
    with pytest.raises(PlacementError, match=r"The task must be a whole number >= 0 .*, not -1$"):
        device("local", -1)


names = st.from_regex(r"[A-Za-z][A-Za-z0-9_]{0,8}", fullmatch=True)
indices = st.none() | st.integers(min_value=0, max_value=10_000)


@st.composite
def device_specs(draw):
    dtype = draw(st.none() | st.sampled_from(["CPU", "GPU", "TPU"]) | names)
    if dtype is not None and dtype.upper() in {"CPU", "GPU", "TPU", "CUSTOM", "EPU"}:
        dtype = dtype.upper()
    return DeviceSpec(
        job=draw(st.none() | names),
        replica=draw(indices),
        task=draw(indices),
        device_type=dtype,
        device_index=draw(indices) if dtype is not None else None,
    )


@given(device_specs())
def test_parse_format_round_trip(spec):
    assert parse_device(str(spec)) == spec
    assert normalize_device(str(spec)) == str(spec)


@settings(deadline=None)  # the first example imports TensorFlow
@given(device_specs())
def test_format_agrees_with_tensorflow(spec):
    import tensorflow as tf

    fields = ("job", "replica", "task", "device_type", "device_index")
    theirs = tf.DeviceSpec.from_string(str(spec))
    assert {f: getattr(theirs, f) for f in fields} == {f: getattr(spec, f) for f in fields}
    assert theirs.to_string() == str(spec)
    built = tf.DeviceSpec(**{f: getattr(spec, f) for f in fields})  # and TensorFlow's own string
    assert parse_device(built.to_string()) == spec
