"""RayFleet: the same fleet interface, with each TensorFlow server in a Ray actor.

How a fleet comes up on a Ray cluster (the pattern of TF_FACTS, "Scale-out on Ray"):

1. a placement group with one bundle per task (``SPREAD`` by default, ``STRICT_SPREAD`` for one
   task per node; a group that cannot be placed fails with :class:`StartTimeoutError` instead of
   waiting forever);
2. one small Ray task per bundle reserves a free port on its node, so the whole cluster spec is
   known before any server starts;
3. one actor per bundle builds its server from that spec, with ``max_restarts=-1``: when the
   actor dies, Ray starts it again in the same bundle (same node, same port), and new sessions
   work once it answers.

Where the servers listen (TensorFlow's servers have no authentication; see
:mod:`graphdist._net.loopback`). Every actor's process loads graphdist's bind shim (through
Ray's ``runtime_env``), so no server ever listens on a wildcard address; which address it gets
is decided by :func:`plan_hosts` once Ray has placed the bundles, before any actor starts:

* every bundle on this process's own host (one node, or simulated nodes sharing its IP
  address): each server binds ``127.0.0.1`` and the cluster spec names ``127.0.0.1``, as in a
  :class:`LocalFleet` -- also on a Ray cluster whose node address is a network one;
* servers on other hosts (a real multi-node cluster, or one node that is not this process's):
  they must reach each other, and this process must reach them, over the network, so the fleet
  refuses to start (:class:`ClusterSpecError`, before any actor starts) unless ``expose=True``;
* ``expose=True``: each server binds its node's cluster address only, never a wildcard, and
  the cluster spec names it -- also on a single node, so that an exposed fleet is reachable at
  the address it reports. On a Ray instance that graphdist started itself that address is
  ``127.0.0.1`` (see below): start Ray on a network address yourself to really expose it.

After the servers answer, each actor reports its process's listening sockets and the server's
port must be on loopback or on that node address (:mod:`graphdist._net.exposure`); the
sockets of Ray's own core worker in the same process are Ray's.

The Ray instance graphdist starts itself (no ``address``, no ``RAY_ADDRESS``, no running local
cluster) runs in Ray's single-machine mode: node address ``127.0.0.1``, no dashboard, so its
GCS, raylet, agents and workers all listen on loopback only; graphdist checks the node address
it got and refuses to go on otherwise. ``import graphdist`` never imports Ray; install it with
``pip install 'ray==2.60.*'`` (``pip install '.[ray]'`` from graphdist's clone).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

from graphdist._cluster import Cluster, Task
from graphdist._exceptions import (
    ArgumentError,
    ClusterSpecError,
    ExposedServerError,
    LoopbackUnavailableError,
    StartTimeoutError,
)
from graphdist._failures import DEAD
from graphdist._fleet.backends import BackendOption, register
from graphdist._fleet.lifecycle import OwnedFleet
from graphdist._fleet.task import TaskView
from graphdist._net.exposure import ListeningTable, check_listening, is_loopback_ip
from graphdist._net.policy import NetPolicy, bound_to
from graphdist._net.probe import GCS_CONNECT_S, RAYLET_PROBE_S, tcp_connect_error
from graphdist._validate import positive, show, timeout_ms, timeout_s
from graphdist._verdicts import ProcessFacts

__all__ = [
    "RayFleet",
    "RayTask",
    "ServerActor",
    "TlsGateways",
    "connect_ray",
    "driver_node",
    "live_nodes",
    "place_bundles",
    "plan_hosts",
    "ray_members",
    "ray_out_of_memory",
]

log = logging.getLogger("graphdist.ray")
STRATEGIES = ("SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK")
LOOPBACK = "127.0.0.1"

# Ray's memory monitor's record (``ray.exceptions.OutOfMemoryError``, Ray 2.60): its node's use
# and limit, then the threshold it went over.
_RAY_NODE_USE = re.compile(r"Memory on the node \(IP: ([^,]+), ID: [^)]*\) was (\S+) used / (\S+)")
_RAY_THRESHOLD = re.compile(r"exceeded threshold of \d+B \(([\d.]+%)")


def ray_out_of_memory(exc: BaseException) -> str | None:
    """Ray's own word that its memory monitor killed an actor's or task's worker (the error
    every call on it then raises: ``ray.exceptions.OutOfMemoryError``), as ``out of memory
    (Ray's memory monitor killed its worker: node IP at USED used / LIMIT, over its threshold
    of P%)``, with what the record gives; None for any other error. Never guessed from a death
    alone: a worker Ray's monitor did not kill has no such error."""
    import ray.exceptions

    if not isinstance(exc, ray.exceptions.OutOfMemoryError):
        return None
    text = str(exc)
    use, threshold = _RAY_NODE_USE.search(text), _RAY_THRESHOLD.search(text)
    details = f"node {use[1]} at {use[2]} used / {use[3]}" if use else ""
    if threshold:
        details += f"{', ' if details else ''}over its threshold of {threshold[1]}"
    return (
        f"out of memory (Ray's memory monitor killed its worker{': ' if details else ''}{details})"
    )


