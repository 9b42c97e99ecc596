"""What every fleet offers, whatever runs its servers: tasks, targets, checked devices, sessions
that name a failed task, health, and reopening sessions.

:class:`LocalFleet` (processes on this machine) and :class:`RayFleet` (Ray actors on a Ray
cluster) derive from :class:`Fleet`; each supplies ``start``, ``close``, ``kill`` and ``restart``
and task objects with ``job``, ``index``, ``address``, ``target``, ``pid``, ``alive`` and
``exitcode``.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from graphdist._cluster import Cluster, Task
from graphdist._exceptions import (
    FleetClosedError,
    FleetError,
    TaskFailedError,
    TaskNotFoundError,
)
from graphdist._fleet.health import ALIVE, DEAD, NOT_ANSWERING, TaskHealth, probe_all
from graphdist._fleet.probe import PROBE_TIMEOUT_S
from graphdist._graph.master import master_for
from graphdist._graph.placement import DeviceSpec, check_device, device
from graphdist._graph.session import session, session_config
from graphdist._validate import timeout_ms

if TYPE_CHECKING:
    import tensorflow as tf

__all__ = ["Fleet", "FleetState", "ReopeningSession", "TaskView"]

log = logging.getLogger("graphdist.fleet")
_FleetT = TypeVar("_FleetT", bound="Fleet")  # typing.Self needs Python 3.11


class FleetState(enum.Enum):
    CREATED = "created"
    STARTING = "starting"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"
    FAILED = "failed"


class ReopeningSession:
    """A session that is reopened once when a run fails because a task died or was restarted.

    Safe only for idempotent fetches (reads, pure computations): the failed run may have
    executed in part before it failed. Use it as a context manager or call :meth:`close`.
    """

    def __init__(self, open_session: Any) -> None:
        self._open = open_session
        self.session: Any = open_session()
        self.reopened = 0

    def run(self, fetches: Any, feed_dict: Any = None, **kwargs: Any) -> Any:
        try:
            return self.session.run(fetches, feed_dict=feed_dict, **kwargs)
        except Exception as exc:
            if not _is_task_failure(exc):
                raise
            log.info("run failed (%s); reopening the session once", type(exc).__name__)
            with contextlib.suppress(Exception):
                self.session.close()
            self.session = self._open()
            self.reopened += 1
            return self.session.run(fetches, feed_dict=feed_dict, **kwargs)

    def close(self) -> None:
        self.session.close()

    def __enter__(self) -> ReopeningSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_task_failure(exc: BaseException) -> bool:
    if isinstance(exc, TaskFailedError):
        return True
    from graphdist._graph.session import TASK_FAILURE_ERRORS

    return type(exc).__name__ in TASK_FAILURE_ERRORS


class TaskView:
    """What every backend's task object shares: its :class:`Task` and the names derived from
    it. Subclasses add ``pid``, ``alive``, ``exitcode``, ``restarts`` and ``log_tail``."""

    task: Task

    @property
    def job(self) -> str:
        return self.task.job

    @property
    def index(self) -> int:
        return self.task.index

    @property
    def address(self) -> str:
        return self.task.address

    @property
    def target(self) -> str:
        return self.task.target

    @property
    def name(self) -> str:
        return self.task.name


class Fleet:
    """The interface shared by every fleet (see the module docstring). Not used directly."""

    cluster: Cluster
    state: FleetState
    operation_timeout_ms: int | None
    gpus: dict[tuple[str, int], list[int]] | None
    _tasks: dict[tuple[str, int], Any]

    def start(self) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _FleetT) -> _FleetT:
        if self.state is FleetState.CREATED:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tasks(self) -> tuple[Any, ...]:
        """Every task's process, in the cluster's order (job name, then index)."""
        return tuple(self._tasks.values())

    def __iter__(self) -> Iterator[Any]:
        return iter(self.tasks)

    @property
    def pids(self) -> list[int]:
        return [t.pid for t in self._tasks.values() if t.pid is not None]

    def task(self, job: str | None = None, index: int = 0) -> Any:
        """The task object of ``job:index`` (``job`` may be left out in a one-job fleet)."""
        job = self._job_or_only(job)
        try:
            return self._tasks[(job, index)]
        except KeyError:
            if job not in self.cluster:
                raise TaskNotFoundError(
                    f"No job {job!r} in this fleet; its jobs are {', '.join(self.cluster.jobs)}",
                    job,
                    index,
                ) from None
            raise TaskNotFoundError(
                f"No task {index} in job {job!r}; it has indices "
                f"{', '.join(map(str, self.cluster.task_indices(job)))}",
                job,
                index,
            ) from None

    def target(self, job: str | None = None, index: int = 0) -> str:
        """``grpc://host:port`` of ``job:index``, for ``tf.compat.v1.Session(target)``."""
        target: str = self.task(job, index).target
        return target

    def device(self, job: str | None = None, task: int | None = None, **kwargs: Any) -> str:
        """A device string on this fleet, checked against its cluster (see :func:`device`).

        ``job`` may be omitted in a one-job cluster and ``task`` in a one-task job; otherwise a
        :class:`PlacementError` says what to pass.
        """
        job = self._job_or_only(job)
        if task is None:
            indices = self.cluster.task_indices(job) if job in self.cluster else ()
            if len(indices) == 1:
                task = indices[0]
        text = device(job, task, **kwargs)
        self.check(text)
        return text

    def check(self, spec: str | DeviceSpec | None) -> DeviceSpec:
        """Check any device string against this fleet's cluster; raises :class:`PlacementError`."""
        counts = None if self.gpus is None else {k: len(v) for k, v in self.gpus.items()}
        return check_device(spec, self.cluster, gpus=counts)

    def session(
        self,
        job: str | None = None,
        task: int = 0,
        graph: tf.Graph | None = None,
        config: tf.compat.v1.ConfigProto | None = None,
        *,
        operation_timeout_ms: int | None = None,
    ) -> Any:
        """A ``tf.compat.v1.Session`` whose master is ``job:task``, with a bounded operation
        timeout (``operation_timeout_ms``, else the fleet's, else the config's, else
        :data:`graphdist.DEFAULT_OPERATION_TIMEOUT_MS`).

        Raises :class:`TaskFailedError` at once if the master is dead or not answering. When a
        run fails because a task died or froze (TensorFlow's Unavailable, DeadlineExceeded,
        Aborted... errors), ``sess.run`` raises :class:`TaskFailedError` naming that task, with
        TensorFlow's error as its cause; other errors pass through unchanged.
        """
        self._require_running()
        master = self.task(job, task)
        # None means "the fleet's" (itself None: the config's, else the default), nothing else.
        wanted = timeout_ms(operation_timeout_ms, "operation_timeout_ms", self.operation_timeout_ms)
        effective = session_config(config, operation_timeout_ms=wanted).operation_timeout_in_ms
        (health,) = self.health(tasks=[master])
        if not health.ok:
            raise self._task_failed(health, effective, "cannot open a session")
        return session(
            master.target,
            graph=graph,
            config=config,
            operation_timeout_ms=effective,
            diagnose=self._diagnose,
        )

    def health(
        self, timeout_s: float = PROBE_TIMEOUT_S, tasks: list[Any] | None = None
    ) -> list[TaskHealth]:
        """Each task's :class:`TaskHealth` (``alive``, ``dead`` or ``not answering``), checked
        with a real gRPC call of at most ``timeout_s`` seconds (all tasks at once)."""
        tasks = list(self._tasks.values()) if tasks is None else tasks
        results = probe_all([t.address for t in tasks], timeout_s)
        out = []
        for ft, (answered, error) in zip(tasks, results, strict=True):
            if not ft.alive:
                status, detail = DEAD, f"exit code {ft.exitcode}"
            elif answered:
                status, detail = ALIVE, ""
            else:
                status, detail = NOT_ANSWERING, error or ""
            out.append(TaskHealth(ft.job, ft.index, ft.address, ft.pid, status, detail))
        return out

    def reopening_session(
        self,
        job: str | None = None,
        task: int = 0,
        graph: tf.Graph | None = None,
        config: tf.compat.v1.ConfigProto | None = None,
        *,
        operation_timeout_ms: int | None = None,
    ) -> ReopeningSession:
        """A session on ``job:task`` whose :meth:`~ReopeningSession.run` reopens the session
        once and runs again when a run fails because a task was restarted or died. Only safe for
        idempotent fetches: a failed run may have executed in part."""
        return ReopeningSession(
            lambda: self.session(
                job, task, graph, config, operation_timeout_ms=operation_timeout_ms
            )
        )

    def _diagnose(self, exc: BaseException, timeout_ms: int) -> FleetError | None:
        """Which task made a run fail, as a TaskFailedError (None if every task is fine)."""
        if self.state is not FleetState.RUNNING:
            return None
        for health in self.health(timeout_s=0.5):
            if not health.ok:
                return self._task_failed(
                    health, timeout_ms, f"the run failed ({type(exc).__name__})"
                )
        return None

    def _task_failed(
        self, health: TaskHealth, timeout_ms: int | None, what: str
    ) -> TaskFailedError:
        hint = (
            f"restart it with fleet.restart({health.job!r}, {health.index}) and open a new session"
            if health.status == DEAD
            else "it may be frozen or overloaded"
        )
        return TaskFailedError(
            f"Task {health.job}:{health.index} at {health.address} is {health.status}"
            + (f" ({health.detail})" if health.detail else "")
            + f": {what}; {hint}",
            task=f"{health.job}:{health.index}",
            address=health.address,
            status=health.status,
            timeout_ms=timeout_ms,
        )

    def session_for(
        self,
        fetches: Any,
        graph: tf.Graph | None = None,
        config: tf.compat.v1.ConfigProto | None = None,
        *,
        operation_timeout_ms: int | None = None,
    ) -> Any:
        """A session whose master is the task that owns most of ``fetches`` (see
        :func:`graphdist.master_for`), so results need no extra hop to reach the client."""
        master = master_for(fetches, self.cluster)
        return self.session(
            master.job, master.index, graph, config, operation_timeout_ms=operation_timeout_ms
        )

    def dead_tasks(self) -> list[Any]:
        """Tasks whose process has exited."""
        return [t for t in self._tasks.values() if t.pid is not None and not t.alive]

    def _job_or_only(self, job: str | None) -> str:
        if job is not None:
            return job
        if len(self.cluster.jobs) == 1:
            return self.cluster.jobs[0]
        raise TaskNotFoundError(
            f"This fleet has several jobs ({', '.join(self.cluster.jobs)}); pass job=",
        )

    def _require_running(self) -> None:
        if self.state is not FleetState.RUNNING:
            raise FleetClosedError(f"The fleet is {self.state.value}; start it first")
