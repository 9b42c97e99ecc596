"""The lifecycle of a fleet that owns its servers: :class:`OwnedFleet`.

::

    CREATED --start()--> STARTING --all answer--> RUNNING --close()--> CLOSING --> CLOSED
                         STARTING --a task fails: stop what started--> FAILED --close()--> CLOSED

``start()`` and ``close()`` are idempotent where that is meaningful (``close()`` any number of
times; ``start()`` once), a failed start stops every task it started and re-raises, a fleet left
running when it is garbage-collected warns with ``ResourceWarning`` and is closed, and an
``atexit`` sweep closes every fleet this process still runs (dask's ``SpecCluster`` lifecycle).
What using the fleet offers is the :class:`~graphdist._fleet.client.Fleet` client's.

A backend (:mod:`graphdist._fleet.backends` declares the contract and registers backends by
name) supplies the primitives: ``_launch()`` (create the task handles and start every task),
``_wait_ready(tasks, timeout_s)``, ``_stop_tasks(tasks, grace_s)``, ``_kill_task(task, sig)``,
``_restart_task(task)``, ``_teardown()`` and ``_listening(task)`` (the task's listening sockets):
once tasks answer, the lifecycle checks where each really listens
(:mod:`graphdist._net.exposure`) and refuses a server on a wildcard or foreign address unless
the fleet was exposed.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from graphdist._exceptions import (
    ExposedServerError,
    FleetError,
    FleetStartError,
    StartTimeoutError,
)
from graphdist._fleet.client import Fleet, FleetState, TaskT
from graphdist._fleet.watchdog import release_signals
from graphdist._net.exposure import ListeningTable, check_listening
from graphdist._net.probe import wait_answering
from graphdist._proc.process import STOP_GRACE_S
from graphdist._validate import flag
from graphdist._validate import timeout_s as check_timeout_s

if TYPE_CHECKING:
    from graphdist._proc.signals import SignalScope

__all__ = ["OwnedFleet"]

log = logging.getLogger("graphdist.fleet")
_FleetT = TypeVar("_FleetT", bound="OwnedFleet[Any]")  # typing.Self needs Python 3.11
_live_fleets: weakref.WeakSet[OwnedFleet[Any]] = weakref.WeakSet()


class OwnedFleet(Fleet[TaskT]):
    """A fleet that starts and stops its own servers (see the module docstring); a backend
    derives from it and supplies the primitives. Not used directly."""

    expose: bool = False
    tls_dir: str | None = None
    """TLS mode: the folder of the fleet's own credentials (made at start); else ``None``."""
    _owner_pid: int = -1

    COMMAND_ARGS: ClassVar[tuple[str, ...]] = (
        "start_timeout_s",
        "expose",
        "log_dir",
        "allow",
        "tls",
        "tls_dir",
    )
    """Which of :meth:`for_command`'s arguments the backend's constructor takes (one it has no
    use for is left out: a Slurm fleet is always exposed, a Ray actor's output is Ray's)."""

    @classmethod
    def for_command(
        cls: type[_FleetT],
        cluster: Any,
        *,
        start_timeout_s: float | None,
        expose: bool,
        log_dir: str | None = None,
        allow: Sequence[str] | None = None,
        tls: bool = False,
        tls_dir: str | None = None,
        **options: Any,
    ) -> _FleetT:
        """A fleet (not started) from command-line options (the backend contract's, in
        :mod:`graphdist._fleet.backends`); ``options`` are only the backend's own."""
        given = {
            "start_timeout_s": start_timeout_s,
            "expose": expose,
            "log_dir": log_dir,
            "allow": allow,
            "tls": tls,
            "tls_dir": tls_dir,
        }
        make: Any = cls  # a backend's own constructor (this base class's takes nothing)
        fleet: _FleetT = make(
            cluster, **{k: v for k, v in given.items() if k in cls.COMMAND_ARGS}, **options
        )
        return fleet

    def __init__(self) -> None:
        super().__init__()
        self._owner_pid = os.getpid()

    @property
    def tls_client(self) -> str | None:
        """TLS mode: the client's credentials folder (for ``graphdist.connect(fleet.real_cluster,
        tls=...)`` from another machine); ``None`` otherwise, or before start."""
        if self.tls_dir is None:
            return None
        return os.path.join(self.tls_dir, "credentials", "client")

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self: _FleetT) -> _FleetT:
        """Start every task and wait until each answers over gRPC; returns ``self``. A failed start
        stops whatever did start and re-raises (``state`` is then ``FAILED``)."""
        if self.state is not FleetState.CREATED:
            raise FleetError(f"This fleet was already started (state {self.state.value})")
        # a backend checks it when it is built; again here, before anything starts, for one set
        # afterwards (fleet.expose = "no" would expose the servers if read by truthiness)
        flag(self.expose, "expose")
        self._state = FleetState.STARTING
        _live_fleets.add(self)
        try:
            self._launch()
            _exit_sweep_runs_first()  # the backend's imports may have registered exit hooks
            self._ready(list(self._tasks.values()), self.start_timeout_s)
        except BaseException:
            self._state = FleetState.FAILED
            self._shutdown(STOP_GRACE_S)
            raise
        self._state = FleetState.RUNNING
        self._on_running()
        return self

    def start_within(self: _FleetT, signals: SignalScope) -> _FleetT:
        """:meth:`start` as a run's attempt starts its servers: a stop signal interrupts it,
        and its wait for the servers ends by the run's deadline; a failed or interrupted start
        closes the fleet before the error goes on."""
        self.start_timeout_s = signals.budget(self.start_timeout_s)
        try:
            with signals.interruptible():
                self.start()
        except BaseException:
            self.close()
            raise
        return self

    def close(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop every task (SIGTERM, up to ``grace_s`` seconds, then SIGKILL, where the backend
        has processes) and release what the fleet holds. Safe to call any number of times."""
        grace_s = check_timeout_s(grace_s, "grace_s", STOP_GRACE_S)
        if self.state in (FleetState.CLOSED, FleetState.CLOSING):
            return
        if self.state in (FleetState.CREATED, FleetState.FAILED):
            self._state = FleetState.CLOSED  # nothing runs: a failed start cleaned up already
            return
        self._state = FleetState.CLOSING
        self._changed()
        try:
            self._close_sessions()
            self._shutdown(grace_s)
        finally:
            self._state = FleetState.CLOSED
            if not _live_fleets:
                release_signals()  # no fleet session runs any more (see guard.py)

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

    def _bring_back(self, task: TaskT) -> None:
        self._restart_task(task)
        try:
            self._ready([task], self.start_timeout_s)
        except ExposedServerError:
            self._kill_task(task, signal.SIGKILL)
            raise

    def _ready(self, tasks: list[TaskT], timeout_s: float) -> None:
        """Wait until ``tasks`` answer, then check that each listens only where it may (see
        :mod:`graphdist._net.exposure`): a server on a wildcard or foreign address, or one
        whose sockets cannot be read, raises :class:`ExposedServerError`."""
        self._wait_ready(list(tasks), timeout_s)  # a backend may consume its list
        table = ListeningTable()  # read after every task answered: their sockets are in it
        for task in tasks:
            self._check_listening(task, self._allowed_addresses(task), table)

    def _wait_answering(
        self,
        tasks: list[TaskT],
        timeout_s: float,
        *,
        each_round: Callable[[list[int]], None] | None = None,
        may_answer: Callable[[int], bool] | None = None,
        hints: Callable[[float], Iterable[int]] | None = None,
        budget_s: float | None = None,
    ) -> None:
        """Return once every task in ``tasks`` answers over gRPC (:func:`probe.wait_answering`,
        which takes ``each_round``, ``may_answer`` and ``hints``), else raise StartTimeoutError
        naming the first still silent, with the count of those that answered; ``budget_s`` is
        the whole start timeout the message names (default: ``timeout_s``), where part of it was
        spent before."""
        silent = wait_answering(
            [t.address for t in tasks],
            timeout_s,
            each_round=each_round,
            may_answer=may_answer,
            hints=hints,
        )
        if silent is None:
            return
        task, budget_s = tasks[silent.index], timeout_s if budget_s is None else budget_s
        why = (
            f"last gRPC error: {silent.last_error}"
            if silent.last_error
            else "never probed: its process had not started yet"
        )
        raise StartTimeoutError(
            f"{silent.answered} of {len(tasks)} servers answered within {budget_s:g} s; "
            f"{task.name} at {task.address} did not ({why}); raise "
            "start_timeout_s if the machine is slow",
            ready=silent.answered,
            expected=len(tasks),
            timeout_s=budget_s,
            task=f"{task.name}",
            address=task.address,
            log_tail=task.log_tail(),
        )

    # -- the backend's primitives -----------------------------------------------------------------

    def _launch(self) -> None:
        """Create the task handles in ``self._tasks`` and start every task (not waiting)."""
        raise NotImplementedError

    def _wait_ready(self, tasks: list[TaskT], timeout_s: float) -> None:
        """Return once every task in ``tasks`` answers over gRPC; else raise a FleetStartError
        naming the first that failed, with the true count of those that did answer."""
        raise NotImplementedError

    def _stop_tasks(self, tasks: list[TaskT], grace_s: float) -> None:
        raise NotImplementedError

    def _kill_task(self, task: TaskT, sig: int) -> None:
        raise NotImplementedError

    def _restart_task(self, task: TaskT) -> None:
        """Bring ``task`` back on its address (kill it first if it runs); count the restart."""
        raise NotImplementedError

    def _allowed_addresses(self, task: TaskT) -> frozenset[str] | None:
        """The non-loopback addresses ``task``'s server may listen on; ``None``: anywhere
        (``expose=True``). Default: loopback only, unless exposed."""
        return None if self.expose else frozenset()

    def _check_listening(
        self, task: TaskT, allowed: frozenset[str] | None, table: ListeningTable | None = None
    ) -> None:
        """Raise ExposedServerError unless ``task``'s process listens only on loopback or
        ``allowed`` (``None``: anywhere), and FleetStartError unless it is the process that
        listens on the task's port: an answer from another process (a second name for an
        address another task has) is no proof of this one (default: its sockets as the OS
        lists them for its pid, in ``table``, one reading for the whole fleet)."""
        name = f"{task.name}"
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
