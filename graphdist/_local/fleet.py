"""LocalFleet: a fleet of TensorFlow gRPC servers on this machine, one OS process each.

Every server process is forked from one fork server (``multiprocess``'s ``forkserver`` context)
that imported TensorFlow once, so a fleet of 8 costs about one TensorFlow import instead of 8;
once it is up, its pool of spares (:mod:`graphdist._proc.forkserver_pool`) serves a warm start
or a ``restart()`` with processes forked ahead of time.
A fleet is ready only when every server has answered a real gRPC call; a failed start stops what
did start and raises an error naming the task, its address and the last lines of its log. Each
server exits by itself as soon as the fleet's owner process is gone, however it died.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from graphdist._cluster import Cluster, ClusterLike, Task
from graphdist._exceptions import (
    ExposedServerError,
    FleetStartError,
    PortInUseError,
)
from graphdist._failures import exited
from graphdist._fleet.backends import BackendOption
from graphdist._fleet.client import EXIT_NEWS_S, FleetState
from graphdist._fleet.lifecycle import OwnedFleet
from graphdist._local.checks import (
    check_hosts_and_ports,
    check_loopback,
    check_tls_served,
    tls_fleet_cluster,
)
from graphdist._local.task import FleetTask, pid_may_be
from graphdist._net.exposure import ListeningTable
from graphdist._net.loopback import loopback_library
from graphdist._net.policy import NetPolicy
from graphdist._net.ready import READY_SOCKET_KEY, ReadyNotices
from graphdist._ports import (
    port_holder,
    release_claims,
    release_ports,
)
from graphdist._private import owned_temp_dir, sweep_stale_temp_dirs
from graphdist._proc.forkserver import ForkServerDiedError, owner_socket_dir, process_class
from graphdist._proc.gpus import GpuPlan, plan_gpus
from graphdist._proc.process import STOP_GRACE_S, stop_all
from graphdist._proc.server import EXIT_PORT_IN_USE
from graphdist._validate import flag, timeout_ms, timeout_s
from graphdist._verdicts import ProcessFacts

if TYPE_CHECKING:
    import tensorflow as tf

    from graphdist._net.tlsmode import TlsMode

__all__ = [
    "DEFAULT_START_TIMEOUT_S",
    "GRPC_QUEUES_ENV",
    "STOP_GRACE_S",
    "FleetState",
    "FleetTask",
    "LocalFleet",
    "grpc_queues",
]

log = logging.getLogger("graphdist.fleet")

DEFAULT_START_TIMEOUT_S = 60.0
LOST_PORT_WAIT_S = 10.0
"""How long, at most, a start waits for a server that another process answered for to exit
(it lost its port: it exits with EXIT_PORT_IN_USE) or to listen on its port after all."""
KILL_WAIT_S = 10.0
"""How long, in seconds, ``kill()`` with SIGKILL or SIGTERM waits for the kernel's word that the
server's process ended."""


GRPC_QUEUES_ENV = "TF_GRPC_WORKER_CACHE_QUEUES"
"""TensorFlow's setting of how many gRPC completion queues (one polling thread each) a server's
client side keeps for its calls to the other tasks: 64 by default, whatever the machine, which is
62 of a server's 97 threads on two cores and most of its start-up (TF_FACTS, "Start-up"). A
LocalFleet gives each server one per CPU it may run on (:func:`grpc_queues`), unless ``env`` or
the owner's environment sets it."""


