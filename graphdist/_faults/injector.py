"""The runner of fault injection (see :mod:`graphdist._faults.faults` for what it does):
:class:`FaultInjector` runs the launcher, reads its output, finds the tasks' processes and
signals them when their faults are due, and cleans up whatever a run left."""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING

from graphdist._cluster import MAX_TASKS, MAX_TASKS_PER_JOB
from graphdist._distribute.events import Event, render
from graphdist._exceptions import ArgumentError
from graphdist._faults.freezer import Freezer
from graphdist._proc.process import marked, stop_processes
from graphdist._validate import check_argv, check_env, count, flag, show
from graphdist._validate import timeout_s as check_timeout_s

if TYPE_CHECKING:
    import psutil

from graphdist._faults.faults import (
    DEFAULT_RUN_TIMEOUT_S,
    DUE_WAIT_S,
    GONE_WAIT_S,
    MARK_ENV,
    MAX_RESTARTS,
    RUN_MARGIN_S,
    SCAN_S,
    STOP_WAIT_S,
    STREAMS_WAIT_S,
    Fault,
    Injected,
    Missed,
    OutputLine,
    RunOutcome,
    freeze,
    hang,
    kill,
)

__all__ = ["FaultInjector"]

_marks = itertools.count()  # each run's mark: this process's pid, this count, a random part


# --- the runner -----------------------------------------------------------------------------------


def _launcher_argv(
    command: Sequence[str],
    workers: int,
    ps: int,
    chief: bool,
    max_restarts: int | None,
    restart_window_s: float | None,
    timeout_s: float | None,
    log_dir: str | os.PathLike[str] | None,
    expose: bool,
    launcher_args: Sequence[str],
) -> list[str]:
    argv = [sys.executable, "-m", "graphdist", "run", "--workers", str(workers)]
    if ps:
        argv += ["--ps", str(ps)]
    if chief:
        argv.append("--chief")
    if max_restarts is not None:
        argv += ["--max-restarts", str(max_restarts)]
    if restart_window_s is not None:
        argv += ["--restart-window", repr(restart_window_s)]
    if timeout_s is not None:
        argv += ["--timeout", repr(timeout_s)]
    if log_dir is not None:
        argv += ["--log-dir", os.fspath(log_dir)]
    if expose:
        argv.append("--expose")
    # events, not words: the launcher's structured output (graphdist._distribute.events)
    argv += ["--output-format", "jsonl"]
    return [*argv, *launcher_args, "--", *command]


def _text(value: object, name: str, what: str) -> str:
    """``value`` (a str or an ``os.PathLike`` of one) as a str that a process can be given: no
    NUL character (``subprocess`` would refuse it with a bare ValueError after the checks)."""
    text = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(text, str):
        raise ArgumentError(f"{name} must be {what}, not {show(value)}", name=name, value=value)
    if "\0" in text:
        raise ArgumentError(
            f"{name} must not contain a NUL character: {show(text)}", name=name, value=value
        )
    return text


def _check_command(command: object) -> list[str]:
    argv = check_argv(command, "command")
    if not argv:
        raise ArgumentError(
            "command must be a non-empty list of str, e.g. [sys.executable, 'train.py'], not []",
            name="command",
            value=command,
        )
    return argv


def _check_launcher_args(launcher_args: object) -> list[str]:
    return check_argv(launcher_args, "launcher_args")


def _check_cwd(cwd: object) -> str | None:
    if cwd is None:
        return None
    path = _text(cwd, "cwd", "a folder (str or os.PathLike)")
    if not os.path.isdir(path):
        raise ArgumentError(
            f"cwd must be an existing folder, not {show(path)}", name="cwd", value=cwd
        )
    return path


def _check_log_dir(log_dir: object) -> str | None:
    if log_dir is None:
        return None
    path = _text(log_dir, "log_dir", "a folder (str or os.PathLike)")
    if not path:
        raise ArgumentError("log_dir must be a folder, not ''", name="log_dir", value=log_dir)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ArgumentError(
            f"log_dir must be a folder (made if missing), not {show(path)}: it is a file",
            name="log_dir",
            value=log_dir,
        )
    return path


