"""Detached fleets: started by one process, kept by a supervisor, used and stopped from others.

:func:`attach` returns a :class:`DetachedFleet`, a :class:`Fleet` on the running fleet: tasks,
targets, devices, sessions that name a failed task, health, and ``kill``/``restart`` done by the
supervisor over its control channel (``control``). The lifecycle (:func:`start_detached`,
:func:`live_record`, :func:`status_rows`, :func:`fleet_problem`, :func:`stop_detached`), which
``graphdist up --detach``, ``status`` and ``down`` only wrap, is
:mod:`graphdist._detached.lifecycle`'s, and importable from here too.
"""

from __future__ import annotations

import os
from typing import Any

from graphdist._cluster import Cluster, Task
from graphdist._detached import control
from graphdist._detached.lifecycle import (
    fleet_problem,
    live_record,
    no_fleet,
    resolve_state_dir,
    start_detached,
    status_rows,
    stop_detached,
)
from graphdist._detached.state import (
    LOGS_DIR,
    STATE_FILE,
    CorruptStateError,
    FleetRecord,
    TaskRecord,
    read_state,
)
from graphdist._detached.supervisor import SupervisorSpec
from graphdist._exceptions import StateError
from graphdist._fleet.client import Fleet, FleetState
from graphdist._fleet.task import LOG_TAIL_LINES, TaskView, read_log_tail
from graphdist._proc.process import STOP_GRACE_S
from graphdist._validate import timeout_ms, timeout_s

__all__ = [
    "DetachedFleet",
    "DetachedTask",
    "SupervisorSpec",
    "attach",
    "fleet_problem",
    "live_record",
    "no_fleet",
    "resolve_state_dir",
    "start_detached",
    "status_rows",
    "stop_detached",
]

KILL_TIMEOUT_S = 30.0
"""Seconds a kill asked of the supervisor may take (it waits until the process is gone)."""


class DetachedTask(TaskView):
    """One server of a detached fleet, as its supervisor last recorded it in ``fleet.json``:
    ``pid``, ``alive`` (that very process still runs), ``exitcode`` (``None`` while it runs, or
    until the supervisor has seen it exit), ``restarts``, ``gave_up``, ``log_path`` and
    :meth:`log_tail`."""

    def __init__(self, fleet: DetachedFleet, record: TaskRecord) -> None:
        self.task = Task(record.job, record.task, record.address)
        self._fleet = fleet
        self._record = record

    @property
    def record(self) -> TaskRecord:
        self._fleet._refresh()
        return self._record

    @property
    def pid(self) -> int:
        return self.record.pid

    @property
    def alive(self) -> bool:
        return self.record.process.alive()

    @property
    def exitcode(self) -> int | None:
        record = self.record
        return None if record.process.alive() else record.exitcode

    @property
    def restarts(self) -> int:
        return self.record.restarts

    @property
    def gave_up(self) -> bool:
        """The supervisor's restart policy gave up on this task (too many restarts within its
        window): it stays dead until :meth:`DetachedFleet.restart` brings it back."""
        return self.record.gave_up

    @property
    def log_path(self) -> str:
        return self.record.log

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> list[str]:
        return read_log_tail(self.log_path, lines)

    def __repr__(self) -> str:
        state = "running" if self.alive else f"exited {self.exitcode}"
        return f"<DetachedTask {self.name} at {self.address} pid={self.pid} {state}>"


