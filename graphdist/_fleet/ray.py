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

Unless ``expose=True``, each actor's process loads graphdist's bind shim (through Ray's
``runtime_env``) so its server listens on its node's address only, not on every interface.
``import graphdist`` never imports Ray; install it with ``pip install graphdist[ray]``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Mapping
from typing import Any

from graphdist._cluster import Cluster, Task
from graphdist._exceptions import ArgumentError, ClusterSpecError, StartTimeoutError
from graphdist._fleet.base import Fleet, TaskView
from graphdist._fleet.loopback import server_bind_address, shim_env
from graphdist._fleet.probe import Prober
from graphdist._validate import timeout_ms, timeout_s

__all__ = ["RayFleet", "RayTask"]

log = logging.getLogger("graphdist.ray")
DEFAULT_START_TIMEOUT_S = 180.0
STRATEGIES = ("SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK")


class _ServerActor:
    """Runs in a Ray actor: one TensorFlow server, started when the actor is (re)created."""

    def __init__(self, cluster: dict[str, Any], job: str, index: int) -> None:
        from graphdist._fleet.server import start_server

        self._server = start_server(cluster, job, index)

    def pid(self) -> int:
        return os.getpid()


def _reserve_port() -> tuple[str, int, str]:
    """Runs in a Ray task on one bundle: (node IP, a free port there, node id)."""
    import ray

    from graphdist._ports import pick_free_ports

    (port,) = pick_free_ports(1)
    node_ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
    return node_ip, port, ray.get_runtime_context().get_node_id()


class RayTask(TaskView):
    """One server of a :class:`RayFleet`: its task, actor, node and current pid."""

    def __init__(self, task: Task, actor: Any, node_id: str, bundle: int) -> None:
        self.task = task
        self.actor = actor
        self.node_id = node_id
        self.bundle = bundle
        self.pid: int | None = None
        self.restarts = 0
        self.exitcode: int | None = None
        self.log_path: str | None = None

    @property
    def alive(self) -> bool:
        """True if the actor answers Ray within 2 s (it may be restarting otherwise)."""
        import ray

        try:
            self.pid = ray.get(self.actor.pid.remote(), timeout=2.0)
        except Exception:
            return False
        return True

    def log_tail(self, lines: int = 12) -> list[str]:
        return []  # the actor's output goes to Ray's logs on its node

    def __repr__(self) -> str:
        return f"<RayTask {self.job}:{self.index} at {self.address} node={self.node_id[:8]}>"


def _counts(spec: str | Mapping[str, int]) -> dict[str, int]:
    if isinstance(spec, str):
        if "=" not in spec or spec.strip().startswith("{"):
            raise ClusterSpecError(
                f"A RayFleet chooses nodes and ports itself; give task counts such as "
                f"'worker=3', not {spec!r}",
                spec,
            )
        return Cluster.parse_counts(spec)
    return Cluster.check_counts(spec)


