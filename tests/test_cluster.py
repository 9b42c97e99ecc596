"""Unit tests of the cluster model (no TensorFlow process is started)."""

from __future__ import annotations

import errno
import json
import os

import pytest

from graphdist import Cluster, ClusterSpecError, Task
from graphdist._ports import release_ports

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


# -- every refusal in its exact words, with the offending piece as ``value`` (what mutation
# testing found unpinned: make mutants, docs/mutants.md) ------------------------------------------

_NOT_V6 = "which is not an IPv6 address; brackets hold an IPv6 address such as [::1]"
_BAD_HOST = (
    "has a malformed host: use a host name or address of ASCII letters, digits, '-', '_' and '.' "
    "(or [IPv6])"
)
_NOT_A_PORT = "which is not a number of ASCII digits from 1 to 65535"
_NOT_READ = "it is not JSON, not 'job=N[,job=N...]' and not an existing file"
_PASS = "pass a dict, JSON text, a JSON file path or 'job=N,...'"
_V6_62 = "a" * 62 + ":b"  # an IPv6-looking host of 64 characters: shown in the hint
_V6_63 = "a" * 63 + ":b"  # 65: too long to show

EXACT = [
    ({}, "The cluster has no jobs; name at least one job", {}),
    ({"local": 5}, "Job 'local' maps to int 5; give a list of 'host:port'", 5),
    ({"local": []}, "Job 'local' has no tasks; give it at least one address", "local"),
    (
        {"local": {"0": "h:1", "00": "h:2"}},
        "Job 'local' has task indices '0' and '00', which are both index 0; name each task once",
        "00",
    ),
    (
        {"local": {"x": "h:1"}},
        "Job 'local' has task index 'x', which is not a whole number of ASCII digits",
        "x",
    ),
    ({"local": {"-1": "h:1"}}, "Job 'local' has negative task index -1", "-1"),
    (
        {"local": {"2147483648": "h:1"}},
        "Job 'local' has task index 2147483648; at most 2147483647",
        "2147483648",
    ),
    (
        {1: ["h:1"], "a": ["h:2"]},  # sorted by str: a job that is no string is named, not a crash
        "Job name 1 is not valid: use a letter followed by letters, digits or '_'",
        1,
    ),
    ({"local": [5]}, "Task address 5 is not a string; write it as 'host:port'", 5),
    (
        {"local": ["grpc://h:1"]},
        "Task address 'grpc://h:1' has a scheme; write it as 'host:port' without 'grpc://'",
        "grpc://h:1",
    ),
    ({"local": ["h"]}, "Task address 'h' has no port; write it as 'host:port'", "h"),
    ({"local": [":1"]}, "Task address ':1' has no port; write it as 'host:port'", ":1"),
    ({"local": ["[::1:80"]}, "Task address '[::1:80' has a malformed IPv6 host", "[::1:80"),
    ({"local": ["[]:80"]}, "Task address '[]:80' has a malformed IPv6 host", "[]:80"),
    ({"local": ["[a]:80"]}, f"Task address '[a]:80' has host '[a]', {_NOT_V6}", "[a]:80"),
    (
        {"local": ["[fe80::1%e th0]:80"]},
        f"Task address '[fe80::1%e th0]:80' has host '[fe80::1%e th0]', {_NOT_V6}",
        "[fe80::1%e th0]:80",
    ),
    (
        {"local": ["[fe80::1%]:80"]},
        f"Task address '[fe80::1%]:80' has host '[fe80::1%]', {_NOT_V6}",
        "[fe80::1%]:80",
    ),
    (
        {"local": ["::1:80"]},
        "Task address '::1:80' looks like IPv6 without brackets; write '[::1]:PORT'",
        "::1:80",
    ),
    (
        {"local": [f"{_V6_62}:1"]},
        f"Task address '{_V6_62}:1' looks like IPv6 without brackets; write '[{_V6_62}]:PORT'",
        f"{_V6_62}:1",
    ),
    (
        {"local": [f"{_V6_63}:1"]},
        f"Task address '{_V6_63}:1' looks like IPv6 without brackets; write '[HOST]:PORT'",
        f"{_V6_63}:1",
    ),
    ({"local": ["h h:1"]}, f"Task address 'h h:1' {_BAD_HOST}", "h h:1"),
    ({"local": ["h:http"]}, f"Task address 'h:http' has port 'http', {_NOT_A_PORT}", "h:http"),
    (
        {"local": ["h:065535"]},  # six digits, whatever their value
        f"Task address 'h:065535' has port '065535', {_NOT_A_PORT}",
        "h:065535",
    ),
    ({"local": ["h:0"]}, "Task address 'h:0' has port 0, outside 1-65535", "h:0"),
    ({"local": ["h:65536"]}, "Task address 'h:65536' has port 65536, outside 1-65535", "h:65536"),
    (
        {"a": ["H:1"], "b": ["x:2", "h:1"]},  # hosts compare without case
        "Address 'h:1' is used by both a-0 and b-1; give every task its own host:port",
        "h:1",
    ),
    (42, f"Cannot read a cluster from int 42; {_PASS}", 42),
    ([], f"Cannot read a cluster from list []; {_PASS}", []),
    ("[1, 2]", f"Cannot read a cluster from list [1, 2]; {_PASS}", [1, 2]),
    ("   ", "The cluster spec is empty; pass JSON, a JSON file path or 'job=N,...'", "   "),
    (
        "local:2",
        f"Cannot read a cluster from 'local:2': {_NOT_READ}; did you mean 'local=2'?",
        None,
    ),
    (
        "a:1, b:2",
        f"Cannot read a cluster from 'a:1, b:2': {_NOT_READ}; did you mean 'a=1,b=2'?",
        None,
    ),
    ("9x:1", f"Cannot read a cluster from '9x:1': {_NOT_READ}", None),
    ("local:two", f"Cannot read a cluster from 'local:two': {_NOT_READ}", None),
    ("whatever", f"Cannot read a cluster from 'whatever': {_NOT_READ}", None),
    ("a=b=1", f"Cannot read a cluster from 'a=b=1': {_NOT_READ}", None),
    ("lo cal=1", f"Cannot read a cluster from 'lo cal=1': {_NOT_READ}", None),
    ("=1", f"Cannot read a cluster from '=1': {_NOT_READ}", None),
    ("a=1,a=2", "Job 'a' is named twice in 'a=1,a=2'", "a"),
    ("a=x", "Job 'a' has count 'x', which is not a whole number of ASCII digits", "x"),
    (
        "missing-cluster.json",
        "Cannot read cluster file 'missing-cluster.json': No such file or directory",
        "missing-cluster.json",
    ),
    (
        '{"a": ["h:1"], "a": ["h:2"]}',
        "The cluster spec text names key 'a' twice in one object; give each key once",
        "a",
    ),
    ('{"a": NaN}', "The cluster spec text holds NaN, which is not JSON", "NaN"),
    (
        '{"a": [1,}',
        "The cluster spec text is not valid JSON (Expecting value at line 1 column 10)",
        '{"a": [1,}',
    ),
    ("[" * 33 + "]" * 33, "The cluster spec text nests deeper than 32 levels", 33),
]


