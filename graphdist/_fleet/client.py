"""What using a fleet offers, whoever owns its servers: the :class:`Fleet` client.

A client knows its cluster and its tasks' handles (:class:`TaskHandle`) and offers everything
that uses them: devices checked against the cluster, sessions whose failures name the task (each
carries a :class:`~graphdist._fleet.guard.SessionGuard`), health over gRPC, reopening sessions,
the master for some fetches, the watcher (``watch(callback)`` hears of every task death within
``watch_interval_s``, 0.1 s, and moves ``_epoch`` so that guards re-check), and ``kill()`` /
``restart()`` through two primitives, ``_kill_task(task, sig)`` and ``_bring_back(task)``.

Who owns the processes is not its business: an :class:`~graphdist._fleet.lifecycle.OwnedFleet`
(:class:`LocalFleet`, :class:`RayFleet`) starts and stops them itself; a
:class:`~graphdist._detached.fleet.DetachedFleet` is a client of a fleet its supervisor owns,
and its primitives are requests to that supervisor.
"""

from __future__ import annotations

import contextlib
import enum
import html
import itertools
import logging
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from graphdist._cluster import Cluster
from graphdist._exceptions import (
    FleetClosedError,
    FleetError,
    TaskFailedError,
    TaskNotFoundError,
)
from graphdist._failures import ALIVE, DEAD, NOT_ANSWERING, dead_detail, task_failed
from graphdist._fleet.guard import FLEET_OPERATION_TIMEOUT_MS, SessionGuard
from graphdist._fleet.health import HealthReport, TaskHealth, probe_all
from graphdist._fleet.task import TaskExit, TaskHandle
from graphdist._graph.master import master_for
from graphdist._graph.placement import DeviceSpec, check_device, device, parse_device
from graphdist._graph.session import TASK_FAILURE_ERRORS, session, session_config
from graphdist._net.probe import DIAGNOSE_PROBE_S, PROBE_TIMEOUT_S, RECHECK_PROBE_S
from graphdist._proc.gpus import task_gpu_counts
from graphdist._validate import timeout_ms
from graphdist._validate import timeout_s as check_timeout_s
from graphdist._verdicts import ProcessFacts, task_status

if TYPE_CHECKING:
    import tensorflow as tf

__all__ = ["Fleet", "FleetState", "ReopeningSession"]

log = logging.getLogger("graphdist.fleet")
SESSION_CLOSE_WAIT_S = 2.0
"""How long, in seconds, closing a fleet waits for its open sessions to close before it stops
the servers (they close side by side; one to a frozen master gives up then)."""
EXIT_NEWS_S = 2.0
"""How long, in seconds, a health check waits for news that is on its way: the end of a task
whose server refuses connections while its process still runs (a killed process's sockets close
just before the kernel marks it ended), and the exit status of a task whose process ended."""
TaskT = TypeVar("TaskT", bound=TaskHandle)


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
    return type(exc).__name__ in TASK_FAILURE_ERRORS


