"""What a LocalFleet checks before anything starts: every task's host is this machine, no two
tasks share a port, each port is free (and claimed for the starting fleet), each host is
loopback unless the fleet is exposed, and a TLS fleet's cluster is on this host's address."""

from __future__ import annotations

import contextlib
import os
import socket

import psutil

from graphdist._cluster import Cluster, Task
from graphdist._exceptions import ClusterSpecError, PortInUseError
from graphdist._net.loopback import bind_address_for
from graphdist._net.policy import NetPolicy
from graphdist._ports import claim_ports, is_port_free, port_holder

__all__ = ["check_hosts_and_ports", "check_loopback", "check_tls_served", "tls_fleet_cluster"]


def _local_addresses() -> set[str]:
    names = {"localhost", "0.0.0.0", "::", "::1", socket.gethostname(), socket.getfqdn()}
    with contextlib.suppress(OSError):
        for addrs in psutil.net_if_addrs().values():
            names.update(a.address.split("%")[0] for a in addrs)
    return {n.lower() for n in names}


def _is_local(host: str) -> bool:
    bare = host.strip("[]").lower()
    return bare.startswith("127.") or bare in _local_addresses()


def check_hosts_and_ports(cluster: Cluster, *, claim_for: object = None) -> None:
    """Raise before anything starts if a task's host is not this machine, two tasks share a
    port, or a port is taken.

    Addresses are compared by what they mean, not by their text: every task of a local fleet
    runs on this machine, so ``localhost:P``, ``127.0.0.1:P`` and ``[::1]:P`` are one port, and
    a second task there would be answered by the first task's server.

    With ``claim_for`` (a fleet about to start), every port is also claimed for it
    (:func:`graphdist._ports.claim_ports`): of two fleets starting on the same ports at the
    same moment, one gets them all and the other :class:`PortInUseError` here, naming the port
    and the process that holds it. The caller releases the claims.
    """
    by_port: dict[int, Task] = {}
    for task in cluster:
        first = by_port.setdefault(task.port, task)
        if first is not task:
            raise ClusterSpecError(
                f"Tasks {first.name} ({first.address}) and {task.name} "
                f"({task.address}) are both on port {task.port} of this machine; give each task "
                "its own port (a spec like 'local=2' picks free ones)",
                task.address,
            )
    for task in cluster:
        if not _is_local(task.host):
            raise ClusterSpecError(
                f"Task {task.name} is at {task.address}, but {task.host!r} is not "
                "an address of this machine; a local fleet runs its servers here (run "
                "`graphdist serve` on that host instead)",
                task.address,
            )
    if claim_for is not None:
        taken = claim_ports(by_port, claim_for)
        if taken is not None:
            raise _port_in_use(by_port[taken.port], taken.holder_pid, starting=taken.starting)
        return
    for task in cluster:
        if not is_port_free(task.port):
            raise _port_in_use(task, port_holder(task.port))


def _port_in_use(task: Task, holder: int | None, *, starting: bool = False) -> PortInUseError:
    """The error for ``task``'s port, held by process ``holder`` (``None``: the system does not
    tell); ``starting``: a fleet of this user is starting there (it holds the port's claim)."""
    who = f" by pid {holder}" if holder else ""
    if starting:
        who += " (this process)" if holder == os.getpid() else ""
        who = f"{who or ' by another process'}, which is starting a graphdist fleet on it"
    return PortInUseError(
        f"Port {task.port} of task {task.name} ({task.address}) is "
        f"already in use{who}; stop that process or choose another port "
        "(a spec like 'local=2' picks free ports)",
        port=task.port,
        holder_pid=holder,
        task=f"{task.name}",
        address=task.address,
    )


def check_loopback(cluster: Cluster) -> None:
    """Raise ClusterSpecError if a task is not on a loopback host (needed unless exposed)."""
    for task in cluster:
        NetPolicy().bind(task)


def tls_fleet_cluster(cluster: Cluster) -> Cluster:
    """``cluster`` as the servers of a TLS fleet see it (every task at its host's loopback
    alias); raises :class:`ClusterSpecError` for a task on loopback, which TLS mode would not
    make reachable (a fleet on loopback needs no TLS)."""
    from graphdist._net.gateway import tls_cluster

    for task in cluster:
        if bind_address_for(task.host) is not None:
            raise ClusterSpecError(
                f"tls=True is for a cluster on this host's address, and task {task.name} is on "
                f"{task.host!r} (loopback, which no other machine reaches): name the host's "
                "address, or drop tls",
                task.host,
            )
    return tls_cluster(cluster)


def check_tls_served(served: Cluster) -> None:
    """The tasks a TLS fleet serves share one host, and it is this machine (one gateway, with
    that host's certificate); raises :class:`ClusterSpecError` otherwise."""
    from graphdist._net.gateway import is_here

    hosts = list(dict.fromkeys(t.host for t in served))
    if len(hosts) != 1 or not is_here(hosts[0]):
        raise ClusterSpecError(
            f"tls=True serves tasks on this machine's address, one host per fleet, and these "
            f"are on {', '.join(hosts)}: "
            + ("serve each host's tasks there" if len(hosts) != 1 else "is that this machine?"),
            hosts[0],
        )