@pytest.mark.parametrize(("spec", "message", "value"), EXACT, ids=lambda v: repr(v)[:40])
def test_every_refusal_in_its_exact_words_with_the_offending_value(spec, message, value):
    with pytest.raises(ClusterSpecError) as info:
        Cluster.parse(spec)
    assert str(info.value) == message
    assert info.value.value == (spec if value is None else value)


def test_a_cluster_built_directly_from_a_non_mapping_says_what_it_got():
    with pytest.raises(ClusterSpecError) as info:
        Cluster([])  # type: ignore[arg-type]
    assert str(info.value) == "A cluster is a mapping of job name to addresses, not list"
    assert info.value.value == []


@pytest.mark.parametrize(
    "address",
    ["[fe80::1%eth0]:80", "[::ffff:10.0.0.1]:80", "[::1]:1", "h:65535", "h:1", "a" * 253 + ":1"],
)
def test_addresses_at_the_edges_of_what_is_valid_are_kept(address):
    assert Cluster.parse({"local": [address]}).address("local", 0) == address


def test_a_host_of_254_characters_is_refused():
    address = "a" * 254 + ":1"
    with pytest.raises(ClusterSpecError, match="has a malformed host") as info:
        Cluster.parse({"local": [address]})
    assert info.value.value == address