class ServerActor:
    """Runs in a Ray actor: one TensorFlow server, started when the actor is (re)created.

    The process was started with the bind shim set to its node's address (so that Ray's own
    core worker, bound before this runs, stays reachable where Ray says it is); the server
    binds ``bind``, which the shim reads at each ``bind()`` call.
    """

    def __init__(self, cluster: dict[str, Any], job: str, index: int, bind: str) -> None:
        from graphdist._proc import lean

        lean.install()  # an actor's process is its own and only serves (see lean.py)
        from graphdist._proc.server import start_server

        with bound_to(bind):
            self._server = start_server(cluster, job, index)

    def pid(self) -> int:
        return os.getpid()

    def listening(self) -> list[tuple[str, int]]:
        """Every TCP socket this process listens on (the server's and Ray's own)."""
        from graphdist._net.exposure import listening_sockets

        return listening_sockets(os.getpid())


class _GatewayActor:
    """Runs in a Ray actor pinned to one node: that node's TLS gateway (TLS mode). Its
    credentials come over Ray's channel as bytes and are written to a private folder on the
    node (the key 0600) only until the gateway has read them; the gateway process ends with the
    actor's (its owner watch)."""

    def __init__(
        self, cluster: dict[str, Any], serving: list[list[Any]], files: dict[str, bytes]
    ) -> None:
        from graphdist._net.tlsmode import received_gateway

        real = Cluster.parse(cluster)
        own = [real.task(job, index) for job, index in serving]
        self.gateway = received_gateway(real, own, files)

    def pid(self) -> int:
        return self.gateway.pid

    def stop(self) -> None:
        from graphdist._net.gateway import stop_gateway

        stop_gateway(self.gateway)


