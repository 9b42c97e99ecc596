"""The small process that owns a detached fleet (``graphdist up --detach``, see ``detached``).

It runs in its own session (so the terminal's Ctrl-C does not reach it), starts the fleet of its
spec's backend, looked up by name (:mod:`graphdist._fleet.backends`: a :class:`LocalFleet` whose
logs live in the state folder, or a :class:`RayFleet`), serves its control channel
(``control.sock``, see ``control``: kill and restart a task), records the fleet in ``fleet.json``
(again whenever a task dies or is restarted) and waits for SIGTERM/SIGINT/SIGHUP; then it stops
the fleet and removes ``fleet.json``. Because the servers watch their owner, killing the
supervisor outright still takes every server down.

Everything it needs is one :class:`SupervisorSpec`, passed as its only argument, in JSON:
``python -m graphdist._detached.supervisor SPEC_JSON`` (build it with
:meth:`SupervisorSpec.command`).
It is started with ``GRAPHDIST_FLEET_MARK`` set (see ``state``), which its fork server and every
server inherit, so ``graphdist down`` finds them all even without a readable ``fleet.json``.

The restart policy ``on-failure`` restarts a dead server as graphdist's one restart policy
decides (:class:`graphdist._proc.restarts.RestartPolicy`, one per task, its start-up rule off: a
server has no first step): after a back-off, at most ``max_restarts`` restarts of a task within
any restart window; the next death within it makes the supervisor give up on that task: it stays
dead, ``fleet.json`` records ``gave_up`` and ``graphdist status`` exits 1. A restart asked over
the control channel (``fleet.restart``) always happens, and clears a give-up.
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
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from graphdist._detached.control import ControlServer
from graphdist._detached.state import (
    LOGS_DIR,
    MARK_ENV,
    STATE_FILE,
    TLS_DIR,
    FleetRecord,
    ProcessRef,
    TaskRecord,
    fleet_mark,
    write_error,
    write_state,
)
from graphdist._exceptions import ArgumentError, GraphdistError, StateError
from graphdist._failures import dead_detail
from graphdist._fleet.backends import backend, check_options
from graphdist._fleet.lifecycle import OwnedFleet
from graphdist._fleet.task import TaskHandle
from graphdist._net.policy import exposed_allow
from graphdist._proc.forkserver_pool import SPARES_ENV
from graphdist._proc.restarts import (
    DEFAULT_MAX_RESTARTS,
    DEFAULT_RESTART_WINDOW_S,
    Decision,
    RestartPolicy,
    backoff_s,
)
from graphdist._proc.signals import stop_on_signals
from graphdist._validate import count, flag, timeout_s

__all__ = [
    "DEFAULT_MAX_RESTARTS",
    "DEFAULT_RESTART_WINDOW_S",
    "RESTART_POLICIES",
    "SupervisorSpec",
    "backoff_s",
    "main",
]

log = logging.getLogger("graphdist.supervisor")
RESTART_POLICIES = ("no", "on-failure")
MONITOR_INTERVAL_S = 0.5


def tls_client_folder(state_dir: str) -> str:
    """The client's credentials folder of a detached TLS fleet whose state is ``state_dir``."""
    return os.path.join(state_dir, TLS_DIR, "credentials", "client")


