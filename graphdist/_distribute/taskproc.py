"""A run's task processes and what they show: :class:`TaskResult` (how a task ended), the
output machinery every backend's task shares (:class:`TaskOutput`: its pipe drained to its end
whatever the sinks do, lines cut at :data:`LINE_LIMIT`, its log file, its tail), the local
task under graphdist's guard (:class:`GuardedTask`), the console (:class:`Output`) and the words
of a failed task (:func:`describe`).

A backend's task is a :class:`TaskOutput` that also answers what the supervising loop asks
(:class:`TaskProcess`): whether its command ended and when, its processes (for the heartbeat),
a signal, and its result once it is gone.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

from graphdist._cluster import Task
from graphdist._distribute.events import Event, OutputLost, Payload, Resumed, TaskStarted
from graphdist._distribute.liveline import LiveLine
from graphdist._distribute.resume import RESUMED_PREFIX, tf_keras_requirement
from graphdist._distribute.runlogs import RunLogs
from graphdist._distribute.warm import WarmProc, Zygote, warm_target
from graphdist._exceptions import TaskOutcome
from graphdist._failures import how_ended
from graphdist._proc import oom
from graphdist._proc.guardreport import parse_progress, parse_report
from graphdist._proc.marks import MARK_ENV, end_marked
from graphdist._proc.process import STOP_GRACE_S, descendants, guarded_argv

__all__ = [
    "GRAPHDIST_PYTHON",
    "LINE_LIMIT",
    "GuardedTask",
    "Output",
    "RunSink",
    "TaskOutput",
    "TaskProcess",
    "TaskResult",
    "cut",
    "describe",
    "how",
    "interpreter_hint",
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
    lost: str | None = None  # its node was lost with it (a backend's words: Slurm's node failure)
    oom: str | None = None  # it was killed for memory: ``out of memory (...)``, from the record
    straggler: str | None = None  # why it was stopped as a straggler (--restart-stragglers)

    @property
    def name(self) -> str:
        return self.task.name


class RunSink(Protocol):
    """What a task process tells its run: its lines, its events, graphdist's own notes."""

    started: float  # the run's start, time.monotonic()
    out: Output

    def line(self, task: str, text: str) -> None: ...

    def emit(self, payload: Payload, task: str | None = None) -> Event: ...

    def progress(self, task: str, record: Mapping[str, Any]) -> None: ...


class TaskProcess(Protocol):
    """A command task as the supervising loop sees it, on any backend."""

    result: TaskResult

    def ended(self) -> int | None: ...

    def ended_at_s(self) -> float: ...

    def running(self) -> bool: ...

    def processes(self) -> list[int] | None: ...

    def signal(self, sig: int) -> None: ...

    def preempt(self) -> None:
        """SIGTERM to the task's command as a preemption notice (TensorFlow's preemption
        handler saves and exits 42): not a stop, so no grace period runs out meanwhile."""
        ...

    def finish(self) -> TaskResult: ...


class TaskOutput:
    """What every kind of task process keeps of its output: its result, its tail, its log file,
    and the reading of its output in chunks (:meth:`_drain`), which a backend's task feeds from
    wherever the output comes (a pipe, a Ray actor)."""

    def _start_output(self, task: Task, run: RunSink, log_path: str | None) -> None:
        self.result = TaskResult(task)
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._run = run
        self._resumed = False
        self._log = RunLogs.open(log_path) if log_path else None
        self._log_path = log_path
        self._finished = False

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
            self._run.emit(Resumed(line[len(RESUMED_PREFIX) :]), self.result.name)

    def _to_log(self, chunk: bytes) -> None:
        if self._log is None:
            return
        try:
            self._log.write(chunk)
        except (OSError, ValueError) as exc:  # a full disk, a file system gone read-only
            self._close_log()
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self._run.emit(OutputLost(self._log_path, why), self.result.name)

    def _close_log(self) -> None:
        log, self._log = self._log, None
        if log is not None:
            with contextlib.suppress(OSError):
                log.close()