class TlsGateways:
    """TLS mode on Ray (a RayFleet's or a Ray run's attempt): credentials for the nodes and this
    process, one :class:`_GatewayActor` per node (pinned to it; inbound for the tasks it holds,
    outbound for the others) and this process's own gateway for the tasks on other hosts.
    ``real`` has each task at its node's address; :attr:`cluster` is what TensorFlow sees (the
    aliases) and :attr:`aliases` each spot's bind address. :meth:`close` stops them all."""

    def __init__(
        self,
        real: Cluster,
        names: Sequence[tuple[str, int]],
        spots: Sequence[tuple[str, int, str]],
        timeout_s: float,
        *,
        folder: str | None = None,
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from graphdist._net.gateway import alias
        from graphdist._net.tlsmode import TlsMode

        away = sorted({ip for ip, _, _ in spots if is_loopback_ip(ip)})
        if away:
            raise ClusterSpecError(
                "tls=True needs Ray nodes on network addresses, and this Ray's node address is "
                "loopback (a Ray instance on this machine only, which no other machine reaches): "
                "drop tls, or join a Ray cluster started on network addresses",
                away,
            )
        self.actors: list[Any] = []
        # the credentials (in ``folder``: a detached fleet's), and this process's outbound gateway
        self._mode = TlsMode(real, folder=folder)
        self.cluster = self._mode.cluster
        self.aliases = [alias(ip) for ip, _, _ in spots]
        try:
            actor_class = ray.remote(_GatewayActor)
            for ip in dict.fromkeys(ip for ip, _, _ in spots):
                node = next(node for node_ip, _, node in spots if node_ip == ip)
                serving = [
                    [job, index]
                    for (job, index), (node_ip, _, _) in zip(names, spots, strict=True)
                    if node_ip == ip
                ]
                self.actors.append(
                    actor_class.options(
                        num_cpus=0,
                        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                    ).remote(real.as_dict(), serving, self._mode.host_files(ip))
                )
            ray.get([g.pid.remote() for g in self.actors], timeout=timeout_s)
        except BaseException:
            self.close()
            raise

    @property
    def folder(self) -> str:
        """The private folder of the credentials (``credentials/client`` the client's)."""
        return self._mode.folder

    def close(self, *, actors: bool = True) -> None:
        """Stop this process's gateway, remove the credentials and (``actors``: Ray can still
        be asked) stop and kill the node gateways' actors."""
        import ray

        self._mode.close()
        if actors and ray.is_initialized():
            for actor in self.actors:
                with contextlib.suppress(Exception):
                    ray.get(actor.stop.remote(), timeout=10.0)
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
        self.actors = []


def _reserve_port() -> tuple[str, int, str]:
    """Runs in a Ray task on one bundle: (node IP, a free port there, node id)."""
    import ray

    from graphdist._ports import pick_free_ports

    (port,) = pick_free_ports(1)
    node_ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
    return node_ip, port, ray.get_runtime_context().get_node_id()


def plan_hosts(
    nodes: Sequence[tuple[str, str]],
    driver: tuple[str, str] | None,
    *,
    expose: bool,
) -> list[str]:
    """Where each bundle's server listens, which is also its host in the cluster spec.

    ``nodes`` gives each bundle's ``(node id, node IP)``; ``driver`` this process's, or ``None``
    where it is unknown (a Ray client). Without ``expose``: ``127.0.0.1`` for every bundle if all
    are on this process's host (its node, a node with the same IP address, or a loopback node
    address, which only a single-machine Ray has); otherwise :class:`ClusterSpecError`, since
    the servers would have to be reached over the network. With ``expose``: each node's own
    address (never a wildcard). A pure function: :class:`RayFleet` calls it once Ray has placed
    the bundles and before any actor starts.
    """
    ips = [ip for _, ip in nodes]
    v6 = sorted({ip for ip in ips if ":" in ip and not is_loopback_ip(ip)})
    if v6:
        raise ClusterSpecError(
            f"Ray node address(es) {', '.join(v6)} are IPv6; graphdist's bind shim handles IPv4 "
            "node addresses only (start the Ray nodes with an IPv4 --node-ip-address)",
            v6,
        )
    if expose:
        return ips

    def here(node: str, ip: str) -> bool:
        if is_loopback_ip(ip):
            return True  # only a single-machine Ray has loopback node addresses
        return driver is not None and (node == driver[0] or ip == driver[1])

    away = sorted({ip for node, ip in nodes if not here(node, ip)})
    if not away:
        return [LOOPBACK] * len(nodes)
    this = "this process (a Ray client)" if driver is None else f"this process ({driver[1]})"
    raise ClusterSpecError(
        f"Ray placed servers on {', '.join(away)}, another host than {this}: servers on "
        "different hosts must reach each other, and this process must reach them, over the "
        "network, and TensorFlow's servers have no authentication (whoever reaches a port can "
        "run code in it). Pass expose=True (CLI: --expose) to bind each server to its node's "
        "cluster address only (never every interface), or run this process on the one node "
        "that holds every server",
        away,
    )


# PYTHONBREAKPOINT as it was before connect_ray's ray.init, which sets it in this process (to
# Ray's debugger hook) and leaves it there after ray.shutdown(): restored by shutdown_ray.
_breakpoint_before: list[str | None] = []


def _restore_breakpoint() -> None:
    if _breakpoint_before:
        before = _breakpoint_before.pop()
        if before is None:
            os.environ.pop("PYTHONBREAKPOINT", None)
        else:
            os.environ["PYTHONBREAKPOINT"] = before


def shutdown_ray() -> None:
    """Shut down the Ray that :func:`connect_ray` connected this process to (it returned True),
    and put back the ``PYTHONBREAKPOINT`` that ``ray.init`` had set in this process's
    environment: the user's ``breakpoint()`` and the processes they start later are not Ray's."""
    import ray

    try:
        ray.shutdown()
    finally:
        _restore_breakpoint()


def connect_ray(address: str | None, runtime_env: dict[str, Any] | None = None) -> bool:
    """Connect this process to Ray, as a RayFleet or a Ray run does: a runtime already up in
    this process is used as it is (returns False); else ``address``, ``RAY_ADDRESS`` or the
    latest local cluster, else a new Ray instance on loopback only (returns True: the caller
    shuts it down with :func:`shutdown_ray`). An address where no Ray answers is an
    :class:`ArgumentError` saying how to start or point at one."""
    import ray

    if ray.is_initialized():
        return _connect_ray(address, runtime_env)
    _breakpoint_before[:] = [os.environ.get("PYTHONBREAKPOINT")]
    try:
        return _connect_ray(address, runtime_env)
    except BaseException:
        _restore_breakpoint()
        raise


def _connect_ray(address: str | None, runtime_env: dict[str, Any] | None) -> bool:
    import ray

    if ray.is_initialized():
        if runtime_env:
            raise ArgumentError(
                "Ray is already running in this process, so its job's runtime_env (a "
                "working_dir to ship) cannot be set; call ray.shutdown() first",
                name="working_dir",
                value=runtime_env,
            )
        return False
    if _starts_local_ray(address):
        _init_loopback_ray(runtime_env)
        return True
    where = address or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        # "auto" is the cluster Ray finds on this machine (a running gcs_server's command line,
        # which may belong to another network namespace): checked too, or ray.init would retry
        # an address it cannot reach for minutes
        _check_reachable(_resolved_address(where))
        ray.init(
            address=address, log_to_driver=False, namespace="graphdist", runtime_env=runtime_env
        )
    except ConnectionAbortedError as exc:
        # a ray:// head answered, but its client server could not start this client's server
        # process: its reply is a traceback whose last line is the cause (the first line says
        # only "Initialization failure from server:")
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        raise ArgumentError(
            f"The Ray cluster at {where} answered, but its client server failed to start this "
            f"client's session ({lines[-1][:300] if lines else 'no reason given'}); see "
            "ray_client_server*.err in the head's Ray logs (/tmp/ray/session_latest/logs), "
            "then try again",
            name="address",
            value=address,
        ) from None
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ArgumentError(
            f"Cannot reach a Ray cluster at {where} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200] if str(exc) else 'no answer'}); start one with "
            "`ray start --head` on a node and pass its HOST:PORT as address, or leave address "
            "out (and RAY_ADDRESS unset) for a Ray instance on this machine",
            name="address",
            value=address,
        ) from None
    return True


def _resolved_address(address: str) -> str:
    """``address`` as Ray resolves it (``auto``: the cluster found on this machine), or as it
    is where Ray cannot say."""
    from ray._private import services as ray_services

    services: Any = ray_services  # private API (ray>=2.60,<2.61 is pinned)
    try:
        return str(services.canonicalize_bootstrap_address(address) or address)
    except Exception:
        return address


def _check_reachable(address: str) -> None:
    """Raise ConnectionError at once where ``address`` (``HOST:PORT``) takes no connection;
    other forms (``auto``, ``ray://...``) are left to Ray."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "/" in address:
        return
    exc = tcp_connect_error(host, int(port), GCS_CONNECT_S)
    if exc is not None:
        raise ConnectionError(f"{host}:{port} takes no connection: {exc.strerror or exc}")


def place_bundles(
    n: int,
    strategy: str,
    cpus: float,
    timeout_s: float,
    what: str,
    exclude: Sequence[str] = (),
) -> tuple[Any, list[Any], list[tuple[str, int, str]]]:
    """A placement group of ``n`` bundles of ``cpus`` CPUs each (``strategy``), and a free port
    reserved on each bundle's node: ``(group, one scheduling strategy per bundle, (node IP,
    port, node id) per bundle)``. ``exclude``: node ids no bundle may go to (nodes found lost
    that Ray still lists alive: it marks a killed node dead only ~16 s later, measured, and
    meanwhile places bundles there that never become ready). A group Ray cannot place within
    ``timeout_s`` is removed and raises :class:`StartTimeoutError` (never a wait for ever)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    selector = None
    if exclude:  # Ray's own label of every node: its id
        selector = [{"ray.io/node-id": f"!in({','.join(exclude)})"}] * n
    pg = placement_group([{"CPU": cpus}] * n, strategy, bundle_label_selector=selector)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        nodes = len([n for n in ray.nodes() if n.get("Alive")])  # type: ignore[no-untyped-call]
        with contextlib.suppress(Exception):
            remove_placement_group(pg)
        strict = strategy == "STRICT_SPREAD"  # one node each: SPREAD would share nodes
        fix = "add nodes, lower cpus_per_task, or use SPREAD" if strict else "add nodes or CPUs"
        raise StartTimeoutError(
            f"Ray could not place {n} {what} ({strategy}, {cpus:g} CPU each) on {nodes} node(s) "
            f"within {timeout_s:.3g} s; {fix}{'' if strict else ', or lower cpus_per_task'}",
            ready=0,
            expected=n,
            timeout_s=timeout_s,
        )
    on_bundle = [
        PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i) for i in range(n)
    ]
    reserve = ray.remote(num_cpus=cpus)(_reserve_port)
    spots = ray.get([reserve.options(scheduling_strategy=s).remote() for s in on_bundle])
    return pg, on_bundle, spots