def test_a_lone_address_is_a_one_task_job():
    assert Cluster({"local": "h:1"}).as_dict() == {"local": ["h:1"]}


def test_unknown_tasks_and_jobs_are_named_with_what_exists():
    c = Cluster({"a": ["h:1", "h:2"], "b": {0: "h:3", 3: "h:4"}})
    with pytest.raises(ClusterSpecError) as info:
        c.task("a", 2)
    assert str(info.value) == "No task with index 2 in job 'a'; it has 2 task(s), indices 0-1"
    assert info.value.value == 2
    with pytest.raises(ClusterSpecError) as info:
        c.task("b", 1)
    assert str(info.value) == "No task with index 1 in job 'b'; it has task indices 0, 3"
    with pytest.raises(ClusterSpecError) as info:
        c.task("ps", 0)
    assert str(info.value) == "No job named 'ps' in the cluster; its jobs are a, b"
    assert info.value.value == "ps"
    assert c.task("b", 3) == Task("b", 3, "h:4")
    assert c.task_indices("b") == (0, 3) and c.num_tasks("a") == 2


def test_queries_subsets_and_equality():
    c = Cluster({"a": ["h:1", "h:2"], "b": ["h:3"]})
    assert list(c) == list(c.tasks) and len(c) == 3
    assert "a" in c and "ps" not in c
    assert c.subset(["b"]) == Cluster({"b": ["h:3"]})
    assert c == Cluster({"b": ["h:3"], "a": ["h:1", "h:2"]})
    assert c != Cluster({"a": ["h:1", "h:2"]}) and c != c.as_dict() and c != 5
    assert hash(c) == hash(Cluster(c.as_dict())) and len({c, Cluster(c.as_dict())}) == 1
    assert c.to_json(indent=1) == json.dumps(c.as_dict(), indent=1)


@pytest.mark.parametrize(
    ("counts", "message", "value"),
    [
        ([], "Task counts are a mapping of job name to count, not list", []),
        ({}, "The cluster has no jobs; name at least one job", {}),
        ({"a": True}, "Job 'a' asks for True tasks; the count must be a whole number >= 1", True),
        ({"a": 1.5}, "Job 'a' asks for 1.5 tasks; the count must be a whole number >= 1", 1.5),
        ({"a": 1025}, "Job 'a' asks for 1025 tasks; at most 1024 per job", 1025),
    ],
)
def test_task_counts_are_checked_in_one_place(counts, message, value):
    with pytest.raises(ClusterSpecError) as info:
        Cluster.check_counts(counts)
    assert str(info.value) == message
    assert info.value.value == value and type(info.value.value) is type(value)


def test_counts_parse_and_the_total_is_bounded_before_any_port_is_picked(monkeypatch):
    from graphdist import _ports as ports

    assert Cluster.check_counts({"a": 1024}) == {"a": 1024}
    assert Cluster.parse_counts("a=2, b=1") == {"a": 2, "b": 1}
    picked: list[int] = []

    def fake(n):
        picked.append(n)
        return list(range(10000, 10000 + n))

    monkeypatch.setattr(ports, "pick_free_ports", fake)
    assert len(Cluster.from_counts({"a": 1000, "b": 24})) == 1024  # exactly the bound: kept
    with pytest.raises(ClusterSpecError) as info:
        Cluster.from_counts({"a": 1000, "b": 25})
    assert str(info.value) == (
        "The jobs ask for 1025 tasks in all; at most 1024 on free ports of this machine (name the "
        "addresses in a JSON spec for more)"
    )
    assert info.value.value == 1025 and picked == [1024]
    c = Cluster.parse("a=1", host="127.0.0.1")
    assert c.address("a", 0) == "127.0.0.1:10000"


