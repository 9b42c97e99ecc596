"""The small process that owns a detached fleet (``graphdist up --detach``, see ``detached``).

It runs in its own session (so the terminal's Ctrl-C does not reach it), starts a
:class:`LocalFleet` whose logs live in the state folder, serves its control channel
(``control.sock``, see ``control``: kill and restart a task), records the fleet in ``fleet.json``
(again whenever a task dies or is restarted) and waits for SIGTERM/SIGINT/SIGHUP; then it stops
the fleet and removes ``fleet.json``. Because the servers watch their owner, killing the
supervisor outright still takes every server down.

Everything it needs is one :class:`SupervisorSpec`, passed as its only argument, in JSON:
``python -m graphdist._fleet.supervisor SPEC_JSON`` (build it with :meth:`SupervisorSpec.command`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

import psutil

from graphdist._cluster import Cluster
from graphdist._exceptions import ArgumentError, GraphdistError
from graphdist._fleet.control import ControlServer
from graphdist._fleet.local import DEFAULT_START_TIMEOUT_S, LocalFleet
from graphdist._fleet.signals import stop_on_signals
from graphdist._fleet.state import (
    STATE_FILE,
    FleetRecord,
    ProcessRef,
    TaskRecord,
    write_error,
    write_state,
)
from graphdist._validate import count, timeout_s

__all__ = ["DEFAULT_MAX_RESTARTS", "RESTART_POLICIES", "SupervisorSpec", "main"]

log = logging.getLogger("graphdist.supervisor")
RESTART_POLICIES = ("no", "on-failure")
DEFAULT_MAX_RESTARTS = 3
MONITOR_INTERVAL_S = 0.5


@dataclass(frozen=True)
class SupervisorSpec:
    """What a supervisor runs, declared once: the CLI and :func:`detached.start_detached` build
    it, the supervisor reads it back from its one argument (:meth:`to_json`/:meth:`from_json`).

    - ``state_dir``: the fleet's state folder (made absolute).
    - ``cluster``: the cluster, as :meth:`Cluster.as_dict` gives it (ports already chosen).
    - ``start_timeout_s``: how long to wait for every server, at start and at each restart.
    - ``restart``: ``"no"`` or ``"on-failure"`` (restart a server that dies).
    - ``max_restarts``: with ``"on-failure"``, restarts per task before giving up.
    - ``expose``: let the servers listen on every interface (default: loopback only).
    """

    state_dir: str
    cluster: dict[str, Any]
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S
    restart: str = "no"
    max_restarts: int = DEFAULT_MAX_RESTARTS
    expose: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "state_dir", os.path.abspath(self.state_dir))
        timeout_s(self.start_timeout_s, "start_timeout_s")
        count(self.max_restarts, "max_restarts", minimum=0)
        if self.restart not in RESTART_POLICIES:
            raise ArgumentError(
                f"restart must be one of {', '.join(RESTART_POLICIES)}, not {self.restart!r}",
                name="restart",
                value=self.restart,
            )
        if not isinstance(self.expose, bool):
            raise ArgumentError(
                f"expose must be True or False, not {self.expose!r}",
                name="expose",
                value=self.expose,
            )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SupervisorSpec:
        """The spec in ``text``; raises ValueError for anything but one :meth:`to_json` made."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"a supervisor spec is a JSON object, not {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown field(s) in the supervisor spec: {', '.join(unknown)}")
        missing = [name for name in ("state_dir", "cluster") if name not in data]
        if missing:
            raise ValueError(f"the supervisor spec lacks {', '.join(missing)}")
        return cls(**data)

    def command(self) -> list[str]:
        """The command line that starts a supervisor for this spec."""
        return [sys.executable, "-m", "graphdist._fleet.supervisor", self.to_json()]


class _Supervisor:
    """The running fleet, its record in ``fleet.json`` and the handling of control requests.
    One lock serialises the monitor loop (restart on failure) and control requests."""

    def __init__(self, spec: SupervisorSpec, fleet: LocalFleet) -> None:
        self.spec = spec
        self.fleet = fleet
        self.started_at = time.time()
        self.lock = threading.Lock()
        self._refs: dict[tuple[str, int], ProcessRef] = {}
        self._written: tuple[Any, ...] | None = None
        self._given_up: set[str] = set()

    def _snapshot(self) -> tuple[Any, ...]:
        return tuple((t.pid, t.alive, t.exitcode, t.restarts) for t in self.fleet.tasks)

    def _ref(self, job: str, index: int, pid: int, alive: bool) -> ProcessRef:
        """The pid with the start time it had when first seen alive: a dead task's pid, reused
        by another process, must not be recorded with that process's start time."""
        ref = self._refs.get((job, index))
        if ref is None or ref.pid != pid:
            try:
                ref = ProcessRef.of(pid) if alive else ProcessRef(pid, 0.0)
            except psutil.Error:
                ref = ProcessRef(pid, 0.0)  # already gone: recorded, and seen as not alive
            self._refs[(job, index)] = ref
        return ref

    def record(self) -> FleetRecord:
        tasks = []
        for t in self.fleet.tasks:
            if t.pid is None:
                continue
            alive = t.alive
            ref = self._ref(t.job, t.index, t.pid, alive)
            exitcode = None if alive else t.exitcode
            tasks.append(
                TaskRecord(
                    t.job,
                    t.index,
                    t.address,
                    t.pid,
                    ref.create_time,
                    t.log_path,
                    t.restarts,
                    exitcode,
                )
            )
        return FleetRecord(
            supervisor=ProcessRef.of(os.getpid()),
            cluster=self.fleet.cluster.as_dict(),
            tasks=tasks,
            started_at=self.started_at,
            restart_policy=self.spec.restart,
            start_timeout_s=self.spec.start_timeout_s,
        )

    def save(self) -> None:
        self._written = self._snapshot()
        write_state(self.spec.state_dir, self.record())

    def tick(self) -> None:
        """One pass of the monitor: restart dead tasks (if asked to), record any change."""
        with self.lock:
            if self.spec.restart == "on-failure":
                self._restart_dead()
            if self._snapshot() != self._written:
                self.save()

    def _restart_dead(self) -> None:
        for task in self.fleet.dead_tasks():
            if task.restarts >= self.spec.max_restarts:
                if task.name not in self._given_up:
                    self._given_up.add(task.name)
                    log.error("%r died %d times; not restarting it again", task, task.restarts + 1)
                continue
            log.warning("%r died (exit code %s); restarting it", task, task.exitcode)
            try:
                self.fleet.restart(task.job, task.index)
            except GraphdistError as exc:
                log.error("restart of %s failed: %s", task.name, exc)
            self.save()

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        """Answer one control request (see ``graphdist._fleet.control``)."""
        op = req.get("op")
        if op == "ping":
            return {"ok": True, "pid": os.getpid()}
        if op not in ("kill", "restart"):
            raise ValueError(f"unknown op {op!r}; expected 'ping', 'kill' or 'restart'")
        job, index = req.get("job"), req.get("index")
        if not isinstance(job, str) or isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(f"{op} needs a job name and a task index, not {job!r}, {index!r}")
        with self.lock:
            try:
                if op == "kill":
                    sig = signal.Signals(req.get("sig", signal.SIGKILL))
                    log.warning("control: sending %s to %s:%d", sig.name, job, index)
                    self.fleet.kill(job, index, sig=sig)
                else:
                    log.warning("control: restarting %s:%d", job, index)
                    self.fleet.restart(job, index)
            finally:
                self.save()
        return {"ok": True}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m graphdist._fleet.supervisor SPEC_JSON", file=sys.stderr)
        return 2
    try:
        spec = SupervisorSpec.from_json(args[0])
    except (ValueError, TypeError) as exc:
        print(f"graphdist-supervisor: bad spec: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    stop = stop_on_signals()
    state_dir = spec.state_dir
    try:
        fleet = LocalFleet(
            Cluster.parse(spec.cluster),
            start_timeout_s=spec.start_timeout_s,
            log_dir=os.path.join(state_dir, "logs"),
            expose=spec.expose,
        ).start()
    except GraphdistError as exc:
        write_error(state_dir, type(exc).__name__, str(exc))
        return 1
    except Exception as exc:  # an unexpected failure must still reach the waiting CLI
        write_error(state_dir, type(exc).__name__, f"{type(exc).__name__}: {exc}")
        raise
    supervisor = _Supervisor(spec, fleet)
    control = ControlServer(state_dir, supervisor.handle)
    try:
        try:
            control.start()
        except OSError as exc:
            write_error(
                state_dir, "StateError", f"Cannot serve {control.path}: {exc.strerror or exc}"
            )
            return 1
        supervisor.save()
        log.info("fleet ready: %r (restart policy %s)", fleet, spec.restart)
        while not stop.wait(MONITOR_INTERVAL_S):
            supervisor.tick()
        log.info("got a stop signal; stopping the fleet")
    finally:
        control.close()
        fleet.close()
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(state_dir, STATE_FILE))
    return 0


if __name__ == "__main__":
    sys.exit(main())
