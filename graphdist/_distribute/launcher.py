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
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from graphdist._cluster import Cluster, Task
from graphdist._distribute.resume import RESUMED_PREFIX
from graphdist._exceptions import (
    ArgumentError,
    ClusterSpecError,
    LaunchError,
    LaunchTimeoutError,
    TaskExitError,
    TaskOutcome,
)
from graphdist._fleet.health import exited
from graphdist._net.loopback import server_bind_address, shim_env
from graphdist._proc.process import TASK_STOP_GRACE_S, descendants, guarded_argv, stop_all
from graphdist._proc.restarts import DEFAULT_RESTART_WINDOW_S, RestartBudget
from graphdist._proc.signals import Interrupted, SignalScope
from graphdist._validate import count
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

    @property
    def name(self) -> str:
        return self.task.name


def launch_cluster(workers: int, ps: int = 0, chief: bool = False) -> Cluster:
    """A cluster of ``chief`` (0 or 1), ``worker`` x ``workers`` and ``ps`` x ``ps`` on free
    loopback ports. Raises ArgumentError for bad counts, ClusterSpecError for ps without a
    chief."""
    count(workers, "workers")
    count(ps, "ps", minimum=0)
    if ps and not chief:
        raise ClusterSpecError(
            "A parameter-server run needs a coordinator: add --chief (chief=True); the chief runs "
            "the command while workers and ps tasks serve",
            ps,
        )
    counts = {"worker": workers}
    if ps:
        counts["ps"] = ps
    if chief:
        counts["chief"] = 1
    return Cluster.from_counts(counts)


