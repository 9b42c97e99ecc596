"""Free-port selection that concurrent processes cannot collide on, and port-holder lookup.

A port is *free* when it can be bound on the wildcard address (TensorFlow's gRPC server always binds
every interface, see TF_FACTS). Candidates are drawn at random outside the kernel's ephemeral range,
so outgoing connections do not grab them between choice and use, and each chosen port is reserved
with an exclusive ``flock`` on a per-user lock file until the process that chose it releases it
(once its server is listening) or exits; the lock files live in a folder private to the user
(``$XDG_RUNTIME_DIR/graphdist/ports`` or ``<temp>/graphdist-<uid>/ports``). Two processes picking
ports at the same moment therefore never get the same one. A lock file is removed by the holder
that releases it, while it still holds the lock; whoever locks a file checks afterwards that it is
still the one at its path (the same inode), else it locks the new one: a lock on a removed file
reserves nothing, and the folder does not fill with a file per port ever picked.

A fleet that is about to start servers *claims* every port it serves (:func:`claim_ports`): the
ports it picked itself, and the fixed ports a cluster spec names, whose lock it takes the same
way, in increasing port order, until its servers listen. Of two fleets started at the same moment
on the same ports, the first to lock the lowest one wins and the other is told at once who holds
it, before it starts anything: the holder of a lock writes its pid and what it does (``picked``,
``starting``) in the lock file, so it can be named even before its servers listen. A port another
process only *picked* is not refused (the ``graphdist up --detach`` command picks the ports its
supervisor process then serves). Claims, like reservations, are per user: another user's fleet is
only seen once its servers listen.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import random
import socket
import threading
import time
from collections.abc import Iterable
from typing import NamedTuple

import psutil

from graphdist._exceptions import NoFreePortsError
from graphdist._private import private_dir, runtime_dir

__all__ = [
    "PortTaken",
    "claim_ports",
    "is_port_free",
    "pick_free_ports",
    "port_holder",
    "release_claims",
    "release_ports",
]

_FALLBACK_RANGE = (20000, 32000)
_MAX_TRIES = 2000
_PID_READS = 20
_RELOCKS = 100  # tries to lock the file at a port's path while others release and re-make it
_held: dict[int, int] = {}  # port -> fd of the lock file that reserves it
# port -> (the fleet that claimed it, how: the claim took its lock, or this process held it
# before (picked), or another process holds it (it picked it, for us to serve))
_claims: dict[int, tuple[object, str]] = {}
_LOCKED, _HELD, _HANDED = "locked", "held", "handed"
_mutex = threading.RLock()  # guards _held and _claims: fleets start from several threads
#: Lock files that nobody holds removed by a process's first pick (:func:`_sweep`), where the
#: folder holds more than SWEEP_ABOVE: files left by holders that were killed, or exited without
#: releasing, drain over starts (~10 ms for 32 on a loaded 2-core machine; a listing otherwise).
SWEEP_FILES = 32
SWEEP_ABOVE = 64
_swept = False


class PortTaken(NamedTuple):
    """Why :func:`claim_ports` could not claim ``port``: ``starting`` when another fleet of this
    user holds its lock (it is starting there: ``holder_pid`` is its process), else something
    listens on it (``holder_pid`` where the system tells)."""

    port: int
    holder_pid: int | None
    starting: bool


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


_PICKED, _STARTING = "picked", "starting"  # what a lock's holder does with the port


def _lock_path(port: int) -> str:
    return os.path.join(_lock_dir(), f"{port}.lock")


def _lock_file(port: int, kind: str) -> tuple[int | None, tuple[int | None, str | None]]:
    """Take ``port``'s lock: ``(fd, ...)``, the lock file open and locked with this process's pid
    and ``kind`` written in it, or ``(None, (pid, kind))`` when another open file holds the lock
    (what its holder wrote: ``None`` where it wrote nothing, or its pid is not a live process)."""
    path = _lock_path(port)
    for _ in range(_RELOCKS):
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _written(fd)
            for _ in range(_PID_READS):  # a holder that has just locked it writes its pid next
                if holder[0] is not None:
                    break
                time.sleep(0.001)
                holder = _written(fd)
            os.close(fd)
            return None, holder
        if _at_path(fd, path):
            _mark(fd, kind)
            return fd, (None, None)
        os.close(fd)  # its last holder removed it after we opened it: lock the one there now
    return None, (None, None)  # released and re-made under us every time: taken, as good as


def _at_path(fd: int, path: str) -> bool:
    """Whether the open file ``fd`` is still the file at ``path`` (not removed, not replaced)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False


def _mark(fd: int, kind: str) -> None:
    """Write this process's pid and ``kind`` in a lock file it holds (best effort: they only
    name the holder)."""
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {kind}\n".encode(), 0)


def _written(fd: int) -> tuple[int | None, str | None]:
    """The pid and kind a lock's holder wrote in its lock file, if that pid is a live process."""
    try:
        fields = os.pread(fd, 64, 0).decode("ascii", "replace").split()
        pid = int(fields[0])
    except (OSError, ValueError, IndexError):  # not written yet, or being rewritten
        return None, None
    if pid <= 0 or not psutil.pid_exists(pid):
        return None, None
    return pid, fields[1] if len(fields) > 1 else None