@dataclass(frozen=True)
class SupervisorSpec:
    """What a supervisor runs, declared once: the CLI and :func:`detached.start_detached` build
    it, the supervisor reads it back from its one argument (:meth:`to_json`/:meth:`from_json`).

    - ``state_dir``: the fleet's state folder (made absolute).
    - ``cluster``: the cluster as the backend takes it (parsed once, by the backend's
      ``parse_cluster``, here: a :class:`Cluster` with its ports chosen for ``local``, task
      counts for ``ray``); its JSON form (``cluster_data``) travels to the supervisor.
    - ``backend``: the backend's registered name (default ``"local"``).
    - ``options``: the backend's own options (:class:`~graphdist._fleet.backends.BackendOption`:
      Ray's ``address``, say), passed through to its ``for_command``; another backend's option
      is refused here, before anything starts.
    - ``start_timeout_s``: how long to wait for every server, at start and at each restart
      (``None``: the backend's default, in seconds).
    - ``restart``: ``"no"`` or ``"on-failure"`` (restart a server that dies).
    - ``max_restarts``: with ``"on-failure"``, restarts of a task within any
      ``restart_window_s`` seconds; one more death within the window and the supervisor gives
      up on the task (see the module docstring for the backoff).
    - ``expose``: let the servers listen on every interface (default: loopback only).
    - ``allow``: with ``expose``, the other machines let in besides the cluster's own hosts
      (addresses or networks; see :mod:`graphdist._net.members`).
    - ``restart_window_s``: the sliding window ``max_restarts`` counts in (default 60 s).
    - ``tls``: TLS mode: the servers on loopback aliases, mutual-TLS gateways on the tasks'
      addresses (and the supervisor's own, for the tasks on other hosts, which a process of
      this user attached on its host goes through), credentials made in ``STATE_DIR/tls`` (the
      client's: :func:`tls_client_folder`); the record keeps the real cluster.
    """

    state_dir: str
    cluster: Any
    start_timeout_s: float | None = None
    restart: str = "no"
    max_restarts: int = DEFAULT_MAX_RESTARTS
    expose: bool = False
    restart_window_s: float = DEFAULT_RESTART_WINDOW_S
    backend: str = "local"
    options: Mapping[str, Any] = field(default_factory=dict)
    allow: tuple[str, ...] = ()
    tls: bool = False

    def __post_init__(self) -> None:
        flag(self.expose, "expose")  # first: a security switch, never read by truthiness
        flag(self.tls, "tls")
        allow = exposed_allow(self.allow or None, self.expose)
        object.__setattr__(self, "allow", allow)
        object.__setattr__(self, "state_dir", os.path.abspath(self.state_dir))
        kind = backend(self.backend)
        start = timeout_s(self.start_timeout_s, "start_timeout_s", kind.DEFAULT_START_TIMEOUT_S)
        object.__setattr__(self, "start_timeout_s", start)
        timeout_s(self.restart_window_s, "restart_window_s")
        count(self.max_restarts, "max_restarts", minimum=0)
        if self.restart not in RESTART_POLICIES:
            raise ArgumentError(
                f"restart must be one of {', '.join(RESTART_POLICIES)}, not {self.restart!r}",
                name="restart",
                value=self.restart,
            )
        if not isinstance(self.options, Mapping):
            raise ArgumentError(
                f"options must be a mapping of option names to values, not {self.options!r}",
                name="options",
                value=self.options,
            )
        object.__setattr__(self, "options", check_options(self.backend, self.options))
        object.__setattr__(self, "cluster", kind.parse_cluster(self.cluster))

    @property
    def start_timeout(self) -> float:
        """``start_timeout_s``, never ``None`` once the spec is built (seconds)."""
        assert self.start_timeout_s is not None
        return self.start_timeout_s

    def to_json(self) -> str:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["cluster"] = backend(self.backend).cluster_data(self.cluster)
        return json.dumps(data, sort_keys=True)

    def fleet(self) -> OwnedFleet[Any]:
        """The fleet this spec asks for (not started), from its backend."""
        return backend(self.backend).for_command(
            self.cluster,
            start_timeout_s=self.start_timeout,
            expose=self.expose,
            log_dir=os.path.join(self.state_dir, LOGS_DIR),
            allow=self.allow or None,
            tls=self.tls,
            tls_dir=os.path.join(self.state_dir, TLS_DIR) if self.tls else None,
            **self.options,
        )

    @property
    def tls_client(self) -> str | None:
        """With ``tls``: the client's credentials folder, to copy to the machine that
        connects."""
        return tls_client_folder(self.state_dir) if self.tls else None

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
        return [sys.executable, "-m", "graphdist._detached.supervisor", self.to_json()]