def _check_faults(
    faults: object, workers: int, ps: int, chief: bool, max_restarts: int | None
) -> list[Fault]:
    if isinstance(faults, Fault):
        faults = [faults]
    if isinstance(faults, str | bytes | Mapping) or not isinstance(faults, Iterable):
        raise ArgumentError(
            f"faults must be a list of faults made by kill(...) or freeze(...), not {show(faults)}",
            name="faults",
            value=faults,
        )
    checked = list(faults)
    tasks = {f"worker-{i}" for i in range(workers)} | {f"ps-{i}" for i in range(ps)}
    tasks |= {"chief-0"} if chief else set()
    runners = {"chief-0"} if ps else {t for t in tasks if not t.startswith("ps-")}
    cluster = f"--workers {workers}" + (f" --ps {ps}" if ps else "") + (" --chief" if chief else "")
    for fault in checked:
        if not isinstance(fault, Fault):
            raise ArgumentError(
                f"faults must be made by kill(...) or freeze(...), not {show(fault)}",
                name="faults",
                value=fault,
            )
        for name, task in (("task", fault.task), ("of", fault.of)):
            if task is not None and task not in tasks:
                raise ArgumentError(
                    f"{fault!r}: no task {task!r} in a run of {cluster} (its tasks: "
                    f"{', '.join(sorted(tasks))})",
                    name=name,
                    value=task,
                )
        if fault.after is not None and fault.watched not in runners:
            raise ArgumentError(
                f"{fault!r}: {fault.watched} runs no command in a run of {cluster}, so it prints "
                f"no lines to wait for; watch a task that does with of= "
                f"({', '.join(sorted(runners))}), or use after_s=",
                name="of",
                value=fault.watched,
            )
        most = max_restarts or 0
        if fault.attempt > most:
            raise ArgumentError(
                f"{fault!r}: attempt {fault.attempt} cannot happen with max_restarts="
                f"{max_restarts} (attempts are 0 to {most}); raise max_restarts",
                name="attempt",
                value=fault.attempt,
            )
    return checked


def _environ(proc: psutil.Process) -> dict[str, str] | None:
    import psutil

    try:
        return proc.environ()
    except psutil.Error:
        return None


def _alive(proc: psutil.Process) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal(procs: Iterable[psutil.Process], sig: int) -> list[int]:
    """Send ``sig`` to each process still running (a reused pid is refused by psutil)."""
    import psutil

    sent = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)
            sent.append(proc.pid)
    return sent