class _TaskProcess:
    def __init__(
        self,
        task: Task,
        argv: Sequence[str],
        env: Mapping[str, str],
        out: Any,
        log_path: str | None = None,
    ) -> None:
        self.result = TaskResult(task)
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.resumed: str | None = None  # what it said it resumed from (RESUMED_PREFIX)
        self._log = open(log_path, "a", encoding="utf-8") if log_path else None  # noqa: SIM115
        self.proc = subprocess.Popen(
            guarded_argv(argv),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.result.pid = self.proc.pid
        self._reader = threading.Thread(target=self._pump, args=(out,), daemon=True)
        self._reader.start()

    def _pump(self, out: _Output) -> None:
        assert self.proc.stdout is not None
        prefix = f"[{self.result.name}] "
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self._tail.append(line)
            if self.resumed is None and line.startswith(RESUMED_PREFIX):
                self.resumed = "resumed from " + line[len(RESUMED_PREFIX) :]
            if self._log is not None:
                self._log.write(line + "\n")
                self._log.flush()
            out.write(prefix + line)

    def poll(self) -> int | None:
        return self.proc.poll()

    def running(self) -> bool:
        return self.proc.poll() is None

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
        self._reader.join(5.0)
        self.result.exitcode = self.proc.poll()
        self.result.tail = list(self._tail)
        if self._log is not None and not self._reader.is_alive():
            self._log.close()
        return self.result


class _Output:
    """Serialises whole prefixed lines from several reader threads onto one stream."""

    def __init__(self, stream: IO[str] | None) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def write(self, line: str) -> None:
        if self._stream is None:
            return
        with self._lock:
            self._stream.write(line + "\n")
            self._stream.flush()


def _stop(procs: Sequence[_TaskProcess], grace_s: float) -> None:
    stop_all(procs, grace_s)


def _describe(result: TaskOutcome, then: str = "") -> str:
    """``NAME exited with code N`` (``then`` after it), its last lines and a hint."""
    tail = "\n".join(f"    [{result.name}] {line}" for line in result.tail[-10:])
    return (
        exited(result.name, result.exitcode)
        + then
        + (f"; its last lines:\n{tail}" if tail else "")
        + _interpreter_hint(result.tail)
    )


def _interpreter_hint(tail: Sequence[str]) -> str:
    """What to do when a task's Python lacks TensorFlow or graphdist: most often the command's
    ``python`` is another interpreter than the one graphdist runs in."""
    missing = [m for m in ("tensorflow", "graphdist") if f"No module named '{m}'" in "".join(tail)]
    if not missing:
        return ""
    return (
        f"\n  the task's Python has no {missing[0]}: is the command's `python` another "
        f"interpreter than graphdist's ({sys.executable})? Run `graphdist run -- "
        f"{sys.executable} ...` or activate the environment graphdist is installed in"
    )


@dataclass
class _Failure:
    """One failed attempt of a run: which task failed, how, and when (seconds into the run)."""

    attempt: int
    task: str
    how: str
    at_s: float


@dataclass
class _Run:
    """What a run with restarts keeps across its attempts (for its summary)."""

    started: float = field(default_factory=time.monotonic)
    failures: list[_Failure] = field(default_factory=list)
    resumed: dict[int, str] = field(default_factory=dict)  # attempt -> what it resumed from

    def summary(self, attempts: int, outcome: str) -> str:
        lines = [
            f"graphdist: run summary: {attempts} attempt(s) in "
            f"{time.monotonic() - self.started:.1f} s; {outcome}"
        ]
        for f in self.failures:
            resumed = self.resumed.get(f.attempt + 1)  # attempts count from 0 here
            after = f"; attempt {f.attempt + 2} {resumed}" if resumed else ""
            lines.append(f"  attempt {f.attempt + 1}: {f.task} {f.how} at {f.at_s:.1f} s{after}")
        return "\n".join(lines)


def _log_folder(log_dir: str | os.PathLike[str] | None) -> str | None:
    """``log_dir`` made, and checked writable, before anything starts (ArgumentError)."""
    if log_dir is None:
        return None
    path = os.path.abspath(os.fspath(log_dir))
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ArgumentError(
            f"Cannot write logs to {path}: {exc.strerror or exc}; pass a writable --log-dir",
            name="log_dir",
            value=os.fspath(log_dir),
        ) from None
    return path


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
) -> list[TaskResult]:
    """Run ``command`` once per task of a fresh local cluster (see the module docstring).

    ``output`` receives the prefixed lines (default: ``sys.stdout``). Returns every command
    task's :class:`TaskResult` (all exit codes 0). Raises :class:`TaskExitError`,
    :class:`LaunchTimeoutError`, :class:`ClusterSpecError` for bad counts or
    :class:`ArgumentError` for an empty command, one that is not an executable, or a timeout that
    is not a finite number > 0. A stop signal during the run: see the module docstring.

    ``max_restarts``: when a task fails, stop every task and start the whole run again (fresh
    ports, a TF_CONFIG for each task, ``GRAPHDIST_RESTART=k`` in attempt k), at most this many
    times within any ``restart_window_s`` seconds, after a back-off (0.5 s, doubling, at most
    30 s: :mod:`graphdist._proc.restarts`); ``timeout_s`` bounds the whole run. The scripts
    resume from their last backup (:func:`graphdist.backup_and_restore`). ``log_dir``: every
    task's whole output also goes to ``log_dir/attempt-K/TASK.log``. A run that restarted, or
    has a ``log_dir``, ends with a summary (attempts, which task failed how and when, what each
    attempt resumed from, the time) on ``output``.
    """
    if not command:
        raise ArgumentError(
            "No command to run; put it after `--`, e.g. -- python train.py", name="command"
        )
    timeout_s = check_timeout_s(timeout_s, "timeout_s")
    count(max_restarts, "max_restarts", minimum=0)
    restart_window_s = check_timeout_s(
        restart_window_s, "restart_window_s", DEFAULT_RESTART_WINDOW_S
    )
    base_env = {**os.environ, **(env or {}), "TF_USE_LEGACY_KERAS": "1"}
    if shutil.which(command[0], path=base_env.get("PATH", os.defpath)) is None:
        # here, not as each task's exit code 127: the guard, not the launcher, starts the command
        where = "" if os.sep in command[0] else " on PATH"
        raise ArgumentError(
            f"Cannot run {command[0]!r}: no executable file by that name{where}",
            name="command",
            value=command[0],
        )
    launch_cluster(workers, ps, chief)  # the counts, checked before anything starts
    logs = _log_folder(log_dir)
    out = _Output(sys.stdout if output is None else output)
    budget = RestartBudget(max_restarts, restart_window_s)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    run = _Run()
    attempt = 0
    procs: list[_TaskProcess] = []
    try:
        with SignalScope() as signals:
            while True:
                procs = []
                try:
                    ctx = _Context(out, deadline, timeout_s, attempt, logs, budget, run)
                    results = _attempt(
                        command, workers, ps, chief, base_env, expose, procs, signals, ctx
                    )
                except TaskExitError as exc:
                    run.failures.append(
                        _Failure(
                            attempt,
                            exc.failed.name,
                            _how(exc.failed),
                            time.monotonic() - run.started,
                        )
                    )
                    _note_resumed(run, procs, attempt)
                    wait = budget.failed()
                    if wait is None:
                        if max_restarts or logs:
                            out.write(run.summary(attempt + 1, "failed"))
                        if not max_restarts:
                            raise
                        gave_up = (
                            f" in attempt {attempt + 1}; gave up after {budget.restarts} "
                            f"restart(s) (--max-restarts {max_restarts} within "
                            f"{restart_window_s:g} s)"
                        )
                        raise TaskExitError(
                            f"Task {_describe(exc.failed, gave_up)}\n  the other tasks were "
                            "stopped",
                            exc.results,
                            exc.failed,
                        ) from None
                    out.write(
                        f"graphdist: {exited(exc.failed.name, exc.failed.exitcode)}; every task "
                        f"was stopped; restarting the run in {wait:g} s (restart "
                        f"{budget.restarts + 1} of at most {max_restarts} within "
                        f"{restart_window_s:g} s)"
                    )
                    with signals.interruptible():
                        time.sleep(wait)
                    budget.restarted()
                    attempt += 1
                    continue
                _note_resumed(run, procs, attempt)
                if run.failures or logs:
                    out.write(run.summary(attempt + 1, "every task exited 0"))
                return results
    except Interrupted as exc:  # the caller's own handler took the signal and returned
        raise LaunchError(
            f"The run was stopped by {exc.name}; every task was stopped",
            [p.finish() for p in procs],
        ) from None


