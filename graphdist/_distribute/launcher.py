"""The multi-worker launcher: one process per tf.distribute task, each with its own TF_CONFIG.

:func:`run_command` is what ``graphdist run --workers N [--ps M] [--chief] -- COMMAND`` does:

- a cluster of ``chief`` (optional), ``worker`` x N and ``ps`` x M on free loopback ports;
- without ps tasks (MultiWorkerMirroredStrategy), every chief and worker runs COMMAND;
- with ps tasks (ParameterServerStrategy), the chief runs COMMAND as the coordinator, and the
  workers and ps tasks are plain graphdist servers (a :class:`LocalFleet` of those jobs) that stop
  when the run ends;
- each COMMAND process gets ``TF_CONFIG``, ``TF_USE_LEGACY_KERAS=1`` (Keras 3 cannot ``fit`` under
  these strategies, see TF_FACTS) and ``GRAPHDIST_TASK``; its output lines are prefixed with its
  task (``[worker-1] ...``);
- the run succeeds only if every COMMAND process exits 0. When one fails, the others are stopped
  (SIGTERM, a grace period, SIGKILL) and :class:`TaskExitError` carries every task's exit code and
  last lines; the whole run is bounded by ``timeout_s`` (:class:`LaunchTimeoutError`).

Nothing a task started outlives the run, however the run ends: grandchildren in a wrapping shell
(``sh -c 'python train.py; true'``) and daemons that left the task's session included. Each COMMAND
runs under a guard (:func:`graphdist._proc.process.guarded_argv`, in a session of its own): a
child subreaper, so every orphan of the task is re-parented to it and stays in its reach, with
``PR_SET_PDEATHSIG`` on the launcher, so even a SIGKILLed launcher sets it off. Stopped (or when
COMMAND exits: its leftovers go too), the guard SIGTERMs every descendant, gives them
``graphdist._proc.process.STOP_GRACE_S`` (TensorFlow programs may catch or ignore SIGTERM),
SIGKILLs the rest and exits once none is left, with COMMAND's exit status. Why a guard, not a
process group or parent-death signals alone: a signal to a group misses whoever called ``setsid``,
``PR_SET_PDEATHSIG`` only reaches a direct child, and neither helps once the launcher is SIGKILLed
and the orphans belong to init; a cgroup would, but needs privileges. ``TaskResult.pid`` is the
guard's pid: once it is gone, all of its task is.

During the run, SIGINT, SIGTERM and SIGHUP (main thread only) stop every task and the ps servers
first; then the launcher gets the signal as it would have without the run
(:class:`graphdist._proc.signals.SignalScope`): SIGINT raises KeyboardInterrupt (``graphdist run``
exits 130), SIGTERM and SIGHUP kill it (a shell shows 143 and 129, 128 + the signal); a Python
handler of the caller's runs instead, and :class:`LaunchError` follows if it returns. Ctrl-C in
a terminal reaches only the launcher: each task has its own session.

The loopback bind shim is loaded into the task processes as into fleet servers, so the in-process
servers that the strategies start are not reachable from the network either.

:func:`run_function` runs a Python function the same way and returns each task's result.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from graphdist._cluster import Cluster, Task
from graphdist._distribute.events import ConsoleLines, Event, render, summary
from graphdist._distribute.heartbeat import (
    HEARTBEAT_TIMEOUT_S,
    Heartbeat,
    check_heartbeat_timeout,
)
from graphdist._distribute.resume import RESUMED_PREFIX
from graphdist._distribute.runlogs import RunLogs
from graphdist._exceptions import (
    ArgumentError,
    ClusterSpecError,
    LaunchError,
    LaunchTimeoutError,
    TaskExitError,
    TaskOutcome,
)
from graphdist._failures import how_ended
from graphdist._net.loopback import server_bind_address, shim_env
from graphdist._net.ports import release_ports
from graphdist._proc.process import (
    MARK_ENV,
    NOW_SIGNAL,
    STOP_GRACE_S,
    TASK_STOP_GRACE_S,
    descendants,
    end_marked,
    guarded_argv,
    stop_all,
)
from graphdist._proc.restarts import (
    DEFAULT_MIN_UPTIME_S,
    DEFAULT_RESTART_WINDOW_S,
    Decision,
    RestartPolicy,
    check_min_uptime,
)
from graphdist._proc.signals import Interrupted, SignalScope
from graphdist._validate import check_argv, check_env, count, flag, show
from graphdist._validate import timeout_s as check_timeout_s

__all__ = [
    "LaunchError",
    "LaunchTimeoutError",
    "TaskExitError",
    "TaskResult",
    "launch_cluster",
    "run_command",
    "run_function",
]

TAIL_LINES = 20
#: The longest output line, in bytes, the launcher holds: a longer one (a progress bar drawn with
#: ``\r``, a dumped array) is shown and kept to this length, with a note of how much more it had;
#: the task's log file gets it whole.
LINE_LIMIT = 64 * 1024
#: The most characters of one output line an error message quotes.
MESSAGE_LINE_CHARS = 300
#: Seconds to wait for a task's output to be drained once its process tree is gone.
READER_JOIN_S = 5.0
#: The exit code of a task that stopped because it was preempted: TensorFlow's
#: ``PreemptionCheckpointHandler`` saves a checkpoint on SIGTERM and exits with it.
PREEMPTION_EXIT_CODE = 42
#: Seconds the other tasks get to exit with the preemption code once one has (they save a
#: checkpoint at a step they agree on first); past it, the first one's exit is a failure.
PREEMPTION_WAIT_S = 30.0
OUTPUT_FORMATS = ("text", "jsonl")


@dataclass
class TaskResult:
    """How one task of a run ended: its process ``pid``, ``exitcode`` (``None`` if it was still
    running when the run was stopped), its last output lines, and (for :func:`run_function`) its
    return ``value``."""

    task: Task
    pid: int | None = None  # the task's guard, the command's parent (see the module docstring)
    exitcode: int | None = None
    tail: list[str] = field(default_factory=list)
    value: Any = None
    frozen: str | None = None  # why the run's heartbeat found it frozen (it was then killed)

    @property
    def name(self) -> str:
        return self.task.name


def launch_cluster(workers: int, ps: int = 0, chief: bool = False) -> Cluster:
    """A cluster of ``chief`` (0 or 1), ``worker`` x ``workers`` and ``ps`` x ``ps`` on free
    loopback ports (reserved for this process until :func:`graphdist._net.ports.release_ports`).
    Raises ArgumentError for bad counts, ClusterSpecError for ps without a chief."""
    return Cluster.from_counts(_counts(workers, ps, chief))


def _counts(workers: int, ps: int, chief: bool) -> dict[str, int]:
    """The jobs of a run, checked (the counts, and a coordinator for ps tasks); picks nothing."""
    count(workers, "workers")
    count(ps, "ps", minimum=0)
    flag(chief, "chief")
    if ps and not chief:
        raise ClusterSpecError(
            "A parameter-server run needs a coordinator: pass chief=True; the chief runs "
            "the command while workers and ps tasks serve",
            ps,
        )
    counts = {"worker": workers}
    if ps:
        counts["ps"] = ps
    if chief:
        counts["chief"] = 1
    return counts


class _TaskProcess:
    """One command task of an attempt: its guard, the guard's reports (the command's pid and
    when it ended), the thread that drains its output, its log."""

    def __init__(
        self,
        task: Task,
        argv: Sequence[str],
        env: Mapping[str, str],
        run: _Run,
        log_path: str | None = None,
    ) -> None:
        self._start_output(task, run, log_path)
        self.mark = secrets.token_hex(12)  # every process of the task carries it (MARK_ENV)
        self.command_pid: int | None = None
        self.command_exit: tuple[int, float] | None = None  # (code, when: run seconds)
        report_r, report_w = os.pipe2(os.O_CLOEXEC)
        try:
            self.proc = subprocess.Popen(
                guarded_argv(argv, name=task.name, report_fd=report_w),
                env={**env, MARK_ENV: self.mark},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                pass_fds=(report_w,),
            )
        except BaseException:
            os.close(report_r)
            raise
        finally:
            os.close(report_w)
        os.set_blocking(report_r, False)
        self._report = report_r
        self._report_buf = b""
        self.result.pid = self.proc.pid
        self._reader = threading.Thread(
            target=self._pump, daemon=True, name=f"graphdist-run-{task.name}"
        )
        self._reader.start()

    def _start_output(self, task: Task, run: _Run, log_path: str | None) -> None:
        """The task's result, its tail and log: what every kind of task process keeps."""
        self.result = TaskResult(task)
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._run = run
        self._resumed = False
        self._log = RunLogs.open(log_path) if log_path else None
        self._log_path = log_path
        self._finished = False

    # -- the guard's reports ---------------------------------------------------------------

    def _read_report(self) -> None:
        if self._report < 0:
            return
        while True:
            try:
                chunk = os.read(self._report, 4096)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                os.close(self._report)
                self._report = -1
                break
            self._report_buf += chunk
        *lines, self._report_buf = self._report_buf.split(b"\n")
        for line in lines:
            words = line.decode("ascii", "replace").split()
            if words[:1] == ["pid"] and len(words) == 2:
                self.command_pid = int(words[1])
            elif words[:1] == ["exit"] and len(words) == 3 and self.command_exit is None:
                self.command_exit = (int(words[1]), float(words[2]) - self._run.started)

    def ended(self) -> int | None:
        """The task's exit code once its command has ended: as its guard reports it (before it
        ends what the command left behind), or as the guard exits (a guard that was killed)."""
        self._read_report()
        if self.command_exit is not None:
            return self.command_exit[0]
        return self.proc.poll()

    def ended_at_s(self) -> float:
        """When the task's command ended (seconds into the run): as the guard saw it, else now."""
        self._read_report()
        if self.command_exit is not None:
            return self.command_exit[1]
        return time.monotonic() - self._run.started

    # -- output ----------------------------------------------------------------------------

    def _pump(self) -> None:
        """Drain the task's pipe to its end, whatever happens to the sinks: a task blocked on a
        full pipe would never end."""
        stdout = self.proc.stdout
        assert stdout is not None
        try:
            self._drain(iter(lambda: stdout.readline(LINE_LIMIT), b""))
        except Exception as exc:  # a bug here must not leave the task blocked on its pipe
            self._run.out.note(f"graphdist: showing {self.result.name}'s output failed ({exc!r})")
            with contextlib.suppress(Exception):
                while stdout.read(LINE_LIMIT):
                    pass
        finally:
            self._close_log()
            with contextlib.suppress(OSError):
                stdout.close()

    def _drain(self, chunks: Iterator[bytes]) -> None:
        """The output, read in chunks of at most LINE_LIMIT bytes that end at a newline."""
        first: bytes | None = None  # the start of a line longer than LINE_LIMIT
        more = 0  # the bytes of that line after its start
        while True:
            chunk = next(chunks, b"")
            if not chunk:
                if first is not None:
                    self._line(first, more)
                return
            self._to_log(chunk)
            ended = chunk.endswith(b"\n")
            if first is None and (ended or len(chunk) < LINE_LIMIT):
                self._line(chunk, 0)
            elif first is None:
                first, more = chunk, 0
            else:
                more += len(chunk) - ended  # the newline is no part of the line
                if ended:
                    self._line(first, more)
                    first = None

    def _line(self, raw: bytes, more: int) -> None:
        line = raw.decode("utf-8", "replace").rstrip("\n")
        if more:
            where = " (whole in its log file)" if self._log is not None else ""
            line += f" [graphdist: line cut at {len(raw)} bytes; {more} more not shown{where}]"
        self._tail.append(line)
        self._run.line(self.result.name, line)
        if not self._resumed and line.startswith(RESUMED_PREFIX):
            self._resumed = True
            self._run.emit("resumed", self.result.name, text=line[len(RESUMED_PREFIX) :])

    def _to_log(self, chunk: bytes) -> None:
        if self._log is None:
            return
        try:
            self._log.write(chunk)
        except (OSError, ValueError) as exc:  # a full disk, a file system gone read-only
            self._close_log()
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self._run.emit("output-lost", self.result.name, sink=self._log_path, error=why)

    def _close_log(self) -> None:
        log, self._log = self._log, None
        if log is not None:
            with contextlib.suppress(OSError):
                log.close()

    # -- stopping --------------------------------------------------------------------------

    def running(self) -> bool:
        return self.proc.poll() is None

    def processes(self) -> list[int] | None:
        """The task's live processes, for the heartbeat (its guard's descendants); None where
        the launcher cannot see them (a task on another machine)."""
        return descendants(self.proc.pid) if self.running() else []

    def signal(self, sig: int) -> None:
        """SIGTERM (or any catchable signal) goes to the guard, which stops its task; SIGKILL, the
        last resort for a guard that did not finish, goes to everything the guard has left."""
        if self.proc.poll() is not None:
            return
        targets = [self.proc.pid]
        if sig == signal.SIGKILL:
            targets = [*reversed(descendants(self.proc.pid)), self.proc.pid]
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)
        for pid in targets:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def finish(self) -> TaskResult:
        """The task's result, once its guard has exited: what the guard could not end (it was
        SIGKILLed, say) is ended here by its mark, so nothing of the task outlives it."""
        if self._finished or self.proc.poll() is None:
            return self.result
        self._finished = True
        end_marked(self.mark, STOP_GRACE_S)
        self._reader.join(READER_JOIN_S)
        code = self.ended()
        self.result.exitcode = self.proc.poll() if code is None else code
        self.result.tail = list(self._tail)
        if self._report >= 0:
            os.close(self._report)
            self._report = -1
        with contextlib.suppress(OSError):  # the pipe's end, if the reader still holds it
            if not self._reader.is_alive() and self.proc.stdout is not None:
                self.proc.stdout.close()
        return self.result


