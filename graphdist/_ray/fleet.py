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
is decided by :func:`~graphdist._ray.nodes.plan_hosts` once Ray has placed the bundles,
before any actor starts:

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

This module holds :class:`RayFleet` and :class:`RayTask`; the Ray engine they share with a Ray
run (connecting, nodes, placement, :func:`~graphdist._ray.nodes.plan_hosts`) is
:mod:`graphdist._ray.nodes`, the actors (:class:`~graphdist._ray.actors.ServerActor`,
:class:`~graphdist._ray.actors.TlsGateways`) :mod:`graphdist._ray.actors`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

from graphdist._cluster import Cluster, Task
from graphdist._exceptions import ClusterSpecError, ExposedServerError
from graphdist._failures import DEAD
from graphdist._fleet.backends import BackendOption
from graphdist._fleet.lifecycle import OwnedFleet
from graphdist._fleet.task import TaskView
from graphdist._net.exposure import ListeningTable, check_listening, is_loopback_ip
from graphdist._net.policy import NetPolicy
from graphdist._ray.actors import ServerActor, TlsGateways
from graphdist._ray.nodes import (
    connect_ray,
    driver_node,
    node_lost,
    node_table,
    place_bundles,
    plan_hosts,
    ray_members,
    ray_out_of_memory,
    ray_worker_out_of_memory,
    shutdown_ray,
)
from graphdist._validate import positive, show, timeout_ms, timeout_s
from graphdist._verdicts import ProcessFacts

__all__ = ["RayFleet", "RayTask"]

log = logging.getLogger("graphdist.ray")
STRATEGIES = ("SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK")


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
        self._why: dict[int, str | None] = {}  # ended_why's answers: Ray's record is final

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

    def ended_why(self, pid: int) -> str | None:
        """Ray's record of why the actor's process ``pid`` ended: ``out of memory (...)`` where
        its memory monitor killed it (:func:`ray_worker_out_of_memory`: the error of a call on
        an actor that Ray starts again does not say so), else None."""
        if pid not in self._why:
            why = ray_worker_out_of_memory(pid, self.node_id)
            if why is None and self._alive and pid == self._pid:
                return None  # still running: no record yet, and none to keep
            self._why[pid] = why
        return self._why[pid]

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

    COMMAND_ARGS = ("start_timeout_s", "expose", "allow", "tls", "tls_dir")  # logs: Ray's

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
        if not facts.ended:
            return facts
        oom = task.oom or (task.ended_why(task.pid) if task.pid is not None else None)
        return dataclasses.replace(facts, oom=oom)

    def _explain(self, task: RayTask, status: str, detail: str) -> tuple[str, str]:
        """A failed task, told with its node: a node Ray lists as dead, or whose raylet does
        not answer either (Ray itself takes about 15 s to declare a node dead), makes the task
        ``dead``, naming the node and every task of this fleet on it; otherwise the node is
        named in the detail."""
        node = node_table().get(task.node_id)
        ip = node["NodeManagerAddress"] if node else task.bind
        where = f"Ray node {task.node_id[:8]} at {ip}"
        lost = node_lost(node)
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