def _how(result: TaskOutcome) -> str:
    """``exited with code 1``, ``exited with code -9 (SIGKILL)``: how a task ended."""
    return exited("", result.exitcode).strip()


def _note_resumed(run: _Run, procs: Sequence[_TaskProcess], attempt: int) -> None:
    """Remember what attempt ``attempt`` said it resumed from (a chief's word first)."""
    for proc in sorted(procs, key=lambda p: p.result.task.job != "chief"):
        said = proc.resumed
        if said is not None and attempt:
            run.resumed.setdefault(attempt, said)
            return


@dataclass
class _Context:
    """What one attempt needs of its run."""

    out: _Output
    deadline: float | None
    timeout_s: float | None
    attempt: int
    logs: str | None
    budget: RestartBudget
    run: _Run


def _attempt(
    command: Sequence[str],
    workers: int,
    ps: int,
    chief: bool,
    base_env: Mapping[str, str],
    expose: bool,
    procs: list[_TaskProcess],
    signals: SignalScope,
    ctx: _Context,
) -> list[TaskResult]:
    """One attempt of a run: a fresh cluster, its ps/worker servers (with ps tasks), one
    process per command task (appended to ``procs``), supervised until every one exits."""
    from graphdist._distribute.tfconfig import tf_config
    from graphdist._fleet.local import LocalFleet

    cluster = launch_cluster(workers, ps, chief)
    runners = [t for t in cluster if t.job == "chief"] if ps else list(cluster)
    runners = [t for t in runners if t.job in ("chief", "worker")]
    served = [job for job in ("worker", "ps") if ps and job in cluster]
    attempt, out = ctx.attempt, ctx.out
    folder = None
    if ctx.logs is not None:
        folder = os.path.join(ctx.logs, f"attempt-{attempt}")
        os.makedirs(folder, exist_ok=True)
    fleet = LocalFleet(cluster, jobs=served, expose=expose, log_dir=folder) if served else None
    try:
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
                "GRAPHDIST_RESTART": str(attempt),
            }
            log_path = None if folder is None else os.path.join(folder, f"{task.name}.log")
            procs.append(_TaskProcess(task, command, task_env, out, log_path))
        return _supervise(procs, signals, ctx, fleet)
    finally:  # no signal interrupts this: it is deferred to the end of the scope
        _stop([p for p in procs if p.poll() is None], TASK_STOP_GRACE_S)
        for proc in procs:
            proc.finish()
        if fleet is not None:
            fleet.close()


