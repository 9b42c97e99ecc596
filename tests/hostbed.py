"""Several "hosts" on this one machine, for tests of what crosses a real network: each host a
named network namespace (``ip netns add``) with an IPv4 address of its own on one bridge in the
root namespace, so processes started on different hosts talk over eth0, never over loopback, on
any machine, with a network or none.

A :class:`HostBed` of N hosts is ``N`` namespaces ``gdh-PID-TAG-I``, a bridge ``gdbKEY`` and a
veth pair per host (``gdvKEYI``, moved into the namespace and renamed eth0; ``gdpKEYI`` on the
bridge), where PID is the creating process's, TAG is random and KEY is PID (5 digits, base 36)
then TAG: unique per bed, so beds of parallel xdist workers never collide, and every name says
whose it is, so :func:`sweep_stale` removes what a crashed run left. :meth:`HostBed.close` kills
every process in the namespaces and checks that nothing of the bed is left.

Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and ``ip`` (iproute2); without them
:func:`require_hostbed` skips, which fails a ``promise`` test unless
GRAPHDIST_ALLOW_PROMISE_SKIPS=1.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import random
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

import pytest

from tests.conftest import Killed, forbid_in_unit_tier, is_gone

NETNS_PREFIX = "gdh-"
# How long close() waits for killed processes to exit, and then for deleted links to disappear.
GONE_S = 10.0
# How long the hosts get to reach each other after the bed is made.
REACH_S = 10.0
REACH_PORT = 7  # any port: each namespace has ports of its own
IP_TIMEOUT_S = 30.0
_TAG_CHARS = "0123456789abcdefghijklmnopqrstuvwxyz"
_NETNS_RE = re.compile(r"^gdh-(\d+)-([0-9a-z]{4})-\d+$")
_LINK_RE = re.compile(r"^gd[bvp]([0-9a-z]{5})([0-9a-z]{4})\d*$")
_ROUTE_TYPES = ("unicast", "local", "broadcast", "multicast", "anycast", "blackhole", "unreachable")

# Run on every host at once: listen on its own address, connect to every peer until each has
# answered, and stay until every peer has connected back (the listen backlog holds their
# connections until they are accepted). Prints the peers it could not reach.
_REACH = """
import socket, sys, time
me, port, deadline, peers = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4:]
deadline += time.monotonic()
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a check's TIME_WAIT: not in use
server.bind((me, port))
server.listen(64)
server.settimeout(0.05)
todo, heard = set(peers), set()
while (todo or not heard >= set(peers)) and time.monotonic() < deadline:
    for peer in sorted(todo):
        try:
            socket.create_connection((peer, port), timeout=0.2).close()
            todo.discard(peer)
        except OSError:
            pass
    try:
        conn, (source, _) = server.accept()
        heard.add(source)
        conn.close()
    except OSError:
        pass
print(" ".join(sorted(todo)))
"""


class HostBedError(RuntimeError):
    """A bed could not be made, or its hosts do not reach each other."""


def _ip(*args: str, stdin: str | None = None, check: bool = True) -> str:
    """``ip ARGS``'s output; a failure raises :class:`HostBedError` with ip's own words."""
    result = subprocess.run(
        ["ip", *args], input=stdin, capture_output=True, text=True, timeout=IP_TIMEOUT_S
    )
    if check and result.returncode != 0:
        raise HostBedError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


def _base36(n: int) -> str:
    digits = ""
    while n:
        n, d = divmod(n, 36)
        digits = _TAG_CHARS[d] + digits
    return digits.rjust(5, "0")


def _netns_names() -> list[str]:
    """The named network namespaces (``ip netns list``: "NAME" or "NAME (id: N)")."""
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def _link_names() -> list[str]:
    """The links of this (the root) network namespace, without their "@peer" suffix."""
    names = []
    for line in _ip("-o", "link", "show").splitlines():
        fields = line.split(":", 2)
        if len(fields) == 3:
            names.append(fields[1].strip().split("@")[0])
    return names


def _netns_pids(names: Sequence[str]) -> list[int]:
    """Pids of the processes in the named namespaces, found as ``ip netns pids`` finds them (the
    namespace of /proc/PID/ns/net is the one mounted at /run/netns/NAME), in one pass for all.
    A zombie has no namespace left and is not found."""
    wanted = set()
    for name in names:
        try:
            st = os.stat(f"/run/netns/{name}")
        except FileNotFoundError:
            continue
        wanted.add((st.st_dev, st.st_ino))
    if not wanted:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in wanted:
            found.append(int(entry))
    return found


def _used_networks() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks of this namespace's addresses and routes: a bed's subnet overlaps none,
    so no address of the machine's own is shadowed or reused."""
    networks = []
    for line in _ip("-o", "-4", "addr", "show").splitlines():
        fields = line.split()
        if "inet" in fields:
            networks.append(ipaddress.IPv4Interface(fields[fields.index("inet") + 1]).network)
    for line in _ip("-4", "route", "show", "table", "all").splitlines():
        fields = line.split()
        if fields and fields[0] in _ROUTE_TYPES:
            fields = fields[1:]
        if fields and fields[0][:1].isdigit():
            networks.append(ipaddress.IPv4Network(fields[0], strict=False))
    return networks


