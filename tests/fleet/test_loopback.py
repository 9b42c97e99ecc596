"""Servers accept connections from loopback only, unless exposure is asked for explicitly."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import textwrap

import psutil
import pytest

import graphdist
from tests.conftest import run_python

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def non_loopback_addresses() -> list[str]:
    found = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family != socket.AF_INET:
                continue
            if not ipaddress.ip_address(a.address).is_loopback:
                found.append(a.address)
    return found


def connects(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2.0)
        try:
            s.connect((host, port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def outside():
    addresses = non_loopback_addresses()
    if not addresses:
        pytest.skip("this machine has no non-loopback IPv4 address to connect from")
    return addresses


def test_fleet_servers_refuse_the_machines_own_network_addresses(graphdist_fleet, outside):
    for task in graphdist_fleet.tasks:
        assert connects("127.0.0.1", task.task.port)
        assert connects("localhost", task.task.port)
        for address in outside:
            assert not connects(address, task.task.port), (address, task)


def test_expose_is_explicit_and_really_exposes(graphdist_fleet_factory, outside, caplog):
    fleet = graphdist_fleet_factory("local=1", expose=True)
    assert "no authentication" in caplog.text
    port = fleet.tasks[0].task.port
    assert all(connects(address, port) for address in outside)


def test_non_loopback_host_needs_expose():
    with pytest.raises(graphdist.ClusterSpecError, match="expose=True"):
        graphdist.LocalFleet({"local": [f"{socket.gethostname()}:23456"]}).start()


def test_detached_cli_fleet_is_loopback_only(state_dir, outside):
    env = {"GRAPHDIST_STATE_DIR": state_dir}
    up = run_python(["-m", "graphdist", "up", "--cluster", "local=2", "--detach"], env=env)
    assert up.returncode == 0, up.stderr
    try:
        rows = json.loads(run_python(["-m", "graphdist", "status", "--json"], env=env).stdout)
        for row in rows:
            port = int(row["address"].rsplit(":", 1)[1])
            assert connects("127.0.0.1", port)
            assert not any(connects(address, port) for address in outside)
    finally:
        assert run_python(["-m", "graphdist", "down"], env=env).returncode == 0


def test_no_mechanism_is_a_clear_error_not_a_silent_exposure(tmp_path):
    code = textwrap.dedent(
        """
        import graphdist
        try:
            graphdist.LocalFleet("local=1").start()
        except graphdist.LoopbackUnavailableError as exc:
            print("refused:", exc)
        """
    )
    env = {"XDG_CACHE_HOME": str(tmp_path), "CC": "/bin/false"}
    result = run_python(["-c", code], env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("refused: Cannot keep the servers on loopback")
    assert "expose=True" in result.stdout
    assert not os.listdir(tmp_path / "graphdist")