def _unlock(fd: int, port: int) -> None:
    """Release ``port``'s lock held through ``fd``: its file is removed first, while it is still
    locked (one that opened it meanwhile finds it is no longer at its path, see
    :func:`_lock_file`), then unlocked and closed."""
    path = _lock_path(port)
    with contextlib.suppress(OSError):
        if _at_path(fd, path):  # only ever this holder's own file
            os.unlink(path)
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)  # a file another process opened before it was removed says nobody
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _sweep() -> None:
    """Remove up to :data:`SWEEP_FILES` lock files, drawn at random, that no process holds: a
    holder killed or gone without releasing leaves its file (the kernel drops only the lock).
    Safe by the same rule as a release: the file is removed while this process holds its lock,
    so one that opened it meanwhile finds it is no longer at its path (:func:`_lock_file`)."""
    folder = _lock_dir()
    try:
        names = os.listdir(folder)
    except OSError:
        return
    if len(names) <= SWEEP_ABOVE:  # the reservations of the moment, or a few left: harmless
        return
    for name in random.sample(names, min(len(names), SWEEP_FILES)):
        port = name.removesuffix(".lock")
        if not port.isdigit() or int(port) in _held:
            continue
        try:
            fd = os.open(os.path.join(folder, name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: a live reservation
            os.close(fd)
            continue
        _unlock(fd, int(port))


def _reserve(port: int) -> bool:
    with _mutex:
        if port in _held or port in _claims:
            return False
        fd, _holder = _lock_file(port, _PICKED)
        if fd is None:
            return False
        try:
            free = is_port_free(port)
        except BaseException:
            _unlock(fd, port)
            raise
        if not free:
            _unlock(fd, port)
            return False
        _held[port] = fd
        return True


def pick_free_ports(count: int) -> list[int]:
    """Choose ``count`` distinct free ports, each reserved for this process until released.

    Raises :class:`NoFreePortsError` if no free port turns up after many tries (a machine with
    almost every port in use, or more tasks than the range holds), or if no more lock files can
    be opened (the open-file limit).
    """
    global _swept
    with _mutex:
        if not _swept:
            _swept = True
            _sweep()
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


def release_ports(ports: Iterable[int], owner: object = None) -> None:
    """Drop this process's reservation of ``ports`` (no-op for ports it does not hold); a port
    that another fleet than ``owner`` claimed (:func:`claim_ports`) is left to that fleet."""
    with _mutex:
        for port in ports:
            claim = _claims.get(port)
            if claim is not None and claim[0] is not owner:
                continue
            _claims.pop(port, None)
            fd = _held.pop(port, None)
            if fd is not None:
                _unlock(fd, port)


def claim_ports(ports: Iterable[int], owner: object) -> PortTaken | None:
    """Claim every port in ``ports`` for ``owner`` (a fleet about to serve them), in increasing
    port order, and check that each is free. A port this process reserved
    (:func:`pick_free_ports`) and no other fleet claimed is taken over; any other port's lock is
    taken, marked as a start's. A lock that another process holds refuses the port if that
    process is starting a fleet on it; one that it only picked the port with (a parent that
    picked the ports of a cluster a child serves: ``graphdist up --detach``) is left to it, and
    the port is this fleet's if it is free.

    Returns ``None`` once all are claimed, else why the first that could not be was not (then
    nothing of this call stays claimed). Release them with :func:`release_ports` (once the
    servers listen) or :func:`release_claims` (a failed start)."""
    taken: list[int] = []
    with _mutex:
        try:
            for port in sorted(set(ports)):
                problem = _claim(port, owner, taken)
                if problem is not None:
                    _unclaim(taken)
                    return problem
        except BaseException:
            _unclaim(taken)
            raise
    return None


def _claim(port: int, owner: object, taken: list[int]) -> PortTaken | None:
    claim = _claims.get(port)
    if claim is not None:
        return None if claim[0] is owner else PortTaken(port, os.getpid(), starting=True)
    if port in _held:  # picked by this process for a spec like 'local=2': this fleet's now
        _mark(_held[port], _STARTING)
        _claims[port] = (owner, _HELD)
    else:
        fd, (pid, kind) = _lock_file(port, _STARTING)
        if fd is not None:
            _held[port] = fd
            _claims[port] = (owner, _LOCKED)
        elif kind == _STARTING:
            return PortTaken(port, pid or port_holder(port), starting=True)
        else:  # another process picked it (or wrote nothing), for this one to serve most likely
            _claims[port] = (owner, _HANDED)
    taken.append(port)
    if not is_port_free(port):
        return PortTaken(port, port_holder(port), starting=False)
    return None


def _unclaim(ports: Iterable[int]) -> None:
    for port in ports:
        claim = _claims.pop(port, None)
        if claim is None:
            continue
        if claim[1] == _LOCKED:  # the claim took the lock: give it back
            fd = _held.pop(port, None)
            if fd is not None:
                _unlock(fd, port)
        elif claim[1] == _HELD and port in _held:  # reserved before: it stays reserved
            _mark(_held[port], _PICKED)


def release_claims(owner: object) -> None:
    """Drop every claim of ``owner`` (a start that failed): the locks it took are released, the
    ports this process had reserved before stay reserved."""
    with _mutex:
        _unclaim([port for port, (who, _) in _claims.items() if who is owner])


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