def _node_table() -> dict[str, dict[str, Any]]:
    """Ray's view of its nodes, by node id (empty where Ray cannot be asked)."""
    import ray

    try:
        return {n["NodeID"]: n for n in ray.nodes()}  # type: ignore[no-untyped-call]
    except Exception:  # Ray is going away: nothing to add
        return {}


def _node_lost(node: Mapping[str, Any] | None) -> str | None:
    """Why the Ray node ``node`` is lost (Ray says it is dead, or its raylet's port does not
    take a connection within a second), or ``None`` while it looks alive."""
    if node is None:
        return "Ray no longer lists it"
    if not node.get("Alive", False):
        return "Ray reports it dead"
    ip, port = str(node.get("NodeManagerAddress")), int(node.get("NodeManagerPort") or 0)
    exc = tcp_connect_error(ip, port, RAYLET_PROBE_S)
    if exc is not None:
        return f"its raylet at {ip}:{port} does not answer: {exc.strerror or exc}"
    return None


def live_nodes() -> tuple[list[Mapping[str, Any]], dict[str, str]]:
    """The Ray nodes that are alive now: those Ray lists alive whose raylet takes a connection
    (asked all at once, a second at most), and ``{node id: why}`` for those Ray lists alive that
    are lost (:func:`_node_lost`)."""
    import ray

    listed = [n for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]
    with ThreadPoolExecutor(max(1, min(32, len(listed)))) as pool:
        why = list(pool.map(_node_lost, listed))
    live = [n for n, lost in zip(listed, why, strict=True) if lost is None]
    lost = {n["NodeID"]: w for n, w in zip(listed, why, strict=True) if w is not None}
    return live, lost


