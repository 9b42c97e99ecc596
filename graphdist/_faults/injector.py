"""The runner of fault injection (see :mod:`graphdist._faults.faults` for what it does):
:class:`FaultInjector` runs the launcher, reads its output, finds the tasks' processes and
signals them when their faults are due, and cleans up whatever a run left."""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from graphdist._cluster import MAX_TASKS, MAX_TASKS_PER_JOB
from graphdist._distribute.events import Event, render
from graphdist._exceptions import ArgumentError
from graphdist._faults.freezer import Freezer
from graphdist._faults.runargs import (
    check_command,
    check_cwd,
    check_faults,
    check_launcher_args,
    check_log_dir,
    launcher_argv,
)
from graphdist._faults.runstate import (
    Frozen,
    Pending,
    Run,
    alive,
    environ_of,
    marked_procs,
    pump,
    remove_freezers,
    signal_all,
    start_time,
    wait_gone,
)
from graphdist._proc.process import stop_processes
from graphdist._validate import check_env, count, flag
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
        self._runs: list[Run] = []
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
        argv_command = check_command(command)
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
        args = check_launcher_args(launcher_args)
        extra_env = check_env(env)
        folder = check_cwd(cwd)
        logs = check_log_dir(log_dir)
        checked = check_faults(faults, workers, ps, chief, max_restarts)
        argv = launcher_argv(
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
        run = Run(argv, mark, self._start(argv, full_env, folder), ps)
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

    def _watch(self, run: Run, faults: list[Fault], wait_s: float) -> bool:
        """Read the output and inject the faults until the launcher has exited and its output
        is read; True if it had to be stopped after ``wait_s``."""
        for pipe, name in ((run.launcher.stdout, "stdout"), (run.launcher.stderr, "stderr")):
            reader = threading.Thread(
                target=pump, args=(pipe, name, run.lines), daemon=True, name=f"faults-{name}"
            )
            reader.start()
            run.readers.append(reader)
        pending = [Pending(f) for f in faults]
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

    def _drain(self, run: Run) -> None:
        for reader in run.readers:
            reader.join(5.0)
        while True:
            try:
                stream, text, at = run.lines.get_nowait()
            except queue.Empty:
                return
            if text is not None:
                self._line(run, [], stream, text, at)

    def _line(self, run: Run, pending: list[Pending], stream: str, text: str, at: float) -> None:
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

    def _timers(self, run: Run, pending: list[Pending]) -> None:
        """Make ``after_s`` faults due; thaw the freezes whose time has come."""
        for p in pending:
            fault = p.fault
            if p.due_since is not None or fault.after_s is None or fault.attempt != run.attempt:
                continue
            found = self._find(run, fault.task, fault.attempt)
            now = time.clock_gettime(time.CLOCK_BOOTTIME)  # start_time's clock
            if found is not None and now >= start_time(found[0]) + fault.after_s:
                p.due_since = time.monotonic()
        now = time.monotonic()
        for frozen in run.frozen:
            if frozen.thaw_at is not None and now >= frozen.thaw_at:
                frozen.thaw_at = None
                if frozen.thaw():
                    frozen.record.thawed_at_s = run.now()

    def _fire_due(self, run: Run, pending: list[Pending]) -> None:
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
        self, run: Run, fault: Fault, found: list[psutil.Process], line: str | None
    ) -> None:
        head = found[0]
        freezer = None
        if fault.action == "kill":
            pids = signal_all(found, signal.SIGKILL)
            confirmed = not wait_gone(found, GONE_WAIT_S)
        elif fault.action == "hang":
            freezer = Freezer()
            pids = freezer.add(p.pid for p in found)
            more = [c for c in self._tree(run, found) if c.pid not in {p.pid for p in found}]
            pids += freezer.add(p.pid for p in more)
            found = [*found, *more]
            confirmed = freezer.freeze()
        else:
            pids = signal_all(found, signal.SIGSTOP)
            # a child forked while its parent was being stopped: stop it too
            more = [c for c in self._tree(run, found) if c.pid not in {p.pid for p in found}]
            pids += signal_all(more, signal.SIGSTOP)
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
            run.frozen.append(Frozen(record, found, thaw_at, freezer))

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

    def _miss_rest(self, run: Run, pending: list[Pending], why: str | None) -> None:
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

    def _scan(self, run: Run) -> list[psutil.Process]:
        """The launcher's live descendants, each remembered for the final sweep, and the
        ``GRAPHDIST_RESTART`` values among them."""
        import psutil

        from graphdist._proc.process import descendants

        if run.launcher.returncode is not None:
            # reaped: its pid is free, maybe another process's already, whose tree is not the
            # run's (the final sweep would SIGCONT and SIGKILL it): what was seen is all
            return [p for p in run.seen.values() if alive(p)]
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
                env = environ_of(proc)
                value = (env or {}).get("GRAPHDIST_RESTART", "")
                if env is not None and "GRAPHDIST_TASK" in env and value.isdigit():
                    run.restart_values.add(int(value))
            found.append(proc)
        return found

    def _tree(self, run: Run, top: Iterable[psutil.Process]) -> list[psutil.Process]:
        import psutil

        out: list[psutil.Process] = []
        for proc in top:
            with contextlib.suppress(psutil.Error):
                for child in proc.children(recursive=True):
                    run.seen.setdefault(child.pid, child)
                    out.append(child)
        return out

    def _find(self, run: Run, task: str, attempt: int) -> list[psutil.Process] | None:
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
                    if " ".join(proc.cmdline()).startswith(title) and alive(proc):
                        return [proc, *self._tree(run, [proc])]
            return None
        pid = run.guards.get((task, attempt))
        guard = next((p for p in procs if p.pid == pid), None)
        if guard is None:
            return None
        children = []
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                if proc.ppid() == guard.pid and alive(proc):
                    children.append(proc)
        children.sort(key=start_time)
        if not children:
            return None
        rest = [p for p in self._tree(run, children) if alive(p)]
        unique = {p.pid: p for p in [*children, *rest]}
        return list(unique.values())

    # -- ending --

    def _stop_launcher(self, run: Run) -> None:
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

    def _thaw(self, run: Run) -> None:
        """SIGCONT whatever this run froze and did not thaw (a stopped process takes no
        SIGTERM: it would be left stopped)."""
        for frozen in run.frozen:
            if frozen.thaw() and frozen.record.thawed_at_s is None:
                frozen.record.thawed_at_s = run.now()
            frozen.thaw_at = None

    def _end(self, run: Run) -> None:
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

    def _kill_all(self, run: Run) -> list[int]:
        """SIGKILL every process of the run still there (seen or marked); the pids of those
        that are not gone after :data:`GONE_WAIT_S`."""
        procs = {p.pid: p for p in run.seen.values() if alive(p)}
        procs.update({p.pid: p for p in marked_procs(run.mark)})
        live = [p for p in procs.values() if alive(p)]
        signal_all(live, signal.SIGCONT)
        signal_all(live, signal.SIGKILL)
        left = sorted(p.pid for p in wait_gone(live, GONE_WAIT_S))
        remove_freezers(run)
        return left

    def _sweep(self, run: Run) -> list[int]:
        """After the launcher has exited: the pids of the run's processes still there after
        :data:`GONE_WAIT_S` (they are then SIGKILLed)."""
        procs = {p.pid: p for p in run.seen.values()}
        procs.update({p.pid: p for p in marked_procs(run.mark)})
        left = wait_gone(procs.values(), GONE_WAIT_S)
        if left:
            self._kill_all(run)
        remove_freezers(run)
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
