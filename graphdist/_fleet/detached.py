"""Detached fleets: started by one process, kept by a supervisor, used and stopped from others.

The lifecycle, which ``graphdist up --detach``, ``status`` and ``down`` only wrap:

- :func:`start_detached` refuses a state folder whose fleet is live, spawns the supervisor
  (``supervisor``) from a :class:`SupervisorSpec` and waits until it writes ``fleet.json``
  (ready) or ``error.json`` (failed), or the start timeout passes;
- :func:`live_record` reads the running fleet's record, cleaning up a stale one (its supervisor
  is gone); :func:`status_rows` turns it into one row per task;
- :func:`stop_detached` stops the supervisor, makes sure every server is gone and removes the
  state folder;
- :func:`attach` returns a :class:`DetachedFleet`, a :class:`Fleet` on the running fleet: tasks,
  targets, devices, sessions that name a failed task, health, and ``kill``/``restart`` done by
  the supervisor over its control channel (``control``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any

from graphdist._cluster import Cluster, Task
from graphdist._exceptions import FleetError, FleetStartError, StateError
from graphdist._fleet import control
from graphdist._fleet.base import Fleet, FleetState, TaskView
from graphdist._fleet.local import LOG_TAIL_LINES, read_log_tail
from graphdist._fleet.process import STOP_GRACE_S
from graphdist._fleet.state import (
    STATE_FILE,
    SUPERVISOR_LOG,
    FleetRecord,
    TaskRecord,
    clear_state,
    default_state_dir,
    read_error,
    read_state,
    stop_processes,
)
from graphdist._fleet.supervisor import SupervisorSpec
from graphdist._private import private_dir
from graphdist._validate import timeout_ms

__all__ = [
    "DetachedFleet",
    "DetachedTask",
    "SupervisorSpec",
    "attach",
    "live_record",
    "no_fleet",
    "resolve_state_dir",
    "start_detached",
    "status_rows",
    "stop_detached",
]

READY_MARGIN_S = 30.0  # beyond the start timeout: the supervisor's own start (importing TF)
KILL_TIMEOUT_S = 30.0


def resolve_state_dir(state_dir: str | os.PathLike[str] | None = None) -> str:
    """``state_dir`` made absolute, or the default one (see ``state.default_state_dir``)."""
    return os.path.abspath(os.fspath(state_dir)) if state_dir else default_state_dir()


def no_fleet(state_dir: str) -> StateError:
    return StateError(
        f"No detached fleet is running in {state_dir}; start one with "
        "`graphdist up --cluster SPEC --detach`",
        state_dir,
    )


def live_record(state_dir: str, *, cleanup: bool) -> FleetRecord | None:
    """The running fleet in ``state_dir``; a stale one (supervisor gone) is cleaned up and
    reported as StateError unless ``cleanup`` is set, in which case ``None`` is returned."""
    record = read_state(state_dir)
    if record is None or record.supervisor.alive():
        return record
    leftovers = stop_processes(t.process for t in record.tasks)
    clear_state(state_dir)
    if cleanup:
        return None
    note = f"; {len(leftovers)} server(s) would not die" if leftovers else ""
    raise StateError(
        f"The fleet in {state_dir} was stale (supervisor pid {record.supervisor.pid} is gone); "
        f"its state was cleaned up{note}",
        state_dir,
    )


def status_rows(record: FleetRecord) -> list[dict[str, Any]]:
    """One row per task: job, task, address, pid, alive, log."""
    return [
        {
            "job": t.job,
            "task": t.task,
            "address": t.address,
            "pid": t.pid,
            "alive": t.process.alive(),
            "log": t.log,
        }
        for t in record.tasks
    ]


def start_detached(spec: SupervisorSpec) -> FleetRecord:
    """Start a supervisor for ``spec`` and return the fleet's record once every server answers.

    Raises :class:`StateError` if a fleet is already running in ``spec.state_dir``,
    :class:`ClusterSpecError`/:class:`PortInUseError` before anything starts, and
    :class:`FleetStartError` if the supervisor reports a failed start, exits, or is not ready
    within ``spec.start_timeout_s`` (plus a margin for its own start)."""
    from graphdist._fleet.local import check_hosts_and_ports, check_loopback

    state_dir = spec.state_dir
    record = live_record(state_dir, cleanup=True)
    if record is not None:
        raise StateError(
            f"A fleet is already running in {state_dir} (supervisor pid "
            f"{record.supervisor.pid}); stop it with `graphdist down` or pass another --state-dir",
            state_dir,
        )
    cluster = Cluster.parse(spec.cluster)
    check_hosts_and_ports(cluster)
    if not spec.expose:
        check_loopback(cluster)
    private_dir(state_dir, "the fleet's state folder")
    log_path = os.path.join(state_dir, SUPERVISOR_LOG)
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            spec.command(),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    deadline = time.monotonic() + spec.start_timeout_s + READY_MARGIN_S
    while True:
        record = read_state(state_dir)
        if record is not None:
            return record
        error = read_error(state_dir)
        code = proc.poll()
        if error is not None or code is not None:
            proc.wait(10)
            if error is None:
                raise FleetStartError(
                    f"The supervisor exited with code {code} before the fleet was ready; see "
                    f"{log_path}"
                )
            clear_state(state_dir)
            raise FleetStartError(error["message"])
        if time.monotonic() > deadline:
            proc.terminate()
            proc.wait(10)
            raise FleetStartError(
                f"The detached fleet was not ready after {spec.start_timeout_s:g} s; raise "
                f"--start-timeout (supervisor log: {log_path})"
            )
        time.sleep(0.05)


def stop_detached(state_dir: str) -> str:
    """Stop the fleet in ``state_dir`` (or clean up a stale one), check that every process is
    gone and remove the folder. Returns what was done: ``"stopped N server(s)"`` or ``"cleaned
    up a stale fleet"``. Raises :class:`StateError` if there is no fleet, :class:`FleetError`
    if a process would not die."""
    record = read_state(state_dir)
    if record is None:
        raise no_fleet(state_dir)
    stale = not record.supervisor.alive()
    # The supervisor stops its servers on SIGTERM; then make sure every pid is really gone.
    left = stop_processes([record.supervisor], grace_s=10.0)
    left += stop_processes(t.process for t in record.tasks)
    if left:
        raise FleetError(
            "Could not stop pid(s) " + ", ".join(str(r.pid) for r in left) + f" of {state_dir}"
        )
    clear_state(state_dir)
    return "cleaned up a stale fleet" if stale else f"stopped {len(record.tasks)} server(s)"


class DetachedTask(TaskView):
    """One server of a detached fleet, as its supervisor last recorded it in ``fleet.json``:
    ``pid``, ``alive`` (that very process still runs), ``exitcode`` (``None`` while it runs, or
    until the supervisor has seen it exit), ``restarts``, ``log_path`` and :meth:`log_tail`."""

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
    def log_path(self) -> str:
        return self.record.log

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> list[str]:
        return read_log_tail(self.log_path, lines)

    def __repr__(self) -> str:
        state = "running" if self.alive else f"exited {self.exitcode}"
        return f"<DetachedTask {self.job}:{self.index} at {self.address} pid={self.pid} {state}>"


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
        self._init_watcher()
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

    @state.setter
    def state(self, value: FleetState) -> None:
        raise AttributeError("a detached fleet's state follows its supervisor; it is not set")

    @property
    def log_dir(self) -> str:
        return os.path.join(self.state_dir, "logs")

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

    def start(self) -> DetachedFleet:
        raise FleetError(
            "A detached fleet is started by `graphdist up --detach`; this handle is attached to "
            f"the one in {self.state_dir}"
        )

    def detach(self) -> None:
        """Drop this handle and leave the fleet running (``graphdist attach`` it again later)."""
        self._detached = True

    def close(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop the fleet like ``graphdist down``: the supervisor (which stops every server with
        its own grace period) and then any server left, and remove the state folder. Safe to
        repeat; also after :meth:`detach`; does nothing if the fleet is already gone or the
        folder now holds another fleet. ``grace_s`` is accepted for the common interface."""
        if self._stopped:
            return
        record = read_state(self.state_dir)
        if record is not None and record.supervisor == self.supervisor:
            stop_detached(self.state_dir)
        self._stopped = True

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # -- faults, through the supervisor ---------------------------------------------------------

    def kill(self, job: str | None = None, index: int = 0, sig: int = signal.SIGKILL) -> None:
        """Have the supervisor send ``sig`` (default SIGKILL) to the server of ``job:index``;
        with SIGKILL or SIGTERM, returns once its process is gone. With ``--restart
        on-failure`` the supervisor then restarts it by itself."""
        self._require_running()
        task = self.task(job, index)
        self._control(
            {"op": "kill", "job": task.job, "index": task.index, "sig": int(sig)}, KILL_TIMEOUT_S
        )

    def restart(self, job: str | None = None, index: int = 0) -> DetachedTask:
        """Have the supervisor start the server of ``job:index`` again on the same address
        (killing it first if it runs) and wait until it answers; returns its task, with the new
        pid. Old sessions that used it are broken; new ones work at once. Raises
        :class:`FleetStartError` if it does not come back."""
        self._require_running()
        task: DetachedTask = self.task(job, index)
        self._control(
            {"op": "restart", "job": task.job, "index": task.index},
            self.start_timeout_s + KILL_TIMEOUT_S,
        )
        return task

    def _control(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        reply = control.request(self.state_dir, message, timeout_s, alive=self.supervisor.alive)
        self._refresh()
        return reply

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
