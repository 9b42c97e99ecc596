"""The process's one watchdog over the runs of guarded sessions (see
:mod:`graphdist._fleet.guard`, whose :class:`~graphdist._fleet.guard.SessionGuard` registers each
run with it): one thread that looks at the tasks of every run in flight for a tick or more, probes
a long run's tasks over gRPC, cancels a run whose task is gone or not answering (it closes the
session from another thread), and, from a guard's first run in the main thread on, reads the
process's signal wakeup fd so that Ctrl-C cancels the step it stops."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from graphdist._exceptions import TaskFailedError
from graphdist._failures import NOT_ANSWERING
from graphdist._fleet.health import probe_all
from graphdist._fleet.task import TaskHandle
from graphdist._net.probe import RUN_PROBE_TIMEOUT_S

__all__ = [
    "CHECK_INTERVAL_S",
    "IDLE_AFTER_S",
    "MISSES_BEFORE_FROZEN",
    "PROBE_INTERVAL_S",
    "WATCHDOG",
    "WatchedGuard",
    "release_signals",
]

CHECK_INTERVAL_S = 0.1
"""Seconds between two looks of the watchdog at the processes of the tasks of runs in flight
(only runs at least this old are looked at: a short step is never touched)."""
PROBE_INTERVAL_S = 2.0
"""How often, in seconds, the watchdog asks a long run's tasks over gRPC whether they answer."""
MISSES_BEFORE_FROZEN = 3
"""Probes in a row a task may miss before a run gives up on it as ``not answering`` (three
probes, 2 s apart: reported in about 6.5 s here)."""
IDLE_AFTER_S = 10.0
"""Seconds without a run after which the watchdog stops ticking and sleeps until the next run
(a loop of short steps never pays for waking it)."""


class WatchedFleet(Protocol):
    """What the watchdog reads of a guarded session's fleet."""

    @property
    def _epoch(self) -> int: ...
    def _status(self, task: Any, answered: bool, error: str = "") -> tuple[str, str]: ...


class WatchedGuard(Protocol):
    """What the watchdog reads and marks of a session's guard (a
    :class:`~graphdist._fleet.guard.SessionGuard`)."""

    allowed: list[TaskHandle]
    broken: TaskFailedError | None
    interrupted: float | None
    sess: Callable[[], Any]
    _inflight: dict[int, float]
    _cancelled: dict[int, tuple[float, bool]]
    _checked: list[TaskHandle] | None
    _epoch: int

    @property
    def fleet(self) -> WatchedFleet: ...
    def fleet_closing(self) -> bool: ...
    def _gone(self, tasks: Iterable[TaskHandle]) -> TaskFailedError | None: ...
    def _failed(self, task: TaskHandle, status: str, detail: str) -> TaskFailedError: ...


class _Run:
    """What the watchdog knows of one run it found in flight for a tick or more."""

    __slots__ = ("cancelled", "epoch", "misses", "next_probe", "probing")

    def __init__(self, started: float, epoch: int) -> None:
        self.epoch = epoch
        self.next_probe = started + PROBE_INTERVAL_S
        self.misses: dict[tuple[str, int], int] = {}
        self.probing = False
        self.cancelled = False