class GuardedTask(TaskOutput):
    """A command task as a local process under graphdist's guard (:func:`graphdist._proc.
    process.guarded_argv`): the guard's reports (the command's pid and when it ended, the
    command's progress records), the thread that drains its output, its log."""

    #: Whether the command is the task itself, whose guard relays its progress records, or
    #: ``"step"``: an engine's step (``srun``), whose stderr carries them from the guard on its
    #: node (a channel in its environment would travel to another host).
    RELAYS_PROGRESS: bool | str = True

    def __init__(
        self,
        task: Task,
        argv: Sequence[str],
        env: Mapping[str, str],
        run: RunSink,
        log_path: str | None = None,
        grace_s: float = STOP_GRACE_S,
        stdin: bytes | None = None,
        zygote: Zygote | None = None,
        cold_because: str | None = "this backend runs no warm interpreter",
    ) -> None:
        self._start_output(task, run, log_path)
        self.mark = secrets.token_hex(12)  # every process of the task carries it (MARK_ENV)
        self.command_pid: int | None = None
        self.command_exit: tuple[int, float] | None = None  # (code, when: run seconds)
        self._oom_asked = False
        oom.shared()  # the kernel's log is read from before the task starts
        self._started_s = time.monotonic()
        env = {**env, MARK_ENV: self.mark}
        report_r, report_w = os.pipe2(os.O_CLOEXEC)
        try:
            warm = None
            if zygote is not None:
                warm = self._start_warm(zygote, task, argv, env, grace_s, report_w, stdin)
                cold_because = warm if isinstance(warm, str) else ""
            if isinstance(warm, WarmProc):
                self.proc: subprocess.Popen[bytes] | WarmProc = warm
            else:
                self.proc = subprocess.Popen(
                    guarded_argv(
                        argv,
                        grace_s=grace_s,
                        name=task.name,
                        report_fd=report_w,
                        progress=self.RELAYS_PROGRESS,
                    ),
                    env=env,
                    stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
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
        # cold_because None: argv is a warm client of its node's agent (graphdist._distribute
        # .nodewarm), the task forked warm there
        self.warm = isinstance(self.proc, WarmProc) or cold_because is None
        run.emit(
            TaskStarted(
                self.proc.pid,
                self.warm,
                None if self.warm else cold_because,
                spare=isinstance(self.proc, WarmProc) and self.proc.spare,
            ),
            task.name,
        )
        if stdin is not None and self.proc.stdin is not None:  # what the command reads, then EOF
            assert self.proc.stdin is not None
            with contextlib.suppress(OSError):  # a command gone already says so itself
                self.proc.stdin.write(stdin)
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        os.set_blocking(report_r, False)
        self._report_lock = threading.Lock()
        self._report = report_r
        self._report_buf = b""
        self.result.pid = self.proc.pid
        self._reader = threading.Thread(
            target=self._pump, daemon=True, name=f"graphdist-run-{task.name}"
        )
        self._reader.start()

    @staticmethod
    def _start_warm(
        zygote: Zygote,
        task: Task,
        argv: Sequence[str],
        env: Mapping[str, str],
        grace_s: float,
        report_w: int,
        stdin: bytes | None,
    ) -> WarmProc | str:
        """The task forked from ``zygote`` (:mod:`graphdist._distribute.warm`), or why it runs
        cold instead."""
        if stdin is not None:
            return "its stdin is fed by graphdist"
        if not zygote.alive:
            return "the run's warm interpreter is gone"
        target = warm_target(argv, env, zygote.env, zygote.preload)
        if isinstance(target, str):
            return target
        try:
            return zygote.spawn(
                argv, target, env, name=task.name, grace_s=grace_s, report_fd=report_w
            )
        except OSError as exc:
            return f"the warm interpreter could not fork it ({exc})"

    # -- the guard's reports ---------------------------------------------------------------

    def _read_report(self) -> None:
        with self._report_lock:  # the loop and the run's readers (failed_now) both read it
            self._read_report_locked()

    def _read_report_locked(self) -> None:
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
        whole, _, self._report_buf = self._report_buf.rpartition(b"\n")
        for record in parse_progress(whole):  # in order: the lock is held (RunState's is brief)
            self._run.progress(self.result.name, record)
        pid, end = parse_report(whole)
        if pid is not None:
            self.command_pid = pid
        if end is not None and self.command_exit is None:
            # the guard's wall clock, which hosts agree on (a node's monotonic clock is its
            # own): how long ago it ended, from now on this run's clock
            ago = time.time() - end[1]
            self.command_exit = (end[0], time.monotonic() - ago - self._run.started)

    @property
    def report_fd(self) -> int | None:
        """The guard's report pipe, readable when it has news (the command's pid, its end): the
        supervising loop wakes on it, so a death is known at once; None once it closed."""
        return self._report if self._report >= 0 else None

    def failed_now(self, ok: Sequence[int | None]) -> bool:
        """Whether the guard has reported the command's end with a code not in ``ok``; from any
        thread (a task's reader: the attempt is broken from the moment a death is known, and
        a survivor's first line of its fall may come before the loop looks)."""
        self._read_report()
        return self.command_exit is not None and self.command_exit[0] not in ok

    def ended(self) -> int | None:
        """The task's exit code once its command has ended: as its guard reports it (before it
        ends what the command left behind), or as the guard exits (a guard that was killed)."""
        self._read_report()
        code = self.command_exit[0] if self.command_exit is not None else self.proc.poll()
        if code == -signal.SIGKILL and not self._oom_asked:  # killed: for memory, says the kernel?
            self._oom_asked = True
            killed = oom.shared().killed(self.command_pid, self._started_s)
            if killed is not None:
                self.result.oom = killed.words()
        return code

    def ended_at_s(self) -> float:
        """When the task's command ended (seconds into the run): as the guard saw it, else now."""
        self._read_report()
        if self.command_exit is not None:
            return self.command_exit[1]
        return time.monotonic() - self._run.started

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

    def preempt(self) -> None:
        """SIGTERM to the command itself, which its guard reported; its guard keeps watching
        (a stop would give the command only the guard's grace to save its checkpoint)."""
        self._read_report()
        if not self.running():
            return
        if self.command_pid is None:
            self.signal(signal.SIGTERM)
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.command_pid, signal.SIGTERM)

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
        with self._report_lock:
            if self._report >= 0:
                os.close(self._report)
                self._report = -1
        with contextlib.suppress(OSError):  # the pipe's end, if the reader still holds it
            if not self._reader.is_alive() and self.proc.stdout is not None:
                self.proc.stdout.close()
        return self.result


