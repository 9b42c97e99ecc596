"""The Ray engine under a :class:`~graphdist._ray.fleet.RayFleet` and a Ray run
(:mod:`graphdist._ray.run`): this process's connection to Ray (:func:`connect_ray`,
:func:`shutdown_ray`), Ray's nodes (:func:`live_nodes`, :func:`node_lost`, :func:`driver_node`),
a placement group with a port reserved on each bundle's node (:func:`place_bundles`), where each
bundle's server listens (:func:`plan_hosts`), who may reach it (:func:`ray_members`), and Ray's
word that its memory monitor killed a worker (:func:`ray_out_of_memory`).

The Ray instance :func:`connect_ray` starts itself (no ``address``, no ``RAY_ADDRESS``, no
running local cluster) runs in Ray's single-machine mode, on loopback only
(:func:`_init_loopback_ray`). Every function imports Ray when it is called: ``import graphdist``
never imports Ray.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from graphdist._exceptions import (
    ArgumentError,
    ClusterSpecError,
    LoopbackUnavailableError,
    StartTimeoutError,
)
from graphdist._net.exposure import is_loopback_ip
from graphdist._net.policy import NetPolicy
from graphdist._net.probe import GCS_CONNECT_S, RAYLET_PROBE_S, tcp_connect_error

__all__ = [
    "LOOPBACK",
    "connect_ray",
    "driver_node",
    "live_nodes",
    "node_lost",
    "node_table",
    "place_bundles",
    "plan_hosts",
    "ray_members",
    "ray_out_of_memory",
    "ray_worker_out_of_memory",
    "shutdown_ray",
    "source_address",
]

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
    return _oom_words(str(exc))


def ray_worker_out_of_memory(pid: int, node_id: str) -> str | None:
    """Ray's record that its memory monitor killed the worker ``pid`` on node ``node_id``
    (the GCS worker table: a dead worker with exit type ``NODE_OUT_OF_MEMORY``), said as
    :func:`ray_out_of_memory` says; None where the record says otherwise, is not written yet
    or cannot be read. An actor that Ray starts again (a RayFleet's server) raises no
    ``OutOfMemoryError``: its calls fail as the actor restarts, and this record is Ray's only
    word of why."""
    try:
        from ray._private.state import state
        from ray.core.generated import common_pb2, gcs_pb2

        table = state._connect_and_get_accessor().get_worker_table()
        node = bytes.fromhex(node_id)
    except Exception:  # Ray gone, another Ray's internals, no node id: no record, no word
        return None
    ends = []
    for raw in table:
        worker = gcs_pb2.WorkerTableData.FromString(raw)  # type: ignore[attr-defined]
        if worker.pid == pid and not worker.is_alive and worker.worker_address.node_id == node:
            ends.append((worker.end_time_ms, worker))
    if not ends:
        return None
    last = max(ends, key=lambda end: end[0])[1]  # a pid reused on the node: its latest worker
    if last.exit_type != common_pb2.NODE_OUT_OF_MEMORY:  # type: ignore[attr-defined]
        return None
    return _oom_words(last.exit_detail)


def _oom_words(text: str) -> str:
    use, threshold = _RAY_NODE_USE.search(text), _RAY_THRESHOLD.search(text)
    details = f"node {use[1]} at {use[2]} used / {use[3]}" if use else ""
    if threshold:
        details += f"{', ' if details else ''}over its threshold of {threshold[1]}"
    return (
        f"out of memory (Ray's memory monitor killed its worker{': ' if details else ''}{details})"
    )


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


def node_table() -> dict[str, dict[str, Any]]:
    """Ray's view of its nodes, by node id (empty where Ray cannot be asked)."""
    import ray

    try:
        return {n["NodeID"]: n for n in ray.nodes()}  # type: ignore[no-untyped-call]
    except Exception:  # Ray is going away: nothing to add
        return {}


def node_lost(node: Mapping[str, Any] | None) -> str | None:
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
    are lost (:func:`node_lost`)."""
    import ray

    listed = [n for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]
    with ThreadPoolExecutor(max(1, min(32, len(listed)))) as pool:
        why = list(pool.map(node_lost, listed))
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