def _free_subnet() -> ipaddress.IPv4Network:
    used = _used_networks()
    rng = random.SystemRandom()
    for _ in range(1000):
        # 10.254/16 is tests/net/netns.py's (in namespaces of its own, but kept apart all the same)
        subnet = ipaddress.IPv4Network(f"10.{rng.randint(1, 253)}.{rng.randint(0, 255)}.0/24")
        if not any(subnet.overlaps(n) for n in used):
            return subnet
    raise HostBedError(f"no free 10.x.y.0/24 subnet: this machine uses {used}")


def _teardown(
    namespaces: Sequence[str], links: Sequence[str], popens: Sequence[subprocess.Popen[Any]]
) -> str:
    """Kill every process in ``namespaces`` (and the ``popens``, wherever they went), wait until
    they are gone, delete the links and the namespaces; return what is still there, described,
    or "" if nothing is."""
    deadline = time.monotonic() + GONE_S
    killed = Killed()  # by pid and start time: never another test's process on a recycled pid
    killed.kill(p.pid for p in popens if p.poll() is None)
    # Killed again and again: a process may fork between the scan and the kill.
    while True:
        inside = _netns_pids(namespaces)
        if not inside or time.monotonic() >= deadline:
            break
        killed.kill(inside)
        time.sleep(0.02)
    for p in popens:  # reaped, so that no zombie of ours stays behind
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    alive = sorted(
        set(killed.alive_after(max(0.1, deadline - time.monotonic())))
        | set(_netns_pids(namespaces))
    )

    existing_links = set(_link_names())
    existing_netns = set(_netns_names())
    # A namespace that still holds a process is kept: deleted, it would live on unnamed.
    namespaces_to_delete = [
        ns for ns in namespaces if ns in existing_netns and not _netns_pids([ns])
    ]
    commands = [f"link del {name}" for name in links if name in existing_links]
    commands += [f"netns del {ns}" for ns in namespaces_to_delete]
    if commands:
        # -force: one that fails (already gone: another sweep got there first) stops no other.
        _ip("-force", "-batch", "-", stdin="\n".join(commands) + "\n", check=False)

    deadline = time.monotonic() + GONE_S
    while True:
        left_links = sorted(set(links) & set(_link_names()))
        left_netns = sorted(set(namespaces) & set(_netns_names()))
        if not (left_links or left_netns) or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    alive = sorted(set(killed.alive_after(0)) | set(_netns_pids(namespaces)))
    if not (left_links or left_netns or alive):
        return ""
    return f"namespaces {left_netns}, links {left_links}, processes {alive}"


def sweep_stale() -> list[str]:
    """Remove every bed whose creating process is dead (a crashed or killed test run's), its
    processes killed first; return their keys. Called whenever a bed is made, so that a crash
    leaves nothing for the next run. Raises :class:`AssertionError` naming what it could not
    remove."""
    beds: dict[str, tuple[list[str], list[str]]] = {}
    for ns in _netns_names():
        m = _NETNS_RE.match(ns)
        if m:
            beds.setdefault(_base36(int(m.group(1))) + m.group(2), ([], []))[0].append(ns)
    for link in _link_names():
        m = _LINK_RE.match(link)
        if m:
            beds.setdefault(m.group(1) + m.group(2), ([], []))[1].append(link)
    swept, failures = [], []
    for key, (namespaces, links) in sorted(beds.items()):
        if not is_gone(int(key[:5], 36)):  # a zombie owner is a dead one
            continue
        left = _teardown(namespaces, links, [])
        if left:
            failures.append(f"stale bed {key}: {left}")
        swept.append(key)
    if failures:
        raise AssertionError("could not remove: " + "; ".join(failures))
    return swept