def test_something_shaped_like_a_cluster_spec_is_read_through_its_as_dict():
    class Spec:
        def as_cluster_def(self):
            return None

        def as_dict(self):
            return {"w": ["h:1"]}

    class DictOnly:
        def as_dict(self):
            return {"w": ["h:1"]}

    assert Cluster.parse(Spec()) == Cluster({"w": ["h:1"]})  # type: ignore[arg-type]
    with pytest.raises(ClusterSpecError, match="Cannot read a cluster from DictOnly"):
        Cluster.parse(DictOnly())  # type: ignore[arg-type]


def test_addresses_only_where_every_process_must_read_the_same_cluster():
    with pytest.raises(ClusterSpecError) as info:
        Cluster.parse_addresses(" local=2")
    assert str(info.value) == (
        "This cluster must name every task's address, and ' local=2' picks new free ports on "
        "every call (so no two tasks would describe the same cluster); pass JSON text or a JSON "
        'file path, e.g. \'{"worker": ["host1:2222", "host2:2222"]}\''
    )
    assert info.value.value == " local=2"
    with pytest.raises(ClusterSpecError, match=r"^TF_CONFIG must name"):
        Cluster.parse_addresses("a=1", what="TF_CONFIG")
    assert Cluster.parse_addresses(json.dumps(SEED)) == Cluster(SEED)


# -- the bounds: JSON nesting and size, cluster files --------------------------------------------


def test_nesting_is_counted_exactly_and_brackets_in_strings_do_not_count():
    from graphdist._spectext import MAX_JSON_DEPTH, load_json

    assert MAX_JSON_DEPTH == 32
    deepest = "[" * 32 + "]" * 32
    assert load_json(deepest, "x") == json.loads(deepest)
    assert load_json('{"k": "' + "[" * 40 + '"}', "x") == {"k": "[" * 40}
    siblings = "[" + ",".join(["[[1]]"] * 40) + "]"  # 40 arrays side by side: 3 deep
    assert len(load_json(siblings, "x")) == 40
    closed = "[[]," + "[" * 31 + "]" * 31 + "]"  # closing brackets count: 32 deep
    assert load_json(closed, "x")
    with pytest.raises(ClusterSpecError, match="nests deeper than 32 levels"):
        load_json("[[]," + "[" * 32 + "]" * 32 + "]", "x")
    with pytest.raises(ClusterSpecError, match="nests deeper than 32 levels"):
        load_json("[[[[]," + "[" * 30 + "]" * 30 + "]]]", "x")  # a close is one level, not all


def test_load_json_raises_the_callers_error_naming_what():
    from graphdist._exceptions import TFConfigError
    from graphdist._spectext import MAX_SPEC_BYTES, load_json

    with pytest.raises(TFConfigError) as info:
        load_json(" " * (MAX_SPEC_BYTES + 1), "TF_CONFIG", TFConfigError)
    assert str(info.value) == (
        f"The TF_CONFIG takes more than {MAX_SPEC_BYTES} bytes (1 MiB) in UTF-8; at most "
        f"{MAX_SPEC_BYTES}"
    )
    assert info.value.value == MAX_SPEC_BYTES + 1
    big = '{"a": ' + "1" * 5000 + "}"
    with pytest.raises(TFConfigError) as info:
        load_json(big, "TF_CONFIG", TFConfigError)
    assert str(info.value).startswith("The TF_CONFIG is not usable JSON: 'Exceeds the limit")
    assert info.value.value == big


