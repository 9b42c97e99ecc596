"""A run's own heartbeat: which of its tasks is frozen, found in seconds, without TensorFlow.

A task that exits is seen at once (its guard reports it), but a frozen one never exits: a worker
stopped by SIGSTOP (swapped out, a debugger's ``kill -STOP``), or hung in native code with the
whole process standing still (a cgroup freezer, a stuck NFS read in every thread). TensorFlow
finds such a MultiWorkerMirroredStrategy worker only by its coordination service's heartbeat (a
10 s timeout, checked once a second: 12 s here); a ParameterServerStrategy coordinator waits on a
frozen worker or ps task until the operation timeout. So the launcher watches its tasks itself,
two ways, on one thread (:class:`Heartbeat`), every :data:`PROBE_INTERVAL_S`:

- **stopped**: a process of the task in state ``T`` (stopped by a signal) in ``/proc/PID/stat``.
  The kernel shows it at once; a task stopped for ``timeout_s`` is frozen. (``t``, a debugger's
  tracing stop, is left alone: someone is looking at it; its server is not probed while it
  shows ``t``, so its silence does not count either.)
- **silent**: every MultiWorkerMirroredStrategy worker and ParameterServerStrategy task serves
  gRPC on its TF_CONFIG address from the moment its strategy is built, and answers the
  liveness call of :mod:`graphdist._net.probe` from gRPC's own threads in a millisecond, busy
  or not. (Not ``WorkerService/GetStatus``: TensorFlow answers that on the server's compute
  pool, so a worker whose pool threads all sat in kernels left it unanswered for seconds, and
  was killed as frozen: CI, 2026-12-06.) Once a task's server has answered once, a task whose server
  has not answered for ``timeout_s`` is frozen — if at least :data:`MISSES` probes sent to it in
  that time got no answer by their deadline (so a launcher that was itself descheduled for a
  while, and sent nothing, does not blame its tasks). A frozen process keeps its listening
  socket, so its calls time out; a refused one means nothing listens any more (the task's
  server has gone, a next program of the task is starting): the watch starts again from "never
  served". A task that never serves is watched only for being stopped.

``timeout_s`` is the run's ``heartbeat_timeout_s`` (:data:`HEARTBEAT_TIMEOUT_S` by default, at
least :data:`MIN_HEARTBEAT_TIMEOUT_S`, ``None``: off): a frozen task is found within about
``timeout_s`` + :data:`PROBE_INTERVAL_S`. The floor is TensorFlow's own: its tests run the
coordination service's heartbeat at 2 s, and 1 s was reported flaky.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from graphdist._exceptions import ArgumentError
from graphdist._proc.process import proc_stat
from graphdist._validate import show

__all__ = [
    "HEARTBEAT_TIMEOUT_S",
    "MIN_HEARTBEAT_TIMEOUT_S",
    "MISSES",
    "PROBE_INTERVAL_S",
    "Heartbeat",
    "check_heartbeat_timeout",
    "process_state",
]

HEARTBEAT_TIMEOUT_S = 3.0
"""Seconds a task may stay stopped, or its server silent, before the run calls it frozen."""
MIN_HEARTBEAT_TIMEOUT_S = 2.0
"""The shortest heartbeat timeout a run takes (TensorFlow's tests use 2 s; 1 s is flaky)."""
PROBE_INTERVAL_S = 0.5
"""Seconds between two looks at every task (its processes' states, a probe of its server)."""
MISSES = 2
"""Probes that must have gone unanswered, within the timeout, before a silent task is frozen."""


def check_heartbeat_timeout(value: object) -> float | None:
    """``value`` (seconds, or ``None``: no heartbeat) checked: a finite number of seconds at
    least :data:`MIN_HEARTBEAT_TIMEOUT_S`, else ArgumentError naming the value and the floor."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ArgumentError(
            f"heartbeat_timeout_s must be a finite number of seconds (or None: off), not "
            f"{show(value)}",
            name="heartbeat_timeout_s",
            value=value,
        )
    if value < MIN_HEARTBEAT_TIMEOUT_S:
        raise ArgumentError(
            f"heartbeat_timeout_s must be at least {MIN_HEARTBEAT_TIMEOUT_S:g} s, not "
            f"{show(value)}: a shorter heartbeat takes a busy task for a frozen one (TensorFlow's "
            "own floor; 1 s was reported flaky)",
            name="heartbeat_timeout_s",
            value=value,
        )
    return float(value)


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` in ``/proc/PID/stat`` (``R``, ``S``, ``T`` ...), None once
    it is gone."""
    stat = proc_stat(pid)
    return None if stat is None else stat.state


@dataclass
class _Watched:
    name: str
    address: str | None
    pids: Callable[[], Sequence[int] | None]
    stopped_since: float | None = None
    answered_at: float | None = None  # the last answer of its server; None: never served
    misses: list[float] = field(default_factory=list)  # when unanswered probes expired
    prober: Any = None
    inflight: Any = None  # the probe in flight
    frozen: str | None = None  # why it is frozen, once it is


class Heartbeat:
    """Watches tasks (:meth:`watch`) from one thread until :meth:`close`; :meth:`frozen` says
    which are frozen and why. ``timeout_s`` as in the module docstring; ``clock`` is
    ``time.monotonic`` (tests give their own and call :meth:`check` themselves)."""

    def __init__(
        self,
        timeout_s: float,
        *,
        interval_s: float = PROBE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        thread: bool = True,
    ) -> None:
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._tasks: dict[str, _Watched] = {}
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        if thread:
            self._thread = threading.Thread(
                target=self._loop, daemon=True, name="graphdist-heartbeat"
            )
            self._thread.start()

    def watch(
        self, name: str, address: str | None, pids: Callable[[], Sequence[int] | None]
    ) -> None:
        """Watch task ``name``: ``pids()`` lists its live processes (None: they cannot be
        seen from here, a task on another machine: its server alone tells), ``address`` (or
        None) is where its server answers once it serves. Watching a name again starts
        afresh (a server restarted on its address)."""
        with self._lock:
            old = self._tasks.pop(name, None)
            self._tasks[name] = _Watched(name, address, pids)
        if old is not None:
            self._drop(old)

    def unwatch(self, name: str) -> None:
        with self._lock:
            old = self._tasks.pop(name, None)
        if old is not None:
            self._drop(old)

    def frozen(self) -> dict[str, str]:
        """``{task: why}`` for every watched task found frozen (``why``: ``stopped (state T)
        for 3.0 s``, ``its server at ADDRESS did not answer for 3.0 s``)."""
        with self._lock:
            return {t.name: t.frozen for t in self._tasks.values() if t.frozen is not None}

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(self.interval_s * 4 + 2.0)
        with self._lock:
            tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            self._drop(task)

    def __enter__(self) -> Heartbeat:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the looks ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._closed.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # a look that failed is the next look's to make: never die
                continue

    def check(self) -> None:
        """One look at every watched task (what the thread does every interval)."""
        with self._lock:
            tasks = list(self._tasks.values())
        for task in tasks:
            if task.frozen is None:
                self._look(task, self._clock())

    def _look(self, task: _Watched, now: float) -> None:
        pids = task.pids()
        states = [] if pids is None else [process_state(pid) for pid in pids]
        # ``t``: a debugger's tracing stop (``gdb -p``, a breakpoint), never a freeze; its
        # server is as silent as a stopped one's, so it is not probed either
        traced = "t" in states
        stopped = not traced and "T" in states
        if not stopped:
            task.stopped_since = None
        elif task.stopped_since is None:
            task.stopped_since = now
        elif now - task.stopped_since >= self.timeout_s:
            task.frozen = f"stopped (state T) for {now - task.stopped_since:.1f} s"
        if stopped or traced:  # its state tells, and says why: its server's silence would say
            # less; once it runs again, its silence counts from then (a short stop is no freeze)
            if task.answered_at is not None:
                task.answered_at, task.misses = now, []
            if task.inflight is not None:
                task.inflight.cancel()
                task.inflight = None
            return
        if task.address is not None and (pids is None or pids):  # not a task that has ended
            self._probe(task, task.address, now)

    def _probe(self, task: _Watched, address: str, now: float) -> None:
        if task.inflight is not None:
            if not task.inflight.done():
                return
            answered = task.prober._outcome(task.inflight)
            task.inflight = None
            if answered:
                task.answered_at, task.misses = now, []
            elif not (task.prober.last_error or "").startswith("DEADLINE_EXCEEDED"):
                # refused, reset: nothing listens (the server is gone, or another program of
                # the task starts next, as in `sh -c 'python a.py; python b.py'`): not frozen,
                # which holds its socket and leaves every call unanswered
                task.answered_at, task.misses = None, []
            elif task.answered_at is not None:
                task.misses.append(now)
        if task.answered_at is not None:
            silent = now - task.answered_at
            recent = [t for t in task.misses if now - t <= self.timeout_s]
            task.misses = recent
            if silent >= self.timeout_s and len(recent) >= MISSES:
                task.frozen = f"its server at {address} did not answer for {silent:.1f} s"
                return
        if task.prober is None:
            from graphdist._net.probe import Prober

            task.prober = Prober(address, alive=True)
        # a deadline under the timeout, so that MISSES of them fit in it
        deadline = max(self.interval_s, self.timeout_s / (MISSES + 1))
        task.inflight = task.prober._call.future(b"", timeout=deadline)

    @staticmethod
    def _drop(task: _Watched) -> None:
        if task.inflight is not None:
            with contextlib.suppress(Exception):
                task.inflight.cancel()
        if task.prober is not None:
            with contextlib.suppress(Exception):
                task.prober.close()
