"""Errors cross processes whole: every graphdist error class goes through ``to_wire`` (and
JSON) and ``from_wire`` and comes back as the same class with the same message and attributes;
a start that fails in a detached fleet's supervisor arrives in the caller as the class the
supervisor raised."""

from __future__ import annotations

import json
import os

import pytest

import graphdist
from graphdist import _exceptions as E
from graphdist._cluster import Task
from graphdist._distribute.launcher import TaskResult

_RESULTS = [
    TaskResult(Task("worker", 0, "localhost:1"), pid=11, exitcode=0, tail=["done"]),
    TaskResult(Task("worker", 1, "localhost:2"), pid=12, exitcode=-9, tail=[], value={"a": 1}),
]

EXAMPLES: list[E.GraphdistError] = [
    E.GraphdistError("root"),
    E.ArgumentError("bad timeout", name="timeout_s", value=float("inf")),
    E.UsageError("bad flag", name="--x", value="y"),
    E.ClusterSpecError("bad spec", "local=x"),
    E.TFConfigError("bad tf_config", {"cluster": {}}),
    E.NoFreePortsError("no ports", count=3, low=10000, high=10010),
    E.PlacementError("bad device", "/job:nope"),
    E.SplitError("no rule for op x"),
    E.VariableError("taken", name="v", device="/job:local/task:1"),
    E.PictureError("cannot write", "/tmp/x.svg"),
    E.StrategyError("no strategy", "worker-1"),
    E.FleetError("fleet"),
    E.FleetStartError(
        "exited",
        task="local-1",
        address="localhost:5",
        exitcode=3,
        log_path="/tmp/l.log",
        log_tail=["a", "b"],
    ),
    E.PortInUseError(
        "in use", port=2020, holder_pid=77, task="local-0", address="localhost:2020", log_tail=["x"]
    ),
    E.StartTimeoutError(
        "slow", ready=1, expected=2, timeout_s=0.5, task="local-1", address="localhost:6"
    ),
    E.ExposedServerError(
        "wildcard", task="local-0", address="localhost:7", sockets=[("0.0.0.0", 7), ("::", 7)]
    ),
    E.LoopbackUnavailableError("no compiler"),
    E.TaskFailedError(
        "dead", task="local-1", address="localhost:8", status="dead", timeout_ms=600000
    ),
    E.SessionInterruptedError("interrupted", master="local-0"),
    E.FleetClosedError("closed"),
    E.TaskNotFoundError("no task 9", "local", 9),
    E.LaunchError("failed", _RESULTS),
    E.TaskExitError("task exited", _RESULTS, _RESULTS[1]),
    E.LaunchTimeoutError("too long", _RESULTS),
    E.StateError("no fleet", "/tmp/state"),
    E.CorruptStateError("/tmp/state/fleet.json", "not JSON", "/tmp/state"),
    E.CredentialsError("key open to others", "/tmp/creds/client/key.pem"),
    E.UnsupportedVersionError("python 3.9"),
]


def _through_the_wire(exc: BaseException) -> E.GraphdistError:
    return E.from_wire(json.loads(json.dumps(E.to_wire(exc))))


def test_the_examples_cover_every_error_class():
    assert {type(e) for e in EXAMPLES} == set(E._classes().values())


@pytest.mark.parametrize("exc", EXAMPLES, ids=lambda e: type(e).__name__)
def test_every_error_class_crosses_whole(exc):
    back = _through_the_wire(exc)
    assert type(back) is type(exc)
    assert str(back) == str(exc)
    assert vars(back) == vars(exc)
    assert back.args == exc.args


@pytest.mark.parametrize("exc", EXAMPLES, ids=lambda e: type(e).__name__)
def test_the_cli_exit_status_is_the_same_on_both_sides_of_the_wire(exc):
    from graphdist._cli.main import EXIT_FAILURE, EXIT_USAGE, exit_status

    assert exit_status(_through_the_wire(exc)) == exit_status(exc)
    if isinstance(exc, E.PortInUseError | E.StateError | E.ClusterSpecError | E.ArgumentError):
        assert exit_status(exc) == EXIT_USAGE
    elif type(exc) in (E.FleetStartError, E.StartTimeoutError, E.TaskFailedError):
        assert exit_status(exc) == EXIT_FAILURE


def test_nested_results_come_back_as_task_results():
    back = _through_the_wire(EXAMPLES[[type(e) for e in EXAMPLES].index(E.TaskExitError)])
    assert isinstance(back, E.TaskExitError)
    assert isinstance(back.failed, TaskResult) and back.failed.task == Task(
        "worker", 1, "localhost:2"
    )
    assert back.failed.exitcode == -9 and back.results[1].value == {"a": 1}


def test_a_foreign_error_arrives_as_a_fleet_error_naming_its_class():
    back = _through_the_wire(ValueError("unknown op 'x'"))
    assert type(back) is E.FleetError
    assert str(back) == "ValueError: unknown op 'x'"
    assert type(E.from_wire({"kind": "NoSuchError", "message": "m", "attrs": {}})) is E.FleetError
    assert type(E.from_wire("garbage")) is E.FleetError


def test_only_graphdist_dataclasses_are_rebuilt():
    data = {
        "kind": "FleetError",
        "message": "m",
        "attrs": {"x": {"__dataclass__": "os:stat_result", "fields": {"a": 1}}},
    }
    assert E.from_wire(data).x == {"a": 1}


def test_copy_error_is_a_fresh_equal_exception():
    original = E.TaskFailedError("dead", task="local-1", address="a:1", status="dead")
    try:
        raise original from OSError("cause")
    except E.TaskFailedError as exc:
        copy = E.copy_error(exc)
    assert copy is not original and original.__traceback__ is not None
    assert copy.__traceback__ is None and copy.__cause__ is None
    assert type(copy) is E.TaskFailedError and vars(copy) == vars(original)


@pytest.mark.timeout(240)
def test_a_port_taken_under_the_supervisor_arrives_as_port_in_use(state_dir, monkeypatch):
    """The caller's own port check is skipped, so the supervisor's fleet finds the port taken:
    its PortInUseError reaches the caller with its port and holder, not as a plain start error."""
    import socket

    from graphdist._detached.fleet import SupervisorSpec, start_detached, stop_detached
    from graphdist._local import fleet as local

    monkeypatch.setattr(local, "check_hosts_and_ports", lambda cluster: None)
    cluster = graphdist.Cluster.parse("local=2")
    port = cluster.tasks[1].port
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        spec = SupervisorSpec(state_dir=state_dir, cluster=cluster.as_dict())
        try:
            with pytest.raises(E.PortInUseError) as info:
                start_detached(spec)
        finally:  # had it started after all, it must not outlive the test
            if os.path.exists(os.path.join(state_dir, "fleet.json")):
                stop_detached(state_dir)
    assert info.value.port == port and info.value.task == "local-1"
    assert info.value.holder_pid in (os.getpid(), None)
    assert f"Port {port}" in str(info.value)