def source_address(ip: str) -> str | None:
    """This machine's address on the route to ``ip`` (what a server there sees as this
    process's source address), or None where there is no route. A UDP socket's connect sends
    nothing: the kernel only picks the route."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect((ip, 9))
            return str(sock.getsockname()[0])
    except OSError:
        return None


def ray_members(net: NetPolicy, *, fleet: bool) -> NetPolicy:
    """``net`` resolved for Ray actors (:meth:`NetPolicy.ray`), the members being every node of
    the Ray cluster (Ray's own processes in the actor's process are reached from them too; Ray's
    token authentication guards who joins) and this process's own address towards each of them
    (an owner or a launcher on a host that is no Ray node, a Ray client's: its readiness and
    heartbeat probes come from there); looked up only where the policy lets them in."""
    if not (net.expose or net.tls):
        return net
    import ray

    nodes = [n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]
    own = [source_address(ip) for ip in dict.fromkeys(nodes)]
    entries = [ip for ip in dict.fromkeys([*nodes, *own]) if ip and not is_loopback_ip(ip)]
    return net.ray(entries, fleet=fleet)


def _starts_local_ray(address: str | None) -> bool:
    """Whether ``ray.init(address)`` would start a new local Ray instance rather than connect
    (Ray's own resolution: ``address``, else ``RAY_ADDRESS``, else the latest local cluster)."""
    from ray._private import services as ray_services

    services: Any = ray_services  # private API (ray>=2.60,<2.61 is pinned)
    if address is None or address == "auto":
        address = os.environ.get("RAY_ADDRESS") or address
    if address == "local":
        return True
    if address is not None and "://" in address:
        return False  # a Ray client
    services.find_gcs_addresses.cache_clear()
    try:
        return services.canonicalize_bootstrap_address(address) is None
    except Exception:
        return False  # ray.init(address) says what is wrong with it


def _init_loopback_ray(runtime_env: dict[str, Any] | None = None) -> None:
    """Start a local Ray instance whose every process listens on loopback only.

    Ray binds its servers (GCS, raylet, agents, core workers) to loopback exactly when the node
    address is loopback, but on Linux ``ray.init`` turns a ``127.0.0.1`` node address into the
    machine's network address unless it runs in its single-machine mode (the default on macOS
    and Windows, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``); that mode is switched on for the
    call. The node address Ray ends up with is checked: anything else is refused.
    """
    import ray
    import ray._private.ray_constants as ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(
            address="local",
            _node_ip_address=LOOPBACK,
            include_dashboard=False,
            log_to_driver=False,
            namespace="graphdist",
            runtime_env=runtime_env,
        )
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved
    node_ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
    if not is_loopback_ip(node_ip):
        ray.shutdown()
        raise LoopbackUnavailableError(
            f"The Ray instance graphdist started runs on {node_ip}, not on loopback, so it would "
            "be reachable from the network; it was shut down. Start Ray yourself and pass its "
            "address (address=... / --address)"
        )


def driver_node() -> tuple[str, str] | None:
    """This process's Ray ``(node id, node IP)``; ``None`` for a Ray client (it may run
    anywhere)."""
    import ray

    try:
        from ray.util.client import ray as ray_client

        client: Any = ray_client
        if client.is_connected():
            return None
    except ImportError:
        pass
    node_ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
    return ray.get_runtime_context().get_node_id(), node_ip


class RayTask(TaskView):
    """One server of a :class:`RayFleet`: its task, actor, node, bind address and current pid.

    What it says of the actor comes from Ray's own signals and never blocks: at most one ping
    (``actor.pid.remote()``, as a ``concurrent.futures.Future`` that Ray completes) is in
    flight, and a read of :attr:`alive` only asks that future whether it is done (under a
    microsecond; ``ray.wait(timeout=0)`` on a pending ping costs about 80 us here); an answer
    gives the pid and, :attr:`ping_interval_s` later, the next read sends the next ping. A ping
    that fails (Ray's ``ActorDiedError`` or ``ActorUnavailableError``) means the actor's
    process died: with ``max_restarts=-1`` Ray starts it again, and a later ping answers with
    the new pid. Ray reports such a death about 1.5-2 s after the process ended (measured
    here); a death this fleet caused (:meth:`RayFleet.kill`, :meth:`RayFleet.restart`) shows
    at once. ``exitcode`` stays ``None``: Ray does not say how the process ended. The watcher
    thread and the caller's thread read it alike: its state is guarded by a lock, held only
    for those short calls (sending a ping costs about 0.15 ms).
    """

    ping_interval_s: float = 0.25
    """Seconds from a ping's answer to the next ping (the fleet's watcher reads every 0.1 s:
    Ray is not flooded). A death stays visible at least this long, so the watcher sees it even
    when Ray brings the actor back at once."""
    kill_wait_s: float = 10.0
    """How long, in seconds, :meth:`RayFleet.kill` waits for Ray to confirm a killed actor's
    process is gone (a failed ping, or a new pid)."""

    def __init__(self, task: Task, actor: Any, node_id: str, bundle: int, bind: str) -> None:
        self.task = task
        self.actor = actor
        self.node_id = node_id
        self.bundle = bundle
        self.bind = bind
        self.restarts = 0
        self.exitcode: int | None = None  # Ray does not say how an actor's process ended
        self.log_path: str | None = None
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._alive = False
        self._ping: Any = None  # the ping in flight, if any: a Future of its ObjectRef
        self._next_ping = 0.0  # time.monotonic() before which no ping is sent
        self._failures = 0  # pings that failed: deaths Ray reported
        self._killed: int | None = None  # the pid this fleet killed: its late answers do not count
        self._failures_at_kill = 0
        #: Ray's word that its memory monitor killed the actor's last process (``out of memory
        #: (...)``: :func:`ray_out_of_memory`), until a new one answers
        self.oom: str | None = None

    @property
    def pid(self) -> int | None:
        """The pid of the actor's process that last answered (after a death, the dead one's,
        until the new process answers); ``None`` before the first answer."""
        return self._pid

    @property
    def alive(self) -> bool:
        """Whether Ray's latest word is that the actor runs: its latest ping answered, from a
        process this fleet is not killing. Never blocks (see the class docstring): as fresh as
        reads are frequent (the fleet's watcher reads every ``watch_interval_s``). False once
        Ray is shut down."""
        with self._lock:
            self._refresh()
            return self._alive

    def _refresh(self) -> None:
        """Take in the answer of the ping in flight, or send the next ping when it is time.
        Non-blocking; called with the lock held."""
        import ray

        if not ray.is_initialized():  # the fleet closed (and any call would start a new Ray)
            self._ping, self._alive = None, False
            return
        ping = self._ping
        if ping is None:
            if time.monotonic() >= self._next_ping:
                try:
                    self._ping = self.actor.pid.remote().future()
                except Exception:  # Ray is shutting down: nothing answers
                    self._alive = False
            return
        if not ping.done():
            return
        try:
            pid = ping.result()
        except Exception as exc:
            # ActorDiedError or ActorUnavailableError: the actor's process died (Ray may be
            # starting it again); or Ray itself is going away. Either way nothing answered.
            log.debug("ping of %r failed: %s: %s", self, type(exc).__name__, exc)
            self._ping, self._next_ping = None, time.monotonic() + self.ping_interval_s
            self._alive = False
            self._failures += 1
            self.oom = ray_out_of_memory(exc)  # Ray's memory monitor killed it, says Ray
            return
        self._ping, self._next_ping = None, time.monotonic() + self.ping_interval_s
        self._take(pid)

    def _take(self, pid: int) -> None:
        """An answer from the actor's process ``pid`` (lock held)."""
        if pid == self._killed:
            return  # the process this fleet killed answered before the kill reached it
        self._pid, self._alive, self._killed, self.oom = pid, True, None, None

    def _answered(self, pid: int) -> None:
        """The actor answered with ``pid`` outside the ping (:meth:`RayFleet._wait_ready`)."""
        with self._lock:
            self._take(pid)
            self._next_ping = time.monotonic() + self.ping_interval_s

    def _mark_killed(self) -> None:
        """This fleet is killing the actor: dead from now on, until another process answers."""
        with self._lock:
            self._killed, self._alive = self._pid, False
            self._failures_at_kill = self._failures

    def _wait_until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Block this thread (never the lock: the watcher's reads go on) until ``done()``, read
        with the lock held, or ``timeout_s``; whether it came true. Waits on the ping in flight,
        so an answer is taken in at once."""
        from concurrent import futures

        import ray

        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                self._refresh()
                if done():
                    return True
                ping, next_ping = self._ping, self._next_ping
            left = deadline - time.monotonic()
            if left <= 0 or not ray.is_initialized():
                return False
            if ping is None:
                time.sleep(max(0.0, min(left, next_ping - time.monotonic())))
            else:
                futures.wait([ping], timeout=min(left, 1.0))  # _refresh takes in the outcome

    def _wait_gone(self, timeout_s: float) -> bool:
        """After :meth:`_mark_killed`: wait until Ray confirms that process is gone (a ping
        failed since, or another process answered)."""
        return self._wait_until(
            lambda: self._failures > self._failures_at_kill or self._killed is None, timeout_s
        )

    def _wait_new_pid(self, old: int | None, timeout_s: float) -> bool:
        """Wait until a process other than ``old`` answers (Ray brought the actor back)."""
        return self._wait_until(lambda: self._alive and self._pid != old, timeout_s)

    def log_tail(self, lines: int = 12) -> list[str]:
        return []  # the actor's output goes to Ray's logs on its node

    def __repr__(self) -> str:
        return f"<RayTask {self.name} at {self.address} node={self.node_id[:8]}>"


def _counts(spec: str | Mapping[str, int]) -> dict[str, int]:
    if isinstance(spec, str):
        if "=" not in spec or spec.strip().startswith("{"):
            raise ClusterSpecError(
                f"A RayFleet chooses nodes and ports itself; give task counts such as "
                f"'worker=3', not {show(spec)}",
                spec,
            )
        return Cluster.parse_counts(spec)
    return Cluster.check_counts(spec)


class RayFleet(OwnedFleet[RayTask]):
    """A fleet of TensorFlow servers in Ray actors, spread over the nodes of a Ray cluster.

    ``cluster`` gives task counts (``"worker=3"`` or ``{"worker": 3}``): Ray picks the nodes, and
    graphdist the ports. ``address`` is passed to ``ray.init`` (``None``: a running cluster in
    this process, else ``RAY_ADDRESS``, else the latest local cluster, else a new local one on
    loopback only); :meth:`close` shuts down a Ray runtime this fleet started (and disconnects
    from one it connected to). ``strategy`` is the placement group strategy (``SPREAD``).
    ``cpus_per_task`` is reserved for every server (default 1). ``start_timeout_s`` bounds the
    placement and the servers' start (``None``: :attr:`DEFAULT_START_TIMEOUT_S`, 180 s, for the
    TensorFlow import in each new actor). ``expose``: needed when the servers are on other
    hosts than this process; each then listens on its node's address only (see the module
    docstring), and lets in only the Ray cluster's nodes and ``allow`` (addresses or networks:
    members only, :mod:`graphdist._net.members`). ``tls``: TLS mode instead
    (:mod:`graphdist._net.gateway`): each server on its node's loopback alias, one gateway
    actor per node, credentials made by this process and handed to each node's gateway over
    Ray's channel (authenticated with Ray's token auth; encrypted only where Ray's own TLS is
    on), :attr:`tls_client` for clients elsewhere, :attr:`real_cluster` the node addresses;
    ``tls_dir``: where the credentials are made (a detached fleet's state folder), removed at
    close.
    Sessions, devices, health: as :class:`LocalFleet`.
    """

    backend_name: ClassVar[str] = "ray"
    DEFAULT_START_TIMEOUT_S: ClassVar[float] = 180.0
    """Seconds: placing the servers and a TensorFlow import in each new actor."""
    summary: ClassVar[str] = "Ray actors on a Ray cluster (this machine's, or one at an address)"
    requires: ClassVar[tuple[str, str] | None] = ("ray", "pip install 'ray==2.60.*'")
    options: ClassVar[tuple[BackendOption, ...]] = (
        BackendOption(
            "address",
            "the Ray cluster to join, e.g. HOST:6379 or auto (default: RAY_ADDRESS, else a Ray "
            "instance of this process's own)",
            "HOST:PORT",
        ),
        BackendOption(
            "strategy",
            "how Ray places the servers: SPREAD (default), STRICT_SPREAD (one per node), PACK "
            "or STRICT_PACK",
            "STRATEGY",
        ),
    )

    @classmethod
    def parse_cluster(cls, spec: Any) -> dict[str, int]:
        return _counts(spec)

    @classmethod
    def cluster_data(cls, cluster: Mapping[str, int]) -> dict[str, int]:
        return dict(cluster)

    @classmethod
    def task_count(cls, cluster: Mapping[str, int]) -> int:
        return sum(cluster.values())

    @classmethod
    def check_cluster(cls, cluster: Mapping[str, int], *, expose: bool, tls: bool = False) -> None:
        """Only ``expose`` and ``tls``: Ray places the servers (it picks the nodes and ports)."""
        NetPolicy.checked(expose, None, tls)

    @classmethod
    def for_command(
        cls,
        cluster: Mapping[str, int],
        *,
        start_timeout_s: float | None,
        expose: bool,
        log_dir: str | None = None,
        allow: Sequence[str] | None = None,
        tls: bool = False,
        tls_dir: str | None = None,
        **options: Any,
    ) -> RayFleet:
        """``log_dir`` is not used: a Ray actor's output goes to Ray's logs on its node;
        ``options``: :attr:`options`."""
        return cls(
            cluster,
            start_timeout_s=start_timeout_s,
            expose=expose,
            allow=allow,
            tls=tls,
            tls_dir=tls_dir,
            **options,
        )

    def __init__(
        self,
        cluster: str | Mapping[str, int] = "local=2",
        *,
        address: str | None = None,
        strategy: str = "SPREAD",
        cpus_per_task: float = 1.0,
        start_timeout_s: float | None = None,
        operation_timeout_ms: int | None = None,
        expose: bool = False,
        allow: Iterable[str] | str | None = None,
        tls: bool = False,
        tls_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.net = NetPolicy.checked(expose, allow, tls)  # first: security switches
        self.expose, self.allow, self.tls = self.net.expose, self.net.allow, self.net.tls
        super().__init__()
        self.counts = _counts(cluster)
        self.real_cluster: Cluster | None = None
        self.tls_dir: str | None = None
        self._tls_dir_given = os.fspath(tls_dir) if tls_dir is not None else None
        self._tls: TlsGateways | None = None
        if strategy not in STRATEGIES:
            raise ClusterSpecError(f"Strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
        self.address = address
        self.strategy = strategy
        self.cpus_per_task = positive(cpus_per_task, "cpus_per_task")
        self.start_timeout_s = timeout_s(
            start_timeout_s, "start_timeout_s", self.DEFAULT_START_TIMEOUT_S
        )
        self.operation_timeout_ms = timeout_ms(operation_timeout_ms, "operation_timeout_ms")
        self.gpus = None
        self._pg: Any = None
        self._owns_ray = False

    # -- the backend's primitives (the lifecycle is Fleet's) -----------------------------------

    def _launch(self) -> None:
        """Place, reserve a port per bundle, and start every actor (see the module docstring)."""
        import ray

        self._owns_ray = connect_ray(self.address)
        names = [(job, i) for job in sorted(self.counts) for i in range(self.counts[job])]
        self._pg, on_bundle, spots = place_bundles(
            len(names), self.strategy, self.cpus_per_task, self.start_timeout_s, "servers"
        )
        hosts = plan_hosts(
            [(node, ip) for ip, _, node in spots], driver_node(), expose=self.expose or self.tls
        )
        if self.expose:
            exposed = sorted({h for h in hosts if not is_loopback_ip(h)})
            if exposed:
                where, members = ", ".join(exposed), "the Ray cluster's nodes"
                log.warning("%s", self.net.exposed(self, where, members))
            else:
                log.warning(
                    "expose=True, but the Ray node address is loopback (a Ray instance on this "
                    "machine only): the servers of %r listen on 127.0.0.1",
                    self,
                )
        jobs: dict[str, list[str]] = {}
        for (job, _), host, (_, port, _) in zip(names, hosts, spots, strict=True):
            jobs.setdefault(job, []).append(f"{host}:{port}")
        self.cluster = Cluster(jobs)
        net = ray_members(self.net, fleet=True)
        if self.tls:
            hosts = self._start_gateways(names, spots)
        actor_class = ray.remote(ServerActor)
        spec = self.cluster.as_dict()
        for i, ((job, index), host, (ip, _, node)) in enumerate(
            zip(names, hosts, spots, strict=True)
        ):
            options: dict[str, Any] = {
                "scheduling_strategy": on_bundle[i],
                "num_cpus": self.cpus_per_task,
                "max_restarts": -1,
                "name": f"graphdist-{os.getpid()}-{id(self):x}-{job}-{index}",
                # The shim is set to the node's address for Ray's own sockets in the process;
                # the actor switches it to ``host`` for its server (see ServerActor).
                "runtime_env": {"env_vars": net.env(ip, inherit=True)},
            }
            actor = actor_class.options(**options).remote(spec, job, index, host)
            task = self.cluster.task(job, index)
            self._tasks[(job, index)] = RayTask(task, actor, node, i, host)

    def _start_gateways(
        self, names: list[tuple[str, int]], spots: list[tuple[str, int, str]]
    ) -> list[str]:
        """TLS mode (:class:`TlsGateways`): the cluster becomes the aliased one, and each
        server's bind address its node's alias."""
        self._tls = TlsGateways(
            self.cluster, names, spots, self.start_timeout_s, folder=self._tls_dir_given
        )
        self.real_cluster, self.cluster = self.cluster, self._tls.cluster
        self.tls_dir = self._tls.folder
        return self._tls.aliases

    def _wait_ready(self, tasks: list[RayTask], timeout_s: float) -> None:
        import ray

        deadline = time.monotonic() + timeout_s
        pids = ray.get([t.actor.pid.remote() for t in tasks], timeout=timeout_s)
        for task, pid in zip(tasks, pids, strict=True):
            task._answered(pid)
        left = max(0.0, deadline - time.monotonic())
        self._wait_answering(tasks, left, budget_s=timeout_s)

    def _allowed_addresses(self, task: RayTask) -> frozenset[str]:
        """Loopback only, or the node address the server was bound to: never anything else,
        not even with ``expose`` (a Ray server never listens on a wildcard)."""
        return frozenset() if is_loopback_ip(task.bind) else frozenset({task.bind})

    def _check_listening(
        self, task: RayTask, allowed: frozenset[str] | None, table: ListeningTable | None = None
    ) -> None:
        """Ask the actor for its process's listening sockets (it may be on another node) and
        check the server's port; Ray's own sockets in that process are Ray's business."""
        import ray

        name = f"{task.name}"
        try:
            sockets = ray.get(task.actor.listening.remote(), timeout=30.0)
        except Exception as exc:
            raise ExposedServerError(
                f"Cannot check where the server of {name} listens (its actor did not say: "
                f"{type(exc).__name__}: {exc}); refusing it rather than assuming it is on "
                "loopback",
                task=name,
                address=task.address,
            ) from None
        checked = check_listening(
            name, task.address, task.pid, allowed, sockets=sockets, port=task.task.port
        )
        if not checked:
            raise ExposedServerError(
                f"The server of {name} does not listen on its port {task.task.port} in its "
                "actor's process; refusing it",
                task=name,
                address=task.address,
            )

    def _kill_task(self, task: RayTask, sig: int) -> None:
        """Kill the actor (whatever ``sig``) and return once Ray confirms its process is gone
        (at most :attr:`RayTask.kill_wait_s`); the task is dead from the start of the call.
        Ray starts it again in the same bundle (same node and port) by itself."""
        import ray

        task._mark_killed()
        ray.kill(task.actor, no_restart=False)
        if not task._wait_gone(task.kill_wait_s):
            log.warning(
                "Ray did not confirm within %g s that the killed actor of %r is gone",
                task.kill_wait_s,
                task,
            )

    def _restart_task(self, task: RayTask) -> None:
        """Kill the actor and wait until Ray has brought it back (a new pid answers, within
        ``start_timeout_s``); the lifecycle then waits until its server answers on the same
        address (and says so if it does not)."""
        old = task.pid
        self._kill_task(task, signal.SIGKILL)
        task._wait_new_pid(old, self.start_timeout_s)
        task.restarts += 1

    def _stop_tasks(self, tasks: list[RayTask], grace_s: float) -> None:
        """Kill every actor for good (Ray gives actors no grace period)."""
        import ray

        if not ray.is_initialized():
            return
        for task in tasks:
            with contextlib.suppress(Exception):
                ray.kill(task.actor, no_restart=True)

    def _teardown(self) -> None:
        """Stop the TLS gateways, remove the placement group and shut down a Ray runtime this
        fleet started."""

        import ray
        from ray.util.placement_group import remove_placement_group

        if self._tls is not None:
            self._tls.close()
            self._tls = None
        if not ray.is_initialized():
            return
        if self._pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self._pg)
            self._pg = None
        if self._owns_ray:
            shutdown_ray()
            self._owns_ray = False

    def _facts(self, task: RayTask, wait_s: float = 0.0) -> ProcessFacts:
        """As Ray says: its actor's process ended, and whether Ray's memory monitor killed it
        (Ray's error on its ping); Ray does not say how it ended otherwise."""
        facts = super()._facts(task, wait_s)
        return dataclasses.replace(facts, oom=task.oom) if facts.ended else facts

    def _explain(self, task: RayTask, status: str, detail: str) -> tuple[str, str]:
        """A failed task, told with its node: a node Ray lists as dead, or whose raylet does
        not answer either (Ray itself takes about 15 s to declare a node dead), makes the task
        ``dead``, naming the node and every task of this fleet on it; otherwise the node is
        named in the detail."""
        node = _node_table().get(task.node_id)
        ip = node["NodeManagerAddress"] if node else task.bind
        where = f"Ray node {task.node_id[:8]} at {ip}"
        lost = _node_lost(node)
        if lost is None:
            return status, f"{detail}; on {where}" if detail else f"on {where}"
        on_it = [t.name for t in self._tasks.values() if t.node_id == task.node_id]
        return DEAD, f"{where} is lost ({lost}); tasks on it: {', '.join(on_it)}"

    @property
    def node_ids(self) -> dict[str, str]:
        """``job:index`` → the Ray node id its server runs on."""
        return {f"{t.name}": t.node_id for t in self._tasks.values()}

    def __repr__(self) -> str:
        return f"<RayFleet {self.state.value} {self.counts}>"


register(RayFleet)
