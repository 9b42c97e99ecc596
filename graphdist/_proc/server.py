"""What runs inside one server process: build a ``tf.train.Server`` and serve until told to stop.

This module is preloaded by the fork server together with TensorFlow, so a forked child only has
to build its server (tens of milliseconds). It imports TensorFlow lazily, inside functions: the
fleet's owner must be able to pickle a reference to :func:`fleet_child` without importing it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import traceback
from typing import Any

from graphdist._failures import task_name
from graphdist._net.ready import READY_SOCKET_KEY, notify
from graphdist._proc.forkserver_exit import exit_when_gone
from graphdist._proc.process import set_parent_death_signal

__all__ = [
    "EXIT_PORT_IN_USE",
    "EXIT_START_FAILED",
    "PROCESS_TITLE_PREFIX",
    "READY_MARKER",
    "fleet_child",
    "prepare_spare",
    "run_server",
    "start_server",
]

EXIT_START_FAILED = 3
EXIT_PORT_IN_USE = 4
READY_MARKER = "graphdist: server ready"
_OWNER_POLL_S = 0.25
# The pid of the process that imported this module: in a server, the fork server (a preload).
_IMPORT_PID = os.getpid()
_watched_owner: int | None = None  # the owner this process already exits with (a spare's)


def _redirect_output(log_path: str) -> None:
    """Send fds 1 and 2 (Python's and TensorFlow's C++ logging) to the task's log file."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - lives as long as the process
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115


def _exit_with(owner_pid: int) -> None:
    """Make this process exit as soon as ``owner_pid`` does, whatever killed the owner.

    The owner is not our parent (the fork server is), so ``PR_SET_PDEATHSIG`` alone would not
    do: it covers the fork server dying, and a watcher thread covers the owner. The watcher waits
    on a pidfd (exact, no polling, immune to pid reuse) and falls back to polling.
    """
    global _watched_owner
    if _watched_owner == owner_pid:
        return  # a spare: set before its task came
    set_parent_death_signal(signal.SIGKILL)
    if os.getpid() != _IMPORT_PID and os.getppid() != _IMPORT_PID:
        os._exit(EXIT_START_FAILED)  # the fork server died before the death signal was set
    _watched_owner = owner_pid
    exit_when_gone(
        owner_pid,
        already_gone_status=EXIT_START_FAILED,
        message=f"graphdist: owner process {owner_pid} is gone; exiting",
        poll_s=_OWNER_POLL_S,
    )


PROCESS_TITLE_PREFIX = "graphdist "
"""How a fleet's server process shows in ``ps``: ``graphdist local:1 (fleet of pid 123)``."""


def _name_process(task: str, owner_pid: int) -> None:
    """Name this process by its task in ``ps`` and ``top`` (its command line would otherwise
    be the fork server's ``python -B -c from graphdist._proc.forkserver_pool import main...``);
    a spare is ``graphdist spare (fleet of pid N)`` until its task comes."""
    try:
        import setproctitle
    except ImportError:  # a dependency; its C part may be missing on an odd platform
        return
    setproctitle.setproctitle(f"{PROCESS_TITLE_PREFIX}{task} (fleet of pid {owner_pid})")


def _own_signals() -> None:
    """A fresh signal state, out of the owner's process group (see :func:`fleet_child`)."""
    # A server dies on SIGTERM (the fleet's close). The owner may block signals (the
    # supervisor does, to sigwait); masks survive fork and exec.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # Ctrl-C and Jupyter's "interrupt kernel" signal the owner's whole process group
    # (jupyter_client uses os.killpg): a server leaves that group and ignores SIGINT, so an
    # interrupt stops the owner's step, not the fleet (its variables live on). It still dies
    # with its owner (above) and on the fleet's SIGTERM.
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def prepare_spare() -> None:
    """In a spare of a fork server's pool (:mod:`graphdist._proc.forkserver_pool`): what
    :func:`fleet_child` does before it knows its task, done ahead (it exits with the fork
    server's owner, leaves the owner's process group, ignores SIGINT, names itself)."""
    from graphdist._proc import forkserver_exit

    owner = forkserver_exit.OWNER
    if owner is None:  # not in a fork server: nothing to tie to
        return
    _exit_with(owner)
    _own_signals()
    _name_process("spare", owner)


