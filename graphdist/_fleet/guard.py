"""Fast failure for a fleet's sessions: a run ends as soon as the fleet knows a task it needs is
gone, not when TensorFlow's operation timeout runs out.

TensorFlow alone learns of a dead or frozen peer late: a new session whose master must reach a
dead task, a transfer from a task killed mid-run, a frozen (SIGSTOP) task or a killed master all
wait out ``operation_timeout_in_ms``. The fleet knows better — it owns the processes — so every
session a fleet opens carries a :class:`SessionGuard`:

- **Before a run**, the tasks the run needs (the master, and every task a device in the graph
  names; on a session's first run every task its ``device_filters`` allow, since the master
  contacts them all when it creates the session) are checked: one that is dead, or restarted
  since the session opened (its server lost this session's state), fails the run at once with
  :class:`TaskFailedError` naming it.
- **During a run**, TensorFlow's call runs in a helper thread while the caller watches those
  tasks: a death or restart is seen within :data:`CHECK_INTERVAL_S`; a task that stops answering
  gRPC (frozen, wedged) is declared ``not answering`` after :data:`MISSES_BEFORE_FROZEN` probes
  in a row, :data:`PROBE_INTERVAL_S` apart. The caller gets the error at once; the session is
  closed in the background, which cancels the step inside TensorFlow.
- **A broken session** (one that saw such a failure, or whose tasks died or restarted) refuses
  further runs with the same error, and :meth:`close` returns at once, finishing in the
  background instead of waiting for a task that cannot answer.

The operation timeout stays as the last resort (a fleet's default is
:data:`FLEET_OPERATION_TIMEOUT_MS`, ten minutes, so healthy long steps run).
"""

from __future__ import annotations

import _thread
import contextlib
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from graphdist._exceptions import TaskFailedError
from graphdist._fleet.health import DEAD, NOT_ANSWERING, probe_all

if TYPE_CHECKING:
    from graphdist._fleet.base import Fleet, TaskHandle

__all__ = [
    "CHECK_INTERVAL_S",
    "FLEET_OPERATION_TIMEOUT_MS",
    "MISSES_BEFORE_FROZEN",
    "PROBE_INTERVAL_S",
    "SessionGuard",
]

FLEET_OPERATION_TIMEOUT_MS = 600_000
"""A fleet session's default operation timeout: the last resort, since the guard finds dead,
restarted and frozen tasks within seconds; long enough for healthy long steps."""
CHECK_INTERVAL_S = 0.05
"""How often, at most, a waiting run looks at its tasks' processes (a fleet's
``watch_interval_s`` if longer: 0.1 s for the fleets here)."""
PROBE_INTERVAL_S = 2.0
"""How often a waiting run asks its tasks over gRPC whether they still answer."""
PROBE_TIMEOUT_S = 1.5
"""How long a probe waits for an answer: a busy task on a loaded machine still gives one, a
frozen task misses every probe (three probes, 2 s apart: reported in about 6.5 s here)."""
MISSES_BEFORE_FROZEN = 3
"""Probes in a row a task may miss before a run gives up on it as ``not answering``."""
_JOB = re.compile(r"/job:([^/]+)")
_TASK = re.compile(r"/task:(\d+)")


class _Outcome:
    """What a run's call returned or raised; ``done`` is a bare lock, held until the call ends
    (cheaper to hand over than an Event: this is paid on every step)."""

    __slots__ = ("done", "error", "value")

    def __init__(self) -> None:
        self.done = _thread.allocate_lock()
        self.done.acquire()
        self.value: Any = None
        self.error: BaseException | None = None


