"""A run's metrics in the Prometheus text format (``graphdist run --metrics-file PATH``), for
node_exporter's textfile collector: counters and gauges kept from the run's events
(:mod:`graphdist._distribute.events`), the same from every backend, and the file written anew
after each event that changes them: a temporary file in the same folder, then a rename, so a
scrape never reads half a file.

Every series carries ``run``, the file's name without ``.prom``: node_exporter merges every file
of its folder, and two runs' series stay apart by it.

=====================================  =======  =============================================
metric                                 type     what
=====================================  =======  =============================================
graphdist_run_up                       gauge    1 while the run runs, 0 once it ended
graphdist_run_start_time_seconds       gauge    when the run started (Unix time)
graphdist_run_attempt                  gauge    the attempt running now (from 1)
graphdist_run_attempts_total           counter  attempts started
graphdist_run_restarts_total           counter  restarts, by ``cause``: ``signal`` (a task
                                                killed by one), ``exit`` (an error exit),
                                                ``frozen``, ``straggler``, ``lost`` (its
                                                node), ``oom``; and
                                                ``scope``: ``run`` (every task), ``server``
                                                (a ps run's server alone)
graphdist_run_task_failures_total      counter  failures that caused a restart or the end, by
                                                ``task``
graphdist_run_preemptions_total        counter  preemptions
graphdist_run_recovery_seconds_total   counter  time from each failure to the next attempt's
                                                first task start, summed
graphdist_run_last_recovery_seconds    gauge    the same for the last recovery
graphdist_run_outcome                  gauge    1 for the run's ``outcome`` once it ended:
                                                ``succeeded``, ``failed``, ``timed_out``,
                                                ``stopped`` or ``preempted`` (a stop signal
                                                at a preemption)
graphdist_run_task_steps               gauge    the steps a ``task`` last reported done
                                                (:func:`graphdist.step`), by ``task``
graphdist_run_task_steps_per_second    gauge    its rate between its last two records
graphdist_run_steps_redone_total       counter  steps done again after restarts, by ``task``
graphdist_run_stragglers_total         counter  times a ``task`` was named a straggler
=====================================  =======  =============================================

The progress series are there once a task reports progress (a script that calls
:func:`graphdist.step` or uses :func:`graphdist.progress`); their records alone write the file
at most once every :data:`PROGRESS_WRITE_S` (a record held back is written by a timer then); a
task's rate is 0 once it exited.

The folder must exist and be the user's alone (:func:`check_metrics_file`): the file is replaced
by a rename there. A write that fails (a full disk) is said once, as an ``output-lost`` event,
the file is removed, and the run goes on without its metrics. ``graphdist_run_up`` says what the
launcher last wrote, not that it lives: a launcher killed by SIGKILL leaves 1 (node_exporter's
``node_textfile_mtime_seconds`` says how old the file is).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any

from graphdist._distribute.runlogs import check_output_folder, check_output_name
from graphdist._exceptions import ArgumentError
from graphdist._validate import show

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping, Sequence

    from graphdist._distribute.events import Event

__all__ = ["RunMetrics", "check_metrics_file", "restart_cause", "run_outcome"]

SUFFIX = ".prom"  # what node_exporter's textfile collector reads, and nothing else
CAUSES = ("signal", "exit", "frozen", "straggler", "lost", "oom")
_COUNTED = (
    "attempt-started",
    "task-started",
    "restarting",
    "gave-up",
    "preempted",
    "run-ended",
    "progress",
    "task-exited",
    "straggler",
)
#: Seconds between two writes that progress records alone cause (each other event writes).
PROGRESS_WRITE_S = 1.0


def check_metrics_file(path: object) -> str:
    """``path`` as an absolute path once it is one a run may write its metrics to: a name
    ending in ``.prom`` in a folder that exists, is the user's (or root's) and that no one else
    can write to. Raises :class:`ArgumentError` naming it."""
    full = check_output_name(
        path,
        name="metrics_file",
        suffixes=(SUFFIX,),
        why=" (node_exporter's textfile collector reads only those)",
    )
    try:
        os.path.basename(full).encode("utf-8")  # it names the series (``run``): a label is UTF-8
    except UnicodeEncodeError:
        raise ArgumentError(
            f"metrics_file's name must be UTF-8 text, not {show(os.fspath(path))}",  # type: ignore[call-overload]
            name="metrics_file",
            value=path,
        ) from None
    try:
        import prometheus_client  # noqa: F401 - a dependency: missing, the install is broken
    except ImportError:
        raise ArgumentError(
            "metrics_file needs prometheus_client, a dependency of graphdist that is not "
            "installed here: pip install prometheus_client",
            name="metrics_file",
            value=path,
        ) from None
    return check_output_folder(full, path, name="metrics_file", what="metrics")


def restart_cause(cause: dict[str, Any]) -> str:
    """A failure as one of the few words a label may take: ``oom``, ``lost``, ``frozen``,
    ``straggler``, ``signal`` or ``exit``, read from its ``how``
    (:func:`graphdist._distribute.taskproc.how`'s words) and exit code."""
    how = str(cause.get("how") or "")
    if "out of memory" in how:
        return "oom"
    if "lost with its node" in how:
        return "lost"
    if "frozen" in how:
        return "frozen"
    if "was a straggler" in how:
        return "straggler"
    code = cause.get("exitcode")
    return "signal" if isinstance(code, int) and code < 0 else "exit"


def run_outcome(data: Mapping[str, Any]) -> str:
    """A run's end as one of the words a label may take: ``succeeded`` (its command tasks ran,
    each exited 0), ``preempted``, ``stopped`` (a stop signal), ``timed_out`` or ``failed``."""
    if data.get("ran"):
        return "succeeded"
    outcome = str(data.get("outcome", ""))
    for prefix, word in (
        ("preempted", "preempted"),
        ("stopped", "stopped"),
        ("timed out", "timed_out"),
    ):
        if outcome.startswith(prefix):
            return word
    return "failed"


class RunMetrics:
    """The metrics of one run, kept from its events (:meth:`feed`) and written to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.run = os.path.basename(path)[: -len(SUFFIX)]
        self.started = time.time()
        self.up = 1
        self.attempt = 0
        self.attempts = 0
        # (cause, scope) -> restarts; a run's every cause from 0, so that a rate sees the first
        self.restarts: dict[tuple[str, str], int] = {(c, "run"): 0 for c in CAUSES}
        self.failures: dict[str, int] = {}
        self.preemptions = 0
        self.recovery_total = 0.0
        self.last_recovery: float | None = None
        self.outcome: str | None = None
        self._failed_at: float | None = None  # the run's clock (at_s) of a failure not recovered
        self.lost: str | None = None  # why the last write failed: no more are tried
        self.steps: dict[str, int] = {}  # task -> steps done, as it last reported
        self.rates: dict[str, float] = {}  # task -> steps/s between its last two records
        self.redone: dict[str, int] = {}  # task -> steps done again after restarts
        self.stragglers: dict[str, int] = {}  # task -> times named a straggler
        self._written_at = 0.0  # time.monotonic() of the last write
        self._later: threading.Timer | None = None  # a write of progress held back
        self._unsaid: str | None = None  # why the timer's write failed, not said yet
        self._held = False  # a progress record changed what no write has written yet
        self._lock = threading.Lock()

    def feed(self, event: Event) -> str | None:
        """Count ``event``; write the file if that changed anything. Returns why the write failed
        the first time one does (None otherwise): the run says so once and goes on. Events come
        from several threads: one at a time, so that a file never replaces a newer one."""
        if event.kind not in _COUNTED:  # a task's reader thread waits for no write
            return None
        with self._lock:
            failed = self._feed(event)
            failed, self._unsaid = failed or self._unsaid, None  # or the timer's, said now
            return failed

    def _feed(self, event: Event) -> str | None:
        data = event.data
        if event.kind == "attempt-started":
            self.attempt, self.attempts = event.attempt, self.attempts + 1
        elif event.kind == "task-started" and self._failed_at is not None:
            self.last_recovery = max(0.0, event.at_s - self._failed_at)
            self.recovery_total += self.last_recovery
            self._failed_at = None
        elif event.kind in ("restarting", "gave-up"):
            cause = data["cause"]
            self.failures[cause["task"]] = self.failures.get(cause["task"], 0) + 1
            if event.kind == "restarting":
                key = (restart_cause(cause), str(data["scope"]))
                self.restarts[key] = self.restarts.get(key, 0) + 1
                if data["scope"] == "run":  # a server's restart starts no command task
                    self._failed_at = float(cause["ended_at_s"])
        elif event.kind == "preempted":
            self.preemptions += 1
            self._failed_at = None  # what comes next is the preemption's restart
        elif event.kind == "run-ended":
            self.up, self.outcome = 0, run_outcome(data)
        elif event.kind == "progress" and event.task is not None:
            self.steps[event.task] = int(data["step"])
            if data.get("steps_per_s") is not None:
                self.rates[event.task] = float(data["steps_per_s"])
            if data.get("redone"):
                self.redone[event.task] = self.redone.get(event.task, 0) + int(data["redone"])
            elif (wait := self._written_at + PROGRESS_WRITE_S - time.monotonic()) > 0:
                self._held = True  # written by the next write, or by the timer then
                self._write_later(wait)
                return None
        elif event.kind == "straggler" and event.task is not None:
            self.stragglers[event.task] = self.stragglers.get(event.task, 0) + 1
        elif event.kind == "task-exited" and event.task in self.rates:
            self.rates[event.task] = 0.0  # it steps no more
        else:
            return None
        return self.write()

    def _write_later(self, wait: float) -> None:
        if self._later is None or not self._later.is_alive():
            self._later = threading.Timer(wait, self._write_if_stale)
            self._later.daemon = True
            self._later.start()

    def _write_if_stale(self) -> None:
        with self._lock:
            if self._held and self.up:  # no write since took it: this one does
                self._unsaid = self.write()  # a failure is said with the next event

    def text(self) -> str:
        """The metrics in the Prometheus text format (prometheus_client's exposition)."""
        from prometheus_client import CollectorRegistry, generate_latest

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self))
        return generate_latest(registry).decode()

    def write(self) -> str | None:
        """Replace the file by the metrics now (a temporary file, then a rename); why it failed
        the first time it does, else None. After a failure the file is removed (a full disk
        still lets it go): left, it would say the run is up for as long as it is scraped."""
        if self.lost is not None:
            return None
        self._written_at, self._held = time.monotonic(), False
        tmp = None
        try:
            text = self.text().encode()
            fd, tmp = tempfile.mkstemp(
                prefix=f".{self.run}.", suffix=".tmp", dir=os.path.dirname(self.path)
            )
            with os.fdopen(fd, "wb") as f:
                f.write(text)
            os.chmod(tmp, 0o644)  # node_exporter reads it as another user
            os.replace(tmp, self.path)
        except Exception as exc:  # whatever it is, the run goes on without its metrics
            for path in (tmp, self.path):
                if path is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
            self.lost = (exc.strerror if isinstance(exc, OSError) else None) or str(exc)
            return self.lost
        return None


