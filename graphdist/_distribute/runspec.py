"""What a run is, checked once: :class:`RunSpec`, built by :meth:`RunSpec.check` at the library's
edge (:func:`graphdist.run_command`) from the caller's arguments. Every value is validated there,
before anything starts, and every layer below takes the typed spec as it is: the attempt loop
(:mod:`graphdist._distribute.supervise`), the run backends (:mod:`graphdist._distribute.
runbackends`) and their tasks. A backend's own options (Ray's ``address``) are checked by that
backend (:meth:`RunBackend.check_options`), which no other backend sees.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from graphdist._cluster import Cluster
from graphdist._distribute.heartbeat import HEARTBEAT_TIMEOUT_S, check_heartbeat_timeout
from graphdist._distribute.runmetrics import check_metrics_file
from graphdist._exceptions import ArgumentError, ClusterSpecError
from graphdist._net.policy import NetPolicy
from graphdist._proc.restarts import (
    DEFAULT_MIN_UPTIME_S,
    DEFAULT_RESTART_WINDOW_S,
    check_min_uptime,
)
from graphdist._validate import check_argv, check_env, count, flag, show
from graphdist._validate import timeout_s as check_timeout_s

__all__ = [
    "OUTPUT_FORMATS",
    "PREEMPTION_EXIT_CODE",
    "RunSpec",
    "counts",
    "launch_cluster",
]

#: The exit code of a task that stopped because it was preempted: TensorFlow's
#: ``PreemptionCheckpointHandler`` saves a checkpoint on SIGTERM and exits with it.
PREEMPTION_EXIT_CODE = 42
OUTPUT_FORMATS = ("text", "jsonl")


def counts(workers: int, ps: int, chief: bool) -> dict[str, int]:
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
    jobs = {"worker": workers}
    if ps:
        jobs["ps"] = ps
    if chief:
        jobs["chief"] = 1
    return jobs


def launch_cluster(workers: int, ps: int = 0, chief: bool = False) -> Cluster:
    """A cluster of ``chief`` (0 or 1), ``worker`` x ``workers`` and ``ps`` x ``ps`` on free
    loopback ports (reserved for this process until :func:`graphdist._ports.release_ports`).
    Raises ArgumentError for bad counts, ClusterSpecError for ps without a chief."""
    return Cluster.from_counts(counts(workers, ps, chief))


@dataclass(frozen=True)
class RunSpec:
    """A run, every value checked (:meth:`check`): what every attempt runs and how the run
    restarts, logs and ends. ``base_env`` is the environment every task starts from (the
    caller's, ``env`` over it, ``TF_USE_LEGACY_KERAS=1``); ``options`` are the chosen backend's
    own, as it checked them."""

    command: tuple[str, ...]
    workers: int
    ps: int
    chief: bool
    base_env: Mapping[str, str]
    output: IO[str]
    timeout_s: float | None = None
    expose: bool = False
    max_restarts: int = 0
    restart_window_s: float = DEFAULT_RESTART_WINDOW_S
    min_uptime_s: float = DEFAULT_MIN_UPTIME_S
    preemption_code: int | None = PREEMPTION_EXIT_CODE
    heartbeat_s: float | None = HEARTBEAT_TIMEOUT_S
    output_format: str = "text"
    log_dir: str | os.PathLike[str] | None = None
    backend: str = "local"
    options: Mapping[str, Any] = field(default_factory=dict)
    tls: bool = False
    metrics_file: str | None = None
    restart_stragglers: bool = False

    @property
    def jobs(self) -> dict[str, int]:
        """``{job: count}`` of the run's cluster."""
        return counts(self.workers, self.ps, self.chief)

    @property
    def served(self) -> tuple[str, ...]:
        """The jobs whose tasks are servers rather than the command (a ps run's worker and ps);
        the others (chief, worker) run the command."""
        return ("worker", "ps") if self.ps else ()

    @property
    def jsonl(self) -> bool:
        return self.output_format == "jsonl"

    @classmethod
    def check(
        cls,
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
        heartbeat_timeout_s: float | None = HEARTBEAT_TIMEOUT_S,
        backend: str = "local",
        tls: bool = False,
        metrics_file: str | os.PathLike[str] | None = None,
        restart_stragglers: bool = False,
    ) -> RunSpec:
        """The spec of a run from the caller's arguments (those of :func:`graphdist.
        run_command`), every one checked: ArgumentError or ClusterSpecError naming the first
        bad one, before anything starts. ``backend`` is a name only here: the caller looks it up
        (:func:`graphdist._distribute.runbackends.run_backend`), and the backend checks its own
        options (:meth:`with_options`)."""
        argv = _check_command(command)
        timeout = check_timeout_s(timeout_s, "timeout_s")
        count(max_restarts, "max_restarts", minimum=0)
        window = check_timeout_s(restart_window_s, "restart_window_s", DEFAULT_RESTART_WINDOW_S)
        uptime = check_min_uptime(min_uptime_s)
        heartbeat_s = check_heartbeat_timeout(heartbeat_timeout_s)
        preemption_code = _check_preemption_code(preemption_exit_code)
        fmt = _check_output_format(output_format)
        NetPolicy.checked(expose, None, tls, run=True)
        if not isinstance(backend, str) or not backend:
            raise ArgumentError(
                f"backend must be a run backend's name, not {show(backend)}",
                name="backend",
                value=backend,
            )
        base_env = {**os.environ, **check_env(env), "TF_USE_LEGACY_KERAS": "1"}
        stream = _check_output(output)
        if shutil.which(argv[0], path=base_env.get("PATH", os.defpath)) is None:
            # here, not as each task's exit code 127: the guard, not the launcher, starts it
            where = "" if os.sep in argv[0] else " on PATH"
            raise ArgumentError(
                f"Cannot run {argv[0]!r}: no executable file by that name{where}",
                name="command",
                value=argv[0],
            )
        counts(workers, ps, chief)
        if not isinstance(restart_stragglers, bool):
            raise ArgumentError(
                f"restart_stragglers must be True or False, not {show(restart_stragglers)}",
                name="restart_stragglers",
                value=restart_stragglers,
            )
        if restart_stragglers and not max_restarts:
            raise ArgumentError(
                "restart_stragglers needs max_restarts=N (N > 0): a straggler is killed and the "
                "run restarted, which no restart left would end",
                name="restart_stragglers",
                value=restart_stragglers,
            )
        metrics = None if metrics_file is None else check_metrics_file(metrics_file)
        spec = cls(
            command=tuple(argv),
            workers=workers,
            ps=ps,
            chief=chief,
            base_env=base_env,
            output=stream,
            timeout_s=timeout,
            expose=bool(expose),
            max_restarts=max_restarts,
            restart_window_s=window,
            min_uptime_s=uptime,
            preemption_code=preemption_code,
            heartbeat_s=heartbeat_s,
            output_format=fmt,
            log_dir=log_dir,  # RunLogs checks it when it makes it
            backend=backend,
            tls=bool(tls),
            metrics_file=metrics,
            restart_stragglers=restart_stragglers,
        )
        return spec

    def with_options(self, options: Mapping[str, Any]) -> RunSpec:
        """This spec with its backend's options, as the backend checked them."""
        return dataclasses.replace(self, options=dict(options))


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


def check_folder(value: object, name: str) -> str:
    """``value`` as the absolute path of an existing folder, or ArgumentError naming ``name``."""
    if not isinstance(value, (str, os.PathLike)) or not os.path.isdir(value):
        raise ArgumentError(
            f"{name} must be an existing folder, not {value!r}", name=name, value=value
        )
    return os.path.abspath(value)
