"""Two fleets started at once on the same fixed ports: the first to claim them wins, the other
gets PortInUseError naming the port, never an exposure or identity error, and never do both fail.

Fixed ports (a spec that names them) are claimed with the same per-user locks as the ports
graphdist picks itself (:mod:`graphdist._ports`), lowest port first, and held until every
server listens; a start whose server loses its port some other way (another user's fleet, which
cannot see those locks) is reported by the server's own exit: a taken port.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest

import graphdist
from graphdist import _ports as port_locks
from graphdist._ports import claim_ports, pick_free_ports, release_claims, release_ports
from tests.conftest import EVENTUALLY_S, REPO, start_python, wait_gone

pytestmark = pytest.mark.integration

ROUNDS = 20
SUBPROCESS_ROUNDS = 2


def _fixed_ports() -> tuple[list[int], dict[str, list[str]]]:
    ports = pick_free_ports(2)
    release_ports(ports)  # free again: the fleets name them as fixed ports
    return ports, {"local": [f"localhost:{p}" for p in ports]}


def _race(spec: dict[str, list[str]]) -> tuple[list[graphdist.LocalFleet], list[Any]]:
    """Start two fleets on ``spec`` at the same moment, each in its own thread; returns them and
    what each start gave ("ok" or the exception). The winner is left running."""
    fleets = [graphdist.LocalFleet(spec, start_timeout_s=60) for _ in range(2)]
    barrier = threading.Barrier(2)
    outcomes: list[Any] = [None, None]

    def start(i: int) -> None:
        barrier.wait(timeout=30)
        try:
            fleets[i].start()
            outcomes[i] = "ok"
        except Exception as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    assert not any(t.is_alive() for t in threads), "a start did not return"
    return fleets, outcomes


def _assert_nothing_held(ports: list[int]) -> None:
    """Neither a reservation nor a claim of ``ports`` is left in this process (no lock fd)."""
    assert not set(ports) & set(port_locks._held)
    assert not set(ports) & set(port_locks._claims)


@pytest.mark.timeout(150)
def test_two_fleets_started_at_once_on_the_same_fixed_ports_one_wins():
    with graphdist.LocalFleet("local=1"):  # the fork server is warm: the starts are quick
        pass
    wins = {0: 0, 1: 0}
    for _ in range(ROUNDS):
        ports, spec = _fixed_ports()
        fleets, outcomes = _race(spec)
        pids = [pid for fleet in fleets for pid in fleet.pids]
        try:
            assert outcomes.count("ok") == 1, outcomes
            winner = outcomes.index("ok")
            wins[winner] += 1
            fleet, loser, error = fleets[winner], fleets[1 - winner], outcomes[1 - winner]
            assert isinstance(error, graphdist.PortInUseError), repr(error)
            assert error.port in ports
            assert str(error.port) in str(error)
            # the winner's claim (this process), or, if it came that late, its server
            assert error.holder_pid in (os.getpid(), *fleet.pids), error
            assert loser.pids == []  # refused before any process started
            assert loser.state is graphdist.FleetState.FAILED
            assert all(h.ok for h in fleet.health()), fleet.health()
        finally:
            for fleet in fleets:
                fleet.close()
        assert wait_gone(pids, EVENTUALLY_S) == []
        _assert_nothing_held(ports)
    assert sum(wins.values()) == ROUNDS


@pytest.mark.timeout(120)
def test_a_server_that_loses_its_port_unseen_fails_as_a_port_in_use(monkeypatch):
    # Another user's fleet cannot see this user's claims: without them, the servers of both
    # fleets race for the ports. Each start that loses one must say so, by its server's exit,
    # not refuse the winner's answer as an exposure or identity failure (both may lose one).
    monkeypatch.setattr("graphdist._local.checks.claim_ports", lambda ports, owner: None)
    with graphdist.LocalFleet("local=1"):
        pass
    for _ in range(6):
        ports, spec = _fixed_ports()
        fleets, outcomes = _race(spec)
        pids = [pid for fleet in fleets for pid in fleet.pids]
        try:
            assert outcomes.count("ok") <= 1, outcomes
            for fleet, outcome in zip(fleets, outcomes, strict=True):
                if outcome == "ok":
                    assert all(h.ok for h in fleet.health()), fleet.health()
                    continue
                assert type(outcome) is graphdist.PortInUseError, repr(outcome)
                assert outcome.port in ports
                assert str(outcome.port) in str(outcome)
        finally:
            for fleet in fleets:
                fleet.close()
        assert wait_gone(pids, EVENTUALLY_S) == []


@pytest.mark.timeout(60)
def test_a_claimed_fixed_port_fails_the_start_before_any_process_starts():
    ports, spec = _fixed_ports()
    other, third = object(), object()  # other fleets of this process
    assert claim_ports([max(ports)], other) is None  # starting on the higher port
    try:
        fleet = graphdist.LocalFleet(spec)
        with pytest.raises(graphdist.PortInUseError) as info:
            fleet.start()
        assert info.value.port == max(ports)
        assert info.value.holder_pid == os.getpid()
        assert str(max(ports)) in str(info.value)
        assert fleet.pids == []
        assert fleet.state is graphdist.FleetState.FAILED
        # The lower port, claimed on the way, was given back: another claim gets it.
        assert claim_ports([min(ports)], third) is None
    finally:
        release_claims(other)
        release_claims(third)
    _assert_nothing_held(ports)


HOLDER = textwrap.dedent(
    """
    import sys
    from graphdist._ports import claim_ports, pick_free_ports
    if sys.argv[1] == "claim":  # another process starting a fleet on the port
        assert claim_ports([int(sys.argv[2])], object()) is None
        print(sys.argv[2], flush=True)
    else:  # a parent that picked the ports of a cluster its child serves (up --detach)
        print(*pick_free_ports(1), flush=True)
    sys.stdin.read()  # hold the lock until the test closes our stdin
    """
)


def _holder(*args: str) -> tuple[subprocess.Popen[str], int]:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert holder.stdout is not None
    line = holder.stdout.readline()
    if not line:
        holder.communicate(timeout=30)
    return holder, int(line)


@pytest.mark.timeout(60)
def test_a_fixed_port_claimed_by_another_process_names_that_process():
    ports, spec = _fixed_ports()
    holder, _ = _holder("claim", str(min(ports)))
    try:
        fleet = graphdist.LocalFleet(spec)
        with pytest.raises(graphdist.PortInUseError) as info:
            fleet.start()
        assert info.value.port == min(ports)
        assert info.value.holder_pid == holder.pid  # read from its lock file: nothing listens
        assert f"pid {holder.pid}" in str(info.value)
        assert fleet.pids == []
    finally:
        holder.communicate(timeout=30)  # closes its stdin: it exits, dropping the claim
    _assert_nothing_held(ports)


@pytest.mark.timeout(60)
def test_a_port_another_process_only_picked_can_be_served_here():
    holder, port = _holder("pick")
    try:
        free = graphdist.Cluster.parse("x=1").address("x", 0)
        with graphdist.LocalFleet({"local": [f"localhost:{port}", free]}) as fleet:
            assert all(h.ok for h in fleet.health())
            pids = fleet.pids
    finally:
        holder.communicate(timeout=30)
    assert wait_gone(pids, EVENTUALLY_S) == []
    _assert_nothing_held([port])


@pytest.mark.timeout(60)
def test_ports_picked_for_a_counted_spec_still_start_and_are_released():
    with graphdist.LocalFleet("local=2") as fleet:
        ports = [t.task.port for t in fleet.tasks]
        assert all(h.ok for h in fleet.health())
        _assert_nothing_held(ports)  # released once every server listened
    # A counted spec's ports belong to the first fleet that starts on them.
    cluster = graphdist.Cluster.parse("local=2")
    ports = [t.port for t in cluster.tasks]
    first, second = graphdist.LocalFleet(cluster), graphdist.LocalFleet(cluster)
    assert claim_ports(ports, first) is None  # first is starting on them
    try:
        with pytest.raises(graphdist.PortInUseError) as info:
            second.start()
        assert info.value.port == min(ports)
        assert second.pids == []
        assert set(ports) <= set(port_locks._held)  # still reserved for this process
    finally:
        release_claims(first)
    with first:
        assert all(h.ok for h in first.health())
    _assert_nothing_held(ports)


RACER = textwrap.dedent(
    """
    import json, os, sys, time
    import graphdist
    ports, go, release = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    fleet = graphdist.LocalFleet(
        {"local": [f"localhost:{p}" for p in ports]}, start_timeout_s=120
    )
    while not os.path.exists(go):
        time.sleep(0.002)
    try:
        fleet.start()
    except Exception as exc:
        print(json.dumps({"error": type(exc).__name__, "port": getattr(exc, "port", None),
                          "holder": getattr(exc, "holder_pid", None), "message": str(exc),
                          "pids": fleet.pids}), flush=True)
        sys.exit(0)
    with fleet:
        alive = all(h.ok for h in fleet.health())
        print(json.dumps({"error": None, "alive": alive, "pids": fleet.pids}), flush=True)
        deadline = time.monotonic() + 100
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.01)
    """
)


@pytest.mark.timeout(150)
def test_two_processes_started_at_once_on_the_same_fixed_ports_one_wins(tmp_path):
    for round_ in range(SUBPROCESS_ROUNDS):
        ports, _spec = _fixed_ports()
        go, release = tmp_path / f"go-{round_}", tmp_path / f"release-{round_}"
        racers = [start_python("-c", RACER, json.dumps(ports), str(go), str(release))]
        racers.append(start_python("-c", RACER, json.dumps(ports), str(go), str(release)))
        pids: list[int] = []
        try:
            go.touch()
            reports = []
            for racer in racers:  # the winner reports once it is up, then waits for release
                assert racer.stdout is not None
                line = racer.stdout.readline()
                assert line, racer.communicate(timeout=30)
                reports.append(json.loads(line))
                pids += reports[-1]["pids"]
            release.touch()
            for racer in racers:
                racer.communicate(timeout=60)
                assert racer.returncode == 0
        finally:
            release.touch()
            for racer in racers:
                if racer.poll() is None:
                    racer.kill()
                    racer.communicate()
        assert wait_gone(pids, EVENTUALLY_S) == []
        winners = [r for r in reports if r["error"] is None]
        assert len(winners) == 1, reports
        assert winners[0]["alive"], reports
        (loser,) = [r for r in reports if r["error"] is not None]
        assert loser["error"] == "PortInUseError", loser
        assert loser["port"] in ports and str(loser["port"]) in loser["message"]
        winner_pid = racers[reports.index(winners[0])].pid
        assert loser["holder"] in (winner_pid, *winners[0]["pids"]), loser
        assert loser["pids"] == []
