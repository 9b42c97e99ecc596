"""Unit and property tests of the device-placement DSL."""

from __future__ import annotations

from typing import Any

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
from graphdist._graph.placement import check_ops
from graphdist._validate import show

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


# -- every refusal in its exact words, with the device it names (what mutation testing found
# unpinned: make mutants, docs/mutants.md) --------------------------------------------------------

_INT = "is not a whole number >= 0 of ASCII digits (at most 2147483647)"
_EXPECTED = "expected job:NAME, replica:N, task:N, device:TYPE:N or TYPE:N"
_MEANT = "; did you mean job:, replica:, task: or device:?"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("/job:a/job:b", "Device '/job:a/job:b' names the job twice (at 'job:b')"),
        (
            "/gpu:0/device:CPU:0",
            "Device '/gpu:0/device:CPU:0' names the device twice (at 'device:CPU:0')",
        ),
        ("/task:1/task:2", "Device '/task:1/task:2' names the task twice (at 'task:2')"),
        ("/device:CPU:0/gpu:1", "Device '/device:CPU:0/gpu:1' names the device twice (at 'gpu:1')"),
        (
            "/replica:0/replica:1",
            "Device '/replica:0/replica:1' names the replica twice (at 'replica:1')",
        ),
        ("/job:1a", "Device '/job:1a': job name '1a' is not valid"),
        ("/replica:x", f"Device '/replica:x': replica 'x' {_INT}"),
        ("/task:x", f"Device '/task:x': task 'x' {_INT}"),
        ("/task:2147483648", f"Device '/task:2147483648': task '2147483648' {_INT}"),
        ("/task:12345678901", f"Device '/task:12345678901': task '12345678901' {_INT}"),
        ("/gpu:x", f"Device '/gpu:x': device index 'x' {_INT}"),
        ("/device:GPU:x", f"Device '/device:GPU:x': device index 'x' {_INT}"),
        ("/device:9x:0", "Device '/device:9x:0': device type '9x' is not valid"),
        ("/gpu:0:1", f"Device '/gpu:0:1': unknown part 'gpu:0:1'; {_EXPECTED}"),
        ("/foo:1", f"Device '/foo:1': unknown part 'foo:1'; {_EXPECTED}"),
        ("/tsk:1", f"Device '/tsk:1': unknown part 'tsk:1'; {_EXPECTED}{_MEANT}"),
        ("/tasks:1", f"Device '/tasks:1': unknown part 'tasks:1'; {_EXPECTED}{_MEANT}"),
        ("/jobs:a", f"Device '/jobs:a': unknown part 'jobs:a'; {_EXPECTED}{_MEANT}"),
        ("/replicas:0", f"Device '/replicas:0': unknown part 'replicas:0'; {_EXPECTED}{_MEANT}"),
        ("/dev:GPU:0", f"Device '/dev:GPU:0': unknown part 'dev:GPU:0'; {_EXPECTED}{_MEANT}"),
    ],
)
def test_every_malformed_part_is_named_in_exact_words(text, message):
    with pytest.raises(PlacementError) as info:
        parse_device(text)
    assert str(info.value) == message
    assert info.value.device == text


def test_edges_of_the_numbers_and_the_length():
    from graphdist._graph.placement import MAX_DEVICE_CHARS

    assert parse_device("/task:2147483647").task == 2147483647
    assert parse_device("/replica:0123456789").replica == 123456789  # ten digits
    assert parse_device("/job:" + "a" * (MAX_DEVICE_CHARS - 5)).job == "a" * (MAX_DEVICE_CHARS - 5)
    long = "/job:" + "a" * (MAX_DEVICE_CHARS - 4)
    with pytest.raises(PlacementError) as info:
        parse_device(long)
    assert str(info.value) == "Device string of 1025 characters; at most 1024"
    assert info.value.device == show(long)  # cut to a readable length, as in every message
    with pytest.raises(PlacementError) as info:
        parse_device(5)  # type: ignore[arg-type]
    assert str(info.value) == "A device must be a string, not int 5" and info.value.device is None


@pytest.mark.parametrize(
    ("fields", "message", "named"),
    [
        (
            {"job": "1a"},
            "Job name '1a' is not valid: use a letter followed by letters, digits or '_'",
            "1a",
        ),
        ({"job": 5}, "Job name 5 is not valid: use a letter followed by letters, digits or '_'", 5),
        (
            {"replica": -1},
            "The replica must be a whole number >= 0 and <= 2147483647, not -1",
            None,
        ),
        ({"task": True}, "The task must be a whole number >= 0 and <= 2147483647, not True", None),
        ({"task": 1.0}, "The task must be a whole number >= 0 and <= 2147483647, not 1.0", None),
        (
            {"device_type": "GPU", "device_index": 2**31},
            "The device index must be a whole number >= 0 and <= 2147483647, not 2147483648",
            None,
        ),
        ({"device_type": "9x"}, "Device type '9x' is not valid", None),
        ({"device_type": 5}, "Device type 5 is not valid", None),
        ({"device_index": 0}, "A device index needs a device type (e.g. GPU)", None),
    ],
)
def test_a_device_spec_refuses_bad_fields_in_exact_words(fields, message, named):
    with pytest.raises(PlacementError) as info:
        DeviceSpec(**fields)
    assert str(info.value) == message
    assert info.value.device == named


