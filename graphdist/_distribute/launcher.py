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

import os
import signal
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

from graphdist._distribute.events import Preempted
from graphdist._distribute.heartbeat import HEARTBEAT_TIMEOUT_S
from graphdist._distribute.resume import RESUMED_PREFIX
from graphdist._distribute.runbackends import check_options, run_backend
from graphdist._distribute.runlogs import RunLogs
from graphdist._distribute.runspec import PREEMPTION_EXIT_CODE, RunSpec, launch_cluster
from graphdist._distribute.supervise import RunState, run_attempts
from graphdist._distribute.taskproc import LINE_LIMIT, TaskProcess, TaskResult, cut
from graphdist._exceptions import (
    ArgumentError,
    LaunchError,
    LaunchTimeoutError,
    TaskExitError,
)
from graphdist._proc.restarts import DEFAULT_MIN_UPTIME_S, DEFAULT_RESTART_WINDOW_S
from graphdist._proc.signals import Interrupted, SignalScope
from graphdist._validate import check_env, show

__all__ = [
    "LINE_LIMIT",
    "PREEMPTION_EXIT_CODE",
    "RESUMED_PREFIX",
    "LaunchError",
    "LaunchTimeoutError",
    "TaskExitError",
    "TaskResult",
    "launch_cluster",
    "run_command",
    "run_function",
]


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
    heartbeat_timeout_s: float | None = HEARTBEAT_TIMEOUT_S,
    tls: bool = False,
    metrics_file: str | os.PathLike[str] | None = None,
    restart_stragglers: bool = False,
    **options: Any,
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
    ``metrics_file``: a ``.prom`` file the run keeps its metrics in, in the Prometheus text
    format (attempts, restarts by cause, recovery times: :mod:`graphdist._distribute.
    runmetrics`), in a folder that exists and no one else can write to.
    ``restart_stragglers`` (needs ``max_restarts``): a task named a straggler (its steps per
    second below half the other tasks' median for 30 s: :mod:`graphdist._distribute.progress`)
    is killed, and the run restarts as for a killed task, its cause the straggler; by default
    a straggler is only named.

    ``heartbeat_timeout_s`` (default :data:`HEARTBEAT_TIMEOUT_S`, at least 2 s; ``None``:
    off): a task stopped (SIGSTOP) that long, or whose server (every MWMS worker and PS task
    serves one) has not answered for that long, is frozen (:mod:`graphdist._distribute.heartbeat`):
    the launcher kills it, and the run fails or restarts as for a killed task. A failed or
    frozen task's attempt is stopped at once (its survivors cannot go on); a stop someone asked
    for (a signal, the timeout) gives each task's processes their grace period.

    ``backend`` names a run backend (:mod:`graphdist._distribute.runbackends`); ``options`` are
    that backend's own, refused by any other. ``backend="ray"`` runs the tasks as processes on a
    Ray cluster's nodes, one per node where there are nodes enough
    (:mod:`graphdist._ray.run`); its option ``address`` is the cluster's
    (``None``: ``RAY_ADDRESS``, else a Ray instance of this machine's own). Restarts, logs and
    the summary are as above. The command must be reachable on every node: it starts in this
    process's working folder where the node has it (shared storage), or with ``working_dir``
    in that folder as Ray ships it to each node (Ray's ``runtime_env`` ``working_dir``).
    ``tls``: TLS mode for the run's tasks (:mod:`graphdist._net.gateway`), on the backends
    that build it (local, ray, slurm): every task's server on its host's loopback alias, the
    cluster in each TF_CONFIG the aliased one, mutual-TLS gateways between hosts (and, on the
    local backend, in front of this machine's address), fresh credentials for every attempt.
    """
    spec = RunSpec.check(
        command,
        tls=tls,
        workers=workers,
        ps=ps,
        chief=chief,
        timeout_s=timeout_s,
        env=env,
        expose=expose,
        output=output,
        max_restarts=max_restarts,
        restart_window_s=restart_window_s,
        log_dir=log_dir,
        min_uptime_s=min_uptime_s,
        preemption_exit_code=preemption_exit_code,
        output_format=output_format,
        heartbeat_timeout_s=heartbeat_timeout_s,
        backend=backend,
        metrics_file=metrics_file,
        restart_stragglers=restart_stragglers,
    )
    kind = run_backend(spec.backend)
    if spec.tls and not getattr(kind, "tls", False):
        raise ArgumentError(
            f"tls is not built for the {spec.backend} run backend (local, ray and slurm have "
            "it; a backend says so with tls = True); drop tls",
            name="tls",
            value=tls,
        )
    given = check_options(spec.backend, {k: v for k, v in options.items() if v is not None})
    spec = spec.with_options(kind.check_options(spec, given))
    logs = None if log_dir is None else RunLogs(log_dir)
    run = RunState(spec, logs)
    procs: list[TaskProcess] = []
    engine = None
    try:
        with SignalScope(notices=(signal.SIGUSR1,)) as signals:
            try:
                engine = kind(spec)
                return run_attempts(engine, procs, signals, run)
            except Interrupted as exc:  # the summary before the signal takes its course
                run.end(_stopped(exc, procs, run), show=True)
                raise
            except LaunchTimeoutError:
                run.end(f"timed out after {spec.timeout_s:g} s", show=True)
                raise
            except Exception as exc:  # every ending has its event and summary
                run.end(f"failed: {type(exc).__name__}", show=run.logs is not None)
                raise
            finally:
                # inside the scope: a stop signal whose handler is the default (SIGTERM,
                # SIGHUP) ends this process as the scope exits, so what the backend holds (a
                # Slurm run's agent steps, Ray's actors) is given back first; signals that come
                # meanwhile are noted, not acted on
                try:
                    run.close()  # the live line away, whatever it raises
                finally:
                    if logs is not None:
                        logs.close()
                    if engine is not None:
                        engine.close()
    except Interrupted as exc:  # the caller's own handler took the signal and returned
        raise LaunchError(
            f"The run was stopped by {exc.name}; every task was stopped",
            [p.finish() for p in procs],
        ) from None


def _stopped(exc: Interrupted, procs: Sequence[TaskProcess], run: RunState) -> str:
    """The outcome of a run a stop signal ended. Every task exiting with the preemption code
    (each saved its checkpoint: Slurm's scancel or requeue, a preempting job) is a preemption,
    told as such: the job's next run resumes from there."""
    codes = [p.result.exitcode for p in procs]
    code = run.preemption_code
    if code is not None and codes and all(c == code for c in codes):
        run.emit(
            Preempted(
                code,
                f"the run ends here (stopped by {exc.name}); a requeued job resumes from the "
                "tasks' checkpoint",
            )
        )
        return f"preempted (stopped by {exc.name})"
    return f"stopped by {exc.name}"


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
                f"({type(exc).__name__}: {cut(str(exc))})",
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