class _Output:
    """Serialises whole lines from several threads onto one stream. A stream that fails (its
    reader went away: ``| head``; a full disk) is dropped with one line on stderr: the run goes
    on, the tasks' pipes keep draining."""

    def __init__(self, stream: IO[str] | None) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def write(self, line: str) -> None:
        with self._lock:
            stream = self._stream
            if stream is None:
                return
            try:
                stream.write(line + "\n")
                stream.flush()
            except (OSError, ValueError) as exc:
                self._stream = None
                self._lost(stream, exc)

    def note(self, line: str) -> None:
        """graphdist's own line about the run: on the stream, or on stderr once it failed."""
        with self._lock:
            lost = self._stream is None
        if lost:
            with contextlib.suppress(OSError, ValueError):
                print(line, file=sys.stderr, flush=True)
        else:
            self.write(line)

    @staticmethod
    def _lost(stream: IO[str], exc: BaseException) -> None:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        if stream is sys.stderr:
            return
        with contextlib.suppress(OSError, ValueError):
            print(
                f"graphdist: cannot write the run's output any more ({why}); the run goes on "
                "without it (its --log-dir keeps every line)",
                file=sys.stderr,
                flush=True,
            )


def _stop(procs: Sequence[_TaskProcess], grace_s: float) -> None:
    stop_all(procs, grace_s)