def _wait_gone(procs: Iterable[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    pending = list(procs)
    deadline = time.monotonic() + timeout_s
    while True:
        pending = [p for p in pending if _alive(p)]
        if not pending or time.monotonic() >= deadline:
            return pending
        time.sleep(0.05)


def _marked(mark: str) -> list[psutil.Process]:
    """Every live process with ``MARK_ENV=mark`` in its environment, wherever it is."""
    import psutil

    found = []
    for pid in marked(mark, env=MARK_ENV):
        with contextlib.suppress(psutil.Error):
            found.append(psutil.Process(pid))
    return found


@dataclass
class _Pending:
    fault: Fault
    due_since: float | None = None  # monotonic, once its condition held
    line: str | None = None


@dataclass
class _Frozen:
    record: Injected
    procs: list[psutil.Process]
    thaw_at: float | None  # monotonic
    freezer: Freezer | None = None  # a hang's cgroup; None: a freeze (SIGSTOP)

    def thaw(self) -> bool:
        """SIGCONT (a freeze) or thaw the cgroup (a hang); whether anything was left."""
        live = [p for p in self.procs if _alive(p)]
        if self.freezer is not None:
            self.freezer.thaw()
            return bool(live)
        return bool(_signal(live, signal.SIGCONT))


@dataclass
class _Run:
    """One launcher run in progress."""

    argv: list[str]
    mark: str
    launcher: subprocess.Popen[bytes]
    ps: int
    started: float = field(default_factory=time.monotonic)
    lines: queue.Queue[tuple[str, str | None, float]] = field(default_factory=queue.Queue)
    output: list[OutputLine] = field(default_factory=list)
    seen: dict[int, psutil.Process] = field(default_factory=dict)
    restart_values: set[int] = field(default_factory=set)
    # (task, attempt from 0) -> its guard's pid, as the launcher's task-started event says:
    # a warm task's guard is no child of the launcher, and its environment (GRAPHDIST_TASK)
    # is not in its /proc/PID/environ (set after the fork, in memory)
    guards: dict[tuple[str, int], int] = field(default_factory=dict)
    # each guard as it was when the run said it started: a reused pid is not it (is_running)
    guard_procs: dict[int, psutil.Process] = field(default_factory=dict)
    attempt: int = 0  # the launcher's current attempt (GRAPHDIST_RESTART), from its events
    summary_attempts: int = 0
    events: list[Event] = field(default_factory=list)
    injected: list[Injected] = field(default_factory=list)
    missed: list[Missed] = field(default_factory=list)
    frozen: list[_Frozen] = field(default_factory=list)
    readers: list[threading.Thread] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.started


class FaultInjector:
    """Runs commands under ``graphdist run`` and injects faults (see the module docstring).
    What is left of every run is stopped by :meth:`close` (the ``graphdist_faults`` fixture
    calls it at teardown)::

        def test_my_training_survives_a_dead_worker(graphdist_faults, tmp_path):
            outcome = graphdist_faults.run(
                [sys.executable, "train.py", "--out", str(tmp_path)],
                workers=2,
                max_restarts=1,
                faults=[graphdist_faults.kill("worker-1", after=r"epoch 2/\\d+ done")],
            )
            assert outcome.returncode == 0, outcome
            assert outcome.attempts == 2
    """

    kill = staticmethod(kill)
    freeze = staticmethod(freeze)
    hang = staticmethod(hang)

    def __init__(self) -> None:
        self._runs: list[_Run] = []
        self._closed = False

    def __repr__(self) -> str:
        return f"<FaultInjector {len(self._runs)} run(s){' closed' if self._closed else ''}>"

    def run(
        self,
        command: Sequence[str],
        *,
        faults: Iterable[Fault] | Fault = (),
        workers: int = 2,
        ps: int = 0,
        chief: bool = False,
        max_restarts: int | None = None,
        restart_window_s: float | None = None,
        timeout_s: float | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        expose: bool = False,
        launcher_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        wait_s: float | None = None,
    ) -> RunOutcome:
        """Run ``graphdist run --workers WORKERS [--ps PS] [--chief] [--max-restarts N]
        [--restart-window S] [--timeout S] [--log-dir DIR] [--expose] [LAUNCHER_ARGS] --
        COMMAND`` (a flag only when its argument is given: the launcher's defaults otherwise)
        in ``cwd`` (default: this process's), with ``env`` over this process's environment;
        inject ``faults``; wait for the launcher to exit and return the :class:`RunOutcome`.

        ``wait_s``: how long to wait for the launcher before stopping it (SIGTERM, then
        SIGKILL after :data:`STOP_WAIT_S`; ``outcome.timed_out``); default ``timeout_s`` +
        :data:`RUN_MARGIN_S` with a ``timeout_s``, else :data:`DEFAULT_RUN_TIMEOUT_S` (600 s):
        a run never waits forever. ``max_restarts`` is at most :data:`MAX_RESTARTS`; ``chief``
        and ``expose`` are ``True`` or ``False`` (never read by truthiness). Raises
        :class:`ArgumentError` naming the argument for a bad value, before anything starts.
        """
        if self._closed:
            raise ArgumentError("This FaultInjector is closed; use a new one", name="self")
        argv_command = _check_command(command)
        expose = flag(expose, "expose")
        chief = flag(chief, "chief")
        count(workers, "workers", maximum=MAX_TASKS_PER_JOB)
        count(ps, "ps", minimum=0, maximum=MAX_TASKS_PER_JOB)
        if workers + ps + chief > MAX_TASKS:
            raise ArgumentError(
                f"A run has at most {MAX_TASKS} tasks in all, not {workers + ps + chief} "
                f"(workers={workers}, ps={ps}, chief={chief})",
                name="workers",
                value=workers,
            )
        if max_restarts is not None:
            count(max_restarts, "max_restarts", minimum=0, maximum=MAX_RESTARTS)
        restart_window_s = check_timeout_s(restart_window_s, "restart_window_s")
        timeout_s = check_timeout_s(timeout_s, "timeout_s")
        wait_s = check_timeout_s(
            wait_s,
            "wait_s",
            DEFAULT_RUN_TIMEOUT_S if timeout_s is None else timeout_s + RUN_MARGIN_S,
        )
        if ps and not chief:
            raise ArgumentError(
                "A parameter-server run needs chief=True (the chief runs the command)",
                name="chief",
                value=chief,
            )
        args = _check_launcher_args(launcher_args)
        extra_env = check_env(env)
        folder = _check_cwd(cwd)
        logs = _check_log_dir(log_dir)
        checked = _check_faults(faults, workers, ps, chief, max_restarts)
        argv = _launcher_argv(
            argv_command,
            workers,
            ps,
            chief,
            max_restarts,
            restart_window_s,
            timeout_s,
            logs,
            expose,
            args,
        )
        mark = f"{os.getpid()}-{next(_marks)}-{uuid.uuid4().hex[:8]}"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra_env, MARK_ENV: mark}
        run = _Run(argv, mark, self._start(argv, full_env, folder), ps)
        self._runs.append(run)
        try:
            timed_out = self._watch(run, checked, wait_s)
        finally:
            self._end(run)
        leftovers = self._sweep(run)
        return RunOutcome(
            argv=argv,
            mark=mark,
            returncode=run.launcher.returncode,
            output=run.output,
            injected=run.injected,
            missed=run.missed,
            attempts=max(run.attempt + 1, run.summary_attempts, len(run.restart_values)),
            restart_values=sorted(run.restart_values),
            elapsed_s=run.now(),
            timed_out=timed_out,
            pids=sorted(run.seen),
            leftovers=leftovers,
            wait_s=wait_s,
        )

    @staticmethod
    def _start(
        argv: list[str], env: dict[str, str], cwd: str | os.PathLike[str] | None
    ) -> subprocess.Popen[bytes]:
        from graphdist._proc.process import set_parent_death_signal

        def arm() -> None:  # between fork and exec: the launcher goes when this thread does
            set_parent_death_signal(signal.SIGTERM)

        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=cwd,
            start_new_session=True,  # a Ctrl-C of the test run reaches the run only through us
            preexec_fn=arm,
        )

    # -- watching the run --

    def _watch(self, run: _Run, faults: list[Fault], wait_s: float) -> bool:
        """Read the output and inject the faults until the launcher has exited and its output
        is read; True if it had to be stopped after ``wait_s``."""
        for pipe, name in ((run.launcher.stdout, "stdout"), (run.launcher.stderr, "stderr")):
            reader = threading.Thread(
                target=_pump, args=(pipe, name, run.lines), daemon=True, name=f"faults-{name}"
            )
            reader.start()
            run.readers.append(reader)
        pending = [_Pending(f) for f in faults]
        deadline = run.started + wait_s
        next_scan = 0.0
        open_streams = 2
        exited_at: float | None = None
        while open_streams or run.launcher.poll() is None:
            if exited_at is None and run.launcher.poll() is not None:
                exited_at = time.monotonic()
            elif exited_at is not None and time.monotonic() - exited_at > STREAMS_WAIT_S:
                break  # something the launcher left holds its output open: _sweep ends it
            try:
                stream, text, at = run.lines.get(timeout=0.05)
            except queue.Empty:
                pass
            else:
                if text is None:
                    open_streams -= 1
                else:
                    self._line(run, pending, stream, text, at)
            now = time.monotonic()
            if now >= next_scan:
                next_scan = now + SCAN_S
                self._scan(run)
                self._timers(run, pending)
            self._fire_due(run, pending)
            if now > deadline and run.launcher.poll() is None:
                self._stop_launcher(run)
                self._drain(run)
                self._miss_rest(run, pending, f"the run was stopped after wait_s={wait_s:g} s")
                return True
        self._miss_rest(run, pending, None)
        return False

    def _drain(self, run: _Run) -> None:
        for reader in run.readers:
            reader.join(5.0)
        while True:
            try:
                stream, text, at = run.lines.get_nowait()
            except queue.Empty:
                return
            if text is not None:
                self._line(run, [], stream, text, at)

    def _line(self, run: _Run, pending: list[_Pending], stream: str, text: str, at: float) -> None:
        """One line of the launcher's: on stdout an event (a task's line, or the run's own,
        kept in the words the console would show), on stderr text."""
        event = None
        if stream == "stdout":
            with contextlib.suppress(ValueError, KeyError, TypeError):
                event = Event.from_json(text)
        if event is None:
            run.output.append(OutputLine(stream, None, run.attempt, text, at - run.started))
            return
        attempt = event.attempt - 1  # the launcher counts from 1, GRAPHDIST_RESTART from 0
        if event.kind != "line":
            if event.kind == "attempt-started":
                run.attempt = max(run.attempt, attempt)
            elif event.kind == "run-ended":
                run.summary_attempts = int(event.data.get("attempts", 0))
            elif event.kind == "task-started" and event.task and event.data.get("pid"):
                run.guards[(event.task, attempt)] = int(event.data["pid"])
                import psutil

                with contextlib.suppress(psutil.Error):
                    guard = psutil.Process(int(event.data["pid"]))
                    run.guard_procs[guard.pid] = guard
                run.restart_values.add(attempt)
            words = render(event, run.events)
            run.events.append(event)
            for said in [] if words is None else words.splitlines():
                run.output.append(OutputLine(stream, None, attempt, said, at - run.started))
            return
        task, body = event.task, str(event.data.get("text", ""))
        run.output.append(OutputLine(stream, task, attempt, body, at - run.started))
        text = f"[{task}] {body}"
        for p in pending:
            fault = p.fault
            if (
                p.due_since is None
                and fault.after is not None
                and fault.watched == task
                and fault.attempt == attempt
                and fault.after.search(body)
            ):
                p.due_since, p.line = time.monotonic(), text

    def _timers(self, run: _Run, pending: list[_Pending]) -> None:
        """Make ``after_s`` faults due; thaw the freezes whose time has come."""
        for p in pending:
            fault = p.fault
            if p.due_since is not None or fault.after_s is None or fault.attempt != run.attempt:
                continue
            found = self._find(run, fault.task, fault.attempt)
            if found is not None and time.time() >= _started(found[0]) + fault.after_s:
                p.due_since = time.monotonic()
        now = time.monotonic()
        for frozen in run.frozen:
            if frozen.thaw_at is not None and now >= frozen.thaw_at:
                frozen.thaw_at = None
                if frozen.thaw():
                    frozen.record.thawed_at_s = run.now()

    def _fire_due(self, run: _Run, pending: list[_Pending]) -> None:
        for p in [p for p in pending if p.due_since is not None]:
            fault = p.fault
            found = self._find(run, fault.task, fault.attempt)
            if found is None:
                if (
                    time.monotonic() - (p.due_since or 0.0) > DUE_WAIT_S
                    or run.attempt > fault.attempt
                ):
                    pending.remove(p)
                    due_at = (p.due_since or run.started) - run.started
                    run.missed.append(
                        Missed(
                            fault,
                            f"it was due at {due_at:.1f} s, "
                            f"but no live process of {fault.task} in attempt {fault.attempt} "
                            "was found",
                        )
                    )
                continue
            pending.remove(p)
            self._inject(run, fault, found, p.line)

    def _inject(
        self, run: _Run, fault: Fault, found: list[psutil.Process], line: str | None
    ) -> None:
        head = found[0]
        freezer = None
        if fault.action == "kill":
            pids = _signal(found, signal.SIGKILL)
            confirmed = not _wait_gone(found, GONE_WAIT_S)
        elif fault.action == "hang":
            freezer = Freezer()
            pids = freezer.add(p.pid for p in found)
            more = [c for c in self._tree(run, found) if c.pid not in {p.pid for p in found}]
            pids += freezer.add(p.pid for p in more)
            found = [*found, *more]
            confirmed = freezer.freeze()
        else:
            pids = _signal(found, signal.SIGSTOP)
            # a child forked while its parent was being stopped: stop it too
            more = [c for c in self._tree(run, found) if c.pid not in {p.pid for p in found}]
            pids += _signal(more, signal.SIGSTOP)
            found = [*found, *more]
            confirmed = self._seen_stopped(head)
        record = Injected(
            fault,
            fault.task,
            head.pid,
            pids,
            fault.attempt,
            run.now(),
            line,
            confirmed,
        )
        run.injected.append(record)
        if fault.action in ("freeze", "hang"):
            thaw_at = None if fault.for_s is None else time.monotonic() + fault.for_s
            run.frozen.append(_Frozen(record, found, thaw_at, freezer))

    @staticmethod
    def _seen_stopped(proc: psutil.Process) -> bool:
        import psutil

        deadline = time.monotonic() + GONE_WAIT_S
        while time.monotonic() < deadline:
            try:
                if proc.status() == psutil.STATUS_STOPPED:
                    return True
            except psutil.Error:
                return False
            time.sleep(0.01)
        return False

    def _miss_rest(self, run: _Run, pending: list[_Pending], why: str | None) -> None:
        for p in pending:
            fault = p.fault
            if why is not None:
                reason = why
            elif fault.attempt > run.attempt:
                reason = (
                    f"the run ended in attempt {run.attempt}; attempt {fault.attempt} never came"
                )
            elif fault.after is not None:
                reason = (
                    f"no line of {fault.watched} in attempt {fault.attempt} matched "
                    f"{fault.after.pattern!r}"
                )
            else:
                reason = (
                    f"{fault.task}'s process in attempt {fault.attempt} was not seen running "
                    f"{fault.after_s:g} s after it started"
                )
            run.missed.append(Missed(fault, reason))

    # -- finding a task's processes --

    def _scan(self, run: _Run) -> list[psutil.Process]:
        """The launcher's live descendants, each remembered for the final sweep, and the
        ``GRAPHDIST_RESTART`` values among them."""
        import psutil

        from graphdist._proc.process import descendants

        if run.launcher.returncode is not None:
            # reaped: its pid is free, maybe another process's already, whose tree is not the
            # run's (the final sweep would SIGCONT and SIGKILL it): what was seen is all
            return [p for p in run.seen.values() if _alive(p)]
        found = []
        # a warm agent's session forks the tasks' guards (graphdist warm): not the launcher's
        # descendants, they are found from the guards the run said it started
        pids = descendants(run.launcher.pid)
        mine = set(pids)
        for guard in list(run.guard_procs.values()):
            if guard.pid not in mine and guard.is_running():
                pids += [guard.pid, *(p for p in descendants(guard.pid) if p not in mine)]
        for pid in dict.fromkeys(pids):
            proc = run.seen.get(pid)
            if proc is None or not proc.is_running():
                try:
                    proc = psutil.Process(pid)
                except psutil.Error:
                    continue
                run.seen[pid] = proc
                env = _environ(proc)
                value = (env or {}).get("GRAPHDIST_RESTART", "")
                if env is not None and "GRAPHDIST_TASK" in env and value.isdigit():
                    run.restart_values.add(int(value))
            found.append(proc)
        return found

    def _tree(self, run: _Run, top: Iterable[psutil.Process]) -> list[psutil.Process]:
        import psutil

        out: list[psutil.Process] = []
        for proc in top:
            with contextlib.suppress(psutil.Error):
                for child in proc.children(recursive=True):
                    run.seen.setdefault(child.pid, child)
                    out.append(child)
        return out

    def _find(self, run: _Run, task: str, attempt: int) -> list[psutil.Process] | None:
        """``task``'s processes in ``attempt``, its command (or server) first; None if none
        is alive."""
        import psutil

        procs = self._scan(run)
        job = task.split("-")[0]
        if run.ps and job in ("worker", "ps"):
            if run.attempt != attempt:
                return None
            title = f"graphdist {job}:{task.split('-')[1]} (fleet of pid {run.launcher.pid})"
            for proc in procs:
                with contextlib.suppress(psutil.Error):
                    if " ".join(proc.cmdline()).startswith(title) and _alive(proc):
                        return [proc, *self._tree(run, [proc])]
            return None
        pid = run.guards.get((task, attempt))
        guard = next((p for p in procs if p.pid == pid), None)
        if guard is None:
            return None
        children = []
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                if proc.ppid() == guard.pid and _alive(proc):
                    children.append(proc)
        children.sort(key=_started)
        if not children:
            return None
        rest = [p for p in self._tree(run, children) if _alive(p)]
        unique = {p.pid: p for p in [*children, *rest]}
        return list(unique.values())

    # -- ending --

    def _stop_launcher(self, run: _Run) -> None:
        """SIGTERM the launcher (it stops its tasks), SIGKILL all of the run after
        :data:`STOP_WAIT_S`."""
        self._thaw(run)
        late: list[object] = []

        def before_kill(live: Sequence[object]) -> None:
            if live:  # what the launcher left is seen before it goes
                late.extend(live)
                self._scan(run)

        stop_processes([run.launcher], STOP_WAIT_S, GONE_WAIT_S, before_kill=before_kill)
        if late:
            self._kill_all(run)

    def _thaw(self, run: _Run) -> None:
        """SIGCONT whatever this run froze and did not thaw (a stopped process takes no
        SIGTERM: it would be left stopped)."""
        for frozen in run.frozen:
            if frozen.thaw() and frozen.record.thawed_at_s is None:
                frozen.record.thawed_at_s = run.now()
            frozen.thaw_at = None

    def _end(self, run: _Run) -> None:
        """However the watch ended (an exception included): the launcher gone, its output
        read, nothing of the run left stopped."""
        if run.launcher.poll() is None:
            self._stop_launcher(run)
        self._thaw(run)
        self._drain(run)
        for stream in (run.launcher.stdout, run.launcher.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()

    def _kill_all(self, run: _Run) -> list[int]:
        """SIGKILL every process of the run still there (seen or marked); the pids of those
        that are not gone after :data:`GONE_WAIT_S`."""
        procs = {p.pid: p for p in run.seen.values() if _alive(p)}
        procs.update({p.pid: p for p in _marked(run.mark)})
        live = [p for p in procs.values() if _alive(p)]
        _signal(live, signal.SIGCONT)
        _signal(live, signal.SIGKILL)
        left = sorted(p.pid for p in _wait_gone(live, GONE_WAIT_S))
        _remove_freezers(run)
        return left

    def _sweep(self, run: _Run) -> list[int]:
        """After the launcher has exited: the pids of the run's processes still there after
        :data:`GONE_WAIT_S` (they are then SIGKILLed)."""
        procs = {p.pid: p for p in run.seen.values()}
        procs.update({p.pid: p for p in _marked(run.mark)})
        left = _wait_gone(procs.values(), GONE_WAIT_S)
        if left:
            self._kill_all(run)
        _remove_freezers(run)
        return sorted(p.pid for p in left)

    def close(self) -> list[int]:
        """Stop whatever is left of every run (the launcher, its descendants, anything with the
        run's mark): SIGCONT, SIGKILL, then check with psutil. Returns the pids still alive
        after that (normally none). Safe to call twice."""
        survivors: list[int] = []
        for run in self._runs:
            if run.launcher.poll() is None:
                self._scan(run)
                with contextlib.suppress(ProcessLookupError):
                    run.launcher.kill()
                run.launcher.wait()
            survivors += self._kill_all(run)
        self._closed = True
        return survivors


def _remove_freezers(run: _Run) -> None:
    """A hang's cgroup goes once its processes have (or they go back to the root cgroup)."""
    for frozen in run.frozen:
        if frozen.freezer is not None:
            frozen.freezer.remove()


def _started(proc: psutil.Process) -> float:
    import psutil

    try:
        return proc.create_time()
    except psutil.Error:
        return math.inf


def _pump(
    stream: IO[bytes] | None, name: str, lines: queue.Queue[tuple[str, str | None, float]]
) -> None:
    """Put each line of ``stream`` on ``lines`` with when it was read; ``None`` at its end."""
    try:
        if stream is not None:
            for raw in stream:
                lines.put((name, raw.decode("utf-8", "replace").rstrip("\r\n"), time.monotonic()))
    except (OSError, ValueError):
        pass
    finally:
        lines.put((name, None, time.monotonic()))