class RayFleet(Fleet[RayTask]):
    """A fleet of TensorFlow servers in Ray actors, spread over the nodes of a Ray cluster.

    ``cluster`` gives task counts (``"worker=3"`` or ``{"worker": 3}``): Ray picks the nodes, and
    graphdist the ports. ``address`` is passed to ``ray.init`` (``None``: a running cluster in
    this process, else ``RAY_ADDRESS``, else a new local one); a Ray runtime this fleet started
    is shut down by :meth:`close`. ``strategy`` is the placement group strategy (``SPREAD``).
    ``cpus_per_task`` is reserved for every server (default 1). ``start_timeout_s`` bounds the
    placement and the servers' start (``None``: :data:`DEFAULT_START_TIMEOUT_S`, 180 s, for the
    TensorFlow import in each new actor). Sessions, devices, health: as :class:`LocalFleet`.
    """

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
    ) -> None:
        super().__init__()
        self.counts = _counts(cluster)
        if strategy not in STRATEGIES:
            raise ClusterSpecError(f"Strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
        self.address = address
        self.strategy = strategy
        if isinstance(cpus_per_task, bool) or not isinstance(cpus_per_task, int | float):
            raise ArgumentError(f"cpus_per_task must be a number, not {cpus_per_task!r}")
        if not cpus_per_task > 0:
            raise ArgumentError(
                f"cpus_per_task must be > 0, not {cpus_per_task!r}",
                name="cpus_per_task",
                value=cpus_per_task,
            )
        self.cpus_per_task = float(cpus_per_task)
        self.start_timeout_s = timeout_s(
            start_timeout_s, "start_timeout_s", DEFAULT_START_TIMEOUT_S
        )
        self.operation_timeout_ms = timeout_ms(operation_timeout_ms, "operation_timeout_ms")
        self.expose = expose
        self.gpus = None
        self._pg: Any = None
        self._owns_ray = False

    # -- the backend's primitives (the lifecycle is Fleet's) -----------------------------------

    def _launch(self) -> None:
        """Place, reserve a port per bundle, and start every actor (see the module docstring)."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init(address=self.address, log_to_driver=False, namespace="graphdist")
            self._owns_ray = True
        names = [(job, i) for job in sorted(self.counts) for i in range(self.counts[job])]
        self._pg = placement_group([{"CPU": self.cpus_per_task}] * len(names), self.strategy)
        ready, _ = ray.wait([self._pg.ready()], timeout=self.start_timeout_s)
        if not ready:
            nodes = len([n for n in ray.nodes() if n.get("Alive")])  # type: ignore[no-untyped-call]
            with contextlib.suppress(Exception):
                remove_placement_group(self._pg)
            self._pg = None
            raise StartTimeoutError(
                f"Ray could not place {len(names)} servers ({self.strategy}, "
                f"{self.cpus_per_task:g} CPU each) on {nodes} node(s) within "
                f"{self.start_timeout_s:g} s; add nodes, lower cpus_per_task, or use SPREAD",
                ready=0,
                expected=len(names),
                timeout_s=self.start_timeout_s,
            )
        on_bundle = [
            PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i)
            for i in range(len(names))
        ]
        reserve = ray.remote(num_cpus=self.cpus_per_task)(_reserve_port)
        spots = ray.get([reserve.options(scheduling_strategy=s).remote() for s in on_bundle])
        jobs: dict[str, list[str]] = {}
        for (job, _), (ip, port, _) in zip(names, spots, strict=True):
            jobs.setdefault(job, []).append(f"{ip}:{port}")
        self.cluster = Cluster(jobs)
        actor_class = ray.remote(_ServerActor)
        spec = self.cluster.as_dict()
        for i, ((job, index), (_, _, node)) in enumerate(zip(names, spots, strict=True)):
            options: dict[str, Any] = {
                "scheduling_strategy": on_bundle[i],
                "num_cpus": self.cpus_per_task,
                "max_restarts": -1,
                "name": f"graphdist-{os.getpid()}-{id(self):x}-{job}-{index}",
            }
            address = server_bind_address(
                self.cluster.task(job, index), expose=self.expose, allow_own_host=True
            )
            if address is not None:
                options["runtime_env"] = {"env_vars": shim_env(address)}
            actor = actor_class.options(**options).remote(spec, job, index)
            self._tasks[(job, index)] = RayTask(self.cluster.task(job, index), actor, node, i)

    def _wait_ready(self, tasks: list[RayTask], timeout_s: float) -> None:
        import ray

        deadline = time.monotonic() + timeout_s
        expected = len(tasks)
        pids = ray.get([t.actor.pid.remote() for t in tasks], timeout=timeout_s)
        for task, pid in zip(tasks, pids, strict=True):
            task.pid = pid
        for ready, task in enumerate(tasks):
            with Prober(task.address) as prober:
                while not prober.probe(0.5):
                    if time.monotonic() > deadline:
                        raise StartTimeoutError(
                            f"{ready} of {expected} servers answered within {timeout_s:g} s; "
                            f"{task.job}:{task.index} at {task.address} did not "
                            f"({prober.last_error}); raise start_timeout_s",
                            ready=ready,
                            expected=expected,
                            timeout_s=timeout_s,
                            task=f"{task.job}:{task.index}",
                            address=task.address,
                        )
                    time.sleep(0.05)

    def _kill_task(self, task: RayTask, sig: int) -> None:
        """Kill the actor (whatever ``sig``): Ray starts it again in the same bundle (same node
        and port) by itself."""
        import ray

        ray.kill(task.actor, no_restart=False)

    def _restart_task(self, task: RayTask) -> None:
        """Kill the actor and wait until Ray has brought it back (a new pid); the lifecycle
        then waits until its server answers on the same address."""
        old = task.pid
        self._kill_task(task, signal.SIGKILL)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if task.alive and task.pid != old:
                break
            time.sleep(0.2)
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
        """Remove the placement group and shut down a Ray runtime this fleet started."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            return
        if self._pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self._pg)
            self._pg = None
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False

    @property
    def node_ids(self) -> dict[str, str]:
        """``job:index`` → the Ray node id its server runs on."""
        return {f"{t.job}:{t.index}": t.node_id for t in self._tasks.values()}

    def __repr__(self) -> str:
        return f"<RayFleet {self.state.value} {self.counts}>"