def test_the_size_bound_counts_utf8_bytes_at_its_edges():
    from graphdist._spectext import MAX_SPEC_BYTES, check_size

    check_size("x" * MAX_SPEC_BYTES, "spec")  # exactly the bound, in characters and bytes
    check_size("é" * (MAX_SPEC_BYTES // 2), "spec")  # 2 bytes each: exactly the bound
    check_size("é" * (MAX_SPEC_BYTES // 8), "spec")  # under a quarter of the bound in characters
    for text in (
        "x" * (MAX_SPEC_BYTES + 1),
        "é" * (MAX_SPEC_BYTES // 2 + 1),
        "😀" * (MAX_SPEC_BYTES // 4 + 1),
    ):
        with pytest.raises(ClusterSpecError) as info:
            check_size(text, "spec")
        assert info.value.value == len(text.encode("utf-8"))
        assert str(info.value).startswith("The spec takes more than")
    with pytest.raises(ClusterSpecError):  # as many characters as the bound: counted in bytes
        check_size("é" * MAX_SPEC_BYTES, "spec")


def _refusal(path):
    with pytest.raises(ClusterSpecError) as info:
        Cluster.parse(path)
    return str(info.value), info.value.value


def test_cluster_files_are_regular_utf8_files_within_the_bound(tmp_path):
    from graphdist._spectext import MAX_SPEC_BYTES

    exact = tmp_path / "exact.json"
    text = json.dumps(SEED)
    exact.write_text(" " * (MAX_SPEC_BYTES - len(text)) + text)  # exactly the bound: read whole
    assert Cluster.parse(exact) == Cluster(SEED)
    plain = tmp_path / "cluster"  # no .json: read because it exists
    plain.write_text("\ufeff" + text, encoding="utf-8")  # a byte order mark is dropped
    assert Cluster.parse(str(plain)) == Cluster(SEED)

    big = tmp_path / "big.json"
    big.write_text(" " * (MAX_SPEC_BYTES + 1))
    assert _refusal(big) == (
        f"The cluster file {str(big)!r} holds {MAX_SPEC_BYTES + 1} bytes; at most "
        f"{MAX_SPEC_BYTES} (1 MiB)",
        str(big),
    )
    assert _refusal(tmp_path) == (
        f"Cannot read cluster file {str(tmp_path)!r}: it is a folder",
        str(tmp_path),
    )
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opened without waiting for a writer, then refused
    assert _refusal(fifo) == (
        f"Cannot read cluster file {str(fifo)!r}: it is not a regular file",
        str(fifo),
    )
    bad = tmp_path / "latin1.json"
    bad.write_bytes(b'{"\xe9": 1}')
    assert _refusal(bad) == (
        f"The cluster file {str(bad)!r} is not UTF-8 text (byte 0xe9 at offset 2)",
        str(bad),
    )
    listed = tmp_path / "list.json"
    listed.write_text("[1]")
    assert _refusal(listed) == (
        f"Cluster file {str(listed)!r} holds list, not a JSON object",
        str(listed),
    )
    broken = tmp_path / "broken.json"
    broken.write_text('{"a": ')
    message, value = _refusal(broken)
    assert message == (
        f"The cluster file {str(broken)!r} is not valid JSON (Expecting value at line 1 column 7)"
    )
    assert value == '{"a": '


def test_a_path_that_cannot_be_opened_is_named_with_the_reason(tmp_path):
    long = "/" + "a" * 100 + ".json"  # longer than a message shows by default: shown whole
    assert _refusal(long) == (f"Cannot read cluster file {long!r}: No such file or directory", long)
    too_long = "/" + "a" * 4091 + ".json"  # 4097 characters, one over what is shown: cut
    message, _ = _refusal(too_long)
    assert message.startswith("Cannot read cluster file '/aaa") and "..." in message
    assert message.endswith(": File name too long")
    nul = os.path.join(str(tmp_path), "a\0b.json")
    message, value = _refusal(nul)
    # Python's own words: "embedded null byte" (3.10-3.12), "open: embedded null character in
    # path" (3.13)
    assert message.startswith(f"Cannot read cluster file {nul!r}: ") and "embedded null" in message
    assert value == nul


def test_an_index_of_exactly_int32s_largest_is_kept():
    assert Cluster({"w": {"2147483647": "h:1"}}).task_indices("w") == (2147483647,)


def test_different_clusters_hash_differently():
    assert hash(Cluster({"a": ["h:1"]})) != hash(Cluster({"a": ["h:2"]}))


def test_spec_text_over_the_bound_is_named_as_spec_text():
    from graphdist._spectext import MAX_SPEC_BYTES

    with pytest.raises(ClusterSpecError) as info:
        Cluster.parse(" " * (MAX_SPEC_BYTES + 1))
    assert str(info.value) == (
        f"The cluster spec text takes more than {MAX_SPEC_BYTES} bytes (1 MiB) in UTF-8; at most "
        f"{MAX_SPEC_BYTES}"
    )


def test_a_long_cluster_file_path_is_shown_whole(tmp_path):
    listed = tmp_path / ("l" * 120 + ".json")
    listed.write_text("[1]")
    assert _refusal(listed) == (
        f"Cluster file {str(listed)!r} holds list, not a JSON object",
        str(listed),
    )
    broken = tmp_path / ("b" * 120 + ".json")
    broken.write_text("{")
    message, _ = _refusal(broken)
    assert message.startswith(f"The cluster file {str(broken)!r} is not valid JSON")


def test_a_cluster_file_is_opened_without_waiting_and_not_inherited(tmp_path, monkeypatch):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(SEED))
    flags: list[int] = []
    real = os.open

    def spy(file, flag, *args):
        flags.append(flag)
        return real(file, flag, *args)

    monkeypatch.setattr(os, "open", spy)
    assert Cluster.parse(path) == Cluster(SEED)
    assert flags and all(f & os.O_NONBLOCK and f & os.O_CLOEXEC for f in flags), flags
    assert all(f & os.O_ACCMODE == os.O_RDONLY for f in flags)


def test_a_cluster_file_is_read_within_the_bound_whatever_its_size_says(tmp_path, monkeypatch):
    """A file whose size is not known up front (one in /proc, one that grows while it is read):
    at most MAX_SPEC_BYTES + 1 bytes are read, in as many chunks as the system gives, and it is
    refused; a read that fails is named."""
    from graphdist._spectext import MAX_SPEC_BYTES

    path = tmp_path / "growing.json"
    path.write_text(" " * (2 * MAX_SPEC_BYTES) + "{}")
    real_fstat, real_read = os.fstat, os.read
    asked: list[int] = []

    class Small:
        def __init__(self, info: os.stat_result) -> None:
            self.st_mode, self.st_size = info.st_mode, 10

    def read(fd, n):
        asked.append(n)
        return real_read(fd, min(n, 65536))  # the system gives 64 KiB at a time

    monkeypatch.setattr(os, "fstat", lambda fd: Small(real_fstat(fd)))
    monkeypatch.setattr(os, "read", read)
    assert _refusal(path) == (
        f"The cluster file {str(path)!r} holds more than {MAX_SPEC_BYTES} bytes (1 MiB)",
        str(path),
    )
    got = sum(min(n, 65536) for n in asked)
    assert got == MAX_SPEC_BYTES + 1, got
    small = tmp_path / "small.json"
    small.write_text(json.dumps(SEED, indent=40))
    monkeypatch.setattr(os, "read", lambda fd, n: real_read(fd, min(n, 7)))  # chunks joined whole
    assert Cluster.parse(small) == Cluster(SEED)

    def broken(fd, n):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "read", broken)
    assert _refusal(small) == (
        f"Cannot read cluster file {str(small)!r}: Input/output error",
        str(small),
    )
