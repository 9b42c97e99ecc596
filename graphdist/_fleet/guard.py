"""Fast failure for a fleet's sessions: a run ends as soon as the fleet knows a task it needs is
gone, not when TensorFlow's operation timeout runs out; and Ctrl-C cancels the step it stops.

TensorFlow alone learns of a dead or frozen peer late: a new session whose master must reach a
dead task, a transfer from a task killed mid-run, or a frozen (SIGSTOP) task wait out
``operation_timeout_in_ms``. The fleet knows better — it owns the processes — so every session a
fleet opens carries a :class:`SessionGuard`:

- **Before a run**, the devices of the ops added to the session's graph since its last run
  are checked against the fleet's cluster (:func:`graphdist._graph.placement.check_ops`:
  however they were written, a device no task has raises :class:`PlacementError` naming the
  op before TensorFlow sees the step; a step with no new op pays one int compare). Then the
  tasks the run needs (the master, and every task a device in the graph
  names; on a session's first run every task its ``device_filters`` allow, since the master
  contacts them all when it creates the session) are checked: one that is dead, or restarted
  since the session opened (its server lost this session's state), fails the run at once with
  :class:`TaskFailedError` naming it. A session of a closed fleet raises
  :class:`FleetClosedError`, one whose step was interrupted :class:`SessionInterruptedError`.
- **During a run**, TensorFlow's call runs in the caller's own thread (no hand-off: a step costs
  what it costs in TensorFlow, plus a few microseconds) and is registered with the process's one
  watchdog thread (:mod:`graphdist._fleet.watchdog`). For a run older than
  :data:`CHECK_INTERVAL_S` the watchdog looks at the tasks' processes every tick: a death or
  restart is seen within two ticks; a task that stops answering gRPC (frozen: stopped, or hung
  whole) is declared ``not answering`` after
  :data:`MISSES_BEFORE_FROZEN` probes in a row, :data:`PROBE_INTERVAL_S` apart (liveness calls,
  which gRPC answers however busy TensorFlow's compute pool is: a task whose kernels never end
  is busy, and its run ends at the operation timeout). It then marks
  the session broken and closes it from another thread, which cancels the step inside
  TensorFlow (``run`` returns within milliseconds, TF_FACTS), and the caller gets the
  :class:`TaskFailedError`.
- **Ctrl-C** (SIGINT, also Jupyter's "interrupt kernel") during a run in the main thread: Python
  only runs a signal handler once TensorFlow's C++ call returns, so from the first main-thread
  run on the process's :func:`signal.set_wakeup_fd` is the watchdog's pipe (any previous wakeup
  fd still gets every byte), and the watchdog cancels the step the same way when SIGINT has a
  Python handler. ``KeyboardInterrupt`` arrives at once, the step consumed nothing after it, and
  the session is closed (the only way TensorFlow cancels a step): its later runs raise
  :class:`SessionInterruptedError`; open a new one.
- **A broken session** refuses further runs with the same error, and closing it returns at once:
  it is abandoned (marked closed, no RPC to a task that cannot answer; TensorFlow would retry
  it until the operation timeout), and its native session is freed when it is collected.

Limit: a frozen *master* cannot be cancelled that way (closing asks the master itself); its run
ends at the operation timeout. The operation timeout stays as the last resort (a fleet's default
is :data:`FLEET_OPERATION_TIMEOUT_MS`, ten minutes, so healthy long steps run).
"""

from __future__ import annotations

import _thread
import logging
import queue
import re
import threading
import time
import weakref
from _thread import get_ident
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from graphdist._cluster import Cluster
from graphdist._exceptions import (
    FleetClosedError,
    FleetError,
    SessionInterruptedError,
    TaskFailedError,
    copy_error,
)
from graphdist._failures import DEAD, task_failed
from graphdist._fleet.health import problem_of
from graphdist._fleet.task import TaskHandle
from graphdist._fleet.watchdog import (
    CHECK_INTERVAL_S,
    MISSES_BEFORE_FROZEN,
    PROBE_INTERVAL_S,
    WATCHDOG,
)
from graphdist._graph.placement import check_ops
from graphdist._graph.session import TASK_FAILURE_ERRORS
from graphdist._net.probe import RUN_PROBE_TIMEOUT_S

__all__ = [
    "CHECK_INTERVAL_S",
    "FLEET_OPERATION_TIMEOUT_MS",
    "MISSES_BEFORE_FROZEN",
    "PROBE_INTERVAL_S",
    "RUN_PROBE_TIMEOUT_S",
    "SessionGuard",
]

log = logging.getLogger("graphdist.session")


