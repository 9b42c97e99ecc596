"""Free-port selection that concurrent processes cannot collide on, and port-holder lookup.

A port is *free* when it can be bound on the wildcard address (TensorFlow's gRPC server always binds
every interface, see TF_FACTS). Candidates are drawn at random outside the kernel's ephemeral range,
so outgoing connections do not grab them between choice and use, and each chosen port is reserved
with an exclusive ``flock`` on a per-user lock file until the process that chose it releases it
(once its server is listening) or exits; the lock files live in a folder private to the user
(``$XDG_RUNTIME_DIR/graphdist/ports`` or ``<temp>/graphdist-<uid>/ports``). Two processes picking
ports at the same moment therefore never get the same one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import random
import socket
from collections.abc import Iterable

import psutil

from graphdist._exceptions import NoFreePortsError
from graphdist._private import private_dir, runtime_dir

__all__ = ["is_port_free", "pick_free_ports", "port_holder", "release_ports"]

_FALLBACK_RANGE = (20000, 32000)
_MAX_TRIES = 2000
_held: dict[int, int] = {}  # port -> fd of the lock file that reserves it


def _lock_dir() -> str:
    """The per-user port-lock folder, private to this user (see :mod:`graphdist._private`)."""
    return private_dir(os.path.join(runtime_dir(), "ports"), "graphdist's port-lock folder")


def _candidate_range() -> tuple[int, int]:
    """The widest stretch of ports below the ephemeral range (or a fixed fallback)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, _high = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return _FALLBACK_RANGE
    if low > 12000:
        return 10000, low - 1
    return _FALLBACK_RANGE


def is_port_free(port: int) -> bool:
    """True if ``port`` can be bound on the IPv4 and IPv6 wildcard addresses right now."""
    families = [(socket.AF_INET, "0.0.0.0")]
    if socket.has_ipv6:
        families.append((socket.AF_INET6, "::"))
    for family, host in families:
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            if exc.errno in (errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT):
                continue  # family not available on this machine
            raise  # out of file descriptors, say: the port was not checked
        try:
            # gRPC sets SO_REUSEADDR too, so a port in TIME_WAIT is usable by the server.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            if exc.errno != errno.EADDRNOTAVAIL:
                raise
        finally:
            sock.close()
    return True


def _reserve(port: int) -> bool:
    if port in _held:
        return False
    path = os.path.join(_lock_dir(), f"{port}.lock")
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    try:
        free = is_port_free(port)
    except BaseException:
        os.close(fd)  # closing drops the lock
        raise
    if not free:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        return False
    _held[port] = fd
    return True


def pick_free_ports(count: int) -> list[int]:
    """Choose ``count`` distinct free ports, each reserved for this process until released.

    Raises :class:`NoFreePortsError` if no free port turns up after many tries (a machine with
    almost every port in use, or more tasks than the range holds), or if no more lock files can
    be opened (the open-file limit).
    """
    low, high = _candidate_range()
    rng = random.SystemRandom()
    ports: list[int] = []
    for _ in range(_MAX_TRIES):
        if len(ports) == count:
            return ports
        port = rng.randint(low, high)
        try:
            reserved = port not in ports and _reserve(port)
        except OSError as exc:  # no more lock files: the open-file limit (ulimit -n), a full disk
            release_ports(ports)
            raise NoFreePortsError(
                f"Could not reserve {count} free ports: after {len(ports)}, "
                f"{exc.strerror or exc}; ask for fewer tasks, raise the open-file limit "
                "(ulimit -n), or name the ports in the cluster spec",
                count=count,
                low=low,
                high=high,
            ) from None
        if reserved:
            ports.append(port)
    release_ports(ports)
    raise NoFreePortsError(
        f"Could not find {count} free ports in {low}-{high} after {_MAX_TRIES} tries; ask for "
        "fewer tasks, or name the ports in the cluster spec",
        count=count,
        low=low,
        high=high,
    )


def release_ports(ports: Iterable[int]) -> None:
    """Drop this process's reservation of ``ports`` (no-op for ports it does not hold)."""
    for port in ports:
        fd = _held.pop(port, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def port_holder(port: int) -> int | None:
    """The pid of a process listening on TCP ``port``, where the system tells (else ``None``)."""
    try:
        connections = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return None
    for conn in connections:
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            return conn.pid
    return None