def _stop_broken(procs: Sequence[_TaskProcess]) -> None:
    """Stop an attempt that a failed or frozen task broke, at once: its survivors cannot go on
    (a MultiWorkerMirroredStrategy collective without one of its workers) and some ignore SIGTERM
    (MWMS installs its own handler), so a grace period would only delay the restart. Each guard
    is told to end its tree with SIGKILL (:data:`graphdist._proc.process.NOW_SIGNAL`); the usual
    escalation follows for a guard that does not. A stop someone asked for (a signal, the
    timeout, the run's end) keeps the grace."""
    for proc in procs:
        if proc.running():
            proc.signal(NOW_SIGNAL)
    _stop(procs, TASK_STOP_GRACE_S)


def _how(result: TaskOutcome) -> str:
    """How a task ended, in words: as its exit code says, or frozen and killed."""
    frozen = getattr(result, "frozen", None)
    if frozen is not None:
        return f"was frozen ({frozen}) and was killed"
    return how_ended(result.exitcode)


def _describe(result: TaskOutcome, then: str = "") -> str:
    """``NAME exited with code N`` (``then`` after it), its last lines and a hint."""
    tail = "\n".join(f"    [{result.name}] {_cut(line)}" for line in result.tail[-10:])
    return (
        f"{result.name} {_how(result)}"
        + then
        + (f"; its last lines:\n{tail}" if tail else "")
        + _interpreter_hint(result.tail)
    )


def _cut(line: str) -> str:
    """One output line as an error message quotes it: at most MESSAGE_LINE_CHARS characters."""
    if len(line) <= MESSAGE_LINE_CHARS:
        return line
    return f"{line[:MESSAGE_LINE_CHARS]} [... {len(line) - MESSAGE_LINE_CHARS} more characters]"