class GuardedFleet(Protocol):
    """What a guard reads of its session's fleet (a :class:`graphdist.Fleet`)."""

    @property
    def tasks(self) -> tuple[TaskHandle, ...]: ...
    @property
    def cluster(self) -> Cluster: ...
    @property
    def _epoch(self) -> int: ...
    @property
    def _sessions_closed(self) -> bool: ...
    def _status(self, task: Any, answered: bool, error: str = "") -> tuple[str, str]: ...
    def _diagnose(self, exc: BaseException, timeout_ms: int) -> FleetError | None: ...
    def _explain(self, task: Any, status: str, detail: str) -> tuple[str, str]: ...
    def _task_gpus(self) -> dict[tuple[str, int], int] | None: ...


FLEET_OPERATION_TIMEOUT_MS = 600_000
"""A fleet session's default operation timeout: the last resort, since the guard finds dead,
restarted and frozen tasks within seconds; long enough for healthy long steps."""
LONG_STEP_S = 0.1
"""A session whose step took longer than this, in seconds, hands its next steps to a helper
thread (costs ~0.1 ms a step, nothing beside such a step) until one is short again: a frozen
task can keep TensorFlow from cancelling a step, and a handed-off step leaves its caller free
anyway. Short steps run in the caller's thread. A session's first run is handed off."""
INTERRUPT_WAIT_S = 5.0
"""How long, in seconds, an interrupted handed-off step is waited for once it is cancelled."""
_JOB = re.compile(r"/job:([^/]+)")
_TASK = re.compile(r"/task:(\d+)")


class _Outcome:
    """What a handed-off call returned or raised; ``done`` is a bare lock, held until the call
    ends (cheaper to hand over than an Event)."""

    __slots__ = ("done", "error", "value")

    def __init__(self) -> None:
        self.done = _thread.allocate_lock()
        self.done.acquire()
        self.value: Any = None
        self.error: BaseException | None = None