class DetachedFleet(Fleet[DetachedTask]):
    """A handle on the fleet a supervisor keeps running (``graphdist up --detach``); get one
    with :func:`graphdist.attach`. It offers what every :class:`Fleet` does (``cluster``,
    ``tasks``, ``task()``, ``target()``, ``device()``, ``session()``, ``session_for()``,
    ``health()``, ``reopening_session()``, ``dead_tasks()``); :meth:`kill` and :meth:`restart`
    are done by the supervisor, which owns the servers.

    The handle owns nothing: leaving ``with graphdist.attach() as fleet:`` only :meth:`detach`\\ es
    (the fleet keeps running, as it was started elsewhere); :meth:`close` stops the fleet itself,
    like ``graphdist down``. ``state`` is ``RUNNING`` while the supervisor runs, ``CLOSED`` once
    the fleet was stopped (here or elsewhere) or the handle detached, ``FAILED`` if the supervisor
    died."""

    def __init__(
        self, state_dir: str, record: FleetRecord, *, operation_timeout_ms: int | None = None
    ) -> None:
        super().__init__()
        self.state_dir = state_dir
        self.supervisor = record.supervisor
        self.cluster = Cluster.parse(record.cluster)
        self.restart_policy = record.restart_policy
        self.start_timeout_s = record.start_timeout_s
        self.operation_timeout_ms = operation_timeout_ms
        self.gpus = None
        self._detached = False
        self._stopped = False
        self._gone = False  # fleet.json removed, or now another supervisor's
        self._stamp: tuple[int, int, int] | None = None
        self._tasks: dict[tuple[str, int], DetachedTask] = {
            (t.job, t.task): DetachedTask(self, t) for t in record.tasks
        }
        self._refresh()

    # -- state ----------------------------------------------------------------------------------

    @property
    def state(self) -> FleetState:
        """Read from the supervisor and ``fleet.json`` each time (see the class docstring)."""
        if self._detached or self._stopped:
            return FleetState.CLOSED
        self._refresh()
        if self._gone:
            return FleetState.CLOSED
        return FleetState.RUNNING if self.supervisor.alive() else FleetState.FAILED

    @property
    def log_dir(self) -> str:
        return os.path.join(self.state_dir, LOGS_DIR)

    def _refresh(self) -> None:
        """Re-read ``fleet.json`` if the supervisor rewrote it (a task died or was restarted)."""
        path = os.path.join(self.state_dir, STATE_FILE)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self._gone = True
            return
        except OSError:
            return
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        try:
            record = read_state(self.state_dir)
        except StateError:
            return  # unreadable for a moment: keep what we know
        if record is None or record.supervisor != self.supervisor:
            self._gone = True
            return
        self._stamp = stamp
        for t in record.tasks:
            task = self._tasks.get((t.job, t.task))
            if task is not None:
                task._record = t

    # -- lifecycle ------------------------------------------------------------------------------

    def detach(self) -> None:
        """Drop this handle and leave the fleet running (``graphdist attach`` it again later)."""
        self._detached = True

    def close(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop the fleet like ``graphdist down``: the supervisor (which stops every server with
        its own grace period) and then any server left, and remove the state folder. Safe to
        repeat; also after :meth:`detach`; does nothing if the fleet is already gone or the
        folder now holds another fleet. ``grace_s`` is accepted for the common interface."""
        timeout_s(grace_s, "grace_s")
        if self._stopped:
            return
        try:
            record = read_state(self.state_dir)
            ours = record is not None and record.supervisor == self.supervisor
        except CorruptStateError:
            ours = self.supervisor.alive()  # stop_detached finds it by its marker
        if ours:
            self._close_sessions()
            stop_detached(self.state_dir)
        self._stopped = True

    def __enter__(self) -> DetachedFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # -- the client's primitives, done by the supervisor, which owns the servers ----------------

    def _kill_task(self, task: DetachedTask, sig: int) -> None:
        """The supervisor sends ``sig``; with SIGKILL or SIGTERM it answers once the process is
        gone (with ``--restart on-failure`` it then restarts the task by itself)."""
        message = {"op": "kill", "job": task.job, "index": task.index, "sig": int(sig)}
        self._control(message, KILL_TIMEOUT_S)

    def _bring_back(self, task: DetachedTask) -> None:
        """The supervisor restarts the server and answers once it answers over gRPC."""
        message = {"op": "restart", "job": task.job, "index": task.index}
        self._control(message, self.start_timeout_s + KILL_TIMEOUT_S)

    def _control(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        try:
            return control.request(self.state_dir, message, timeout_s, alive=self.supervisor.alive)
        finally:
            self._refresh()

    def __repr__(self) -> str:
        tasks = ", ".join(f"{t.name}={t.address}" for t in self.cluster)
        return (
            f"<DetachedFleet {self.state.value} [{tasks}] supervisor pid={self.supervisor.pid} "
            f"state_dir={self.state_dir}>"
        )


def attach(
    state_dir: str | os.PathLike[str] | None = None, *, operation_timeout_ms: int | None = None
) -> DetachedFleet:
    """A :class:`DetachedFleet` on the fleet ``graphdist up --detach`` started in ``state_dir``
    (default: the CLI's, ``$GRAPHDIST_STATE_DIR`` else ``~/.local/state/graphdist``)::

        fleet = graphdist.attach()
        with fleet.session("local", 0) as sess:
            ...
        fleet.detach()   # or fleet.close() to stop the fleet, like `graphdist down`

    ``operation_timeout_ms`` is put in every session's config, as for :class:`LocalFleet`.
    Raises :class:`StateError` naming the folder if no fleet runs there (a stale one, whose
    supervisor is gone, is cleaned up first)."""
    operation_timeout_ms = timeout_ms(operation_timeout_ms, "operation_timeout_ms")
    folder = resolve_state_dir(state_dir)
    record = live_record(folder, cleanup=False)
    if record is None:
        raise no_fleet(folder)
    return DetachedFleet(folder, record, operation_timeout_ms=operation_timeout_ms)
