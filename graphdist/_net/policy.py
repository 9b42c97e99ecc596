"""One network policy: where a process's servers listen and whom they let in and dial.

Every engine (a LocalFleet, ``graphdist serve``, a RayFleet, a SlurmFleet and the local, Ray and
Slurm runs) asks a :class:`NetPolicy` instead of deciding for itself. It is made once, from the
user's ``expose`` / ``allow`` / ``tls`` (checked here: :meth:`NetPolicy.checked`), then
resolved once per cluster for one kind of process (the cluster's members looked up before any
process starts) and asked for each process's environment (:meth:`NetPolicy.env`):

==================  ============================  ===================================  ========
process             bind (``GRAPHDIST_BIND_ADDR``)  accept list (``GRAPHDIST_ALLOW``)      dial
==================  ============================  ===================================  ========
LocalFleet server   loopback; exposed: ``*``      exposed: hosts + allow                 cluster
local run task      loopback; exposed: ``*``      exposed: hosts                         none
serve               its host; bind_all: ``*``     hosts + allow; TLS: none but loopback  cluster
Ray actor           its node (server: its host)   exposed (a TLS fleet too): Ray's nodes  none
Slurm run task      its node                      hosts + this host; TLS: loopback only   none
TLS gateway         ``127.0.0.1``                 inbound: every machine (``*``)         none
==================  ============================  ===================================  ========

The shim (:mod:`graphdist._net.loopback`, ``loopback.c``) enforces what this module decides;
:mod:`graphdist._net.members` parses the lists and resolves the hosts. No other module writes
these variables (tests/net/test_policy.py checks it), so what members-only lets in is changed
here and in the shim.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

from graphdist._cluster import Cluster, Task
from graphdist._exceptions import ArgumentError, ClusterSpecError
from graphdist._net.loopback import BIND_ADDR_ENV, bind_address_for, shim_env
from graphdist._net.members import (
    ALLOW_ENV,
    DIAL_ENV,
    dial_addresses,
    member_addresses,
    parse_allow,
)
from graphdist._validate import flag

__all__ = [
    "NetPolicy",
    "bound_to",
    "dial_list",
    "exposed_allow",
    "gateway_env",
    "member_list",
]

# One environment variable each, which Linux bounds to 128 KiB (MAX_ARG_STRLEN): a longer one
# fails execve. 1,024 allow entries of the longest kind (an IPv6 /128) and 1,024 hosts fit.
KEEP_WILDCARD = "*"  # a bind address: TensorFlow's wildcard, the shim still enforcing the lists
_MAX_LIST_CHARS = 128 * 1024 - len(ALLOW_ENV) - 2
_MAX_DIAL_CHARS = 128 * 1024 - len(DIAL_ENV) - 2


def exposed_allow(allow: Iterable[str] | str | None, expose: bool) -> tuple[str, ...]:
    """A fleet's ``allow`` argument, parsed; refused without ``expose`` (a server on loopback
    is reached by no other machine, so it would do nothing)."""
    networks = parse_allow(allow)
    if networks and not expose:
        raise ArgumentError(
            "allow does nothing without expose=True: the servers stay on loopback, which no "
            "other machine reaches; drop it, or pass expose=True as well",
            name="allow",
            value=allow,
        )
    return networks


def member_list(members: Iterable[str], allow: Sequence[str] = ()) -> str:
    """``GRAPHDIST_ALLOW``'s value: ``members`` (addresses), then the parsed ``allow`` networks
    not among them. Raises :class:`ArgumentError` where it is too long for one variable."""
    entries = list(dict.fromkeys(members))
    entries += [n for n in allow if n not in entries]
    value = ",".join(entries)
    if len(value) > _MAX_LIST_CHARS:
        raise ArgumentError(
            f"The member list (the cluster's {len(entries) - len(allow)} host address(es) "
            f"and allow's {len(allow)} entries) is {len(value):,} characters, more than "
            f"one environment variable holds ({_MAX_LIST_CHARS:,}); name networks (CIDR) instead "
            "of single addresses",
            name="allow",
            value=f"{len(allow)} entries",
        )
    return value


def dial_list(cluster: Cluster) -> str:
    """``GRAPHDIST_DIAL``'s value for a server of ``cluster``: every address of its tasks
    (:func:`~graphdist._net.members.dial_addresses`). Raises :class:`ClusterSpecError` where
    the list is too long for one environment variable."""
    value = ",".join(dial_addresses(cluster))
    if len(value) > _MAX_DIAL_CHARS:
        raise ClusterSpecError(
            f"The cluster's {len(cluster)} tasks make a dial list of {len(value):,} "
            f"characters, more than one environment variable holds ({_MAX_DIAL_CHARS:,}); name "
            "hosts by one address each",
            f"{len(cluster)} tasks",
        )
    return value


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


@dataclass(frozen=True)
class NetPolicy:
    """The network policy of one fleet, run attempt or serve (see the module docstring):
    ``expose`` (``serve``: ``--bind-all``), the parsed ``allow`` networks, ``tls``; once resolved
    for a cluster, the ``accept`` and ``dial`` lists (``None``: unset)."""

    expose: bool = False
    allow: tuple[str, ...] = ()
    tls: bool = False
    accept: str | None = None
    dial: str | None = None

    @classmethod
    def checked(
        cls, expose: bool, allow: Iterable[str] | str | None = None, tls: bool = False, *,
        nodes: str | None = None, run: bool = False,
    ) -> NetPolicy:  # fmt: skip
        """The user's switches checked, ``expose`` first (a security switch, never read by
        truthiness): ``tls`` refuses ``expose`` and ``allow``, ``allow`` needs ``expose``. On an
        engine's nodes (``nodes``: the engine's name, ``"Slurm"``) servers always listen on
        their nodes: ``expose=False`` is refused. ``run``: a run's switches (its tasks' servers;
        a run takes no ``allow``)."""
        expose, tls = flag(expose, "expose"), flag(tls, "tls")
        if tls and (allow or (expose and nodes is None)):
            name = "allow" if allow else "expose"
            why = (
                "the tasks' servers stay on loopback, and the gateways admit other machines by "
                "certificate, not by address; drop expose"
                if run
                else "no server listens on a host address, and the gateways admit by "
                "certificate, not by address; drop it"
            )
            raise ArgumentError(
                f"{name} does nothing with tls=True: {why}",
                name=name,
                value=allow if allow else expose,
            )
        if nodes is not None and not expose:
            raise ClusterSpecError(
                f"A {nodes} fleet's servers listen on their nodes' addresses (members only): "
                f"expose=False cannot be kept on {nodes}; drop it",
                expose,
            )
        on_nodes = nodes is not None
        return cls(expose, parse_allow(allow) if on_nodes else exposed_allow(allow, expose), tls)

    # -- resolved once per cluster, for one kind of process ---------------------------------

    def servers(self, cluster: Cluster) -> NetPolicy:
        """A LocalFleet's servers: exposed, they let in the cluster's hosts and ``allow``; they
        dial only the cluster's tasks (a session's cluster_def naming another fleet of this
        user's, on loopback, is refused at connect())."""
        accept = member_list(member_addresses(cluster), self.allow) if self.expose else None
        return replace(self, accept=accept, dial=dial_list(cluster))

    def tasks(self, cluster: Cluster) -> NetPolicy:
        """A local run's command tasks (user code: no dial list): exposed, the cluster's hosts."""
        accept = member_list(member_addresses(cluster), self.allow) if self.expose else None
        return replace(self, accept=accept)

    def serve(self, cluster: Cluster, wire: Cluster) -> NetPolicy:
        """``graphdist serve`` of ``cluster`` (``wire``: as TensorFlow sees it): the cluster's
        hosts and ``allow`` let in; in TLS mode (the server on its alias) no other machine."""
        accept = "" if self.tls else member_list(member_addresses(cluster), self.allow)
        return replace(self, accept=accept, dial=dial_list(wire))

    def ray(self, nodes: Iterable[str], *, fleet: bool) -> NetPolicy:
        """Ray actors: exposed (a fleet's in TLS mode too, whose actors' node addresses carry
        Ray's own sockets), the Ray cluster's ``nodes`` and ``allow``."""
        accept = self.expose or (fleet and self.tls)
        return replace(self, accept=member_list(nodes, self.allow) if accept else None)

    def node_tasks(self, cluster: Cluster, own: Iterable[str]) -> NetPolicy:
        """A run's tasks on an engine's nodes (Slurm's): the engine's nodes and this host's
        ``own`` addresses (the launcher probes them from here: its servers' ``allow``); in TLS
        mode (the tasks on their nodes' aliases) no other machine."""
        networks = parse_allow([f"{a}/{128 if ':' in a else 32}" for a in own])
        if self.tls:
            return replace(self, allow=networks, accept="")
        return replace(
            self, allow=networks, accept=member_list(member_addresses(cluster), networks)
        )

    def exposed(self, fleet: object, where: str, members: str) -> str:
        """What an exposed ``fleet`` warns of as it starts: its servers listen on ``where`` and
        let in ``members`` and ``allow``."""
        extra = f" and {', '.join(self.allow)}" if self.allow else ""
        return (
            f"expose=True: the servers of {fleet!r} listen on {where} and let in {members}{extra}; "
            "TensorFlow's gRPC runtime has no authentication, so whoever runs code on those "
            "machines can run code in the servers"
        )

    # -- what each process gets --------------------------------------------------------------

    def bind(self, task: Task, *, own_host: bool = False) -> str:
        """Where the server of ``task`` listens: the one place graphdist decides it.

        ``*`` where exposed (TensorFlow's own wildcard, the shim still enforcing the members).
        Otherwise the loopback address of a loopback host (``localhost`` → ``127.0.0.1``,
        ``[::1]`` → ``::1``); with ``own_host`` (a server on a real host: ``serve``) the IPv4
        address the task's host resolves to; anything else raises :class:`ClusterSpecError`
        naming the task."""
        address = KEEP_WILDCARD if self.expose else bind_address_for(task.host)
        if address is not None:
            return address
        if not own_host:
            raise ClusterSpecError(
                f"Task {task.name} is on {task.host!r}, which is not a loopback "
                "address; servers stay on loopback unless you pass expose=True (CLI: --expose), "
                "which makes them reachable from the network without authentication",
                task.address,
            )
        host = task.host.strip("[]")
        if _is_wildcard(host):
            raise ClusterSpecError(
                f"Task {task.name} is on {task.host!r}, the wildcard address: its server "
                "would listen on every interface, reachable from the network without "
                "authentication. Name the host's own address, or pass --bind-all (expose=True) if "
                "that is what you want",
                task.address,
            )
        try:
            infos = socket.getaddrinfo(host, task.port, socket.AF_INET, socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise ClusterSpecError(
                f"Host {host!r} of task {task.name} does not resolve to an IPv4 address "
                f"({exc.strerror}); use --bind-all to listen on every interface",
                task.address,
            ) from None
        resolved = str(infos[0][4][0])
        if _is_wildcard(resolved):
            raise ClusterSpecError(
                f"Host {host!r} of task {task.name} resolves to the wildcard address "
                f"{resolved}; name the host's own address, or pass --bind-all",
                task.address,
            )
        return resolved

    def env(
        self, bind: str, preload: str | None = None, *, inherit: bool = False, shim: bool = True
    ) -> dict[str, str]:
        """The environment of a process whose servers bind ``bind``: the shim (``LD_PRELOAD``
        with the process's own ``preload`` kept; ``inherit``: kept for the programs it starts;
        ``shim=False``: already loaded, a fork server's child) and the resolved lists."""
        env = shim_env(bind, preload, inherit=inherit) if shim else {BIND_ADDR_ENV: bind}
        return {**env, **self.lists()}

    def lists(self) -> dict[str, str]:
        """The resolved accept and dial lists alone (a Ray run's task: the shim is set on its
        node, the lists come with the task's environment)."""
        found = {ALLOW_ENV: self.accept, DIAL_ENV: self.dial}
        return {name: value for name, value in found.items() if value is not None}


@contextlib.contextmanager
def bound_to(bind: str) -> Iterator[None]:
    """In a process that carries the shim (a Ray actor's, bound to its node for Ray's own
    sockets): the servers started within bind ``bind`` (the shim reads it at each ``bind()``)."""
    node = os.environ.get(BIND_ADDR_ENV)
    os.environ[BIND_ADDR_ENV] = bind
    try:
        yield
    finally:
        if node is not None:
            os.environ[BIND_ADDR_ENV] = node


def gateway_env(inbound: bool) -> dict[str, str]:
    """A TLS gateway's environment: this process's, with the shim on loopback and no dial list;
    ``inbound`` (listeners on host addresses) lets in every machine (``*``), which then has to
    pass the TLS handshake."""
    env = {k: v for k, v in os.environ.items() if k not in (ALLOW_ENV, DIAL_ENV)}
    env.update(shim_env("127.0.0.1", os.environ.get("LD_PRELOAD")))
    if inbound:
        env[ALLOW_ENV] = "*"
    return env