def test_a_device_spec_keeps_the_largest_index_and_replaces_fields():
    spec = DeviceSpec("w", 0, 2**31 - 1, "GPU", 2**31 - 1)
    assert spec.replace(task=1) == DeviceSpec("w", 0, 1, "GPU", 2**31 - 1)
    assert spec.replace() == spec


def test_the_builder_names_what_it_cannot_build():
    with pytest.raises(PlacementError) as info:
        device("a", index=1)
    assert str(info.value) == "index= needs device_type=; or use gpu=N / cpu=N"
    with pytest.raises(PlacementError) as info:
        device("a", gpu=0, cpu=0, device_type="TPU")
    assert str(info.value) == "Give at most one of gpu=, cpu= or device_type=, not GPU, CPU, TPU"
    with pytest.raises(PlacementError) as info:
        device("a", device_type=5)  # type: ignore[arg-type]
    assert str(info.value) == "Device type 5 is not a string"
    assert info.value.device == "5"  # shown: it was no string
    with pytest.raises(PlacementError) as info:
        device("a", device_type="9x")
    assert str(info.value) == "Device '9x': device type '9x' is not valid"
    assert info.value.device == "9x"
    assert device("a", 1, device_type="gpu", index=2) == "/job:a/replica:0/task:1/device:GPU:2"
    assert device("a", 1, device_type="XLA_GPU", index=0).endswith("/device:XLA_GPU:0")


SEVERAL = Cluster({"local": ["h:1", "h:2"], "ps": ["h:3"], "sparse": {0: "h:4", 3: "h:5"}})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "/task:0",
            "Device '/task:0' names a task but no job; add /job:NAME (jobs: local, ps, sparse)",
        ),
        (
            "/job:w/task:0",
            "Device '/job:w/task:0': no job 'w' in the cluster; its jobs are local, ps, sparse",
        ),
        (
            "/job:local/task:2",
            "Device '/job:local/task:2': no task with index 2 in job 'local' (it has tasks 0-1)",
        ),
        (
            "/job:sparse/task:1",
            "Device '/job:sparse/task:1': no task with index 1 in job 'sparse' (it has tasks 0, 3)",
        ),
        (
            "/job:local/replica:1",
            "Device '/job:local/replica:1': replica 1 does not exist; graphdist clusters have "
            "only replica 0",
        ),
    ],
)
def test_a_device_outside_the_cluster_is_named_in_exact_words(text, message):
    with pytest.raises(PlacementError) as info:
        check_device(text, SEVERAL)
    assert str(info.value) == message
    assert info.value.device == text


GPUS = {("local", 0): 2, ("local", 1): 0}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "/job:local/task:1/gpu:0",
            "Device '/job:local/task:1/device:GPU:0': task local:1 has 0 GPU(s)",
        ),
        (
            "/job:local/task:0/gpu:2",
            "Device '/job:local/task:0/device:GPU:2': task local:0 has 2 GPU(s) (indices 0-1)",
        ),
        (
            "/job:local/gpu:0",
            "Device '/job:local/device:GPU:0': task local:1 has 0 GPU(s)",
        ),  # each task
        (
            "/job:ps/gpu:0",
            "Device '/job:ps/device:GPU:0': task ps:0 has 0 GPU(s)",
        ),  # not listed: none
    ],
)
def test_a_gpu_a_task_lacks_is_named_with_what_it_has(text, message):
    with pytest.raises(PlacementError) as info:
        check_device(text, SEVERAL, gpus=GPUS)
    assert str(info.value) == message
    assert info.value.device == parse_device(text).to_string()


def test_gpus_the_tasks_have_pass_and_only_gpus_are_counted():
    assert check_device("/job:local/task:0/gpu:1", SEVERAL, gpus=GPUS).device_index == 1
    assert check_device("/job:local/task:0/gpu:*", SEVERAL, gpus=GPUS).device_index is None
    assert check_device("/job:ps/cpu:0", SEVERAL, gpus=GPUS).device_type == "CPU"
    assert check_device("/gpu:5", SEVERAL, gpus=GPUS).device_index == 5  # no job: not checked
    assert check_device(None, SEVERAL, gpus=GPUS) == DeviceSpec()
    assert check_device("/job:sparse/task:3/replica:0", SEVERAL).task == 3


def test_a_task_without_a_job_in_a_one_job_cluster_is_checked_in_that_job():
    single = Cluster({"local": ["h:1", "h:2"]})
    with pytest.raises(PlacementError) as info:
        check_device("/task:5", single)
    assert str(info.value) == (
        "Device '/task:5': no task with index 5 in job 'local' (it has tasks 0-1)"
    )


# -- the devices a graph's ops ask for (check_ops: TensorFlow's matching rule) -----------------

TWO = Cluster({"local": ["h:1", "h:2"]})
JOBS = Cluster({"local": ["h:1", "h:2"], "ps": ["h:3"]})
NO_GPU = {("local", 0): 0, ("local", 1): 0}