def _supervise(
    procs: list[_TaskProcess],
    signals: SignalScope,
    ctx: _Context,
    fleet: Any = None,
) -> list[TaskResult]:
    """Wait for every task to exit 0; stop the others when one fails or the time is up. With a
    fleet of ps/worker servers and restarts allowed: a dead worker is restarted on its address
    (within the restart budget: the coordinator carries on), a dead ps task fails the attempt
    (the next one starts the ps tasks and the coordinator again, which resumes)."""
    deadline, timeout_s = ctx.deadline, ctx.timeout_s
    while True:
        if fleet is not None and ctx.budget.max_restarts:  # else as TensorFlow has it: the
            _check_servers(fleet, signals, ctx)  # coordinator carries on without a dead worker
        codes = [p.poll() for p in procs]
        failed = next((p for p, c in zip(procs, codes, strict=True) if c not in (None, 0)), None)
        if failed is not None:
            _stop([p for p in procs if p is not failed], TASK_STOP_GRACE_S)
            results = [p.finish() for p in procs]
            raise TaskExitError(
                f"Task {_describe(failed.result)}\n  the other tasks were stopped",
                results,
                failed.result,
            )
        if all(c == 0 for c in codes):
            return [p.finish() for p in procs]
        if deadline is not None and time.monotonic() > deadline:
            running = [p.result.name for p, c in zip(procs, codes, strict=True) if c is None]
            _stop(procs, TASK_STOP_GRACE_S)
            raise LaunchTimeoutError(
                f"The run did not finish within {timeout_s:g} s (still running: "
                f"{', '.join(running)}); every task was stopped; raise --timeout if it needs "
                "longer",
                [p.finish() for p in procs],
            )
        with signals.interruptible():
            time.sleep(0.05)


def _check_servers(fleet: Any, signals: SignalScope, ctx: _Context) -> None:
    """A parameter-server run's dead servers: restart a worker on its address (the coordinator
    re-schedules its work and uses it again once back) while the budget allows; a dead ps task,
    or a worker beyond the budget, fails the attempt (TaskExitError)."""
    for server in fleet.dead_tasks():
        result = TaskResult(server.task, pid=server.pid, exitcode=server.exitcode)
        result.tail = server.log_tail()
        wait = ctx.budget.failed() if server.job == "worker" else None
        if wait is None:
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
        elapsed = time.monotonic() - ctx.run.started
        ctx.run.failures.append(_Failure(ctx.attempt, server.task.name, _how(result), elapsed))
        ctx.out.write(
            f"graphdist: the server of {exited(server.task.name, server.exitcode)}; restarting it "
            f"on {server.address} in {wait:g} s (restart {ctx.budget.restarts + 1} of at most "
            f"{ctx.budget.max_restarts} within {ctx.budget.window_s:g} s); the coordinator "
            "carries on"
        )
        with signals.interruptible():
            time.sleep(wait)
        fleet.restart(server.job, server.index)
        ctx.budget.restarted()


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
    ``fn`` and its result must be picklable with ``dill``."""
    import dill

    with tempfile.TemporaryDirectory(prefix="graphdist-run-") as tmp:
        payload = os.path.join(tmp, "payload.pkl")
        with open(payload, "wb") as f:
            dill.dump((fn, args, kwargs), f, recurse=True)
        path_env = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        results = run_command(
            [sys.executable, "-m", "graphdist._distribute.taskfn", payload, tmp],
            workers=workers,
            ps=ps,
            chief=chief,
            timeout_s=timeout_s,
            env={**(env or {}), "PYTHONPATH": path_env},
            output=output,
            max_restarts=max_restarts,
            restart_window_s=restart_window_s,
            log_dir=log_dir,
        )
        values = {}
        for result in results:
            with open(os.path.join(tmp, f"{result.name}.pkl"), "rb") as f:
                values[result.name] = dill.load(f)
        return values