def _interpreter_hint(tail: Sequence[str]) -> str:
    """What to do when a task's Python lacks TensorFlow or graphdist: most often the command's
    ``python`` is another interpreter than the one graphdist runs in; or tf-keras, which the
    run's ``TF_USE_LEGACY_KERAS=1`` makes ``tf.keras``: the ``distribute`` extra has it."""
    text = "".join(tail)
    missing = [m for m in ("tensorflow", "graphdist") if f"No module named '{m}'" in text]
    if not missing and ("Keras cannot be imported" in text or "No module named 'tf_keras'" in text):
        return (
            "\n  the task's Python has no tf-keras, tf.keras in a run (graphdist run sets "
            "TF_USE_LEGACY_KERAS=1: Keras 3 cannot fit under MultiWorkerMirroredStrategy); install "
            f"it: `{sys.executable} -m pip install 'graphdist[distribute]'` (or tf-keras alone)"
        )
    if not missing:
        return ""
    return (
        f"\n  the task's Python has no {missing[0]}: is the command's `python` another "
        f"interpreter than graphdist's ({sys.executable})? Run `graphdist run -- "
        f"{sys.executable} ...` or activate the environment graphdist is installed in"
    )


@dataclass(frozen=True)
class _Job:
    """What every attempt of a run runs: the command, the cluster's counts, the environment."""

    command: Sequence[str]
    workers: int
    ps: int
    chief: bool
    base_env: Mapping[str, str]
    expose: bool
    backend: str = "local"
    working_dir: str | None = None


class _Preempted(Exception):
    """Every command task of an attempt exited with the preemption code."""

    def __init__(self, code: int, results: Sequence[TaskResult]) -> None:
        super().__init__(code)
        self.code = code
        self.results = list(results)


class _Run:
    """What a run keeps across its attempts: where its output goes and in which format, its log
    folder, its restart policy and deadline, which attempt it is in (from 1), and its events,
    which it renders and records as they happen (:mod:`graphdist._distribute.events`)."""

    def __init__(
        self,
        out: _Output,
        output_format: str,
        logs: RunLogs | None,
        policy: RestartPolicy,
        timeout_s: float | None,
        preemption_code: int | None,
        heartbeat_s: float | None = HEARTBEAT_TIMEOUT_S,
    ) -> None:
        self.out = out
        self.jsonl = output_format == "jsonl"
        self.logs = logs
        self.policy = policy
        self.timeout_s = timeout_s
        self.preemption_code = preemption_code
        self.heartbeat_s = heartbeat_s
        self.started = time.monotonic()
        self.attempt = 1
        self.events: list[Event] = []  # every event but the output lines
        self.console = ConsoleLines()  # TensorFlow's own lines stay in the logs (issue 29)
        self._lock = threading.Lock()

    @property
    def deadline(self) -> float | None:
        return None if self.timeout_s is None else self.started + self.timeout_s

    def line(self, task: str, text: str) -> None:
        """One line of a task's output: shown, never kept (a chatty task's lines add up)."""
        if self.jsonl:
            event = Event(
                "line", time.monotonic() - self.started, self.attempt, task, {"text": text}
            )
            self.out.write(event.to_json())
        elif (shown := self.console.render(task, text)) is not None:
            self.out.write(shown)

    def emit(self, kind: str, task: str | None = None, **data: Any) -> Event:
        with self._lock:
            event = Event(kind, time.monotonic() - self.started, self.attempt, task, data)
            self.events.append(event)
            events = list(self.events)
        if self.logs is not None:
            self.logs.record_event(event)
        if self.jsonl:
            self.out.note(event.to_json())
        else:
            text = render(event, events[:-1])
            if text is not None:
                self.out.note(text)
        return event

    def end(self, outcome: str, *, show: bool) -> None:
        """The run's last event, with its summary: to the log folder always, to the output
        where ``show``."""
        logs = None if self.logs is None else self.logs.path
        event = self.emit("run-ended", outcome=outcome, attempts=self.attempt, logs=logs, show=show)
        if self.logs is not None:
            self.logs.write_summary(summary(self.events[: self.events.index(event) + 1]))

    def timed_out(self, results: Sequence[TaskOutcome], doing: str) -> LaunchTimeoutError:
        return LaunchTimeoutError(
            f"The run did not finish within {self.timeout_s:g} s ({doing}); every task was "
            "stopped; raise timeout_s if it needs longer",
            results,
        )

    def backoff(self, wait: float, signals: SignalScope, what: str) -> None:
        """Wait ``wait`` seconds before restarting ``what``; the deadline holds meanwhile."""
        deadline = self.deadline
        left = None if deadline is None else deadline - time.monotonic()
        with signals.interruptible():
            time.sleep(wait if left is None else max(0.0, min(wait, left)))
        if left is not None and left < wait:
            raise self.timed_out([], f"it was waiting {wait:g} s to restart {what}")

    def cause(self, result: TaskOutcome, ended_at_s: float) -> dict[str, Any]:
        """A failed task, as the restarting and gave-up events carry it."""
        return {
            "task": result.name,
            "pid": result.pid,
            "exitcode": result.exitcode,
            "how": _how(result),
            "ended_at_s": round(ended_at_s, 3),
        }


def _check_command(command: object) -> list[str]:
    """``command`` as a list of strings, or ArgumentError naming what is wrong with it."""
    argv = check_argv(command, "command")
    if not argv:
        raise ArgumentError(
            "No command to run; put it after `--`, e.g. -- python train.py", name="command"
        )
    return argv


def _check_output(output: object) -> IO[str]:
    if output is None:
        return sys.stdout
    if not callable(getattr(output, "write", None)):
        raise ArgumentError(
            f"output must be a text stream (with write), not {show(output)}",
            name="output",
            value=output,
        )
    return output  # type: ignore[return-value]


def _check_output_format(value: object) -> str:
    if value not in OUTPUT_FORMATS:
        raise ArgumentError(
            f"output_format must be one of {', '.join(OUTPUT_FORMATS)}, not {show(value)}",
            name="output_format",
            value=value,
        )
    return str(value)