def refusal(ops: list[tuple[str, str]], cluster: Cluster = TWO, **kw: Any) -> PlacementError:
    with pytest.raises(PlacementError) as info:
        check_ops(ops, cluster, **kw)
    assert "\n" not in str(info.value)  # one line
    return info.value


def test_an_op_on_a_task_the_fleet_lacks_is_named_with_its_device_and_the_tasks():
    error = refusal([("a", "/job:local/task:0"), ("add_1", "/job:local/task:2")])
    assert str(error) == (
        "Op 'add_1' asks for /job:local/task:2, which this fleet does not have "
        "(it has /job:local/task:0, /job:local/task:1)"
    )
    assert (error.op, error.device) == ("add_1", "/job:local/task:2")


@pytest.mark.parametrize(
    "device",
    [
        "/job:ps/task:0",  # a job the cluster lacks
        "/task:2",  # no job has task 2
        "/job:local/replica:1/task:0",  # graphdist clusters have replica 0 only
        "/job:local/task:2/device:CPU:0",
    ],
)
def test_every_device_no_task_matches_is_refused(device):
    assert refusal([("op", device)]).device == device


@pytest.mark.parametrize(
    "device",
    [
        "",  # no constraint
        "/job:local",  # any task of the job
        "/task:1",  # task 1 of any job: TensorFlow accepts it in a cluster of several jobs
        "/job:local/replica:0/task:1/device:CPU:0",
        "/device:CPU:0",
        "/job:local/task:0/device:GPU:0",  # GPUs unknown (gpus=None): not checked
    ],
)
def test_devices_some_task_matches_pass_as_tensorflow_places_them(device):
    check_ops([("op", device)], JOBS)


def test_a_long_job_is_named_by_its_first_and_last_task():
    big = Cluster({"worker": [f"h:{i}" for i in range(1, 101)], "ps": ["h:200"]})
    assert str(refusal([("w", "/job:worker/task:100")], big)).endswith(
        "(it has /job:ps/task:0, /job:worker/task:0 to /job:worker/task:99 (100 tasks))"
    )


def test_a_gpu_on_a_fleet_without_gpus_is_named_with_what_to_do():
    error = refusal([("add", "/job:local/task:1/device:GPU:0")], gpus=NO_GPU)
    assert str(error) == (
        "Op 'add' asks for /job:local/task:1/device:GPU:0, which this fleet does not have (its "
        "tasks have no GPU; place the op on a CPU, or allow soft placement in the session's "
        "config)"
    )
    refusal([("add", "/device:GPU:*")], gpus=NO_GPU)  # no task at all: TensorFlow fails it too


def test_gpus_a_task_has_pass_and_one_beyond_them_names_each_tasks_count():
    gpus = {("local", 0): 2, ("local", 1): 0}
    check_ops([("a", "/job:local/task:0/device:GPU:1"), ("b", "/device:GPU:*")], TWO, gpus=gpus)
    check_ops([("c", "/job:local/device:GPU:0")], TWO, gpus=gpus)  # one task of the job has it
    assert str(refusal([("d", "/job:local/device:GPU:2")], gpus=gpus)).endswith(
        "(/job:local/task:0 has 2 GPU(s), /job:local/task:1 has 0 GPU(s))"
    )
    assert refusal([("e", "/job:local/task:1/device:GPU:0")], gpus=gpus).op == "e"


def test_each_device_is_checked_once_and_the_first_op_asking_for_it_is_named():
    ops = [("first", "/job:local/task:7"), ("second", "/job:local/task:7")]
    assert refusal(ops).op == "first"


def test_a_job_of_three_tasks_is_listed_whole():
    three = Cluster({"local": ["h:1", "h:2", "h:3"]})
    assert str(refusal([("o", "/job:local/task:3")], three)).endswith(
        "(it has /job:local/task:0, /job:local/task:1, /job:local/task:2)"
    )


def test_one_gpu_serves_gpu_0_and_the_wildcard_and_an_unlisted_task_has_none():
    one = {("local", 0): 1}  # local:1 not listed: no GPU
    check_ops([("a", "/job:local/task:0/device:GPU:0"), ("b", "/device:GPU:*")], TWO, gpus=one)
    assert str(refusal([("c", "/job:local/device:GPU:1")], gpus=one)).endswith(
        "(/job:local/task:0 has 1 GPU(s), /job:local/task:1 has 0 GPU(s))"
    )
    assert str(refusal([("d", "/job:local/task:1/device:GPU:0")], gpus=one)).startswith(
        "Op 'd' asks for /job:local/task:1/device:GPU:0, which this fleet does not have (its "
        "tasks have no GPU"
    )


def test_ops_after_one_without_a_device_are_still_checked():
    assert refusal([("free", ""), ("far", "/job:local/task:9")]).op == "far"


def test_a_malformed_op_device_names_the_op():
    error = refusal([("odd", "/job:local/tsk:1")])
    assert str(error).startswith("Op 'odd': Device '/job:local/tsk:1': unknown part 'tsk:1'")
    assert (error.op, error.device) == ("odd", "/job:local/tsk:1")
