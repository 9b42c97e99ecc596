"""Checking where a server really listens: the fail-closed half of the loopback promise.

The bind shim (:mod:`graphdist._net.loopback`) is how servers are kept on loopback; this module
is how graphdist knows that it worked. After a server answers, its process's listening sockets are
read from the operating system (through ``psutil``) and every one of them must be on a loopback
address (``127.0.0.0/8``, ``::1``, ``::ffff:127.x.y.z``) or on an address the fleet was told to
use (a Ray node's or a real host's own address). A wildcard (``0.0.0.0``, ``::``) or any other
address — a shim that the dynamic loader skipped, a shim built wrong, a server that bound by
itself — raises :class:`ExposedServerError`, and the fleet stops the server. Where the sockets
cannot be read at all the answer is the same refusal: the promise is checked, never assumed.

The sockets come from Linux's own tables: ``/proc/net/tcp`` and ``/proc/net/tcp6`` (every
listening socket of this network namespace, by inode) and ``/proc/PID/fd`` (which inodes a
process holds). A :class:`ListeningTable` reads the tables once for any number of processes; a
fleet of 16 servers is checked in one read instead of 16 (``psutil``'s per-process call reads
them each time, about 12 ms per server here).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import sys
from collections.abc import Iterable

from graphdist._exceptions import ExposedServerError

__all__ = [
    "ListeningTable",
    "check_listening",
    "host_addresses",
    "is_loopback_ip",
    "listening_sockets",
]

_TCP_LISTEN = "0A"  # the state column of /proc/net/tcp*: TCP_LISTEN


def _decode(address: str) -> tuple[str, int]:
    """``"0100007F:1F90"`` (a /proc/net/tcp* address: 32-bit words in host order) ->
    ``("127.0.0.1", 8080)``."""
    ip_hex, port_hex = address.split(":")
    raw = bytes.fromhex(ip_hex)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(raw)), int(port_hex, 16)


class ListeningTable:
    """One reading of every listening TCP socket (IPv4 and IPv6) of this network namespace;
    :meth:`of` says which of them a process holds."""

    def __init__(self) -> None:
        self._by_inode: dict[int, tuple[str, int]] = {}
        for name in ("tcp", "tcp6"):
            try:
                f = open(f"/proc/net/{name}")  # noqa: SIM115 - closed below
            except FileNotFoundError:  # a kernel without IPv6
                continue
            with f:
                next(f, None)  # the header
                for line in f:
                    fields = line.split()
                    if len(fields) > 9 and fields[3] == _TCP_LISTEN:
                        self._by_inode[int(fields[9])] = _decode(fields[1])

    def of(self, pid: int) -> list[tuple[str, int]]:
        """The ``(address, port)`` of every socket of this table that process ``pid`` holds,
        sorted; raises :class:`OSError` where the process is gone or cannot be read."""
        folder = f"/proc/{pid}/fd"
        found = set()
        for fd in os.listdir(folder):
            try:
                target = os.readlink(f"{folder}/{fd}")
            except FileNotFoundError:  # closed since the listing
                continue
            if target.startswith("socket:["):
                address = self._by_inode.get(int(target[8:-1]))
                if address is not None:
                    found.add(address)
        return sorted(found)


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """The ``(address, port)`` of every TCP socket that process ``pid`` listens on; raises
    :class:`OSError` where the process is gone or cannot be read."""
    return ListeningTable().of(pid)


def _address(ip: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``ip`` as the OS reports it, parsed, with a v4-mapped IPv6 address unwrapped."""
    try:
        address = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def is_loopback_ip(ip: str) -> bool:
    """Whether ``ip`` (IPv4 or IPv6, v4-mapped included) is a loopback address."""
    address = _address(ip)
    return address is not None and address.is_loopback


def _plain(ip: str) -> str:
    """``ip`` without a v4-mapped prefix, for comparing with a cluster's IPv4 addresses."""
    address = _address(ip)
    return ip if address is None else str(address)


def check_listening(
    task: str,
    address: str,
    pid: int | None,
    allowed: Iterable[str] | None = (),
    *,
    sockets: list[tuple[str, int]] | None = None,
    port: int | None = None,
    table: ListeningTable | None = None,
    opt_out: str = "pass expose=True (CLI: --expose) if you do want it reachable",
) -> list[tuple[str, int]]:
    """Raise :class:`ExposedServerError` unless every socket that the server of ``task`` (process
    ``pid``) listens on is loopback or in ``allowed`` (``None``: anywhere, only read them);
    returns the sockets it checked.

    ``sockets`` skips reading them from the OS (a backend that asks the process itself, as Ray
    does); ``port`` limits the check to that port (a process that also runs other services);
    ``table`` is a reading of the OS's sockets to use (default: a fresh one); ``opt_out`` the
    words of the refusal for how the caller's user exposes a server on purpose.
    """
    if sockets is None:
        if pid is None:
            raise ExposedServerError(
                f"Cannot check where the server of {task} listens: its process id is unknown; "
                "refusing it rather than assuming it is on loopback",
                task=task,
                address=address,
            )
        try:
            sockets = (table or ListeningTable()).of(pid)
        except OSError as exc:
            raise ExposedServerError(
                f"Cannot check where the server of {task} (pid {pid}) listens "
                f"({type(exc).__name__}: {exc}); refusing it rather than assuming it is on "
                "loopback",
                task=task,
                address=address,
            ) from None
    checked = [(ip, p) for ip, p in sockets if port is None or p == port]
    if allowed is None:  # exposed on purpose: anywhere is fine
        return checked
    allowed_plain = {_plain(ip) for ip in allowed}
    bad = [
        (ip, p) for ip, p in checked if not is_loopback_ip(ip) and _plain(ip) not in allowed_plain
    ]
    if bad:
        where = ", ".join(f"{ip}:{p}" if ":" not in ip else f"[{ip}]:{p}" for ip, p in bad)
        raise ExposedServerError(
            f"The server of {task} listens on {where}, reachable from other machines, although "
            "graphdist was asked to keep it on loopback; it was stopped. The bind shim did not "
            "take effect (a broken cached library, or LD_PRELOAD ignored by the loader): remove "
            f"~/.cache/graphdist/loopback-bind-*.so and retry, or {opt_out}",
            task=task,
            address=address,
            sockets=bad,
        )
    return checked


def host_addresses() -> list[str]:
    """This host's own addresses, neither loopback nor link-local (a Slurm run's servers let
    them in: the launcher probes them from a login node; a local TLS run's gateway listens on
    the first)."""
    import psutil

    found: list[str] = []
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            with contextlib.suppress(ValueError):
                ip = ipaddress.ip_address(address.address.split("%", 1)[0])
                if not ip.is_loopback and not ip.is_link_local and str(ip) not in found:
                    found.append(str(ip))
    return found