class _Collector:
    """prometheus_client's view of a :class:`RunMetrics`."""

    def __init__(self, metrics: RunMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        m = self.m

        def family(kind: Any, name: str, doc: str, values: Any, by: Sequence[str] = ()) -> Any:
            """One family: ``values`` is one value, or {label values (a tuple): value}."""
            made = kind(f"graphdist_run_{name}", doc, labels=["run", *by])
            for key, value in sorted(values.items() if by else [((), values)]):
                made.add_metric([m.run, *key], value)
            return made

        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield family(gauge, "up", "1 while the run runs, 0 once it ended", m.up)
        yield family(gauge, "start_time_seconds", "When the run started (Unix time)", m.started)
        yield family(gauge, "attempt", "The attempt running now (from 1)", m.attempt)
        yield family(counter, "attempts", "Attempts started", m.attempts)
        yield family(
            counter,
            "restarts",
            "Restarts by what ended the failed task, of the run or of a ps run's server",
            m.restarts,
            ("cause", "scope"),
        )
        failures = {(task,): n for task, n in m.failures.items()}
        doc = "Failures that caused a restart or the end"
        yield family(counter, "task_failures", doc, failures, ("task",))
        yield family(counter, "preemptions", "Preemptions", m.preemptions)
        doc = "Time from each failure to the next attempt's first task start, summed"
        yield family(counter, "recovery_seconds", doc, m.recovery_total)
        if m.last_recovery is not None:
            doc = "The last recovery's time"
            yield family(gauge, "last_recovery_seconds", doc, m.last_recovery)
        if m.outcome is not None:
            doc = "1 for the run's outcome once it ended"
            yield family(gauge, "outcome", doc, {(m.outcome,): 1}, ("outcome",))
        if m.steps:
            by_task = {(task,): n for task, n in m.steps.items()}
            yield family(gauge, "task_steps", "Steps a task last reported done", by_task, ("task",))
            rates = {(task,): r for task, r in m.rates.items()}
            doc = "A task's steps per second between its last two records"
            yield family(gauge, "task_steps_per_second", doc, rates, ("task",))
            redone = {(task,): m.redone.get(task, 0) for task in m.steps}
            doc = "Steps done again after restarts"
            yield family(counter, "steps_redone", doc, redone, ("task",))
            named = {(task,): m.stragglers.get(task, 0) for task in m.steps}
            doc = "Times a task was named a straggler"
            yield family(counter, "stragglers", doc, named, ("task",))