class Output:
    """Serialises whole lines from several threads onto one stream. A stream that fails (its
    reader went away: ``| head``; a full disk) is dropped with one line on stderr: the run goes
    on, the tasks' pipes keep draining."""

    def __init__(self, stream: IO[str] | None, kept: str | None = None) -> None:
        self._stream = stream
        self._had_stream = stream is not None
        self._kept = kept  # where every line is kept all the same (a run's log folder), if any
        self.lock = threading.Lock()  # one line at a time, the live line's draws included
        self.live: LiveLine | None = None  # the run's live line on a terminal, cleared first

    def write(self, line: str) -> None:
        with self.lock:
            stream = self._stream
            if stream is None:
                return
            try:
                if self.live is not None and self.live.shown:
                    self.live.before_line()
                stream.write(line + "\n")
                stream.flush()
            except (OSError, ValueError) as exc:
                self._stream = None
                if self.live is not None:  # drawn no more (its stop takes this lock)
                    self.live.shown = False
                self._lost(stream, exc)

    @property
    def lost(self) -> bool:
        """Whether the stream failed (its lines are dropped, said once on stderr)."""
        with self.lock:
            return self._stream is None and self._had_stream

    def note(self, line: str) -> None:
        """graphdist's own line about the run: on the stream, or on stderr once it failed."""
        with self.lock:
            lost = self._stream is None
        if lost:
            with contextlib.suppress(OSError, ValueError):
                print(line, file=sys.stderr, flush=True)
        else:
            self.write(line)

    def _lost(self, stream: IO[str], exc: BaseException) -> None:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        if stream is sys.stderr:
            return
        kept = (
            f"{self._kept} keeps every line"
            if self._kept is not None
            else "pass --log-dir to keep every line"
        )
        with contextlib.suppress(OSError, ValueError):
            print(
                f"graphdist: cannot write the run's output any more ({why}); the run goes on "
                f"without it ({kept})",
                file=sys.stderr,
                flush=True,
            )