def grpc_queues() -> str:
    """The :data:`GRPC_QUEUES_ENV` value a LocalFleet's servers get by default: this process's
    CPUs (its affinity), at most TensorFlow's own default of 64."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return str(max(1, min(64, cpus)))


def ready_notices() -> ReadyNotices | None:
    """A start's notice socket (:mod:`graphdist._net.ready`) in this process's private
    fork-server folder; None where it cannot be made (the start then probes in rounds)."""
    try:
        return ReadyNotices(owner_socket_dir())
    except (OSError, ValueError) as exc:
        log.debug("no ready notices (%s): the start probes in rounds", exc)
        return None


class LocalFleet(OwnedFleet[FleetTask]):
    """A fleet of TensorFlow servers on this machine, one process per task of ``cluster``.

    ``cluster`` is anything :meth:`Cluster.parse` accepts; the default ``"local=2"`` is the seed's
    two-task job on free ports. Use it as a context manager, or call :meth:`start` and
    :meth:`close`::

        with graphdist.LocalFleet("local=2") as fleet:
            with fleet.session("local", 0) as sess:
                ...

    Arguments (all keyword-only but ``cluster``):

    - ``start_timeout_s`` (``None``: :data:`DEFAULT_START_TIMEOUT_S`, 60 s): how long
      :meth:`start` waits for every server.
    - ``log_dir``: where ``JOB-INDEX.log`` files go; default a temporary folder removed at close.
    - ``env``: extra environment variables for every server process. Unless it or this
      process's environment sets ``TF_GRPC_WORKER_CACHE_QUEUES``, each server gets one gRPC
      completion queue per CPU instead of TensorFlow's 64 (:data:`GRPC_QUEUES_ENV`).
    - ``server_config``: a ``ConfigProto`` for the servers' default session config.
    - ``operation_timeout_ms``: the timeout :meth:`session` puts in every config
      (default :data:`graphdist.FLEET_OPERATION_TIMEOUT_MS`, ten minutes: the fleet itself
      finds dead and frozen tasks within seconds, see :mod:`graphdist._fleet.guard`).
    - ``jobs``: serve only the tasks of these jobs (default: all); the others are served by
      other processes, e.g. the chief and workers of :func:`graphdist.run_command`.
    - ``gpus``: pin GPUs per task through ``CUDA_VISIBLE_DEVICES``: ``"round-robin"`` over the
      machine's GPUs, or ``{"worker:0": [0, 1], ...}``; then ``fleet.device(..., gpu=N)`` is
      checked against each task's count. Default ``None``: every server sees every GPU.
    - ``expose`` (default ``False``): servers accept connections from loopback only (TensorFlow's
      servers have no authentication); ``True`` lets them listen on every interface, as
      TensorFlow does by itself, and logs the risk. Without it every task must be on a loopback
      host, and :class:`LoopbackUnavailableError` is raised where the loopback shim cannot be
      built (no C compiler), instead of exposing the ports silently.
    - ``allow`` (with ``expose``): the other machines let in, as addresses or networks
      (``["10.0.0.7", "10.0.1.0/24"]``). An exposed server lets in only the cluster's own hosts
      and these (members only, :mod:`graphdist._net.members`); any other machine's connection
      is closed and logged in the task's log.
    - ``tls`` (default ``False``): TLS mode (:mod:`graphdist._net.gateway`), for a cluster on
      this host's address: no server listens on it, each stays on its host's loopback alias,
      and one mutual-TLS gateway process listens on the tasks' addresses instead, letting in
      holders of the fleet's own credentials only. They are made at start, for this fleet
      alone, in a private folder removed at close: :attr:`tls_client` is the client's folder
      to copy to another machine, for ``graphdist.connect(fleet.real_cluster, tls=...)``.
      :attr:`cluster` is the cluster as TensorFlow sees it (the aliases); :attr:`real_cluster`
      the one given. ``allow`` is refused with it (the gateway admits by certificate).
      ``tls_dir``: where the credentials are made instead (a detached fleet's state folder);
      removed at close all the same.

    :meth:`start` raises :class:`PortInUseError` (a port is taken: nothing is started),
    :class:`FleetStartError` (a server exited while starting) or :class:`StartTimeoutError`;
    in every case no process of the fleet is left running.
    """

    backend_name: ClassVar[str] = "local"
    pids_here = True
    DEFAULT_START_TIMEOUT_S: ClassVar[float] = DEFAULT_START_TIMEOUT_S
    summary: ClassVar[str] = "one process per server on this machine (default)"
    requires: ClassVar[tuple[str, str] | None] = None
    options: ClassVar[tuple[BackendOption, ...]] = ()

    @classmethod
    def parse_cluster(cls, spec: Any) -> Cluster:
        return Cluster.parse(spec)

    @classmethod
    def cluster_data(cls, cluster: Cluster) -> dict[str, Any]:
        return cluster.as_dict()

    @classmethod
    def task_count(cls, cluster: Cluster) -> int:
        return len(cluster.tasks)

    @classmethod
    def check_cluster(cls, cluster: Cluster, *, expose: bool, tls: bool = False) -> None:
        expose = flag(expose, "expose")
        check_hosts_and_ports(cluster)
        if flag(tls, "tls"):
            tls_fleet_cluster(cluster)
            check_tls_served(cluster)
        elif not expose:
            check_loopback(cluster)

    def __init__(
        self,
        cluster: ClusterLike = "local=2",
        *,
        start_timeout_s: float | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        server_config: tf.compat.v1.ConfigProto | None = None,
        operation_timeout_ms: int | None = None,
        expose: bool = False,
        jobs: Iterable[str] | None = None,
        gpus: GpuPlan = None,
        allow: Iterable[str] | str | None = None,
        tls: bool = False,
        tls_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.net = NetPolicy.checked(expose, allow, tls)  # first: security switches
        self.expose, self.allow, self.tls = self.net.expose, self.net.allow, self.net.tls
        super().__init__()
        # the plain values first: a job=N cluster reserves ports as it is parsed
        self.start_timeout_s = timeout_s(
            start_timeout_s, "start_timeout_s", DEFAULT_START_TIMEOUT_S
        )
        self.operation_timeout_ms = timeout_ms(operation_timeout_ms, "operation_timeout_ms")
        self.real_cluster = Cluster.parse(cluster)
        self.cluster = tls_fleet_cluster(self.real_cluster) if self.tls else self.real_cluster
        self.tls_dir: str | None = None
        self._tls_dir_given = os.fspath(tls_dir) if tls_dir is not None else None
        self._tls: TlsMode | None = None
        self.jobs = tuple(jobs) if jobs is not None else self.cluster.jobs
        for job in self.jobs:
            self.cluster.task_indices(job)  # raises ClusterSpecError naming an unknown job
        if self.tls:
            check_tls_served(self.real_cluster.subset(self.jobs))
        self.gpus = plan_gpus(gpus, self.cluster)
        self._env = dict(env or {})
        self._server_config = server_config.SerializeToString() if server_config else None
        self._own_log_dir = log_dir is None
        self.log_dir = os.fspath(log_dir) if log_dir is not None else ""
        self._process_class: Any = None
        self._notices: ReadyNotices | None = None

    # -- the backend's primitives (the lifecycle is Fleet's) -----------------------------------

    def _launch(self) -> None:
        # Claims the ports until every server listens (_on_running) or the start failed
        # (_teardown): two fleets started at once on the same ports cannot both get some.
        check_hosts_and_ports(self.served, claim_for=self)
        for path in sweep_stale_temp_dirs():  # left by owners killed with SIGKILL
            log.debug("removed %s: its owner process is gone", path)
        if self._own_log_dir:
            self.log_dir = owned_temp_dir("fleet")  # graphdist-fleet-<pid>-*: swept if we die
        os.makedirs(self.log_dir, exist_ok=True)
        self._process_class = process_class(self._bind_shim())
        self._notices = ready_notices()
        # the members and the dial list, resolved once, before any server starts
        self.net = self.net.servers(self.cluster)
        if self.tls:
            self._start_gateway()
        for task in self.served:
            ft = FleetTask(task, os.path.join(self.log_dir, f"{task.name}.log"))
            self._tasks[(task.job, task.index)] = ft
            self._start_task(ft)
        # Every request is queued; a fresh fork server is still importing TensorFlow (seconds):
        # meanwhile import what the readiness probes need. The fork server's answers (the pids)
        # are read by the readiness rounds as they come (_wait_ready): the fork server forks
        # one child after another, and a server forked early is probed while later ones are
        # still being forked, instead of after the last pid.
        import grpc  # noqa: F401

    def _on_running(self) -> None:
        release_ports((t.port for t in self.cluster.tasks), owner=self)
        log.info("fleet ready: %s", ", ".join(f"{t.name}={t.address}" for t in self.cluster))

    def _stop_tasks(self, tasks: list[FleetTask], grace_s: float) -> None:
        for ft in stop_all(tasks, grace_s):
            log.error("%r survived SIGTERM and SIGKILL", ft)
        # Ended as the kernel says; their exit statuses are the fork server's news, which a
        # loaded machine delays: a stop ends once they are in (up to EXIT_NEWS_S each), so a
        # stopped fleet's record says how each ended (its table read "exited with an unknown
        # code" for a task close() had stopped, in the suite under load).
        for ft in tasks:
            ft.facts(EXIT_NEWS_S)

    def _start_gateway(self) -> None:
        """TLS mode: the fleet's own credentials and its gateway (inbound for every task it
        serves, outbound for the cluster's tasks on other hosts)."""
        from graphdist._net.tlsmode import TlsMode

        self._tls = TlsMode(
            self.real_cluster,
            self.real_cluster.subset(self.jobs).tasks,
            folder=self._tls_dir_given,
            log_path=os.path.join(self.log_dir, "tls-gateway.log"),
        )
        self.tls_dir = self._tls.folder

    def _teardown(self) -> None:
        if self._tls is not None:
            self._tls.close()
            self._tls = None
        release_claims(self)  # a failed start: its servers are stopped, the ports are free
        if self._notices is not None:
            self._notices.close()
        self._remove_own_logs()

    def _kill_task(self, task: FleetTask, sig: int) -> None:
        task.signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            task._join(KILL_WAIT_S)

    def _facts(self, task: FleetTask, wait_s: float = 0.0) -> ProcessFacts:
        return dataclasses.replace(task.facts(wait_s), killed_with=self._killed_with(task))

    def _restart_task(self, task: FleetTask) -> None:
        if task.alive:
            self._kill_task(task, signal.SIGKILL)
        task.restarts += 1
        self._start_task(task)
        self._confirm_started(task)

    # -- queries --------------------------------------------------------------------------------

    @property
    def served(self) -> Cluster:
        """The part of the cluster this fleet runs servers for (see ``jobs``)."""
        return self.cluster.subset(self.jobs)

    def __repr__(self) -> str:
        tasks = ", ".join(f"{t.name}={t.address}" for t in self.cluster)
        return f"<LocalFleet {self.state.value} [{tasks}]>"

    # -- internals ------------------------------------------------------------------------------

    def _task_env(self, task: Task) -> dict[str, str]:
        env = dict(self._env)
        # the user's setting, in env or here, wins; an empty one is none (TensorFlow reads an
        # empty value as 0 queues and dies of SIGFPE at its first call to another task)
        if not os.environ.get(GRPC_QUEUES_ENV, "").strip():
            env.setdefault(GRPC_QUEUES_ENV, grpc_queues())
        # the fork server carries the shim; this tells it the address and the lists
        env.update(self.net.env(self.net.bind(task), shim=False))
        if self.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.gpus[(task.job, task.index)]))
        return env

    def _spec(self, ft: FleetTask) -> dict[str, Any]:
        return {
            "cluster": self.cluster.as_dict(),
            "job": ft.job,
            "index": ft.index,
            "log_path": ft.log_path,
            "owner_pid": self._owner_pid,
            "env": self._task_env(ft.task),
            "config": self._server_config,
            READY_SOCKET_KEY: self._notices.path if self._notices is not None else None,
        }

    def _bind_shim(self) -> str:
        """The LD_PRELOAD library that keeps servers on loopback, or exposed, lets in only
        the cluster's hosts and ``allow``."""
        if self.expose:
            log.warning(
                "%s", self.net.exposed(self, "every network interface", "the cluster's own hosts")
            )
        else:
            check_loopback(self.served)
        return loopback_library()

    def _start_task(self, ft: FleetTask) -> None:
        """Ask the fork server for ``ft``'s process (not waiting for it: see _confirm_started)."""
        try:
            ft._start(self._process_class, self._spec(ft))
        except ForkServerDiedError as exc:
            raise self._fork_server_died(ft, exc) from exc

    def _confirm_started(self, ft: FleetTask) -> None:
        """Wait for the fork server's answer to ``ft``'s request: the pid of its process."""
        try:
            ft.pid  # noqa: B018 - read from the fork server on first use
        except ForkServerDiedError as exc:
            raise self._fork_server_died(ft, exc) from exc
        log.debug("started %r", ft)

    def _fork_server_died(self, ft: FleetTask, exc: ForkServerDiedError) -> FleetStartError:
        name = f"{ft.name}"
        return FleetStartError(
            f"Server {name} at {ft.address} could not be started: {exc}",
            task=name,
            address=ft.address,
            log_path=ft.log_path,
            log_tail=ft.log_tail(),
        )

    def _wait_ready(self, pending: list[FleetTask], timeout_s: float) -> None:
        """Probe every task until it answers; each round first reads the pids the fork server
        has sent meanwhile (never waiting for one) and reports a task whose process exited, or
        whose fork server died, at once. Once all answer, every pid is read (the listening
        check needs it; a server that answered has been forked, so its pid is there or comes)."""

        def each_round(silent: list[int]) -> None:
            for i in silent:
                ft = pending[i]
                if ft.forked():
                    self._confirm_started(ft)
                if not ft.alive:
                    raise self._start_failure(ft)

        def may_answer(i: int) -> bool:  # forked: each_round read its pid (not None) this round
            return pending[i].forked()

        hints = None
        if self._notices is not None:
            notices, places = self._notices, {ft.name: i for i, ft in enumerate(pending)}

            def hints(wait_s: float) -> list[int]:  # the servers that said they serve
                return [
                    places[name]
                    for name, pid in notices.wait(wait_s)
                    if name in places and pid_may_be(pending[places[name]], pid)
                ]

        self._wait_answering(
            pending, timeout_s, each_round=each_round, may_answer=may_answer, hints=hints
        )
        for ft in pending:
            self._confirm_started(ft)

    def _check_listening(
        self, task: FleetTask, allowed: frozenset[str] | None, table: ListeningTable | None = None
    ) -> None:
        """The lifecycle's check of where ``task`` listens, naming the real cause when it fails
        because the server lost its port to another process (one this user's port claims do
        not cover: another user's, say): that process answered for it, or its sockets could not
        be read because it had already exited. Such a server exits (with EXIT_PORT_IN_USE)
        within moments, and the start then fails with what :meth:`_start_failure` says (a
        :class:`PortInUseError` naming the port and its holder); one that listens on its port
        after all is accepted once it answers. A server seen listening where it must not is
        refused at once, and one that still runs is never assumed to be on loopback."""
        try:
            super()._check_listening(task, allowed, table)
            return
        except ExposedServerError as exc:
            # Sockets seen where they must not be, or unreadable for another reason than an
            # exit (the process still runs): the refusal stands.
            if exc.sockets or not isinstance(task, FleetTask) or not task._join(0.5):
                raise
            raise self._start_failure(task) from None
        except FleetStartError as exc:
            if not isinstance(task, FleetTask):
                raise
            refusal = exc
        deadline = time.monotonic() + min(LOST_PORT_WAIT_S, self.start_timeout_s)
        while True:
            if task._join(0.05):  # it exited: that is the cause
                raise self._start_failure(task) from None
            if time.monotonic() >= deadline:
                raise refusal
            try:
                super()._check_listening(task, allowed, ListeningTable())
            except ExposedServerError as exc:
                if exc.sockets:
                    raise
                continue
            except FleetStartError:
                continue
            # It listens on its port now: the answer came from the process that held it then.
            self._wait_answering([task], max(0.1, deadline - time.monotonic()))
            return

    def _start_failure(self, ft: FleetTask) -> FleetStartError:
        ft._join(1.0)
        exitcode = ft.facts(EXIT_NEWS_S).exitcode
        tail = ft.log_tail()
        name = f"{ft.name}"
        if exitcode == EXIT_PORT_IN_USE:
            holder = port_holder(ft.task.port)
            who = f" by pid {holder}" if holder else ""
            return PortInUseError(
                f"Server {name} could not listen on {ft.address}: port {ft.task.port} is in "
                f"use{who}",
                port=ft.task.port,
                holder_pid=holder,
                task=name,
                address=ft.address,
                log_tail=tail,
            )
        return FleetStartError(
            f"Server {exited(f'{name} at {ft.address}', exitcode)} while starting "
            f"(log: {ft.log_path})",
            task=name,
            address=ft.address,
            exitcode=exitcode,
            log_path=ft.log_path,
            log_tail=tail,
        )

    def _remove_own_logs(self) -> None:
        if self._own_log_dir and self.log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)