class Fleet(Generic[TaskT]):
    """The interface shared by every fleet (see the module docstring). Not used directly: an
    :class:`~graphdist._fleet.lifecycle.OwnedFleet` backend or a detached fleet's handle
    derives from it and supplies ``state``, the task handles and the two primitives."""

    cluster: Cluster
    start_timeout_s: float
    operation_timeout_ms: int | None = None
    gpus: dict[tuple[str, int], list[int]] | None = None
    _gpu_counts: tuple[dict[tuple[str, int], int] | None] | None = None  # _task_gpus, once found
    _tasks: dict[tuple[str, int], TaskT]
    pids_here = False
    """Whether its tasks' pids are processes of this machine (a LocalFleet's are; a Slurm or
    Ray task's pid is on its node): only then may ``/proc`` be read for them."""
    _state: FleetState = FleetState.CREATED
    _sessions_closed = False
    """Set once the fleet closes: its sessions were closed with it (their guards read it)."""
    _epoch = 0
    """A new value whenever a task may have died, restarted or been killed (the watcher, kill,
    restart and close set it): a session's guard re-checks its tasks only when it changed, so
    a step pays no liveness check of its own (see :mod:`graphdist._fleet.guard`)."""
    _epochs = itertools.count(1)  # next() on it is atomic: two threads never lose a change

    def __init__(self) -> None:
        self._tasks = {}
        self._watch_lock = threading.Lock()
        self._watchers: list[Callable[[TaskT], None]] = []
        self._watch_thread: threading.Thread | None = None
        self._exits: list[TaskExit] = []
        self._sessions: weakref.WeakSet[Any] = weakref.WeakSet()
        self._sessions_closed = False
        # task name -> (pid, signal): the process kill() ended (or is ending), and how
        self._killed: dict[str, tuple[int | None, int]] = {}

    @property
    def state(self) -> FleetState:
        """Where the fleet is in its life (``RUNNING`` while it can be used)."""
        return self._state

    # -- the primitives a fleet supplies --------------------------------------------------------

    def _kill_task(self, task: TaskT, sig: int) -> None:
        """Send ``sig`` to ``task``'s server; with SIGKILL or SIGTERM, return once it is gone."""
        raise NotImplementedError

    def _bring_back(self, task: TaskT) -> None:
        """Start ``task``'s server again on its address (killing it first if it runs), count
        the restart and return once it answers; raise FleetStartError if it does not."""
        raise NotImplementedError

    def _explain(self, task: TaskT, status: str, detail: str) -> tuple[str, str]:
        """A failed task's ``(status, detail)`` as the backend can tell it better (a Ray node
        that is lost, say); as it is by default."""
        return status, detail

    def _facts(self, task: TaskT, wait_s: float = 0.0) -> ProcessFacts:
        """What is known of ``task``'s process (see :class:`ProcessFacts`): by default its
        handle's record, which each backend keeps from its engine (Ray's actor, Slurm's step;
        LocalFleet asks the kernel). ``wait_s``: how long a backend may wait for the exit status
        of a process that ended."""
        ended = not task.alive
        return ProcessFacts(ended, task.exitcode if ended else None, self._killed_with(task))

    def _killed_with(self, task: TaskT) -> int | None:
        """The signal :meth:`kill` ended ``task``'s current process with, if it did."""
        pid, sig = self._killed.get(task.name, (None, 0))
        return sig if sig and pid == task.pid else None

    def _status(self, task: TaskT, answered: bool, error: str = "") -> tuple[str, str]:
        """``task``'s ``(status, detail)``, by the rule (:func:`graphdist._verdicts.task_status`)
        over its process's facts, read after its probe answered (``answered``) or failed
        (``error``): before a backend's :meth:`_explain`. Waits (up to :data:`EXIT_NEWS_S`)
        only for news on its way: the kernel's word on a process whose server refuses
        connections, and the exit status of one that ended."""
        facts = self._facts(task)
        if not answered and facts.ended is False and error.startswith("UNAVAILABLE"):
            deadline = time.monotonic() + EXIT_NEWS_S
            while facts.ended is False and time.monotonic() < deadline:
                time.sleep(0.02)
                facts = self._facts(task)
        if facts.ended and facts.exitcode is None:
            facts = self._facts(task, EXIT_NEWS_S)
        return task_status(facts, answered, error)

    # -- faults ---------------------------------------------------------------------------------

    def kill(self, job: str | None = None, index: int = 0, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (default SIGKILL) to the server of ``job:index``; with SIGKILL or
        SIGTERM, return once it is gone (a backend that brings servers back by itself, like Ray,
        may start it again at once). For fault drills; see :meth:`restart`."""
        self._require_running()
        task = self.task(job, index)
        if sig in (signal.SIGKILL, signal.SIGTERM):  # dead from now on, killed by graphdist
            self._killed[task.name] = (task.pid, sig)
        try:
            self._kill_task(task, sig)
        finally:
            self._changed()

    def restart(self, job: str | None = None, index: int = 0) -> TaskT:
        """Start the server of ``job:index`` again on the same address (killing it first if it
        still runs) and wait until it answers. Variables on other tasks keep their values; old
        sessions that used this task are broken (TensorFlow never recovers them), new ones work
        at once. Raises :class:`FleetStartError` if it does not come back in time."""
        self._require_running()
        task = self.task(job, index)
        self._changed()
        try:
            self._bring_back(task)
        finally:
            self._changed()
        log.info("restarted %r (restart %d)", task, task.restarts)
        return task

    def _changed(self) -> None:
        """A task may have died or restarted: sessions re-check their tasks (see ``_epoch``)."""
        self._epoch = next(Fleet._epochs)

    def _close_sessions(self, wait_s: float = SESSION_CLOSE_WAIT_S) -> None:
        """Close every session this fleet opened that is still open, while its servers still
        answer (each close is one quick RPC then; later, dropping the session costs nothing).
        A run in flight in another thread is cancelled and raises FleetClosedError. Closes run
        side by side, each in its own thread holding its session, and the fleet waits up to
        ``wait_s`` seconds for them: a frozen master cannot hold up the close."""
        self._sessions_closed = True
        sessions = [s for s in list(self._sessions) if not s._closed]
        if not sessions or sys.is_finalizing():  # no thread can start while Python exits
            return
        threads = [
            threading.Thread(target=s.close, name="graphdist-close", daemon=True) for s in sessions
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + wait_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    # -- using a fleet ----------------------------------------------------------------------------

    @property
    def tasks(self) -> tuple[TaskT, ...]:
        """Every task's handle, in the cluster's order (job name, then index)."""
        return tuple(self._tasks.values())

    def __iter__(self) -> Iterator[TaskT]:
        return iter(self.tasks)

    @property
    def pids(self) -> list[int]:
        return [t.pid for t in self._tasks.values() if t.pid is not None]

    def task(self, job: str | None = None, index: int = 0) -> TaskT:
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
        return self.task(job, index).target

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
        """Check any device string against this fleet's cluster, a GPU against those its task
        has (:meth:`_task_gpus`); raises :class:`PlacementError`."""
        parsed = parse_device(spec)
        gpus = self._task_gpus() if parsed.device_type == "GPU" else None
        return check_device(parsed, self.cluster, gpus=gpus)

    def _task_gpus(self) -> dict[tuple[str, int], int] | None:
        """How many GPUs each task has, as far as this fleet knows (``None``: unknown, not
        checked): see :func:`graphdist._proc.gpus.task_gpu_counts`. Found once, on first use
        (it may ask ``nvidia-smi``)."""
        if self._gpu_counts is None:
            self._gpu_counts = (task_gpu_counts(self.gpus, self.cluster, here=self.pids_here),)
        return self._gpu_counts[0]

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
        :data:`graphdist.FLEET_OPERATION_TIMEOUT_MS`, ten minutes: the last resort).

        Raises :class:`TaskFailedError` at once if the master is dead or not answering. Runs
        (``run`` and ``make_callable`` callables) fail fast with :class:`TaskFailedError` naming
        the task when a task they need is dead, restarted or frozen, before or during the run;
        closing such a session does not wait (see :mod:`graphdist._fleet.guard`). Other errors
        pass through unchanged.
        """
        self._require_running()
        master = self.task(job, task)
        # None means "the fleet's" (itself None: the config's, else the fleet default), nothing
        # else. A fleet's default is long: its guard, not the timeout, finds failed tasks.
        wanted = timeout_ms(operation_timeout_ms, "operation_timeout_ms", self.operation_timeout_ms)
        if wanted is None and (config is None or config.operation_timeout_in_ms <= 0):
            wanted = FLEET_OPERATION_TIMEOUT_MS
        effective = session_config(config, operation_timeout_ms=wanted)
        (health,) = self.health(tasks=[master])
        if not health.ok:
            raise self._task_failed(
                health, effective.operation_timeout_in_ms, "cannot open a session"
            )
        self._ensure_watcher()  # it tells the sessions' guards of every death (``_epoch``)
        guard = SessionGuard(
            self, master, effective.device_filters, soft_placement=effective.allow_soft_placement
        )
        guard.timeout_ms = effective.operation_timeout_in_ms
        sess = session(master.target, graph=graph, config=effective, guard=guard)
        guard.attach(sess)
        self._sessions.add(sess)
        return sess

    def health(
        self, timeout_s: float = PROBE_TIMEOUT_S, tasks: list[TaskT] | None = None
    ) -> HealthReport:
        """Each task's :class:`TaskHealth` (``alive``, ``dead`` or ``not answering``), checked
        with a real gRPC call of at most ``timeout_s`` seconds (all tasks at once)."""
        timeout_s = check_timeout_s(timeout_s, "timeout_s", PROBE_TIMEOUT_S)
        tasks = list(self._tasks.values()) if tasks is None else tasks
        results = probe_all([t.address for t in tasks], timeout_s, alive=True)
        out = []
        for ft, (answered, error) in zip(tasks, results, strict=True):
            status, detail = self._status(ft, answered, error or "")
            if status != ALIVE:
                status, detail = self._explain(ft, status, detail)
            out.append(TaskHealth(ft.job, ft.index, ft.address, ft.pid, status, detail))
        return HealthReport(out)

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
        bad = [h for h in self.health(timeout_s=DIAGNOSE_PROBE_S) if not h.ok]
        if len(bad) > 1 and all(h.status == NOT_ANSWERING for h in bad):
            # A task busy on a loaded machine can miss a short probe, a frozen one misses a
            # long one too: ask the silent ones again before naming one of them.
            silent = [self.task(h.job, h.index) for h in bad]
            bad = [h for h in self.health(RECHECK_PROBE_S, tasks=silent) if not h.ok] or bad
        bad.sort(key=lambda h: h.status != DEAD)  # a dead task is the cause before a silent one
        if not bad:
            return None
        return self._task_failed(bad[0], timeout_ms, f"the run failed ({type(exc).__name__})")

    def _task_failed(
        self, health: TaskHealth, timeout_ms: int | None, what: str
    ) -> TaskFailedError:
        return task_failed(health, health.status, health.detail, what=what, timeout_ms=timeout_ms)

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

    def dead_tasks(self) -> list[TaskT]:
        """Tasks whose process has exited, with their exit status (each waited for up to
        :data:`EXIT_NEWS_S` where it is still on its way)."""
        dead = [t for t in self._tasks.values() if t.pid is not None and not t.alive]
        for task in dead:
            self._facts(task, EXIT_NEWS_S)
        return dead

    # -- the watcher: the fleet knows when a task dies -------------------------------------------

    #: Seconds between two looks at every task's process (a backend may change it).
    watch_interval_s: float = 0.1

    def watch(self, callback: Callable[[TaskT], None]) -> None:
        """Call ``callback(task)`` (from a watcher thread) each time a task of this running fleet
        is seen dead, once per death: a restarted task that dies again is reported again.
        The watcher starts with the first callback or session and ends when the fleet closes."""
        with self._watch_lock:
            self._watchers.append(callback)
        self._ensure_watcher()

    def _ensure_watcher(self) -> None:
        with self._watch_lock:
            if self._watch_thread is None:
                self._watch_thread = threading.Thread(
                    target=self._watch_loop, name=f"graphdist-watch-{id(self):x}", daemon=True
                )
                self._watch_thread.start()

    def task_exits(self) -> list[TaskExit]:
        """Every death the watcher saw, oldest first (empty until :meth:`watch` is called)."""
        with self._watch_lock:
            return list(self._exits)

    def _watch_loop(self) -> None:
        seen: dict[str, int | None] = {}  # task name -> pid reported dead
        known: dict[str, tuple[int | None, int, bool]] = {}  # task name -> pid, restarts, alive
        while self.state in (FleetState.STARTING, FleetState.RUNNING):
            for task in list(self._tasks.values()):
                alive = task.alive
                now = (task.pid, task.restarts, alive)
                if known.setdefault(task.name, now) != now:
                    known[task.name] = now
                    self._changed()
                if task.pid is None or seen.get(task.name) == task.pid or alive:
                    continue
                if self.state is not FleetState.RUNNING:
                    break
                seen[task.name] = task.pid
                at = time.monotonic()  # its exit status may still be on its way: wait for it
                exitcode = self._facts(task, EXIT_NEWS_S).exitcode
                event = TaskExit(task.name, task.pid, exitcode, at)
                with self._watch_lock:
                    self._exits.append(event)
                    callbacks = list(self._watchers)
                log.info("watcher: %s (pid %s) exited with %s", task.name, task.pid, exitcode)
                for callback in callbacks:
                    try:
                        callback(task)
                    except Exception:  # a listener's bug must not stop the watcher
                        log.exception("fleet watcher callback %r failed", callback)
            time.sleep(self.watch_interval_s)

    def _repr_html_(self) -> str:
        """Jupyter's view of a fleet: its state and one row per task: green while it runs, grey
        once the fleet stopped it (or before it started), red for a task that died. Every
        coloured row sets its text colour too, so a dark theme's light text stays readable."""
        rows = []
        closed = self.state in (FleetState.CLOSING, FleetState.CLOSED)
        for t in self._tasks.values():
            alive, code = t.alive, t.exitcode
            if alive:
                state, colour = "running", "#d9f2d9"
            elif not t.pid:
                state, colour = "not started", "#e8e8e8"
            elif closed and code in (-signal.SIGTERM, 0):
                state, colour = "stopped", "#e8e8e8"  # by close(); a task killed before is not
            else:
                state, colour = dead_detail(code), "#f8d0d0"
            rows.append(
                f'<tr style="background:{colour};color:#1a1a1a">'
                f"<td>{html.escape(t.job)}:{t.index}</td><td>{html.escape(t.address)}</td>"
                f"<td>{t.pid}</td><td>{state}</td><td>{t.restarts}</td></tr>"
            )
        return (
            f"<b>{html.escape(type(self).__name__)}</b> ({self.state.value})<table><thead><tr>"
            "<th>task</th><th>address</th><th>pid</th><th>process</th><th>restarts</th>"
            f"</tr></thead><tbody>{''.join(rows)}</tbody></table>"
        )

    def _job_or_only(self, job: str | None) -> str:
        if job is not None:
            return job
        if len(self.cluster.jobs) == 1:
            return self.cluster.jobs[0]
        raise TaskNotFoundError(
            f"This fleet has several jobs ({', '.join(self.cluster.jobs)}); pass job=",
        )

    def _require_running(self) -> None:
        if self.state is FleetState.RUNNING:
            return
        if self.state is FleetState.CREATED:
            what = "has not been started yet; call start() first, or use it in a `with` block"
        elif self.state is FleetState.STARTING:
            what = "is still starting; use it once start() has returned"
        elif self.state is FleetState.FAILED:
            what = "failed to start; close() it and start a new fleet"
        else:
            what = f"is {self.state.value}; start a new fleet"
        raise FleetClosedError(f"The fleet {what}")
