"""A run's training progress, both sides of it.

The task's side: :func:`step` (a custom loop's call after each step) and :func:`progress` (a
Keras callback for ``model.fit``) write the task's steps done, and scalars such as the loss, to
its guard's progress channel (:mod:`graphdist._proc.guardreport`: an inherited pipe named by
``GRAPHDIST_PROGRESS_FD``), one JSON record a line: the first call of a process at once, then at
most one record every :data:`INTERVAL_S`, the newest; a last one when the process exits. A write
never blocks: a full pipe drops the record (the next one carries the steps, which count from
the start). Outside ``graphdist run`` (no channel) both do nothing. The cost is a clock read per
call (``benchmarks/progress.py`` measures it against a loop without it).

The launcher's side: :class:`StepBook` turns a task's records into ``progress`` events (its
rate since its record before, the steps an earlier attempt had done past this attempt's start),
the same from every engine whose guard relays the channel.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import math
import operator
import os
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from graphdist._distribute.events import Progress, Straggler
from graphdist._exceptions import ArgumentError
from graphdist._proc.guardreport import MAX_PROGRESS_LINE, PROGRESS_ENV, channel_fd
from graphdist._validate import show

__all__ = [
    "INTERVAL_S",
    "STRAGGLER_SHARE",
    "STRAGGLER_WINDOW_S",
    "StepBook",
    "Stragglers",
    "progress",
    "step",
]

#: Seconds between two records of one process (its first is written at once).
INTERVAL_S = 0.5
#: The longest wait :func:`step`'s ``ready`` may say (more: no time of this step).
MAX_WAIT_S = 3600.0
#: A task whose rate stays below this share of the other tasks' median is a straggler...
STRAGGLER_SHARE = 0.5
#: ... once it has stayed there this many seconds.
STRAGGLER_WINDOW_S = 30.0
#: Under a synchronous strategy, a task whose wait a step is this share of a step below the
#: other tasks' is the one they wait for (their steps would be that much shorter without it).
STRAGGLER_WAIT_SHARE = 0.2

Count = int | Callable[[], int]


def _local(value: object) -> list[object]:
    """A value's parts on this worker: a strategy's per-replica value (``strategy.run``'s result
    on a worker of several devices) has one a replica; anything else is its own."""
    parts = getattr(value, "values", None)
    return list(parts) if isinstance(parts, tuple) and parts else [value]


def _float(value: object, pick: Callable[[list[float]], float]) -> float | None:
    """``value`` as a float (``pick`` of its replicas' where it has several); None for what is
    no number."""
    numbers = []
    for part in _local(value):
        if isinstance(part, bool | str | bytes):
            return None
        try:
            numbers.append(float(part))  # type: ignore[arg-type]  # a tensor, a NumPy scalar
        except (TypeError, ValueError):
            return None
    return pick(numbers)


def _number(name: str, value: object) -> float | None:
    """A scalar as a record holds it (None: not finite); ArgumentError for what is no number.
    A per-replica value's replicas are averaged."""
    number = _float(value, statistics.fmean)
    if number is None:
        raise ArgumentError(
            f"graphdist.step's scalar {name} must be a number, not {show(value)}",
            name=name,
            value=value,
        )
    return number if math.isfinite(number) else None


def _wait(ready: object, at: float) -> float:
    """The seconds from ``ready`` (the step's wall-clock time when this task had its part
    ready to synchronize) to ``at`` (its :func:`step` call): what it waited for the others."""
    number = _float(ready, max)  # a tf.timestamp() tensor; per replica: the last one ready
    if number is None or not math.isfinite(number) or not -1.0 <= at - number <= MAX_WAIT_S:
        raise ArgumentError(
            f"graphdist.step's ready must be the step's wall-clock time when this task had its "
            f"part ready (time.time() or tf.timestamp(), before the step's all-reduce), not "
            f"{show(ready)}",
            name="ready",
            value=ready,
        )
    return max(0.0, at - number)


#: What reads a step's wait when its record is written (None: not known).
WaitReader = Callable[[], float | None]
_Pending = tuple[Count, int | None, Mapping[str, object], WaitReader | None]


class _Channel:
    """This process's end of its guard's progress channel (one per process: a forked child
    finds its own on its first call) and the record waiting for its turn."""

    def __init__(self) -> None:
        self.pid = -1
        self.fd = -1
        self.first = True
        self.next_at = 0.0
        self.pending: _Pending | None = None
        self.lock = threading.Lock()

    def forked(self) -> None:
        """In a forked child: a lock another thread held stays held there; a fresh one."""
        self.lock = threading.Lock()

    def _open(self) -> None:
        self.pid, self.fd, self.first, self.next_at, self.pending = os.getpid(), -1, True, 0.0, None
        fd = channel_fd(os.environ.get(PROGRESS_ENV))  # our guard's pipe, nothing else
        if fd is None:
            return
        with contextlib.suppress(OSError):
            os.set_blocking(fd, False)
            self.fd = fd
            atexit.register(self.flush)

    def update(
        self,
        n: Count,
        total: int | None,
        scalars: Mapping[str, object],
        wait: WaitReader | None = None,
    ) -> None:
        with self.lock:
            if self.pid != os.getpid():
                self._open()
            if self.fd < 0:
                return
            self.pending = (n, total, scalars, wait)
            now = time.monotonic()
            if now >= self.next_at:
                self.next_at = now + INTERVAL_S
                self._write()

    def flush(self) -> None:
        """Write the record waiting, if any (at exit: never raises)."""
        if self.pid != os.getpid():  # a forked child's copy: not its record
            return
        with self.lock:
            if self.fd >= 0:
                with contextlib.suppress(Exception):  # a scalar that is no number, at exit
                    self._write()

    def _write(self) -> None:
        if self.pending is None:
            return
        n, total, raw, wait = self.pending
        self.pending = None
        scalars = {str(name): _number(str(name), value) for name, value in raw.items()}
        record: dict[str, Any] = {
            "step": n() if callable(n) else n,
            "t": time.time(),
            "total": total,
            "first": self.first,
            "scalars": scalars,
        }
        waited = None if wait is None else wait()
        if waited is not None:
            record["wait"] = round(waited, 6)
        line = json.dumps(record, separators=(",", ":")).encode() + b"\n"
        if len(line) > MAX_PROGRESS_LINE // 2:  # too many scalars: the steps still go
            record["scalars"] = {}
            line = json.dumps(record, separators=(",", ":")).encode() + b"\n"
        try:
            os.write(self.fd, line)  # one atomic write (under PIPE_BUF)
        except BlockingIOError:
            return  # the pipe is full: the next record carries the steps
        except OSError:
            self.fd = -1  # the guard is gone
            return
        self.first = False


_CHANNEL = _Channel()
os.register_at_fork(after_in_child=lambda: _CHANNEL.forked())


def _check_count(value: object, name: str, least: int) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError(name)
        count = operator.index(value)  # type: ignore[arg-type]  # an int, a NumPy integer
    except TypeError:
        raise ArgumentError(
            f"graphdist.step's {name} must be a whole number, not {show(value)}",
            name=name,
            value=value,
        ) from None
    if count < least:
        raise ArgumentError(
            f"graphdist.step's {name} must be at least {least}, not {count}", name=name, value=value
        )
    return count


def step(n: int, /, *, total: int | None = None, ready: object = None, **scalars: object) -> None:
    """Report that this task has done ``n`` steps (counted from the run's start, so a resumed
    attempt goes on from where it resumed), with scalars such as ``loss=...`` (numbers, tensors
    read only when a record is written); ``total``: the steps the run will do. Call it after
    each step of a custom training loop under ``graphdist run``: the launcher's ``progress``
    events and ``--metrics-file`` get the task's steps, rate and scalars. Never blocks; does
    nothing outside ``graphdist run``.

    ``ready``, under a synchronous strategy (MultiWorkerMirroredStrategy): the wall-clock time
    at which this task had the step's gradients, before their all-reduce: the step function's
    :func:`graphdist.ready_time` of them (a per-replica value: its last replica's). The time
    from it to this call is what the task waited for the others; the one the others wait for
    is named a straggler (:class:`Stragglers`). A ``ready`` that is no wall-clock time of this
    step (a string, another clock's reading) raises :class:`ArgumentError` when its record is
    written (the first at once)."""
    n = _check_count(n, "n", 0)
    if total is not None:
        total = _check_count(total, "total", 1)
    _CHANNEL.update(
        n, total, scalars, None if ready is None else partial(_wait, ready, time.time())
    )


def _iterations(model: Any, batches: int) -> int:
    """The model's optimizer's steps; ``batches`` (those this process saw) where they cannot
    be read."""
    try:
        count = model.optimizer.iterations
        return int(count.numpy()) if hasattr(count, "numpy") else int(count)
    except Exception:  # whatever a strategy's variable raises
        return batches


_CALLBACK: type[Any] | None = None


def _callback_class() -> type[Any]:
    global _CALLBACK
    if _CALLBACK is not None:
        return _CALLBACK
    import tensorflow as tf

    class GraphdistProgress(tf.keras.callbacks.Callback):  # type: ignore[misc]
        """Reports the model's optimizer steps and its batch logs (loss, metrics) through
        :func:`graphdist.step`'s channel after each batch of ``fit``."""

        def __init__(self) -> None:
            super().__init__()
            self._supports_tf_logs = True  # logs stay tensors: read only when a record goes
            self._batches = 0
            self._marks: Any = None  # fitmarks.FitMarks
            self._began = 0.0

        def on_train_begin(self, logs: Any = None) -> None:
            from graphdist._distribute.fitmarks import FitMarks

            self._marks = FitMarks.of(self.model)
            if self._marks is not None:
                self._marks.wrap(self.model)

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self._began = time.time()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self._batches += 1
            batches = self._batches
            params = self.params or {}
            epochs, steps = params.get("epochs"), params.get("steps")
            total = epochs * steps if isinstance(epochs, int) and isinstance(steps, int) else None
            model = self.model
            # a dict of tensors; under ParameterServerStrategy a RemoteValue: steps alone
            scalars = dict(logs) if isinstance(logs, Mapping) else {}
            marks = self._marks
            wait = None if marks is None else partial(marks.wait, self._began, time.time())
            _CHANNEL.update(lambda: _iterations(model, batches), total or None, scalars, wait)

        def on_train_end(self, logs: Any = None) -> None:
            if self._marks is not None:
                self._marks.unwrap(self.model)
            _CHANNEL.flush()

    _CALLBACK = GraphdistProgress
    return _CALLBACK


def progress() -> Any:
    """A Keras callback for ``model.fit`` (``tf.keras``: tf-keras or Keras 3) that reports the
    task's steps (its optimizer's ``iterations``), the epochs' total and the batch logs (loss,
    metrics) as :func:`step` does. Under ParameterServerStrategy the coordinator reports them."""
    return _callback_class()()


class StepBook:
    """The launcher's record of each task's progress: :meth:`payload` turns a record
    (:func:`graphdist._proc.guardreport.parse_progress`) into a ``progress`` event's fields."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[int, int, float]] = {}  # task -> (attempt, step, t)
        self._done: dict[str, int] = {}  # task -> the most steps it reported, any attempt
        self.redone = 0  # every task's steps done again

    def steps(self) -> dict[str, int]:
        """Each task's last reported steps."""
        return {task: last[1] for task, last in self._last.items()}

    def payload(self, task: str, attempt: int, record: Mapping[str, Any]) -> Progress:
        n, t = int(record["step"]), float(record["t"])
        last = self._last.get(task)
        rate = None
        if last is not None and last[0] == attempt and t > last[2] and n >= last[1]:
            rate = round((n - last[1]) / (t - last[2]), 3)
        redone = 0
        if record.get("first") and (last is None or last[0] != attempt):
            redone = max(0, self._done.get(task, 0) - (n - 1))  # steps n.. done before
        self.redone += redone
        self._last[task] = (attempt, n, t)
        self._done[task] = max(self._done.get(task, 0), n)
        scalars = dict(record.get("scalars", {}))
        return Progress(n, record.get("total"), rate, scalars, redone, record.get("wait"))


class Stragglers:
    """The straggler rules over the tasks' records (:class:`StepBook`'s payloads), each named
    once when it held for :data:`STRAGGLER_WINDOW_S`, and again only after it recovered for as
    long (a blip, such as a pause between two fits, neither names nor clears):

    - the rate rule, for tasks that step apart (each reporting its own loop's steps; under
      ParameterServerStrategy only the coordinator runs the loop, its workers report nothing):
      a task whose rate stays below :data:`STRAGGLER_SHARE` of the other tasks' median;
    - the wait rule, for a synchronous strategy, where every worker steps at the slowest one's
      pace and the rates agree: a task that reports its wait (``graphdist.step(ready=...)``)
      and whose median wait over the window is below the other tasks' by at least
      :data:`STRAGGLER_WAIT_SHARE` of its median step in the window: it reaches each step's
      all-reduce last, and the others wait for it. A wait is read on one host's clock (from
      the task's ready to its step's end, which every worker reaches together), so hosts'
      clocks need not agree.

    Every task counts from its records in the attempt (an attempt starts afresh, a task that
    exited counts no more)."""

    def __init__(self) -> None:
        self._rates: dict[str, float] = {}
        # task -> its records' (at_s, wait, rate) in the window
        self._waits: dict[str, collections.deque[tuple[float, float, float]]] = {}
        self._since: dict[str, float] = {}  # task -> when it first fell behind
        self._named: set[str] = set()
        self._fine: dict[str, float] = {}  # a named task -> since when it is no longer behind

    def forget(self, task: str | None = None) -> None:
        """A task counts no more (it exited), or none does (a new attempt)."""
        for task_ in list(self._rates) + list(self._waits) if task is None else [task]:
            self._rates.pop(task_, None)
            self._waits.pop(task_, None)
            self._since.pop(task_, None)
            self._named.discard(task_)
            self._fine.pop(task_, None)

    def check(
        self,
        task: str,
        at_s: float,
        rate: float | None,
        node: str | None,
        wait: float | None = None,
    ) -> Straggler | None:
        """Take ``task``'s rate (and wait) at ``at_s`` (the run's clock); the event that names
        it, once."""
        if rate is None:
            return None
        self._rates[task] = rate
        if rate <= 0:  # it steps no more: the heartbeat's to judge, and no window runs on
            self._since.pop(task, None)
            return None
        others = [r for t, r in self._rates.items() if t != task]
        mid = statistics.median(others) if others else 0.0
        if wait is not None:
            return self._check_wait(task, at_s, rate, node, wait, mid)
        said = self._waits.get(task)
        if said and said[-1][0] >= at_s - STRAGGLER_WINDOW_S:  # a step without its wait, in a
            return None  # synchronous run: no news, and no reason to judge it by its rate
        for_s = self._held(task, at_s, behind=mid > 0 and rate < STRAGGLER_SHARE * mid)
        if for_s is None:
            return None
        return Straggler(node, rate, round(mid, 3), round(1.0 / rate - 1.0 / mid, 6), for_s)

    def _check_wait(
        self, task: str, at_s: float, rate: float, node: str | None, wait: float, mid: float
    ) -> Straggler | None:
        self._waits.setdefault(task, collections.deque()).append((at_s, wait, rate))
        medians = {}
        for name, samples in self._waits.items():
            while samples and samples[0][0] < at_s - STRAGGLER_WINDOW_S:
                samples.popleft()
            if samples:
                medians[name] = statistics.median(w for _, w, _ in samples)
        others = [m for name, m in medians.items() if name != task]
        if not others:  # none said a wait within the window (a pause, an evaluation): no news
            return None
        theirs = statistics.median(others)
        lag = theirs - medians[task]
        step_s = 1.0 / statistics.median(r for _, _, r in self._waits[task])  # a pause's rate
        for_s = self._held(task, at_s, behind=lag >= STRAGGLER_WAIT_SHARE * step_s)  # is one
        if for_s is None:
            return None
        return Straggler(node, rate, round(mid, 3), round(lag, 6), for_s, round(theirs, 6))

    def _held(self, task: str, at_s: float, *, behind: bool) -> float | None:
        """How long ``task`` has been behind, when that is the window and it was not named
        yet (it is now); None otherwise. A task not named that is not behind starts afresh; a
        named one has recovered once it was not behind for the window (then it is named again
        when it falls behind again, for the window)."""
        if not behind:
            if task in self._named:
                fine = self._fine.setdefault(task, at_s)
                if at_s - fine < STRAGGLER_WINDOW_S:
                    return None  # still named: a blip, or a recovery under way
                self._named.discard(task)
                self._fine.pop(task)
            self._since.pop(task, None)
            return None
        self._fine.pop(task, None)
        since = self._since.setdefault(task, at_s)
        if at_s - since < STRAGGLER_WINDOW_S or task in self._named:
            return None
        self._named.add(task)
        return round(at_s - since, 3)