def _check_preemption_code(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 255:
        raise ArgumentError(
            f"preemption_exit_code must be an exit code from 1 to 255 (or None), not {show(value)}",
            name="preemption_exit_code",
            value=value,
        )
    return value


def run_command(
    command: Sequence[str],
    *,
    workers: int = 2,
    ps: int = 0,
    chief: bool = False,
    timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
    expose: bool = False,
    output: IO[str] | None = None,
    max_restarts: int = 0,
    restart_window_s: float = DEFAULT_RESTART_WINDOW_S,
    log_dir: str | os.PathLike[str] | None = None,
    min_uptime_s: float = DEFAULT_MIN_UPTIME_S,
    preemption_exit_code: int | None = PREEMPTION_EXIT_CODE,
    output_format: str = "text",
    backend: str = "local",
    address: str | None = None,
    working_dir: str | os.PathLike[str] | None = None,
    heartbeat_timeout_s: float | None = HEARTBEAT_TIMEOUT_S,
) -> list[TaskResult]:
    """Run ``command`` once per task of a fresh local cluster (see the module docstring).

    ``output`` receives the prefixed lines and the run's own lines (default: ``sys.stdout``);
    if writing to it fails (its reader went away, a full disk), the run goes on without it,
    saying so on stderr. ``output_format="jsonl"``: one JSON object a line instead, every task
    line and every event of the run (:mod:`graphdist._distribute.events`). Lines longer than
    :data:`LINE_LIMIT` bytes are cut there (the log file keeps them whole). Returns every
    command task's :class:`TaskResult` (all exit codes 0). Raises :class:`TaskExitError`,
    :class:`LaunchTimeoutError`, :class:`ClusterSpecError` for bad counts or
    :class:`ArgumentError` for any bad argument (a command that is not a list of str or not an
    executable, a timeout that is not a finite number > 0, ``expose`` not a bool, an unsafe
    ``log_dir``), before anything starts. A stop signal during the run: see the module docstring.

    ``max_restarts``: when a task fails, stop every task and start the whole run again (fresh
    ports, a TF_CONFIG for each task, ``GRAPHDIST_RESTART=k`` after k restarts), as the restart
    policy decides (:mod:`graphdist._proc.restarts`): at most ``max_restarts`` times within any
    ``restart_window_s`` seconds, after a back-off (BACKOFF); a run whose attempts fail three
    times in a row within ``min_uptime_s`` of starting gives up early (a start-up failure).
    ``preemption_exit_code`` (TensorFlow's 42; ``None``: off): an attempt whose every command
    task exits with it (``PreemptionCheckpointHandler`` after a SIGTERM) is a preemption,
    restarted at once without spending a restart, even with ``max_restarts=0``. ``timeout_s``
    bounds the whole run, back-offs included. The scripts resume from their last backup
    (:func:`graphdist.backup_and_restore`). ``log_dir``: a folder of the run's own,
    ``log_dir/run-N`` (:mod:`graphdist._distribute.runlogs`), gets every task's whole output
    (``attempt-K/TASK.log``, K from 1), the events, the exit statuses and the summary. A run
    that restarted, or has a ``log_dir``, ends with a summary (attempts, which task failed how
    and when, what each attempt resumed from, the time) on ``output``, however it ended.

    ``heartbeat_timeout_s`` (default :data:`HEARTBEAT_TIMEOUT_S`, at least 2 s; ``None``:
    off): a task stopped (SIGSTOP) that long, or whose server (every MWMS worker and PS task
    serves one) has not answered for that long, is frozen (:mod:`graphdist._distribute.heartbeat`):
    the launcher kills it, and the run fails or restarts as for a killed task. A failed or
    frozen task's attempt is stopped at once (its survivors cannot go on); a stop someone asked
    for (a signal, the timeout) gives each task's processes their grace period.

    ``backend="ray"`` runs the tasks as processes on a Ray cluster's nodes, one per node where
    there are nodes enough (:mod:`graphdist._distribute.rayrun`); ``address`` is the cluster's
    (``None``: ``RAY_ADDRESS``, else a Ray instance of this machine's own). Restarts, logs and
    the summary are as above. The command must be reachable on every node: it starts in this
    process's working folder where the node has it (shared storage), or with ``working_dir``
    in that folder as Ray ships it to each node (Ray's ``runtime_env`` ``working_dir``).
    """
    argv = _check_command(command)
    timeout_s = check_timeout_s(timeout_s, "timeout_s")
    count(max_restarts, "max_restarts", minimum=0)
    restart_window_s = check_timeout_s(
        restart_window_s, "restart_window_s", DEFAULT_RESTART_WINDOW_S
    )
    min_uptime_s = check_min_uptime(min_uptime_s)
    heartbeat_s = check_heartbeat_timeout(heartbeat_timeout_s)
    preemption_code = _check_preemption_code(preemption_exit_code)
    output_format = _check_output_format(output_format)
    flag(expose, "expose")
    _check_backend(backend, address)
    folder = _check_working_dir(working_dir, backend)
    base_env = {**os.environ, **check_env(env), "TF_USE_LEGACY_KERAS": "1"}
    stream = _check_output(output)
    if shutil.which(argv[0], path=base_env.get("PATH", os.defpath)) is None:
        # here, not as each task's exit code 127: the guard, not the launcher, starts the command
        where = "" if os.sep in argv[0] else " on PATH"
        raise ArgumentError(
            f"Cannot run {argv[0]!r}: no executable file by that name{where}",
            name="command",
            value=argv[0],
        )
    _counts(workers, ps, chief)  # checked before anything starts
    logs = None if log_dir is None else RunLogs(log_dir)
    policy = RestartPolicy(
        max_restarts, restart_window_s, what="the run", min_uptime_s=min_uptime_s
    )
    run = _Run(
        _Output(stream), output_format, logs, policy, timeout_s, preemption_code, heartbeat_s
    )
    procs: list[_TaskProcess] = []
    owns_ray = False
    if backend == "ray":
        from graphdist._fleet.ray import connect_ray

        owns_ray = connect_ray(address, {"working_dir": folder} if folder else None)
    try:
        with SignalScope() as signals:
            try:
                job = _Job(argv, workers, ps, chief, base_env, expose, backend, folder)
                return _run(job, procs, signals, run)
            except Interrupted as exc:  # the summary before the signal takes its course
                run.end(f"stopped by {exc.name}", show=True)
                raise
            except LaunchTimeoutError:
                run.end(f"timed out after {timeout_s:g} s", show=True)
                raise
    except Interrupted as exc:  # the caller's own handler took the signal and returned
        raise LaunchError(
            f"The run was stopped by {exc.name}; every task was stopped",
            [p.finish() for p in procs],
        ) from None
    finally:
        if logs is not None:
            logs.close()
        if owns_ray:
            import ray

            ray.shutdown()


def _check_working_dir(working_dir: object, backend: str) -> str | None:
    """``working_dir``: an existing folder, for Ray runs only (a local run is in this one)."""
    if working_dir is None:
        return None
    if backend != "ray":
        raise ArgumentError(
            "working_dir is shipped to Ray's nodes and needs backend='ray'",
            name="working_dir",
            value=working_dir,
        )
    if not isinstance(working_dir, (str, os.PathLike)) or not os.path.isdir(working_dir):
        raise ArgumentError(
            f"working_dir must be an existing folder, not {working_dir!r}",
            name="working_dir",
            value=working_dir,
        )
    return os.path.abspath(working_dir)


def _check_backend(backend: object, address: object) -> None:
    """``backend`` is ``"local"`` or ``"ray"`` (with Ray installed); ``address`` only with
    Ray."""
    if backend not in ("local", "ray"):
        raise ArgumentError(
            f"backend must be 'local' or 'ray', not {backend!r}", name="backend", value=backend
        )
    if address is not None and (backend != "ray" or not isinstance(address, str) or not address):
        raise ArgumentError(
            f"address ({address!r}) is a Ray cluster's HOST:PORT and needs backend='ray'",
            name="address",
            value=address,
        )
    if backend == "ray" and importlib.util.find_spec("ray") is None:
        raise ArgumentError(
            "backend='ray' needs Ray: pip install 'graphdist[ray]'",
            name="backend",
            value=backend,
        )


def _run(job: _Job, procs: list[_TaskProcess], signals: SignalScope, run: _Run) -> list[TaskResult]:
    """The attempts of a run, until one succeeds or the restart policy gives up."""
    policy = run.policy
    while True:
        procs.clear()
        try:
            results = _attempt(job, procs, signals, run)
        except _Preempted as exc:
            decision = policy.failed(preempted=True)
            run.emit("preempted", code=exc.code, decision=decision.words())
            policy.restarted(decision)
            run.attempt += 1
            continue
        except TaskExitError as exc:
            ended_at = getattr(exc, "ended_at_s", time.monotonic() - run.started)
            cause = run.cause(exc.failed, ended_at)
            decision = policy.failed()
            if not decision.restart:
                reason = decision.reason if policy.max_restarts else "failed"
                run.emit("gave-up", cause=cause, reason=reason, decision=decision.words())
                if not policy.max_restarts:
                    run.end("failed", show=run.logs is not None)
                    raise
                run.end("failed", show=True)
                gave_up = f" in attempt {run.attempt}; {decision.words()}"
                hint = (
                    "; raise max_restarts or restart_window_s to allow more"
                    if decision.reason == "budget"
                    else "; read its last lines, or raise min_uptime_s if its start takes longer"
                )
                raise TaskExitError(
                    f"Task {_describe(exc.failed, gave_up + hint)}\n  the other tasks were stopped",
                    exc.results,
                    exc.failed,
                ) from None
            run.emit(
                "restarting",
                cause=cause,
                wait_s=decision.wait_s,
                scope="run",
                decision=decision.words(),
            )
            run.backoff(decision.wait_s, signals, f"the run after attempt {run.attempt} failed")
            policy.restarted(decision)
            run.attempt += 1
            continue
        run.end("every task exited 0", show=run.attempt > 1 or run.logs is not None)
        return results


def _attempt(
    job: _Job, procs: list[_TaskProcess], signals: SignalScope, run: _Run
) -> list[TaskResult]:
    """One attempt of a run: a fresh cluster, its ps/worker servers (with ps tasks), one
    process per command task (appended to ``procs``), supervised until every one exits. Its
    ports, processes and files are all given back when it ends, however it ends."""
    from graphdist._distribute.tfconfig import tf_config
    from graphdist._fleet.local import LocalFleet

    if job.backend == "ray":
        from graphdist._distribute.rayrun import ray_attempt

        return ray_attempt(job, procs, signals, run)
    command, ps, expose, base_env = job.command, job.ps, job.expose, job.base_env
    cluster = launch_cluster(job.workers, ps, job.chief)
    fleet = None
    try:
        runners = [t for t in cluster if t.job == "chief"] if ps else list(cluster)
        runners = [t for t in runners if t.job in ("chief", "worker")]
        served = [job for job in ("worker", "ps") if ps and job in cluster]
        servers = [t.name for t in cluster if t.job in served]
        run.emit(
            "attempt-started",
            tasks=[t.name for t in runners],
            servers=servers,
            restarts=run.attempt - 1,
        )
        folder = None if run.logs is None else run.logs.attempt(run.attempt)
        if served:
            fleet = LocalFleet(cluster, jobs=served, expose=expose, log_dir=folder)
        if fleet is not None:
            with signals.interruptible():
                fleet.start()
        for task in runners:
            signals.check()
            address = server_bind_address(task, expose=expose)
            task_env = {
                **base_env,
                **(
                    shim_env(address, base_env.get("LD_PRELOAD"), inherit=True)
                    if address is not None
                    else {}
                ),
                "TF_CONFIG": tf_config(cluster, task.job, task.index).to_json(),
                "GRAPHDIST_TASK": task.name,
                "GRAPHDIST_RESTART": str(run.attempt - 1),
            }
            log_path = None if folder is None else os.path.join(folder, f"{task.name}.log")
            procs.append(_TaskProcess(task, command, task_env, run, log_path))
        run.policy.started()
        return _supervise(procs, signals, run, fleet)
    finally:  # no signal interrupts this: it is deferred to the end of the scope
        results = _end_tasks(procs, run)
        if fleet is not None:
            fleet.close()
            for server in fleet.tasks:
                run.emit(
                    "task-exited",
                    server.name,
                    pid=server.pid,
                    exitcode=server.exitcode,
                    how=how_ended(server.exitcode),
                    server=True,
                )
        release_ports(t.port for t in cluster)
        if run.logs is not None:
            run.logs.record_exits(run.attempt, _exit_rows(results, fleet))


def _end_tasks(procs: Sequence[_TaskProcess], run: _Run) -> list[TaskResult]:
    """The end of an attempt's command tasks, whatever ended it: those still running stopped,
    every one finished, and its exit told (``task-exited``)."""
    _stop([p for p in procs if p.running()], TASK_STOP_GRACE_S)
    results = [proc.finish() for proc in procs]
    for proc in procs:
        run.emit(
            "task-exited",
            proc.result.name,
            pid=proc.result.pid,
            exitcode=proc.result.exitcode,
            how=how_ended(proc.result.exitcode),
            ended_at_s=round(proc.ended_at_s(), 3),
        )
    return results


def _exit_rows(results: Sequence[TaskResult], fleet: Any) -> list[dict[str, Any]]:
    """How every task of an attempt ended, for the log folder's ``exits.json``."""
    tasks: list[Any] = [*results, *([] if fleet is None else fleet.tasks)]
    return [
        {"task": t.name, "pid": t.pid, "exitcode": t.exitcode, "how": how_ended(t.exitcode)}
        for t in tasks
    ]


def _heartbeat(procs: Sequence[_TaskProcess], run: _Run, fleet: Any) -> Heartbeat | None:
    """The attempt's heartbeat (None when the run has none): every command task at its
    TF_CONFIG address, and a ps run's servers."""
    if run.heartbeat_s is None:
        return None
    heartbeat = Heartbeat(run.heartbeat_s)
    for proc in procs:
        heartbeat.watch(proc.result.name, proc.result.task.address, proc.processes)
    for server in [] if fleet is None else fleet.tasks:
        heartbeat.watch(server.name, server.address, _server_processes(server))
    return heartbeat


def _server_processes(server: Any) -> Callable[[], list[int]]:
    return lambda: [server.pid] if server.pid is not None and server.alive else []


def _supervise(
    procs: list[_TaskProcess],
    signals: SignalScope,
    run: _Run,
    fleet: Any = None,
) -> list[TaskResult]:
    """Wait for every task to exit 0; stop the others when one fails or the time is up. With a
    fleet of ps/worker servers and restarts allowed: a dead worker is restarted on its address
    (within the restart budget: the coordinator carries on), a dead ps task fails the attempt
    (the next one starts the ps tasks and the coordinator again, which resumes). A task that
    exits with the preemption code waits for the others to do the same (a preemption). A task
    the heartbeat finds frozen is killed, and counts as failed."""
    heartbeat = _heartbeat(procs, run, fleet)
    try:
        return _watch(procs, signals, run, fleet, heartbeat)
    finally:
        if heartbeat is not None:
            heartbeat.close()


def _kill_frozen(procs: Sequence[_TaskProcess], frozen: Mapping[str, str]) -> None:
    """Kill every frozen command task (SIGKILL reaches a stopped process; its guard may be
    stopped too) and remember why."""
    for proc in procs:
        why = frozen.get(proc.result.name)
        if why is not None and proc.result.frozen is None:
            proc.result.frozen = why
            proc.signal(signal.SIGKILL)


def _watch(
    procs: list[_TaskProcess],
    signals: SignalScope,
    run: _Run,
    fleet: Any,
    heartbeat: Heartbeat | None,
) -> list[TaskResult]:
    deadline = run.deadline
    while True:
        frozen = {} if heartbeat is None else heartbeat.frozen()
        if fleet is not None:
            killed = _kill_frozen_servers(fleet, frozen)
            if run.policy.max_restarts:  # else as TensorFlow has it: the coordinator carries
                try:  # on without a worker
                    _check_servers(fleet, signals, run, heartbeat, killed)
                except TaskExitError:
                    _stop_broken(procs)
                    raise
        _kill_frozen(procs, frozen)
        codes = [p.ended() for p in procs]
        failed = next((p for p, c in zip(procs, codes, strict=True) if c not in (None, 0)), None)
        if failed is not None:
            code = failed.ended()
            if (
                code is not None
                and code == run.preemption_code
                and _all_preempted(procs, signals, run)
            ):
                _stop(procs, TASK_STOP_GRACE_S)
                raise _Preempted(code, [p.finish() for p in procs])
            ended_at = failed.ended_at_s()
            _stop_broken(procs)  # the failed one's guard may still be ending its tree
            results = [p.finish() for p in procs]
            error = TaskExitError(
                f"Task {_describe(failed.result)}\n  the other tasks were stopped",
                results,
                failed.result,
            )
            error.ended_at_s = ended_at  # type: ignore[attr-defined]
            raise error
        if all(c == 0 for c in codes):
            _stop(procs, TASK_STOP_GRACE_S)  # the guards end what the commands left behind
            return [p.finish() for p in procs]
        if deadline is not None and time.monotonic() > deadline:
            running = [p.result.name for p, c in zip(procs, codes, strict=True) if c is None]
            _stop(procs, TASK_STOP_GRACE_S)
            raise run.timed_out([p.finish() for p in procs], f"still running: {', '.join(running)}")
        with signals.interruptible():
            time.sleep(0.05)


def _all_preempted(procs: Sequence[_TaskProcess], signals: SignalScope, run: _Run) -> bool:
    """Whether every task exits with the preemption code, waiting up to PREEMPTION_WAIT_S (and
    the run's deadline) for the others to save their checkpoint and exit."""
    wait_until = time.monotonic() + PREEMPTION_WAIT_S
    if run.deadline is not None:
        wait_until = min(wait_until, run.deadline)
    while True:
        codes = [p.ended() for p in procs]
        if any(c is not None and c != run.preemption_code for c in codes):
            return False
        if all(c == run.preemption_code for c in codes):
            return True
        if time.monotonic() > wait_until:
            return False
        with signals.interruptible():
            time.sleep(0.05)


def _kill_frozen_servers(fleet: Any, frozen: Mapping[str, str]) -> dict[str, str]:
    """Kill a ps run's frozen servers: a dead one is what the coordinator and the restarts
    know how to handle (a frozen one holds the coordinator's steps until their timeout).
    ``{server: why}`` for those killed now."""
    killed = {}
    for server in fleet.tasks:
        if server.name in frozen and server.alive:
            killed[server.name] = frozen[server.name]
            fleet.kill(server.job, server.index)
    return killed


def _check_servers(
    fleet: Any,
    signals: SignalScope,
    run: _Run,
    heartbeat: Heartbeat | None = None,
    frozen: Mapping[str, str] | None = None,
) -> None:
    """A parameter-server run's dead servers: restart a worker on its address (the coordinator
    re-schedules its work and uses it again once back) while the policy allows; a dead ps task,
    or a worker beyond the budget, fails the attempt (TaskExitError). ``frozen``: the servers
    just killed because they were frozen, and why."""
    frozen = frozen or {}
    for server in fleet.dead_tasks():
        result = TaskResult(server.task, pid=server.pid, exitcode=server.exitcode)
        result.tail = server.log_tail()
        result.frozen = frozen.get(server.name)
        decision: Decision | None = None
        if server.job == "worker":
            decision = run.policy.failed(what=f"the server of {server.name}", startup=False)
        if decision is None or not decision.restart:
            why = (
                " (its server)"
                if server.job == "worker"
                else " (its server: its variables are lost)"
            )
            raise TaskExitError(
                f"Task {_describe(result, why)}\n  the other tasks were stopped",
                [result],
                result,
            )
        run.emit(
            "restarting",
            cause=run.cause(result, time.monotonic() - run.started),
            wait_s=decision.wait_s,
            scope="server",
            decision=decision.words(),
        )
        run.backoff(decision.wait_s, signals, f"the server of {server.name}")
        fleet.restart(server.job, server.index)
        if heartbeat is not None:
            heartbeat.watch(server.name, server.address, _server_processes(server))
        run.policy.restarted(decision)


def run_function(
    fn: Callable[..., Any],
    *args: Any,
    workers: int = 2,
    ps: int = 0,
    chief: bool = False,
    timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
    output: IO[str] | None = None,
    max_restarts: int = 0,
    restart_window_s: float = DEFAULT_RESTART_WINDOW_S,
    log_dir: str | os.PathLike[str] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Run ``fn(*args, **kwargs)`` in one fresh Python process per command task (as
    :func:`run_command`, restarts and logs included; TF_CONFIG is set before anything imports
    TensorFlow) and return ``{task name: return value}`` (of the attempt that succeeded).
    ``fn`` and its result must be picklable with ``dill``: ArgumentError before anything starts
    when ``fn`` is not callable or cannot be pickled; :class:`LaunchError` when a task exits 0
    without handing its result back (it called ``os._exit``, say)."""
    import dill

    if not callable(fn):
        raise ArgumentError(
            f"fn must be a callable to run in each task, not {show(fn)}", name="fn", value=fn
        )
    env = check_env(env)
    with tempfile.TemporaryDirectory(prefix="graphdist-run-") as tmp:
        payload = os.path.join(tmp, "payload.pkl")
        try:
            with open(payload, "wb") as f:
                dill.dump((fn, args, kwargs), f, recurse=True)
        except Exception as exc:
            raise ArgumentError(
                f"Cannot hand {show(fn)} and its arguments to the tasks: dill cannot pickle them "
                f"({type(exc).__name__}: {_cut(str(exc))})",
                name="fn",
                value=fn,
            ) from None
        path_env = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        results = run_command(
            [sys.executable, "-m", "graphdist._distribute.taskfn", payload, tmp],
            workers=workers,
            ps=ps,
            chief=chief,
            timeout_s=timeout_s,
            env={**env, "PYTHONPATH": path_env},
            output=output,
            max_restarts=max_restarts,
            restart_window_s=restart_window_s,
            log_dir=log_dir,
        )
        values = {}
        for result in results:
            try:
                with open(os.path.join(tmp, f"{result.name}.pkl"), "rb") as f:
                    values[result.name] = dill.load(f)
            except FileNotFoundError:
                raise LaunchError(
                    f"Task {result.name} exited with code 0 without handing back the result of "
                    f"{show(fn)}: did it end its process (os._exit, sys.exit) before returning?",
                    results,
                ) from None
        return values