class _Watchdog:
    """The one thread per process that watches every guarded run in flight (see the module
    docstring). A run costs its caller two dict operations: the caller writes
    ``guard._inflight[thread id] = start time`` and deletes it afterwards; the watchdog reads
    those, ticking every :data:`CHECK_INTERVAL_S` while runs happen, and sleeps after
    :data:`IDLE_AFTER_S` without one. A run younger than one tick is never touched."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.guards: weakref.WeakSet[WatchedGuard] = weakref.WeakSet()
        self._runs: dict[tuple[int, int, float], _Run] = {}  # (guard id, thread, start) -> run
        self._wake = threading.Event()
        self.idle = True
        self._thread: threading.Thread | None = None
        self._pipe: tuple[int, int] | None = None  # signal wakeup fd: (read end, write end)
        self._forward = -1  # the wakeup fd ours replaced: it gets every byte too
        self.main_thread: int = threading.main_thread().ident or 0
        self.wakeup_installed = False  # by a guard's first run in the main thread

    def wake(self) -> None:
        """Start ticking (a run began while the watchdog slept)."""
        with self._lock:
            if not self.idle:
                return
            self.idle = False
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="graphdist-watchdog", daemon=True
                )
                self._thread.start()
            self._wake.set()

    # -- the signal wakeup fd (main thread only) ------------------------------------------------

    def install_wakeup_fd(self) -> None:
        """Have Python write every signal's number to the watchdog's pipe (from now on, until
        :meth:`release_wakeup_fd`); the wakeup fd that was set before gets every byte too."""
        if self._pipe is None:
            self._pipe = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            previous = signal.set_wakeup_fd(self._pipe[1], warn_on_full_buffer=False)
        except ValueError:  # not the main interpreter's main thread
            return
        if previous != self._pipe[1]:
            self._forward = previous

    def release_wakeup_fd(self) -> None:
        """Put back the wakeup fd ours replaced (main thread only; no fleet runs any more)."""
        if self._pipe is None or threading.current_thread() is not threading.main_thread():
            return
        with contextlib.suppress(ValueError):
            current = signal.set_wakeup_fd(self._forward)
            if current != self._pipe[1]:  # someone replaced ours since: leave theirs
                signal.set_wakeup_fd(current)
            else:
                self._forward = -1
        self.wakeup_installed = False

    def _after_fork(self) -> None:
        # A forked child has the parent's memory but not its thread: start afresh.
        self.__init__()  # type: ignore[misc]

    # -- the watchdog's side --------------------------------------------------------------------

    def _loop(self) -> None:
        last_active = time.monotonic()
        while True:
            if not self._wake.is_set():
                self._wake.wait()
                last_active = time.monotonic()
            self._sleep(CHECK_INTERVAL_S)
            now = time.monotonic()
            if self._check_all(now):
                last_active = now
            elif now - last_active > IDLE_AFTER_S:
                with self._lock:
                    self.idle = True  # first: a run that starts now either is seen below
                    self._wake.clear()  # or finds idle set and wakes us
                if self._check_all(now):
                    self.wake()

    def _check_all(self, now: float) -> bool:
        """Check every run in flight for a tick or more; whether any run was in flight."""
        seen = False
        live: set[tuple[int, int, float]] = set()
        for guard in list(self.guards):
            for ident, started in list(guard._inflight.items()):
                seen = True
                if now - started < CHECK_INTERVAL_S:
                    continue
                key = (id(guard), ident, started)
                live.add(key)
                run = self._runs.get(key)
                if run is None:
                    run = self._runs[key] = _Run(started, guard._epoch)
                if not run.cancelled:
                    self._check(guard, ident, started, run, now)
        for key in [k for k in self._runs if k not in live]:
            del self._runs[key]  # over
        return seen

    def _sleep(self, seconds: float) -> None:
        pipe = self._pipe
        if pipe is None:
            time.sleep(seconds)
            return
        ready, _, _ = select.select([pipe[0]], [], [], seconds)
        if not ready:
            return
        try:
            data = os.read(pipe[0], 512)
        except OSError:
            return
        forward = self._forward
        if forward >= 0:
            with contextlib.suppress(OSError):
                os.write(forward, data)
        if signal.SIGINT in data and callable(signal.getsignal(signal.SIGINT)):
            # A Python handler (Python's own, graphdist's, Jupyter's) wants the main thread
            # interrupted, which cannot happen while it is inside TensorFlow: end its step.
            for guard in list(self.guards):
                started = guard._inflight.get(self.main_thread)
                if started is not None:
                    self.cancel(guard, self.main_thread, started, None)

    def _check(
        self, guard: WatchedGuard, ident: int, started: float, run: _Run, now: float
    ) -> None:
        if guard.fleet_closing():
            return  # the fleet closes its sessions itself
        needed = guard._checked or guard.allowed
        epoch = guard.fleet._epoch
        if epoch != run.epoch:  # a task may have died or restarted: look
            run.epoch = epoch
            problem = guard._gone(needed)
            if problem is not None:
                self.cancel(guard, ident, started, problem)
                return
        if now >= run.next_probe and not run.probing:
            run.probing = True
            run.next_probe += PROBE_INTERVAL_S  # on schedule: a probe may take its timeout
            threading.Thread(
                target=self._probe,
                args=(guard, ident, started, run, needed),
                name="graphdist-probe",
                daemon=True,
            ).start()

    def _probe(
        self,
        guard: WatchedGuard,
        ident: int,
        started: float,
        run: _Run,
        tasks: list[TaskHandle],
    ) -> None:
        try:
            results = probe_all([t.address for t in tasks], RUN_PROBE_TIMEOUT_S, alive=True)
            for task, (answered, error) in zip(tasks, results, strict=True):
                key = (task.job, task.index)
                run.misses[key] = 0 if answered else run.misses.get(key, 0) + 1
                if run.misses[key] >= MISSES_BEFORE_FROZEN and not run.cancelled:
                    detail = f"{run.misses[key]} gRPC probes in a row unanswered, last: {error}"
                    run.cancelled = True
                    # dead or frozen by the fleet's rule over the process's facts, never by
                    # which news came first (graphdist._verdicts): a task whose process ended,
                    # or that the fleet is killing, misses its probes too
                    status, why = guard.fleet._status(task, False, error or "")
                    problem = guard._gone([task]) or guard._failed(
                        task, status, detail if status == NOT_ANSWERING else why
                    )
                    self.cancel(guard, ident, started, problem)
                    return
        finally:
            run.probing = False

    def cancel(
        self, guard: WatchedGuard, ident: int, started: float, problem: TaskFailedError | None
    ) -> None:
        """End the run of thread ``ident`` that began at ``started``: mark why (a task's
        ``problem``, else an interrupt), then close its session from another thread, which
        cancels the step inside TensorFlow. That thread holds the session until the close
        returns; the caller learns it was cancelled from ``guard._cancelled``."""
        sess = guard.sess()
        with self._lock:
            if sess is None or guard._inflight.get(ident) != started:
                return  # the step is over
            mark = guard._cancelled.get(ident)
            if mark is not None and mark[0] == started:
                return  # already cancelled
            run = self._runs.get((id(guard), ident, started))
            if run is not None:
                run.cancelled = True
            interrupt = problem is None and not guard.fleet_closing()
            if problem is not None:
                guard.broken = problem
            elif interrupt:
                guard.interrupted = time.time()
            guard._cancelled[ident] = (started, interrupt)
        threading.Thread(
            target=_close_quietly, args=(sess,), name="graphdist-cancel", daemon=True
        ).start()


def _close_quietly(sess: Any) -> None:
    """Close ``sess`` (cancels its running step inside TensorFlow); errors are moot now."""
    with contextlib.suppress(Exception):  # the caller gets the error that matters
        sess._close_quietly()


WATCHDOG = _Watchdog()
"""The process's one watchdog (its thread starts with the first guarded run)."""


def _reset_after_fork() -> None:
    WATCHDOG._after_fork()


os.register_at_fork(after_in_child=_reset_after_fork)


def release_signals() -> None:
    """Give back the signal wakeup fd (a fleet's close calls it once no fleet runs; only the
    main thread can)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if WATCHDOG.wakeup_installed:
        WATCHDOG.release_wakeup_fd()