class _Supervisor:
    """The running fleet, its record in ``fleet.json``, the restart policy and the handling of
    control requests. One lock serialises the monitor loop and control requests."""

    def __init__(self, spec: SupervisorSpec, fleet: OwnedFleet[Any]) -> None:
        self.spec = spec
        self.fleet = fleet
        self.started_at = time.time()
        self.lock = threading.Lock()
        self._refs: dict[tuple[str, int], ProcessRef] = {}
        self._written: tuple[Any, ...] | None = None
        # The restart policy's state, per task name.
        self._given_up: set[str] = set()
        # a scheduled restart: its monotonic time and the decision that allowed it
        self._due: dict[str, tuple[float, Decision]] = {}
        self._restart_at: dict[str, float] = {}  # ... the same as wall-clock time, for the record
        self._policies = {  # the clock is read through this module's `time` (tests replace it)
            t.name: RestartPolicy(
                spec.max_restarts,
                spec.restart_window_s,
                what=t.name,
                min_uptime_s=0.0,
                clock=lambda: time.monotonic(),
            )
            for t in fleet.tasks
        }

    def _snapshot(self) -> tuple[Any, ...]:
        return (
            tuple((t.pid, t.alive, t.exitcode, t.restarts) for t in self.fleet.tasks),
            tuple(sorted(self._given_up)),
            tuple(sorted(self._restart_at.items())),
        )

    def _ref(self, job: str, index: int, pid: int, alive: bool) -> ProcessRef:
        """The pid with the start time it had when first seen alive: a dead task's pid, reused
        by another process, must not be recorded with that process's start time."""
        ref = self._refs.get((job, index))
        if ref is None or ref.pid != pid:
            try:
                ref = ProcessRef.of(pid) if alive else ProcessRef(pid, 0.0)
            except ProcessLookupError:
                ref = ProcessRef(pid, 0.0)  # already gone: recorded, and seen as not alive
            self._refs[(job, index)] = ref
        return ref

    def _real_cluster(self) -> dict[str, Any] | None:
        """TLS mode: the tasks' real addresses (the fleet's ``cluster`` is the aliases)."""
        real = getattr(self.fleet, "real_cluster", None) if self.spec.tls else None
        return real.as_dict() if real is not None else None

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
                    ref.started,
                    t.log_path or "",
                    t.restarts,
                    exitcode,
                    gave_up=t.name in self._given_up,
                    restart_at=self._restart_at.get(t.name),
                )
            )
        return FleetRecord(
            supervisor=ProcessRef.of(os.getpid()),
            cluster=self.fleet.cluster.as_dict(),
            real_cluster=self._real_cluster(),
            tasks=tasks,
            started_at=self.started_at,
            restart_policy=self.spec.restart,
            start_timeout_s=self.spec.start_timeout,
            max_restarts=self.spec.max_restarts,
            restart_window_s=self.spec.restart_window_s,
        )

    def save(self) -> None:
        self._written = self._snapshot()
        write_state(self.spec.state_dir, self.record())

    def next_wait(self) -> float:
        """Seconds until the monitor should look again: the next scheduled restart, at most
        :data:`MONITOR_INTERVAL_S`."""
        due = [at for at, _ in self._due.values()]
        if not due:
            return MONITOR_INTERVAL_S
        return min(MONITOR_INTERVAL_S, max(0.01, min(due) - time.monotonic()))

    def tick(self) -> None:
        """One pass of the monitor: schedule or do restarts (if asked to), record any change."""
        with self.lock:
            if self.spec.restart == "on-failure":
                self._restart_dead()
            if self._snapshot() != self._written:
                self.save()

    def _restart_dead(self) -> None:
        now = time.monotonic()
        for task in self.fleet.dead_tasks():
            if task.name in self._given_up:
                continue
            due = self._due.get(task.name)
            if due is None:
                self._schedule(task, now)
            elif now >= due[0]:
                self._restart(task, due[1])

    def _schedule(self, task: TaskHandle, now: float) -> None:
        """A death just seen: the policy decides to give up or to restart after a back-off."""
        decision = self._policies[task.name].failed()
        died = f"{task.name} died ({dead_detail(task.exitcode)})"
        if not decision.restart:
            self._given_up.add(task.name)
            log.error("%s; %s; log %s", died, decision.words(), task.log_path)
            return
        self._due[task.name] = (now + decision.wait_s, decision)
        self._restart_at[task.name] = time.time() + decision.wait_s
        log.warning("%s; %s", died, decision.words())

    def _restart(self, task: TaskHandle, decision: Decision) -> None:
        """Do a scheduled restart; a failed one is a death like any other (the next tick
        schedules the next attempt, with a longer backoff)."""
        self._due.pop(task.name, None)
        self._restart_at.pop(task.name, None)
        self._policies[task.name].restarted(decision)
        log.warning("%s: restarting it (restart %d in all)", task.name, task.restarts + 1)
        try:
            self.fleet.restart(task.job, task.index)
        except GraphdistError as exc:
            log.error("restart of %s failed: %s", task.name, exc)
            if not task.alive:
                self._schedule(task, time.monotonic())
        else:
            log.info("%s restarted (pid %s)", task.name, task.pid)
        self.save()

    def _forget(self, name: str) -> None:
        """A restart asked for by hand: the policy's give-up, schedule and backoff start over."""
        self._given_up.discard(name)
        self._due.pop(name, None)
        self._restart_at.pop(name, None)
        self._policies[name].reset()

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        """Answer one control request (see ``graphdist._detached.control``)."""
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
                    task = self.fleet.task(job, index)
                    self._forget(task.name)
                    self.fleet.restart(job, index)
            finally:
                self.save()
        return {"ok": True}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m graphdist._detached.supervisor SPEC_JSON", file=sys.stderr)
        return 2
    try:
        spec = SupervisorSpec.from_json(args[0])
    except (ValueError, TypeError) as exc:
        print(f"graphdist-supervisor: bad spec: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # Normally set by whoever started us (see detached.start_detached); the fork server and the
    # servers inherit it from here.
    os.environ[MARK_ENV] = fleet_mark(spec.state_dir)

    stop = stop_on_signals()
    state_dir = spec.state_dir
    try:
        owned = spec.fleet()
        # A detached fleet keeps its size: a spare for each of its servers is what a restart
        # (even of all of them) takes, where the default pool, made for notebooks that start
        # fleets of any size, keeps 8 (each a TensorFlow process). GRAPHDIST_SPARES, if set, wins.
        os.environ.setdefault(SPARES_ENV, str(backend(spec.backend).task_count(spec.cluster)))
        fleet = owned.start()
    except GraphdistError as exc:
        write_error(state_dir, exc)
        return 1
    except Exception as exc:  # an unexpected failure must still reach the waiting CLI
        write_error(state_dir, exc)
        raise
    supervisor = _Supervisor(spec, fleet)
    control = ControlServer(state_dir, supervisor.handle)
    try:
        try:
            control.start()
        except OSError as exc:
            error = StateError(f"Cannot serve {control.path}: {exc.strerror or exc}", state_dir)
            write_error(state_dir, error)
            return 1
        supervisor.save()
        log.info(
            "fleet ready: %r (restart policy %s, at most %d restarts per task within %g s)",
            fleet,
            spec.restart,
            spec.max_restarts,
            spec.restart_window_s,
        )
        while not stop.wait(supervisor.next_wait()):
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
