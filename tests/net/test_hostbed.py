"""The bed of hosts (tests/hostbed.py) is what tests of a real network stand on: each host has an
address of its own and reaches the others over TCP, a process on a host sees that host's network
only, and a bed leaves nothing behind: not its processes, namespaces or links when closed, not
even when its creator died without closing it (:func:`sweep_stale`), and two beds at once stay
apart."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from itertools import permutations

import pytest

from tests.conftest import REPO, is_gone
from tests.hostbed import Host, HostBed, require_hostbed, sweep_stale

pytestmark = [pytest.mark.promise, pytest.mark.timeout(60)]

# On a host: listen on ADDRESS (a free port, printed), wait up to TIMEOUT s for one connection,
# print the address it came from ("none" without one).
ACCEPT_ONE = """
import socket, sys
server = socket.socket()
server.bind((sys.argv[1], 0))
server.listen(1)
server.settimeout(float(sys.argv[2]))
print(server.getsockname()[1], flush=True)
try:
    print(server.accept()[1][0])
except OSError:
    print("none")
"""
CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 2).close()"
# On a host: what its processes see of the network, through psutil and through /sys.
SEEN = """
import json, os
from tests.net.netns import non_loopback_addresses
print(json.dumps({"addresses": non_loopback_addresses(), "sys": os.listdir("/sys/class/net")}))
"""


def reached_from(client: Host, server: Host, timeout_s: float = 10.0) -> str:
    """The address a connection from ``client`` to ``server``'s address arrives from, as the
    server sees it; "none" if it never arrives."""
    listener = server.popen(
        [sys.executable, "-I", "-S", "-c", ACCEPT_ONE, server.address, str(timeout_s)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert listener.stdout is not None
    port = listener.stdout.readline().strip()
    client.run([sys.executable, "-I", "-S", "-c", CONNECT, server.address, port], timeout=30)
    out: str = listener.communicate(timeout=timeout_s + 30)[0]
    return out.strip()


def ip_lines(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout


def ipv4_addresses(ip_o_4_addr: str) -> set[str]:
    """The addresses of ``ip -o -4 addr`` output."""
    return {line.split()[3].split("/")[0] for line in ip_o_4_addr.splitlines() if line.strip()}


def assert_nothing_left(bed: HostBed) -> None:
    netns = ip_lines("netns", "list")
    links = ip_lines("-o", "link")
    for ns in bed.namespaces:
        assert ns not in netns
    assert bed.key not in links, links
    assert bed.bridge not in links


def test_each_host_has_its_own_address_and_reaches_every_other(hosts: HostBed) -> None:
    addresses = [h.address for h in hosts]
    assert [h.name for h in hosts] == ["host1", "host2", "host3"]
    assert addresses == [str(hosts.subnet.network_address + i) for i in (1, 2, 3)]
    assert hosts.subnet.prefixlen == 24
    root = ipv4_addresses(ip_lines("-o", "-4", "addr"))
    assert not any(ipaddress.ip_address(a) in hosts.subnet for a in root)
    for client, server in permutations(hosts, 2):
        assert reached_from(client, server) == client.address, (client, server)


def test_a_process_on_a_host_sees_that_host_network_only(hosts: HostBed) -> None:
    root = ipv4_addresses(ip_lines("-o", "-4", "addr"))
    for host in hosts:
        inside = host.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, check=True)
        assert ipv4_addresses(inside.stdout) == {"127.0.0.1", host.address}
        assert not (root - {"127.0.0.1"}) & ipv4_addresses(inside.stdout)
        seen = host.run(
            [sys.executable, "-c", SEEN], capture_output=True, text=True, cwd=REPO, timeout=30
        )
        assert seen.returncode == 0, seen.stderr
        # psutil's reading agrees; /sys is the namespace's (ip netns exec mounts a sysfs of it)
        facts = json.loads(seen.stdout)
        assert facts["addresses"] == [host.address]
        assert sorted(facts["sys"]) == ["eth0", "lo"]


def test_close_kills_every_process_on_the_hosts_and_leaves_nothing() -> None:
    require_hostbed()
    bed = HostBed(2)
    try:
        sleeper = bed[0].popen(["sleep", "600"])
        # Not started through the bed, and detached from its shell: found by its namespace alone.
        detached = bed[1].run(
            ["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"],
            capture_output=True,
            text=True,
            check=True,
        )
        orphan = int(detached.stdout)
        assert bed[0].pids() == [sleeper.pid]
        assert bed[1].pids() == [orphan]
    finally:
        bed.close()
    assert_nothing_left(bed)
    assert sleeper.returncode == -signal.SIGKILL  # killed, and reaped by close()
    with pytest.raises(ProcessLookupError):
        os.kill(sleeper.pid, 0)
    # The orphan's parent is pid 1 of this machine, which may reap it a while later.
    assert is_gone(orphan)
    bed.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        bed[0].popen(["true"])


def test_sweep_stale_removes_the_bed_of_a_dead_process_only() -> None:
    require_hostbed()
    with HostBed(1) as mine:
        # The bed of a process that dies before it closes it: alive while the bed is made (a
        # sweep by another test process in the meantime must leave it alone), then killed.
        owner = subprocess.Popen(["sleep", "600"])
        try:
            stale = HostBed(2, owner_pid=owner.pid)
            detached = stale[0].run(
                ["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"],
                capture_output=True,
                text=True,
                check=True,
            )
        finally:
            owner.kill()
            owner.wait()
        try:
            assert all(ns.startswith(f"gdh-{owner.pid}-") for ns in stale.namespaces)
            orphan = int(detached.stdout)
            swept = sweep_stale()  # (or by a bed another test process makes meanwhile)
            assert mine.key not in swept
            assert_nothing_left(stale)
            assert is_gone(orphan)
            assert mine[0].netns in ip_lines("netns", "list")
            assert mine.bridge in ip_lines("-o", "link")
        finally:
            stale.close()  # nothing left to close, nothing left over
    assert_nothing_left(mine)


def test_two_beds_at_once_stay_apart() -> None:
    require_hostbed()
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(lambda _: HostBed(2), range(2))
    try:
        assert a.key != b.key
        assert not set(a.namespaces) & set(b.namespaces)
        assert not set(a.links) & set(b.links)
        assert reached_from(a[1], a[0]) == a[1].address
        assert reached_from(b[1], b[0]) == b[1].address
        assert reached_from(a[1], b[0], timeout_s=1) == "none"  # separate networks
        b.close()
        assert reached_from(a[0], a[1]) == a[0].address
    finally:
        a.close()
        b.close()
    assert_nothing_left(a)
    assert_nothing_left(b)


def test_a_host_address_with_127_in_it_is_not_taken_for_loopback() -> None:
    """Beds draw 10.x.y.0/24 at random: 10.169.127.2 (a CI run's bed) and 10.127.4.1 are host
    addresses, and the tests that look for servers off loopback must count them as such."""
    from tests.conftest import on_loopback

    for address in ("10.169.127.2:36901", "10.127.4.1:80", "*:15421", "[::]:22", "0.0.0.0:1"):
        assert not on_loopback(address), address
    for address in (
        "127.149.98.93:13547",
        "[::ffff:127.219.143.3]:17263",
        "[::1]:22",
        "127.0.0.1:1",
    ):
        assert on_loopback(address), address