def how(result: TaskOutcome) -> str:
    """How a task ended, in words: as its exit code says, frozen and killed, or lost with its
    node."""
    ran_out = getattr(result, "oom", None)
    if ran_out is not None:
        return f"ran {ran_out}"
    frozen = getattr(result, "frozen", None)
    if frozen is not None:
        return f"was frozen ({frozen}) and was killed"
    lost = getattr(result, "lost", None)
    if lost is not None:
        return f"was lost with its node ({lost})"
    slow = getattr(result, "straggler", None)
    if slow is not None:
        return f"was a straggler ({slow}) and was killed"
    return how_ended(result.exitcode)


def describe(result: TaskOutcome, then: str = "", command: Sequence[str] = ()) -> str:
    """``NAME exited with code N`` (``then`` after it), its last lines and a hint; ``command``:
    the task's command, which the hint puts right when its Python is the wrong one."""
    tail = "\n".join(f"    [{result.name}] {cut(line)}" for line in result.tail[-10:])
    return (
        f"{result.name} {how(result)}"
        + then
        + (f"; its last lines:\n{tail}" if tail else "")
        + interpreter_hint(result.tail, command)
    )


def cut(line: str) -> str:
    """One output line as an error message quotes it: at most MESSAGE_LINE_CHARS characters."""
    if len(line) <= MESSAGE_LINE_CHARS:
        return line
    return f"{line[:MESSAGE_LINE_CHARS]} [... {len(line) - MESSAGE_LINE_CHARS} more characters]"


_UNFIXABLE = re.compile(
    r"^(?:(?:ModuleNotFoundError|ImportError|SyntaxError|IndentationError|TabError): .*"
    r"|\S*python[\d.]*: (?:can't open file .*|No module named .*"
    r"|Error while finding module specification for .*))$"
)
"""The last line of a Python task that failed in a way no restart fixes: a module it imports
is missing, its code does not parse, its script or ``-m`` module does not exist (a dotted
``-m a.b`` whose package is missing says "Error while finding module specification")."""


def unfixable_error(tail: Sequence[str]) -> str | None:
    """The error line of a task's output (``tail``) that says it failed in a way no restart
    fixes (:data:`_UNFIXABLE`), or ``None``."""
    lines = [_SGR.sub("", line).strip() for line in tail if line.strip()]
    if lines and _UNFIXABLE.match(lines[-1]):
        return lines[-1]
    return None


# Colour codes (ECMA-48 SGR): Python 3.13 colours a traceback written to a terminal, as a task's
# stderr is under srun --unbuffered (its pty) or a warm task's
_SGR = re.compile(r"\x1b\[[0-9;]*m")


#: The words before the command a wrong-Python hint gives; the CLI puts its own options there.
GRAPHDIST_PYTHON = "Give it graphdist's Python: "


def interpreter_hint(tail: Sequence[str], command: Sequence[str] = ()) -> str:
    """What to do when a task's Python lacks TensorFlow or graphdist: most often the command's
    ``python`` is another interpreter than the one graphdist runs in (``command``, the task's,
    with graphdist's interpreter in its place: a command to copy); or tf-keras, which the
    run's ``TF_USE_LEGACY_KERAS=1`` makes ``tf.keras``: the ``distribute`` extra has it."""
    text = "".join(tail)
    missing = [m for m in ("tensorflow", "numpy", "graphdist") if f"No module named '{m}'" in text]
    if not missing and ("Keras cannot be imported" in text or "No module named 'tf_keras'" in text):
        return (
            "\n  the task's Python has no tf-keras, tf.keras in a run (graphdist run sets "
            "TF_USE_LEGACY_KERAS=1: Keras 3 cannot fit under MultiWorkerMirroredStrategy); install "
            f"the one that matches TensorFlow: `{sys.executable} -m pip install "
            f"'{tf_keras_requirement()}'` (or, from graphdist's clone, `pip install "
            "'.[distribute]'`)"
        )
    if not missing:
        return ""
    instead = f"Start it with {sys.executable}"
    if command and re.fullmatch(r"python[\d.]*", os.path.basename(command[0])):
        instead = f"{GRAPHDIST_PYTHON}`{shlex.join([sys.executable, *command[1:]])}`"
    return (
        f"\n  the task's Python has no {missing[0]}: is the command's `python` another "
        f"interpreter than graphdist's ({sys.executable})? {instead}, "
        "or activate the environment graphdist is installed in"
    )