class _Runner:
    """Daemon threads that run handed-off TensorFlow calls, reused between runs (a stuck call
    never keeps the interpreter from exiting)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], _Outcome]] = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, call: Callable[[], Any], outcome: _Outcome) -> None:
        """Run ``call()`` in a helper thread; its result or error goes to ``outcome``."""
        with self._lock:
            if self._idle == 0:
                threading.Thread(target=self._work, name="graphdist-run", daemon=True).start()
            else:
                self._idle -= 1
        self._jobs.put((call, outcome))

    def _work(self) -> None:
        while True:
            call, outcome = self._jobs.get()
            try:
                outcome.value = call()
            except BaseException as exc:  # handed to the caller
                outcome.error = exc
            # An idle thread keeps nothing alive: the call holds its session, which must be
            # collectable (e.g. at exit) as soon as the caller lets go of it.
            del call
            outcome.done.release()
            del outcome
            with self._lock:
                self._idle += 1


_runner = _Runner()


class SessionGuard:
    """The guard of one session of ``fleet`` whose master is ``master`` (see the module
    docstring). ``device_filters`` and ``soft_placement`` (``allow_soft_placement``: a GPU a
    task lacks is then placed on its CPU, so GPUs are not checked) are the session config's."""

    def __init__(
        self,
        fleet: GuardedFleet,
        master: TaskHandle,
        device_filters: Iterable[str] = (),
        *,
        soft_placement: bool = False,
    ) -> None:
        self.fleet = fleet
        self.master = master
        self.allowed = self._filtered(list(device_filters))
        self.soft_placement = soft_placement
        self.pids = {self._key(t): t.pid for t in fleet.tasks}
        self.restarts = {self._key(t): t.restarts for t in fleet.tasks}
        self.timeout_ms = 0
        self.broken: TaskFailedError | None = None
        self.interrupted: float | None = None  # time.time() of the interrupt that closed it
        self._ran = False
        self._version = -1  # the graph's version when its ops' devices were last looked at
        self._ops_seen = 0  # how many of its ops were looked at then (a graph only grows)
        self._devices: set[str] = set()  # every device its ops ask for, each one checked
        self._needs = [master]  # the master and every task a device in the graph names
        self._epoch = -1  # the fleet's _epoch when this session's tasks were last found fine
        self._checked: list[TaskHandle] | None = None  # the tasks checked then
        self.sess: Callable[[], Any] = lambda: None  # a weak reference, set by attach()
        self._hand_off = True  # the first run (it creates the session) may be long
        self._inflight: dict[int, float] = {}  # thread id -> start of its run in flight
        # thread id -> (start of its run that the watchdog cancelled, whether for an interrupt)
        self._cancelled: dict[int, tuple[float, bool]] = {}
        WATCHDOG.guards.add(self)

    def attach(self, sess: Any) -> None:
        """Guard ``sess`` (held weakly: the guard never keeps its session alive)."""
        self.sess = weakref.ref(sess)

    # -- which tasks a run needs -----------------------------------------------------------------

    @staticmethod
    def _key(task: TaskHandle) -> tuple[str, int]:
        return (task.job, task.index)

    def _filtered(self, filters: list[str]) -> list[TaskHandle]:
        tasks = list(self.fleet.tasks)
        if not filters:
            return tasks
        return [t for t in tasks if any(self._names(f, t) for f in filters)] or [self.master]

    @staticmethod
    def _names(device: str, task: TaskHandle) -> bool:
        job = _JOB.search(device)
        if job is None or job.group(1) != task.job:
            return False
        index = _TASK.search(device)
        return index is None or int(index.group(1)) == task.index

    def _needed(self, sess: Any) -> list[TaskHandle]:
        """The tasks this run needs, once the devices of the ops added to the session's graph
        since the last look are checked (raises :class:`PlacementError` for one the fleet
        lacks). A step with no new op pays one int compare."""
        graph = sess.graph
        if graph.version != self._version:
            self._look(graph)
        return self._needs if self._ran else self.allowed

    def _look(self, graph: Any) -> None:
        """Check the devices of ``graph``'s ops added since the last look; then mark them seen
        and, when they name new devices, find the tasks runs need again. An op on a device the
        fleet lacks stays unseen: every run raises the same error (TensorFlow places the whole
        graph, so every step would fail)."""
        version = graph.version
        ops = graph.get_operations()  # in creation order
        fresh: dict[str, str] = {}
        for op in ops[self._ops_seen :]:
            device = op.device
            if device and device not in self._devices and device not in fresh:
                fresh[device] = op.name
        if fresh:
            needs_gpus = not self.soft_placement and any("GPU" in d for d in fresh)
            gpus = self.fleet._task_gpus() if needs_gpus else None
            check_ops([(name, d) for d, name in fresh.items()], self.fleet.cluster, gpus=gpus)
            self._devices.update(fresh)
            self._needs = [self.master] + [
                t
                for t in self.fleet.tasks
                if t is not self.master and any(self._names(d, t) for d in self._devices)
            ]
        self._version, self._ops_seen = version, len(ops)

    # -- what is wrong, if anything --------------------------------------------------------------

    def _failed(self, task: TaskHandle, status: str, detail: str) -> TaskFailedError:
        status, detail = self.fleet._explain(task, status, detail)
        return task_failed(task, status, detail, timeout_ms=self.timeout_ms or None)

    def _gone(self, tasks: Iterable[TaskHandle]) -> TaskFailedError | None:
        """A needed task that died or was restarted since this session opened."""
        for task in tasks:
            key = self._key(task)
            found = problem_of(task, self.pids.get(key), self.restarts.get(key))
            if found is not None and found[0] == DEAD:  # how it ended, as the fleet knows it
                status, detail = self.fleet._status(task, False)
                found = (status, detail) if status == DEAD else found
            if found is not None:
                return self._failed(task, *found)
        return None

    def fleet_closing(self) -> bool:
        """Whether the fleet is closing or closed (a cheap flag, read on every watchdog tick)."""
        return self.fleet._sessions_closed

    def refusal(self) -> Exception | None:
        """Why this session cannot run any more, as the error to raise (None: it can)."""
        if self.fleet_closing():
            return FleetClosedError(
                f"The fleet of this session (master {self.master.name}) was "
                "closed, which closed its sessions; start a new fleet and open a session on it"
            )
        if self.broken is not None:
            return copy_error(self.broken)  # a fresh copy to raise: no old traceback
        if self.interrupted is not None:
            when = time.strftime("%H:%M:%S", time.localtime(self.interrupted))
            master = self.master
            return SessionInterruptedError(
                f"This session was closed at {when} to cancel the step that KeyboardInterrupt "
                "stopped (TensorFlow cancels a step only by closing its session; nothing of that "
                "step ran on after it); open a new one: "
                f"fleet.session({master.job!r}, {master.index})",
                master=master.name,
            )
        return None

    def diagnose(self, exc: BaseException, timeout_ms: int) -> Exception | None:
        """Which task made TensorFlow's error ``exc`` happen, as a TaskFailedError (or why the
        session was closed under the run: the fleet closed, an interrupt)."""
        self.timeout_ms = timeout_ms
        refused = self.refusal()
        if refused is not None:
            return refused
        found: Exception | None = self._gone(self.fleet.tasks)
        if found is None:
            found = self.fleet._diagnose(exc, timeout_ms)  # asks every task over gRPC
        if isinstance(found, TaskFailedError):
            self.broken = found
        return found

    def abandon_on_close(self, sess: Any) -> bool:
        """Whether closing must skip its RPC (it would wait out the operation timeout): the
        session is broken or a task it used is gone."""
        return self.broken is not None or self._gone(self.allowed) is not None

    # -- a run -----------------------------------------------------------------------------------

    def run(self, sess: Any, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``call(*args, **kwargs)`` (TensorFlow's run, a callable, ``make_callable``) in this
        thread, failing fast as the module docstring says. This is paid on every step: the
        common path is a few attribute reads and two dict operations."""
        if sess._closed or self.broken is not None or self.fleet._sessions_closed:
            refused = self.refusal()
            if refused is not None:
                raise refused
        needed = self._needed(sess)
        epoch = self.fleet._epoch
        if epoch != self._epoch or needed is not self._checked:
            # A task may have died or restarted since the last look (the fleet's watcher, kill
            # and restart change the epoch), or this run needs other tasks: look now.
            problem = self._gone(needed)
            if problem is not None:
                if not self.fleet_closing():
                    self.broken = problem
                raise self.refusal() or problem
            self._epoch, self._checked = epoch, needed
        ident = get_ident()
        if self._hand_off:
            return self._run_handed_off(sess, ident, call, args, kwargs)
        if ident == WATCHDOG.main_thread and not WATCHDOG.wakeup_installed:
            WATCHDOG.wakeup_installed = True
            WATCHDOG.install_wakeup_fd()
        inflight = self._inflight
        inflight[ident] = started = time.monotonic()
        if WATCHDOG.idle:
            WATCHDOG.wake()
        try:
            value = call(*args, **kwargs)
        except Exception as exc:
            mark = self._cancelled.pop(ident, None)
            cancelled = mark is not None and mark[0] == started
            if cancelled and mark is not None and mark[1]:
                # Interrupted: the step is cancelled. Python's own SIGINT handler may have
                # raised inside TensorFlow's building of the CancelledError, which pybind11
                # turns into "MISMATCH of original and normalized active exception types"; a
                # Jupyter kernel's handler raises nothing. Either way: KeyboardInterrupt.
                raise KeyboardInterrupt from None
            error = self._translate(exc, cancelled)
            if error is None:
                raise
            raise error from exc
        finally:
            inflight.pop(ident, None)
            if self._cancelled:  # a KeyboardInterrupt that Python raised itself, or a step
                self._cancelled.pop(ident, None)  # that ended before its cancel
            if time.monotonic() - started > LONG_STEP_S:
                self._hand_off = True  # this session's steps are long: hand them off
        self._ran = True
        return value

    def _run_handed_off(
        self,
        sess: Any,
        ident: int,
        call: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """``call`` in a helper thread while this one waits: a failure the watchdog finds ends
        the wait at once even when TensorFlow cannot cancel the step (a frozen task), and
        ``KeyboardInterrupt`` (raised in the wait) cancels the step and waits, up to
        :data:`INTERRUPT_WAIT_S`, until it is over."""
        outcome = _Outcome()
        inflight = self._inflight
        inflight[ident] = started = time.monotonic()
        if WATCHDOG.idle:
            WATCHDOG.wake()
        _runner.submit(lambda: call(*args, **kwargs), outcome)
        try:
            while not outcome.done.acquire(True, CHECK_INTERVAL_S):
                mark = self._cancelled.get(ident)
                if mark is None or mark[0] != started:
                    continue
                if mark[1]:  # interrupted under another SIGINT handler (a Jupyter kernel's)
                    raise KeyboardInterrupt
                refused = self.refusal()
                if refused is not None:
                    raise refused  # the step goes on until TensorFlow ends it
        except KeyboardInterrupt:
            WATCHDOG.cancel(self, ident, started, None)
            outcome.done.acquire(True, INTERRUPT_WAIT_S)  # the step is cancelled: over soon
            raise
        finally:
            inflight.pop(ident, None)
            mark = self._cancelled.pop(ident, None)
            cancelled = mark is not None and mark[0] == started
        if time.monotonic() - started <= LONG_STEP_S:
            self._hand_off = False  # short steps run in the caller's thread: no hand-off cost
        error = outcome.error
        if error is not None:
            translated = self._translate(error, cancelled) if isinstance(error, Exception) else None
            if translated is None:
                raise error
            raise translated from error
        self._ran = True
        return outcome.value

    def _translate(self, exc: Exception, cancelled: bool) -> Exception | None:
        """The graphdist error TensorFlow's ``exc`` stands for (None: ``exc`` as it is)."""
        import tensorflow as tf

        if not isinstance(exc, tf.errors.OpError):
            return None
        if cancelled:  # the watchdog or the fleet closed the session under the step
            return self.refusal()
        if type(exc).__name__ not in TASK_FAILURE_ERRORS:
            return None
        return self.diagnose(exc, self.timeout_ms)
