"""Security switches are typed strictly at every public entry that takes one (issue 30): ``expose``
is ``True`` or ``False``, never read by truthiness (``expose="no"`` or ``"false"`` are true
strings and would expose the servers). A bad value is an ArgumentError that names ``expose`` and
quotes the value, raised before anything starts: no child process of this one appears, no port
is picked, no state folder is made."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import psutil
import pytest

import graphdist
from graphdist._detached.fleet import start_detached
from graphdist._detached.supervisor import SupervisorSpec
from graphdist._exceptions import ArgumentError
from graphdist._faults.injector import FaultInjector
from graphdist._fleet.client import FleetState
from graphdist._local.fleet import LocalFleet
from graphdist._ray.fleet import RayFleet
from graphdist._validate import show

BAD = ["no", "false", 1, None, 0, "", "True"]
# explicit addresses: parsing them picks no port (a job=N spec would reserve some)
FIXED = {"worker": ["localhost:2", "localhost:3"]}


@pytest.fixture
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fails the test if a port is picked or a child process of this one appears."""
    from graphdist import _ports as ports

    def no_port(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a free port was picked for a refused switch")

    monkeypatch.setattr(ports, "pick_free_ports", no_port)
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    new = {p.pid for p in me.children(recursive=True)} - before
    assert not new, f"processes {sorted(new)} were started for a refused switch"


def _local_start(value: object) -> None:
    fleet = LocalFleet(FIXED)
    fleet.expose = value  # type: ignore[assignment]
    try:
        fleet.start()
    finally:
        assert fleet.state is FleetState.CREATED  # refused before STARTING
        fleet.close()


def _ray_start(value: object) -> None:
    fleet = RayFleet("worker=2")
    fleet.expose = value  # type: ignore[assignment]
    try:
        fleet.start()
    finally:
        assert fleet.state is FleetState.CREATED
        fleet.close()


def _spec(tmp: str, value: object, backend: str = "local") -> SupervisorSpec:
    cluster = FIXED if backend == "local" else "worker=2"
    return SupervisorSpec(os.path.join(tmp, "fleet"), cluster, expose=value, backend=backend)  # type: ignore[arg-type]


def _detached_start(tmp: str, value: object) -> None:
    spec = _spec(tmp, False)
    object.__setattr__(spec, "expose", value)  # a spec changed after its checks
    try:
        start_detached(spec)
    finally:
        assert not os.path.lexists(spec.state_dir), "the state folder was made"


ENTRIES: dict[str, Callable[[str, object], object]] = {
    "LocalFleet()": lambda tmp, v: LocalFleet(FIXED, expose=v),  # type: ignore[arg-type]
    "LocalFleet(job=N)": lambda tmp, v: LocalFleet("worker=2", expose=v),  # type: ignore[arg-type]
    "LocalFleet.check_cluster": lambda tmp, v: LocalFleet.check_cluster(
        LocalFleet.parse_cluster(FIXED),
        expose=v,  # type: ignore[arg-type]
    ),
    "LocalFleet.for_command": lambda tmp, v: LocalFleet.for_command(
        LocalFleet.parse_cluster(FIXED),
        start_timeout_s=None,
        expose=v,  # type: ignore[arg-type]
    ),
    "LocalFleet.start": lambda tmp, v: _local_start(v),
    "RayFleet()": lambda tmp, v: RayFleet("worker=2", expose=v),  # type: ignore[arg-type]
    "RayFleet.check_cluster": lambda tmp, v: RayFleet.check_cluster({"worker": 2}, expose=v),  # type: ignore[arg-type]
    "RayFleet.for_command": lambda tmp, v: RayFleet.for_command(
        {"worker": 2},
        start_timeout_s=None,
        expose=v,  # type: ignore[arg-type]
    ),
    "RayFleet.start": lambda tmp, v: _ray_start(v),
    "SupervisorSpec": lambda tmp, v: _spec(tmp, v),
    "SupervisorSpec(ray)": lambda tmp, v: _spec(tmp, v, backend="ray"),
    "SupervisorSpec(job=N)": lambda tmp, v: SupervisorSpec(
        os.path.join(tmp, "fleet"),
        "worker=2",
        expose=v,  # type: ignore[arg-type]
    ),
    "start_detached": _detached_start,
    "run_command": lambda tmp, v: graphdist.run_command(
        ["true"],
        workers=1,
        expose=v,  # type: ignore[arg-type]
        log_dir=os.path.join(tmp, "logs"),
    ),
    "FaultInjector.run": lambda tmp, v: FaultInjector().run(
        [sys.executable, "-c", "pass"],
        expose=v,  # type: ignore[arg-type]
    ),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", BAD, ids=repr)
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_expose_is_true_or_false_before_anything_starts(entry, value, tmp_path, nothing_starts):
    with pytest.raises(ArgumentError) as err:
        ENTRIES[entry](str(tmp_path), value)
    assert err.value.name == "expose"
    assert err.value.value is value
    message = str(err.value)
    assert f"expose must be True or False, not {show(value)}" in message, message
    assert not os.listdir(tmp_path)  # no state folder, no log folder


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", [True, False])
def test_true_and_false_are_taken(value, tmp_path, nothing_starts):
    assert LocalFleet(FIXED, expose=value).expose is value
    assert RayFleet("worker=2", expose=value).expose is value
    assert _spec(str(tmp_path), value).expose is value
    assert replace(_spec(str(tmp_path), value), restart="on-failure").expose is value
    LocalFleet.check_cluster(LocalFleet.parse_cluster(FIXED), expose=True)
    RayFleet.check_cluster({"worker": 2}, expose=value)


@pytest.mark.timeout(60)
def test_chief_of_a_fault_run_is_a_switch_too(nothing_starts):
    with pytest.raises(ArgumentError, match="chief must be True or False, not 'no'") as err:
        FaultInjector().run([sys.executable, "-c", "pass"], chief="no")  # type: ignore[arg-type]
    assert err.value.name == "chief"
