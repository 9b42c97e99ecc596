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
from graphdist._exceptions import (
    ArgumentError,
    ClusterSpecError,
    LaunchError,
    LaunchTimeoutError,
    TaskExitError,
)
from graphdist._fleet.health import exited
from graphdist._net.loopback import server_bind_address, shim_env
from graphdist._proc.process import TASK_STOP_GRACE_S, descendants, guarded_argv, stop_all
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
    def __init__(self, task: Task, argv: Sequence[str], env: Mapping[str, str], out: Any) -> None:
        self.result = TaskResult(task)
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
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


def _describe(result: TaskResult) -> str:
    tail = "\n".join(f"    [{result.name}] {line}" for line in result.tail[-10:])
    return (
        exited(result.name, result.exitcode)
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
) -> list[TaskResult]:
    """Run ``command`` once per task of a fresh local cluster (see the module docstring).

    ``output`` receives the prefixed lines (default: ``sys.stdout``). Returns every command
    task's :class:`TaskResult` (all exit codes 0). Raises :class:`TaskExitError`,
    :class:`LaunchTimeoutError`, :class:`ClusterSpecError` for bad counts or
    :class:`ArgumentError` for an empty command, one that is not an executable, or a timeout that
    is not a finite number > 0. A stop signal during the run: see the module docstring.
    """
    from graphdist._distribute.tfconfig import tf_config
    from graphdist._fleet.local import LocalFleet

    if not command:
        raise ArgumentError(
            "No command to run; put it after `--`, e.g. -- python train.py", name="command"
        )
    timeout_s = check_timeout_s(timeout_s, "timeout_s")
    base_env = {**os.environ, **(env or {}), "TF_USE_LEGACY_KERAS": "1"}
    if shutil.which(command[0], path=base_env.get("PATH", os.defpath)) is None:
        # here, not as each task's exit code 127: the guard, not the launcher, starts the command
        where = "" if os.sep in command[0] else " on PATH"
        raise ArgumentError(
            f"Cannot run {command[0]!r}: no executable file by that name{where}",
            name="command",
            value=command[0],
        )
    cluster = launch_cluster(workers, ps, chief)
    runners = [t for t in cluster if t.job == "chief"] if ps else list(cluster)
    runners = [t for t in runners if t.job in ("chief", "worker")]
    served = [job for job in ("worker", "ps") if ps and job in cluster]
    out = _Output(sys.stdout if output is None else output)

    fleet = LocalFleet(cluster, jobs=served, expose=expose) if served else None
    procs: list[_TaskProcess] = []
    try:
        with SignalScope() as signals:
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
                    }
                    procs.append(_TaskProcess(task, command, task_env, out))
                return _supervise(procs, timeout_s, signals)
            finally:  # no signal interrupts this: it is deferred to the end of the scope
                _stop([p for p in procs if p.poll() is None], TASK_STOP_GRACE_S)
                if fleet is not None:
                    fleet.close()
    except Interrupted as exc:  # the caller's own handler took the signal and returned
        raise LaunchError(
            f"The run was stopped by {exc.name}; every task was stopped",
            [p.finish() for p in procs],
        ) from None


def _supervise(
    procs: list[_TaskProcess], timeout_s: float | None, signals: SignalScope
) -> list[TaskResult]:
    """Wait for every task to exit 0; stop the others when one fails or the time is up."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
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


def run_function(
    fn: Callable[..., Any],
    *args: Any,
    workers: int = 2,
    ps: int = 0,
    chief: bool = False,
    timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
    output: IO[str] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Run ``fn(*args, **kwargs)`` in one fresh Python process per command task (as
    :func:`run_command`; TF_CONFIG is set before anything imports TensorFlow) and return
    ``{task name: return value}``. ``fn`` and its result must be picklable with ``dill``."""
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
        )
        values = {}
        for result in results:
            with open(os.path.join(tmp, f"{result.name}.pkl"), "rb") as f:
                values[result.name] = dill.load(f)
        return values
