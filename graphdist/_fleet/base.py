"""The fleet every backend shares: its lifecycle, and what using a fleet offers.

Lifecycle (:class:`Fleet` owns it, as dask's ``SpecCluster`` does for its subclasses)::

    CREATED --start()--> STARTING --all answer--> RUNNING --close()--> CLOSING --> CLOSED
                         STARTING --a task fails: stop what started--> FAILED --close()--> CLOSED

``start()`` and ``close()`` are idempotent where that is meaningful (``close()`` any number of
times; ``start()`` once), a failed start stops every task it started and re-raises, a fleet left
running when it is garbage-collected warns with ``ResourceWarning`` and is closed, and an
``atexit`` sweep closes every fleet this process still runs. ``kill()``, ``restart()`` and
``health()`` work the same on every backend, and so does the watcher: ``watch(callback)`` hears of
every task death within ``watch_interval_s`` (0.1 s), the seam that supervisors and fast failure
build on.

A backend supplies only its primitives: ``_launch()`` (create the task handles and start every
task), ``_wait_ready(tasks, timeout_s)`` (return once each answers over gRPC, else raise naming the
first that did not), ``_stop_tasks(tasks, grace_s)``, ``_kill_task(task, sig)``,
``_restart_task(task)`` and ``_teardown()`` (what is left after the tasks: log folders, placement
groups), and may refine ``_allowed_addresses(task)`` / ``_check_listening(task, allowed)``: once
tasks answer, the lifecycle checks where each really listens (:mod:`graphdist._net.exposure`) and
refuses a server on a wildcard or foreign address unless the fleet was exposed. Its task handles
satisfy :class:`TaskHandle`. Using a fleet — devices checked against the cluster, sessions whose
failures name the task, health, reopening sessions, the master for some fetches — is all here,
whatever the backend.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import html
import itertools
import logging
import os
import signal
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, Protocol, TypeVar

from graphdist._cluster import Cluster, Task
from graphdist._exceptions import (
    ExposedServerError,
    FleetClosedError,
    FleetError,
    FleetStartError,
    StartTimeoutError,
    TaskFailedError,
    TaskNotFoundError,
)
from graphdist._fleet.guard import FLEET_OPERATION_TIMEOUT_MS, SessionGuard, release_signals
from graphdist._fleet.health import (
    ALIVE,
    DEAD,
    NOT_ANSWERING,
    HealthReport,
    TaskHealth,
    probe_all,
    task_failed,
)
from graphdist._graph.master import master_for
from graphdist._graph.placement import DeviceSpec, check_device, device
from graphdist._graph.session import session, session_config
from graphdist._net.exposure import ListeningTable, check_listening
from graphdist._net.probe import PROBE_TIMEOUT_S, wait_answering
from graphdist._proc.process import STOP_GRACE_S
from graphdist._validate import timeout_ms
from graphdist._validate import timeout_s as check_timeout_s

if TYPE_CHECKING:
    import tensorflow as tf

__all__ = ["Fleet", "FleetState", "ReopeningSession", "TaskExit", "TaskHandle", "TaskView"]

log = logging.getLogger("graphdist.fleet")
_FleetT = TypeVar("_FleetT", bound="Fleet[Any]")  # typing.Self needs Python 3.11
_live_fleets: weakref.WeakSet[Fleet[Any]] = weakref.WeakSet()
# Probes that find which task made a run fail: a short one for all tasks, then, where several
# did not answer, a longer one for those (a busy task answers it, a frozen one does not).
_DIAGNOSE_PROBE_S = 0.5
_RECHECK_PROBE_S = 2.0
SESSION_CLOSE_WAIT_S = 2.0
"""How long, in seconds, ``close()`` waits for the fleet's open sessions to close before it
stops the servers (they close side by side; one to a frozen master gives up then)."""


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


class TaskExit(NamedTuple):
    """A task death the fleet's watcher saw: ``task`` (``"job:index"``), its ``pid``, its
    ``exitcode`` (negative: killed by that signal; ``None`` if the backend cannot tell) and when
    (``time.monotonic()``)."""

    task: str
    pid: int | None
    exitcode: int | None
    at: float


class TaskHandle(Protocol):
    """What a fleet's task handle tells, on every backend (a plain attribute or a property)."""

    @property
    def job(self) -> str: ...
    @property
    def index(self) -> int: ...
    @property
    def address(self) -> str: ...
    @property
    def target(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def pid(self) -> int | None: ...
    @property
    def alive(self) -> bool: ...
    @property
    def exitcode(self) -> int | None: ...
    @property
    def restarts(self) -> int: ...
    @property
    def log_path(self) -> str | None: ...
    def log_tail(self, lines: int = ...) -> list[str]: ...


_TaskT = TypeVar("_TaskT", bound=TaskHandle)


class TaskView:
    """What every backend's task handle derives from its :class:`Task`: the names. Subclasses add
    the rest of :class:`TaskHandle` (``pid``, ``alive``, ``exitcode``, ``restarts``, ``log_path``,
    ``log_tail``)."""

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


class Fleet(Generic[_TaskT]):
    """The lifecycle and the interface shared by every fleet (see the module docstring); a
    backend derives from it and supplies the primitives. Not used directly."""

    cluster: Cluster
    state: FleetState = FleetState.CREATED
    start_timeout_s: float
    operation_timeout_ms: int | None = None
    expose: bool = False
    gpus: dict[tuple[str, int], list[int]] | None = None
    _tasks: dict[tuple[str, int], _TaskT]
    _owner_pid: int = -1
    _sessions_closed = False
    """Set once the fleet closes: its sessions were closed with it (their guards read it)."""
    _epoch = 0
    """A new value whenever a task may have died, restarted or been killed (the watcher, kill,
    restart and close set it): a session's guard re-checks its tasks only when it changed, so
    a step pays no liveness check of its own (see :mod:`graphdist._fleet.guard`)."""
    _epochs = itertools.count(1)  # next() on it is atomic: two threads never lose a change

    def __init__(self) -> None:
        self.state = FleetState.CREATED
        self._owner_pid = os.getpid()
        self._tasks = {}
        self._init_watcher()
        self._init_sessions()

    def _init_sessions(self) -> None:
        self._sessions: weakref.WeakSet[Any] = weakref.WeakSet()
        self._sessions_closed = False

    def _init_watcher(self) -> None:
        self._watch_lock = threading.Lock()
        self._watchers: list[Callable[[_TaskT], None]] = []
        self._watch_thread: threading.Thread | None = None
        self._exits: list[TaskExit] = []

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self: _FleetT) -> _FleetT:
        """Start every task and wait until each answers over gRPC; returns ``self``. A failed start
        stops whatever did start and re-raises (``state`` is then ``FAILED``)."""
        if self.state is not FleetState.CREATED:
            raise FleetError(f"This fleet was already started (state {self.state.value})")
        self.state = FleetState.STARTING
        _live_fleets.add(self)
        try:
            self._launch()
            _exit_sweep_runs_first()  # the backend's imports may have registered exit hooks
            self._ready(list(self._tasks.values()), self.start_timeout_s)
        except BaseException:
            self.state = FleetState.FAILED
            self._shutdown(STOP_GRACE_S)
            raise
        self.state = FleetState.RUNNING
        self._on_running()
        return self

    def close(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop every task (SIGTERM, up to ``grace_s`` seconds, then SIGKILL, where the backend
        has processes) and release what the fleet holds. Safe to call any number of times."""
        grace_s = check_timeout_s(grace_s, "grace_s", STOP_GRACE_S)
        if self.state in (FleetState.CLOSED, FleetState.CLOSING):
            return
        if self.state in (FleetState.CREATED, FleetState.FAILED):
            self.state = FleetState.CLOSED  # nothing runs: a failed start cleaned up already
            return
        self.state = FleetState.CLOSING
        self._changed()
        try:
            self._close_sessions()
            self._shutdown(grace_s)
        finally:
            self.state = FleetState.CLOSED
            if not _live_fleets:
                release_signals()  # no fleet session runs any more (see guard.py)

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

    def _shutdown(self, grace_s: float) -> None:
        try:
            self._stop_tasks(list(self._tasks.values()), grace_s)
        finally:
            _live_fleets.discard(self)
            self._teardown()

    def __enter__(self: _FleetT) -> _FleetT:
        if self.state is FleetState.CREATED:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            running = getattr(self, "state", None) in (FleetState.RUNNING, FleetState.STARTING)
            owner = os.getpid() == getattr(self, "_owner_pid", -1)
        except (AttributeError, TypeError):  # interpreter shutdown: module globals are None
            return  # (the atexit sweep closed whatever still ran)
        if running and owner:
            warnings.warn(
                f"{self!r} was never closed; closing it now", ResourceWarning, stacklevel=2
            )
            with contextlib.suppress(Exception):
                self.close()

    def kill(self, job: str | None = None, index: int = 0, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (default SIGKILL) to the server of ``job:index``; with SIGKILL or
        SIGTERM, return once it is gone (a backend that brings servers back by itself, like Ray,
        may start it again at once). For fault drills; see :meth:`restart`."""
        self._require_running()
        try:
            self._kill_task(self.task(job, index), sig)
        finally:
            self._changed()

    def restart(self, job: str | None = None, index: int = 0) -> _TaskT:
        """Start the server of ``job:index`` again on the same address (killing it first if it
        still runs) and wait until it answers. Variables on other tasks keep their values; old
        sessions that used this task are broken (TensorFlow never recovers them), new ones work
        at once. Raises :class:`FleetStartError` if it does not come back in time."""
        self._require_running()
        task = self.task(job, index)
        self._changed()
        try:
            self._restart_task(task)
            self._ready([task], self.start_timeout_s)
        except ExposedServerError:
            self._kill_task(task, signal.SIGKILL)
            raise
        finally:
            self._changed()
        log.info("restarted %r (restart %d)", task, task.restarts)
        return task

    def _ready(self, tasks: list[_TaskT], timeout_s: float) -> None:
        """Wait until ``tasks`` answer, then check that each listens only where it may (see
        :mod:`graphdist._net.exposure`): a server on a wildcard or foreign address, or one
        whose sockets cannot be read, raises :class:`ExposedServerError`."""
        self._wait_ready(list(tasks), timeout_s)  # a backend may consume its list
        table = ListeningTable()  # read after every task answered: their sockets are in it
        for task in tasks:
            self._check_listening(task, self._allowed_addresses(task), table)

    def _wait_answering(
        self,
        tasks: list[_TaskT],
        timeout_s: float,
        *,
        each_round: Callable[[list[int]], None] | None = None,
        budget_s: float | None = None,
    ) -> None:
        """Return once every task in ``tasks`` answers over gRPC (:func:`probe.wait_answering`),
        else raise StartTimeoutError naming the first still silent, with the count of those
        that answered; ``budget_s`` is the whole start timeout the message names (default:
        ``timeout_s``), where part of it was spent before."""
        silent = wait_answering([t.address for t in tasks], timeout_s, each_round=each_round)
        if silent is None:
            return
        task, budget_s = tasks[silent.index], timeout_s if budget_s is None else budget_s
        raise StartTimeoutError(
            f"{silent.answered} of {len(tasks)} servers answered within {budget_s:g} s; "
            f"{task.job}:{task.index} at {task.address} did not (last gRPC error: "
            f"{silent.last_error}); raise start_timeout_s if the machine is slow",
            ready=silent.answered,
            expected=len(tasks),
            timeout_s=budget_s,
            task=f"{task.job}:{task.index}",
            address=task.address,
            log_tail=task.log_tail(),
        )

    # -- the backend's primitives -----------------------------------------------------------------

    def _launch(self) -> None:
        """Create the task handles in ``self._tasks`` and start every task (not waiting)."""
        raise NotImplementedError

    def _wait_ready(self, tasks: list[_TaskT], timeout_s: float) -> None:
        """Return once every task in ``tasks`` answers over gRPC; else raise a FleetStartError
        naming the first that failed, with the true count of those that did answer."""
        raise NotImplementedError

    def _stop_tasks(self, tasks: list[_TaskT], grace_s: float) -> None:
        raise NotImplementedError

    def _kill_task(self, task: _TaskT, sig: int) -> None:
        raise NotImplementedError

    def _restart_task(self, task: _TaskT) -> None:
        """Bring ``task`` back on its address (kill it first if it runs); count the restart."""
        raise NotImplementedError

    def _allowed_addresses(self, task: _TaskT) -> frozenset[str] | None:
        """The non-loopback addresses ``task``'s server may listen on; ``None``: anywhere
        (``expose=True``). Default: loopback only, unless exposed."""
        return None if self.expose else frozenset()

    def _check_listening(
        self, task: _TaskT, allowed: frozenset[str] | None, table: ListeningTable | None = None
    ) -> None:
        """Raise ExposedServerError unless ``task``'s process listens only on loopback or
        ``allowed`` (``None``: anywhere), and FleetStartError unless it is the process that
        listens on the task's port: an answer from another process (a second name for an
        address another task has) is no proof of this one (default: its sockets as the OS
        lists them for its pid, in ``table``, one reading for the whole fleet)."""
        name = f"{task.job}:{task.index}"
        sockets = check_listening(name, task.address, task.pid, allowed, table=table)
        port = int(task.address.rsplit(":", 1)[1])
        if not any(p == port for _, p in sockets):
            raise FleetStartError(
                f"Server {name} is not the process listening on {task.address} (pid "
                f"{task.pid} listens on {sorted({p for _, p in sockets}) or 'nothing'}): another "
                "process answered for it. Is the address another task's under another name?",
                task=name,
                address=task.address,
            )

    def _teardown(self) -> None:
        """Release what is left once the tasks are stopped (default: nothing)."""

    def _on_running(self) -> None:
        """Called once every task answered (default: nothing)."""

    # -- using a fleet ----------------------------------------------------------------------------

    @property
    def tasks(self) -> tuple[_TaskT, ...]:
        """Every task's handle, in the cluster's order (job name, then index)."""
        return tuple(self._tasks.values())

    def __iter__(self) -> Iterator[_TaskT]:
        return iter(self.tasks)

    @property
    def pids(self) -> list[int]:
        return [t.pid for t in self._tasks.values() if t.pid is not None]

    def task(self, job: str | None = None, index: int = 0) -> _TaskT:
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
        guard = SessionGuard(self, master, effective.device_filters)
        guard.timeout_ms = effective.operation_timeout_in_ms
        sess = session(master.target, graph=graph, config=effective, guard=guard)
        guard.attach(sess)
        self._sessions.add(sess)
        return sess

    def health(
        self, timeout_s: float = PROBE_TIMEOUT_S, tasks: list[_TaskT] | None = None
    ) -> HealthReport:
        """Each task's :class:`TaskHealth` (``alive``, ``dead`` or ``not answering``), checked
        with a real gRPC call of at most ``timeout_s`` seconds (all tasks at once)."""
        timeout_s = check_timeout_s(timeout_s, "timeout_s", PROBE_TIMEOUT_S)
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
        bad = [h for h in self.health(timeout_s=_DIAGNOSE_PROBE_S) if not h.ok]
        if len(bad) > 1 and all(h.status == NOT_ANSWERING for h in bad):
            # A task busy on a loaded machine can miss a short probe, a frozen one misses a
            # long one too: ask the silent ones again before naming one of them.
            silent = [self.task(h.job, h.index) for h in bad]
            bad = [h for h in self.health(_RECHECK_PROBE_S, tasks=silent) if not h.ok] or bad
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

    def dead_tasks(self) -> list[_TaskT]:
        """Tasks whose process has exited."""
        return [t for t in self._tasks.values() if t.pid is not None and not t.alive]

    # -- the watcher: the fleet knows when a task dies -------------------------------------------

    #: Seconds between two looks at every task's process (a backend may change it).
    watch_interval_s: float = 0.1

    def watch(self, callback: Callable[[_TaskT], None]) -> None:
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
                event = TaskExit(task.name, task.pid, task.exitcode, time.monotonic())
                with self._watch_lock:
                    self._exits.append(event)
                    callbacks = list(self._watchers)
                log.info("watcher: %s (pid %s) exited with %s", task.name, task.pid, task.exitcode)
                for callback in callbacks:
                    try:
                        callback(task)
                    except Exception:  # a listener's bug must not stop the watcher
                        log.exception("fleet watcher callback %r failed", callback)
            time.sleep(self.watch_interval_s)

    def _repr_html_(self) -> str:
        """Jupyter's view of a fleet: its state and one row per task."""
        rows = []
        for t in self._tasks.values():
            alive = t.alive
            state = "running" if alive else f"exited {t.exitcode}" if t.pid else "not started"
            rows.append(
                f'<tr style="background:{"#d9f2d9" if alive else "#f8d0d0"}">'
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
        if self.state is not FleetState.RUNNING:
            raise FleetClosedError(f"The fleet is {self.state.value}; start it first")


def _exit_sweep_runs_first() -> None:
    """Make :func:`_close_live_fleets` the next exit hook to run. ``atexit`` runs the last
    registered first, and ``multiprocess`` registers a hook on its first import that joins every
    child process: registered before it, the sweep would run after that join, which waits for
    ever on servers that wait for their owner (TF_FACTS, "Long-lived processes")."""
    atexit.unregister(_close_live_fleets)
    atexit.register(_close_live_fleets)


def _close_live_fleets() -> None:
    """Close every fleet this process still runs (a fleet's servers also exit by themselves
    when their owner dies, but a clean close stops them at once and removes their files)."""
    for fleet in list(_live_fleets):
        if os.getpid() == fleet._owner_pid:
            with contextlib.suppress(Exception):
                fleet.close()


atexit.register(_close_live_fleets)