def start_server(
    cluster: dict[str, Any], job: str, index: int, *, config: bytes | None = None
) -> Any:
    """Build and start the ``tf.distribute.Server`` for ``job:index`` of ``cluster``.

    ``config`` is a serialized ``ConfigProto`` for the server's default session config.
    Raises what TensorFlow raises; a taken port surfaces as ``tf.errors.UnknownError``.
    """
    from graphdist._net.members import check_enforced

    check_enforced(f"/job:{job}/task:{index}")  # members only, where asked: in force, or no server
    import tensorflow as tf

    server_config = None
    if config:
        server_config = tf.compat.v1.ConfigProto.FromString(config)
    server = tf.distribute.Server(
        tf.train.ClusterSpec(cluster),
        job_name=job,
        task_index=index,
        protocol="grpc",
        config=server_config,
        start=True,
    )
    return server


def run_server(
    cluster: dict[str, Any], job: str, index: int, *, config: bytes | None = None
) -> None:
    """Start the server for ``job:index`` (see :func:`start_server`) and serve forever."""
    start_server(cluster, job, index, config=config).join()


def fleet_child(spec: dict[str, Any]) -> None:
    """Entry point of a fleet's server process (runs in a child of the fork server).

    ``spec`` holds ``cluster``, ``job``, ``index``, ``log_path``, ``owner_pid``, ``env`` and
    ``config``. Exit codes: :data:`EXIT_PORT_IN_USE`, :data:`EXIT_START_FAILED`.
    """
    _redirect_output(spec["log_path"])
    _exit_with(spec["owner_pid"])
    _own_signals()
    os.environ.update(spec.get("env") or {})
    _name_process(f"{spec['job']}:{spec['index']}", spec["owner_pid"])
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "(unset: every GPU)")
    print(
        f"graphdist: starting /job:{spec['job']}/task:{spec['index']} pid={os.getpid()} "
        f"CUDA_VISIBLE_DEVICES={gpus}",
        flush=True,
    )
    try:
        server = start_server(
            spec["cluster"], spec["job"], spec["index"], config=spec.get("config")
        )
        notify(spec.get(READY_SOCKET_KEY), task_name(spec["job"], spec["index"]))
        print(
            f"{READY_MARKER}: /job:{spec['job']}/task:{spec['index']} at {server.target}",
            flush=True,
        )
        server.join()
    except BaseException as exc:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        text = str(exc)
        in_use = "Could not start gRPC server" in text or "Address already in use" in text
        os._exit(EXIT_PORT_IN_USE if in_use else EXIT_START_FAILED)


def _warm_up() -> None:
    """In the fork server, once: what every server would otherwise load by itself after its fork
    (TensorFlow's lazily loaded modules behind ``tf.distribute.Server``, its protos, the members
    check, setproctitle). Nothing here starts a thread: forking stays safe."""
    import tensorflow as tf

    from graphdist._net import members  # noqa: F401

    with contextlib.suppress(ImportError):
        import setproctitle  # noqa: F401
    tf.compat.v1.ConfigProto.FromString(tf.compat.v1.ConfigProto().SerializeToString())
    tf.train.ClusterSpec({"warm": ["localhost:1"]}).as_cluster_def()
    _ = tf.distribute.Server


_exit_module = sys.modules.get("graphdist._proc.forkserver_exit")
if _exit_module is not None and _exit_module.IN_FORK_SERVER:  # preloaded in a fork server
    _exit_module.register_exit_hook()  # again, after TensorFlow's handlers: it runs first
    with contextlib.suppress(Exception):  # an optimisation only: a server loads them itself
        _warm_up()