@functools.cache
def _missing() -> str:
    """What this machine lacks to make a bed ("" for nothing): tried once per process, with a
    namespace, a bridge and a veth pair made, a command run in the namespace, and all deleted."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "a bed of network namespaces needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN)"
    if shutil.which("ip") is None:
        return "ip (iproute2) is not installed: cannot make network namespaces"
    key = _base36(os.getpid()) + "".join(random.choices(_TAG_CHARS, k=4))
    ns = f"{NETNS_PREFIX}{os.getpid()}-{key[5:]}-1"
    links = [f"gdb{key}", f"gdp{key}1", f"gdv{key}1"]
    made = subprocess.run(
        ["ip", "-batch", "-"],
        input=f"netns add {ns}\nlink add {links[0]} type bridge\n"
        f"link add {links[2]} type veth peer name {links[1]}\nlink set {links[2]} netns {ns}\n",
        capture_output=True,
        text=True,
        timeout=IP_TIMEOUT_S,
    )
    if made.returncode == 0:
        made = subprocess.run(
            ["ip", "netns", "exec", ns, "true"],
            capture_output=True,
            text=True,
            timeout=IP_TIMEOUT_S,
        )
    left = _teardown([ns], links, [])
    if made.returncode != 0:
        return f"cannot make network namespaces with a bridge and veth pairs: {made.stderr.strip()}"
    if left:
        return f"cannot delete a network namespace made to try: {left}"
    return ""


def require_hostbed() -> None:
    """Skip (with what is missing) unless this process can make a :class:`HostBed`."""
    missing = _missing()
    if missing:
        pytest.skip(missing)


class Host:
    """One host of a bed: a network namespace with ``address`` on its eth0; the commands it runs
    (``ip netns exec``) inherit the environment as usual, and are killed when the bed closes."""

    def __init__(self, bed: HostBed, index: int, address: str) -> None:
        self.name = f"host{index}"
        self.netns = f"{NETNS_PREFIX}{bed.owner_pid}-{bed.tag}-{index}"
        self.address = address
        self._bed = bed

    def __repr__(self) -> str:
        return f"Host({self.name!r}, netns={self.netns!r}, address={self.address!r})"

    def argv(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` run on this host: ``ip netns exec NS cmd`` (ip execs it: same pid)."""
        return ["ip", "netns", "exec", self.netns, *cmd]

    def popen(self, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """``subprocess.Popen`` of ``cmd`` on this host; the bed reaps it when it closes."""
        self._bed._check_open()
        proc: subprocess.Popen[Any] = subprocess.Popen(self.argv(cmd), **kwargs)
        self._bed._popens.append(proc)
        return proc

    def run(self, cmd: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """``subprocess.run`` of ``cmd`` on this host."""
        self._bed._check_open()
        return subprocess.run(self.argv(cmd), **kwargs)

    def pids(self) -> list[int]:
        """Pids of every process on this host (``ip netns pids``), whoever started it."""
        return [int(p) for p in _ip("netns", "pids", self.netns).split()]


class HostBed:
    """``n`` hosts on one bridge, addresses .1 .. .n of a /24 unused on this machine, checked to
    reach each other over TCP once made. ``owner_pid`` (for tests of :func:`sweep_stale` only)
    names another process as the bed's creator."""

    def __init__(self, n: int = 3, *, owner_pid: int | None = None) -> None:
        if not 1 <= n <= 254:
            raise ValueError(f"a bed has 1 to 254 hosts (one /24), not {n}")
        forbid_in_unit_tier("a host bed (network namespaces)")
        sweep_stale()
        self.owner_pid = os.getpid() if owner_pid is None else owner_pid
        self.tag = "".join(random.SystemRandom().choices(_TAG_CHARS, k=4))
        self.key = _base36(self.owner_pid) + self.tag
        self.bridge = f"gdb{self.key}"
        self.subnet = _free_subnet()
        self.hosts = [Host(self, i, str(self.subnet.network_address + i)) for i in range(1, n + 1)]
        self._popens: list[subprocess.Popen[Any]] = []
        self._closed = False
        try:
            self._make()
            self._check_reach()
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"HostBed({self.key!r}, {self.subnet}, {self.hosts})"

    def __enter__(self) -> HostBed:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    @property
    def namespaces(self) -> list[str]:
        return [h.netns for h in self.hosts]

    @property
    def links(self) -> list[str]:
        """The bed's links in the root namespace (the gdv ends, until moved, too)."""
        n = range(1, len(self.hosts) + 1)
        return [
            *(f"gdp{self.key}{i}" for i in n),
            *(f"gdv{self.key}{i}" for i in n),
            self.bridge,
        ]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")

    def _make(self) -> None:
        # addrgenmode none: no IPv6 link-local address anywhere, so the root namespace gains no
        # address, and eth0 has no "tentative" one for a second or two (duplicate detection).
        root = [f"netns add {ns}" for ns in self.namespaces]
        root += [
            f"link add {self.bridge} type bridge",
            f"link set {self.bridge} addrgenmode none",
            f"link set {self.bridge} up",
        ]
        for i, host in enumerate(self.hosts, 1):
            veth, port = f"gdv{self.key}{i}", f"gdp{self.key}{i}"
            root += [
                f"link add {veth} type veth peer name {port}",
                f"link set {port} addrgenmode none",
                f"link set {port} master {self.bridge}",
                f"link set {port} up",
                f"link set {veth} netns {host.netns}",
            ]
        _ip("-batch", "-", stdin="\n".join(root) + "\n")
        inside = []
        for i, host in enumerate(self.hosts, 1):
            commands = [
                f"link set gdv{self.key}{i} name eth0",
                "link set eth0 addrgenmode none",
                f"addr add {host.address}/{self.subnet.prefixlen} dev eth0",
                "link set eth0 up",
                "link set lo up",
            ]
            inside.append(
                subprocess.Popen(
                    ["ip", "-n", host.netns, "-batch", "-"],
                    stdin=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
            self._popens.append(inside[-1])
            assert inside[-1].stdin is not None
            inside[-1].stdin.write("\n".join(commands) + "\n")
            inside[-1].stdin.close()
        for host, proc in zip(self.hosts, inside, strict=True):
            assert proc.stderr is not None
            err = proc.stderr.read()
            if proc.wait(timeout=IP_TIMEOUT_S) != 0:
                raise HostBedError(f"cannot set up {host!r}: {err.strip()}")

    def _check_reach(self) -> None:
        """Every host connects to every other over TCP, or :class:`HostBedError` names who could
        not reach whom, and the usual culprit."""
        if len(self.hosts) < 2:
            return
        addresses = [h.address for h in self.hosts]
        probes = [
            h.popen(
                [
                    sys.executable,
                    *("-I", "-S", "-c", _REACH, h.address, str(REACH_PORT), str(REACH_S)),
                    *(a for a in addresses if a != h.address),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for h in self.hosts
        ]
        failures = []
        for host, probe in zip(self.hosts, probes, strict=True):
            out, err = probe.communicate(timeout=REACH_S + 30)
            if probe.returncode != 0:
                last = err.strip().splitlines()[-1:] or [f"exit status {probe.returncode}"]
                failures.append(f"{host.name} could not probe: {last[0]}")
            elif out.split():
                failures.append(f"{host.name} ({host.address}) -> {', '.join(out.split())}")
        if failures:
            raise HostBedError(
                f"the hosts of {self!r} do not reach each other over TCP: {'; '.join(failures)}. "
                f"net.bridge.bridge-nf-call-iptables is {_bridge_nf_call_iptables()}: when 1, "
                "bridged IPv4 goes through the root namespace's iptables/nftables FORWARD chain, "
                "whose DROP policy (as Docker sets it) drops it"
            )

    def close(self) -> None:
        """Kill every process on every host, wait until they are gone, delete the namespaces,
        the veth pairs and the bridge; then check that none of them is left, or raise
        :class:`AssertionError` naming what is. Idempotent."""
        if self._closed:
            return
        left = _teardown(self.namespaces, self.links, self._popens)
        if left:
            raise AssertionError(f"{self!r} left behind: {left}")
        self._closed = True


def _bridge_nf_call_iptables() -> str:
    try:
        with open("/proc/sys/net/bridge/bridge-nf-call-iptables", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return "unset (br_netfilter is not loaded)"
