"""Members only: which other machines may connect to a server that listens on a host address.

A TensorFlow server runs any op a client sends, with the server's rights, and takes no
credentials. On one machine graphdist keeps servers on loopback (:mod:`graphdist._net.loopback`);
a server on a host address (``graphdist serve``, ``expose=True`` fleets, detached fleets,
RayFleet) is reachable from the whole network. So every such server also loads the bind shim,
with ``GRAPHDIST_ALLOW`` set to the cluster's own hosts (their addresses, resolved before the
server starts) and the addresses and networks the user allows (``--allow``, ``allow=``): a peer
from another machine whose address is in neither is closed at ``accept()`` and logged with its
address. Peers on the server's own machine keep the same-user rule.

It protects a cluster from the other machines of its network. Not from address spoofing on the
same segment (the check reads the peer's source address), nor from anyone who can run a process
on a member host: TensorFlow's gRPC servers take no TLS credentials, so there is nothing better
to check. The promise is checked where it is kept: the server's own process asks the shim
(:func:`check_enforced`) before TensorFlow's server starts, and refuses to start without it.

The other direction too: a session's ``cluster_def`` names the workers a server dials, so a
client that may use one server could make it dial another fleet of the same user (on loopback,
where the same-user rule lets the server in) and run ops there. The servers graphdist starts
itself (LocalFleet, ``serve``) are given ``GRAPHDIST_DIAL`` (every address of every task of
their cluster), and the shim refuses any other TCP ``connect()``; :func:`check_enforced` checks
that too. Run tasks and Ray actors run user code, which may dial anything: they get no dial
list. Which process gets which list is decided in :mod:`graphdist._net.policy`.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
from collections.abc import Iterable

from graphdist._cluster import Cluster, Task
from graphdist._exceptions import ArgumentError, ClusterSpecError, LoopbackUnavailableError
from graphdist._validate import show

__all__ = [
    "ALLOW_ENV",
    "DIAL_ENV",
    "check_enforced",
    "dial_addresses",
    "member_addresses",
    "parse_allow",
    "shim_members",
]

ALLOW_ENV = "GRAPHDIST_ALLOW"
DIAL_ENV = "GRAPHDIST_DIAL"

_MAX_ENTRIES = 1024  # see graphdist._net.policy: the list fits one environment variable
_ALL_V4 = ipaddress.IPv6Network("::ffff:0:0/96")  # every IPv4 address, as IPv6 sockets see it


def _normal(
    network: ipaddress.IPv4Network | ipaddress.IPv6Network,
) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """A v4-mapped IPv6 network (``::ffff:10.0.0.0/104``) as the IPv4 network it is
    (``10.0.0.0/8``): an IPv4 peer on an IPv6 socket is ``::ffff:a.b.c.d``, so both spellings
    let in the same machines, and the wildcard check must see them alike."""
    if isinstance(network, ipaddress.IPv6Network) and network.prefixlen >= 96:
        mapped = network.network_address.ipv4_mapped
        if mapped is not None:
            return ipaddress.IPv4Network(f"{mapped}/{network.prefixlen - 96}")
    return network


def _every_ipv4(network: ipaddress.IPv4Network | ipaddress.IPv6Network) -> bool:
    """Whether ``network`` holds every IPv4 address (``::ffff:0:0/95``, ``::/80``)."""
    return isinstance(network, ipaddress.IPv6Network) and _ALL_V4.subnet_of(network)


def parse_allow(allow: str | Iterable[str] | None, *, name: str = "allow") -> tuple[str, ...]:
    """``allow`` (``"10.0.0.3,10.0.1.0/24"`` or a list of such entries; ``None``: nothing) as
    normalized networks (``"10.0.0.3/32"``). Raises :class:`ArgumentError` naming the bad value
    for an address or network that does not parse, an empty list, and a wildcard (``0.0.0.0``,
    ``::``, a ``/0`` network), which would let in every machine."""
    if allow is None:
        return ()
    if isinstance(allow, str):
        entries = allow.split(",")
    else:
        try:
            entries = list(allow)
        except TypeError:
            raise ArgumentError(
                f"{name} must be addresses or networks (a list, or a comma-separated string), "
                f"not {show(allow)}",
                name=name,
                value=allow,
            ) from None
    if len(entries) > _MAX_ENTRIES:
        raise ArgumentError(
            f"{name} has {len(entries)} entries; at most {_MAX_ENTRIES}", name=name, value=allow
        )
    networks: list[str] = []
    for entry in entries:
        if not isinstance(entry, str):
            raise ArgumentError(
                f"{name} entries must be strings such as '10.0.0.3' or '10.0.0.0/24', "
                f"not {show(entry)}",
                name=name,
                value=entry,
            )
        text = entry.strip()
        if not text:
            continue
        if "%" in text:  # Python parses fe80::1%eth0; the shim, rightly, does not
            raise ArgumentError(
                f"{name}: {show(text)} is a scoped address (the part after '%' names an "
                "interface of one machine), which a peer's address never carries; name it "
                f"without its zone ({show(text.split('%', 1)[0])})",
                name=name,
                value=text,
            )
        try:
            network = _normal(ipaddress.ip_network(text, strict=False))
        except ValueError:
            raise ArgumentError(
                f"{name}: {show(text)} is not an IP address or network (CIDR) such as "
                "'10.0.0.3' or '10.0.0.0/24'",
                name=name,
                value=text,
            ) from None
        if network.prefixlen == 0 or network.network_address.is_unspecified:
            raise ArgumentError(
                f"{name}: {show(text)} is a wildcard, which would let every machine run code in "
                "the servers; name the clients' addresses or networks",
                name=name,
                value=text,
            )
        if _every_ipv4(network):
            raise ArgumentError(
                f"{name}: {show(text)} holds every IPv4 address (::ffff:0:0/96 is IPv4 as an "
                "IPv6 socket sees it): a wildcard, which would let every IPv4 machine run code "
                "in the servers; name the clients' addresses or networks",
                name=name,
                value=text,
            )
        if str(network) not in networks:
            networks.append(str(network))
    if not networks:
        raise ArgumentError(
            f"{name} is empty; name at least one address or network, or leave it out (the "
            "cluster's own hosts are always let in)",
            name=name,
            value=allow,
        )
    return tuple(networks)


def member_addresses(cluster: Cluster) -> list[str]:
    """The addresses of the cluster's hosts that are not loopback (a loopback peer is on this
    machine and meets the same-user rule instead), resolved now; raises
    :class:`ClusterSpecError` for a host that does not resolve: a member that cannot be named
    would be shut out, so the server does not start."""
    found: list[str] = []
    for task in cluster:
        why = "its server could not be let in as a member of the cluster"
        for ip in _task_ips(task, why):
            if not ip.is_loopback and str(ip) not in found:
                found.append(str(ip))
    return found


def _task_ips(task: Task, why: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """Every address the host of ``task`` resolves to now (without an IPv6 zone, which the shim
    cannot parse); :class:`ClusterSpecError` saying ``why`` it matters for one that does not."""
    host = task.host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ClusterSpecError(
            f"Host {host!r} of task {task.name} does not resolve ({exc.strerror}), so {why}; "
            "name it by address",
            task.address,
        ) from None
    return [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]


def dial_addresses(cluster: Cluster) -> list[str]:
    """Every address a server of ``cluster`` may dial: each task's host resolved now (loopback
    ones included, every address a name has: ``localhost`` is 127.0.0.1 and ::1) with its port,
    as the shim reads them (``127.0.0.1:2222``, ``[::1]:2222``). Raises
    :class:`ClusterSpecError` for a host that does not resolve (its task could not be dialled)."""
    found: list[str] = []
    for task in cluster:
        for ip in _task_ips(task, "the cluster's servers could not dial it"):
            text = f"[{ip}]:{task.port}" if ip.version == 6 else f"{ip}:{task.port}"
            if text not in found:
                found.append(text)
    return found


def _entries(value: str) -> int:
    return sum(1 for entry in value.split(",") if entry)


def _shim_reads(symbol: str) -> int | None:
    """What graphdist's shim, if it is loaded in this process, answers from its exported
    ``symbol`` (a list's entries; -1 one unreadable, -2 unset); ``None`` where it is not loaded
    (no process variable says so: its own exported function is looked up)."""
    try:
        return int(getattr(ctypes.CDLL(None), symbol)())
    except (AttributeError, OSError):
        return None


def shim_members() -> int | None:
    """What the shim reads of ``GRAPHDIST_ALLOW`` (see :func:`_shim_reads`)."""
    return _shim_reads("graphdist_members")


def shim_dial() -> int | None:
    """What the shim reads of ``GRAPHDIST_DIAL`` (see :func:`_shim_reads`; -1: malformed)."""
    return _shim_reads("graphdist_dial")


def _check_list(env: str, found: int | None, refusal: str, not_loaded: str) -> None:
    """Raise :class:`LoopbackUnavailableError` (``refusal``, then why) unless the shim reads as
    many entries of ``env`` as the environment holds (``found``: what it read); nothing to check
    where ``env`` is unset."""
    expected = os.environ.get(env)
    if expected is None:
        return
    count = -3 if found is None else found
    if count != _entries(expected):
        why = {
            -3: not_loaded,
            -2: "the shim does not see the list",
            -1: "the shim cannot read an entry of the list",
        }.get(count, f"the shim reads {count} entries instead of {_entries(expected)}")
        raise LoopbackUnavailableError(
            f"{refusal}: {why}; it was not started. Is LD_PRELOAD honoured here (a wrapper such "
            "as env or nice in between drops it)?"
        )


def check_enforced(what: str) -> None:
    """In a server's own process, before its server starts: where ``GRAPHDIST_ALLOW`` or
    ``GRAPHDIST_DIAL`` is set, check that graphdist's shim is loaded here and reads the same
    list; raises :class:`LoopbackUnavailableError` otherwise (the server must not start
    unguarded)."""
    if DIAL_ENV in os.environ:
        _check_list(
            DIAL_ENV,
            shim_dial(),
            f"The server of {what} must dial only its own cluster's tasks ({DIAL_ENV}), but "
            "that cannot be enforced",
            "graphdist's shim (a version that checks dials) is not loaded in its process",
        )
    if ALLOW_ENV in os.environ:
        _check_list(
            ALLOW_ENV,
            shim_members(),
            f"The server of {what} would listen on a host address, but cannot enforce that only "
            "its cluster's hosts connect",
            "graphdist's shim is not loaded in its process",
        )