class _Runner:
    """Daemon threads that run TensorFlow calls for waiting callers, reused between runs (a
    stuck call never keeps the interpreter from exiting)."""

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
    docstring). ``device_filters`` are the session config's."""

    def __init__(
        self, fleet: Fleet[Any], master: TaskHandle, device_filters: Iterable[str] = ()
    ) -> None:
        self.fleet = fleet
        self.master = master
        self.allowed = self._filtered(list(device_filters))
        self.pids = {self._key(t): t.pid for t in fleet.tasks}
        self.restarts = {self._key(t): t.restarts for t in fleet.tasks}
        self.timeout_ms = 0
        self.broken: TaskFailedError | None = None
        self._ran = False
        self._needs: dict[tuple[int, int], list[TaskHandle]] = {}

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
        if not self._ran:
            return self.allowed
        graph = sess.graph
        key = (id(graph), graph.version)
        needed = self._needs.get(key)
        if needed is None:
            devices = {op.device for op in graph.get_operations() if op.device}
            needed = [self.master] + [
                t
                for t in self.fleet.tasks
                if t is not self.master and any(self._names(d, t) for d in devices)
            ]
            self._needs = {key: needed}
        return needed

    # -- what is wrong, if anything --------------------------------------------------------------

    def _failed(self, task: TaskHandle, status: str, detail: str) -> TaskFailedError:
        if status == DEAD:
            hint = (
                f"restart it with fleet.restart({task.job!r}, {task.index}) and open a new session"
            )
        elif status == "restarted":
            hint = "its server lost this session's state; open a new session"
        else:
            hint = "it may be frozen or overloaded"
        return TaskFailedError(
            f"Task {task.job}:{task.index} at {task.address} is {status} ({detail}); {hint}",
            task=f"{task.job}:{task.index}",
            address=task.address,
            status=status,
            timeout_ms=self.timeout_ms or None,
        )

    def _gone(self, tasks: Iterable[TaskHandle]) -> TaskFailedError | None:
        """A needed task that died or was restarted since this session opened."""
        for task in tasks:
            key = self._key(task)
            if not task.alive:
                return self._failed(task, DEAD, f"exit code {task.exitcode}")
            if task.restarts != self.restarts.get(key) or task.pid != self.pids.get(key):
                return self._failed(task, "restarted", f"now pid {task.pid}")
        return None

    def diagnose(self, exc: BaseException, timeout_ms: int) -> Exception | None:
        """Which task made TensorFlow's error ``exc`` happen, as a TaskFailedError."""
        self.timeout_ms = timeout_ms
        found: Exception | None = self.broken or self._gone(self.fleet.tasks)
        if found is None:
            found = self.fleet._diagnose(exc, timeout_ms)  # asks every task over gRPC
        if isinstance(found, TaskFailedError):
            self.broken = found
        return found

    def close_in_background(self, sess: Any) -> bool:
        """Whether closing must not wait: the session is broken or a task it used is gone."""
        return self.broken is not None or self._gone(self.allowed) is not None

    # -- a run -----------------------------------------------------------------------------------

    def _refuse(self, error: TaskFailedError) -> TaskFailedError:
        """Mark the session broken by ``error``; a fresh copy to raise (no old traceback)."""
        self.broken = error
        return TaskFailedError(
            str(error),
            task=error.task,
            address=error.address,
            status=error.status,
            timeout_ms=error.timeout_ms,
        )

    def run(self, sess: Any, call: Callable[[], Any]) -> Any:
        """``call()`` (TensorFlow's run), failing fast as the module docstring says."""
        self.timeout_ms = sess._config.operation_timeout_in_ms
        if self.broken is not None:
            raise self._refuse(self.broken)
        needed = self._needed(sess)
        problem = self._gone(needed)
        if problem is not None:
            raise self._refuse(problem)
        outcome = _Outcome()
        _runner.submit(call, outcome)
        next_probe = time.monotonic() + PROBE_INTERVAL_S
        misses = dict.fromkeys(map(self._key, needed), 0)
        wait = max(CHECK_INTERVAL_S, self.fleet.watch_interval_s)
        while not outcome.done.acquire(True, wait):
            problem = self._gone(needed)
            if problem is None and time.monotonic() >= next_probe:
                problem = self._probe(needed, misses)
                next_probe += PROBE_INTERVAL_S  # on schedule: a probe may take PROBE_TIMEOUT_S
            if problem is not None and outcome.done.locked():
                self.broken = problem
                threading.Thread(target=self._cancel, args=(sess,), daemon=True).start()
                raise self._refuse(problem)
        if outcome.error is not None:
            raise outcome.error
        self._ran = True
        return outcome.value

    def _probe(
        self, tasks: list[TaskHandle], misses: dict[tuple[str, int], int]
    ) -> TaskFailedError | None:
        results = probe_all([t.address for t in tasks], PROBE_TIMEOUT_S)
        for task, (answered, error) in zip(tasks, results, strict=True):
            key = self._key(task)
            misses[key] = 0 if answered else misses[key] + 1
            if misses[key] >= MISSES_BEFORE_FROZEN:
                return self._failed(
                    task,
                    NOT_ANSWERING,
                    f"{misses[key]} gRPC probes in a row unanswered, last: {error}",
                )
        return None

    @staticmethod
    def _cancel(sess: Any) -> None:
        """Close ``sess`` (cancels its running step inside TensorFlow); errors are moot now."""
        with contextlib.suppress(Exception):  # the caller already has the error that matters
            sess._close_quietly()
