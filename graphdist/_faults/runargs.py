"""The arguments of :meth:`graphdist._faults.injector.FaultInjector.run`, checked (a clear
:class:`ArgumentError` naming the bad value), and the ``graphdist run`` command line they make."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping, Sequence

from graphdist._exceptions import ArgumentError
from graphdist._faults.faults import Fault
from graphdist._validate import check_argv, show

__all__ = [
    "check_command",
    "check_cwd",
    "check_faults",
    "check_launcher_args",
    "check_log_dir",
    "launcher_argv",
]


def launcher_argv(
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


def check_command(command: object) -> list[str]:
    argv = check_argv(command, "command")
    if not argv:
        raise ArgumentError(
            "command must be a non-empty list of str, e.g. [sys.executable, 'train.py'], not []",
            name="command",
            value=command,
        )
    return argv


def check_launcher_args(launcher_args: object) -> list[str]:
    return check_argv(launcher_args, "launcher_args")


def check_cwd(cwd: object) -> str | None:
    if cwd is None:
        return None
    path = _text(cwd, "cwd", "a folder (str or os.PathLike)")
    if not os.path.isdir(path):
        raise ArgumentError(
            f"cwd must be an existing folder, not {show(path)}", name="cwd", value=cwd
        )
    return path


def check_log_dir(log_dir: object) -> str | None:
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


def check_faults(
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
