"""Imported only inside graphdist's fork servers, as the first preload module (before TensorFlow):
make the fork server exit at once when its owner is gone.

- The owner's pid comes in :data:`OWNER_ENV` (set by the owner for the spawn). A watcher thread
  waits on it (a pidfd: exact, no polling, immune to pid reuse; polling where pidfds are missing)
  and ends the process with ``os._exit`` the moment the owner dies, however it died. It starts
  before TensorFlow is imported, so an owner killed during a start (while the fork server is still
  importing TensorFlow, seconds) takes the fork server with it at once; multiprocess's own exit
  path, the owner's end of the "alive" pipe, is only looked at once the preload is done.
  (``PR_SET_PDEATHSIG`` would not do: it fires when the owner *thread* that spawned the fork
  server exits, and a fleet may be started from a short-lived thread.)
- multiprocess's fork server leaves its loop with ``SystemExit`` when every holder of the "alive"
  pipe is gone, then runs a normal interpreter shutdown, which with TensorFlow loaded takes 1-5 s.
  Nothing in the fork server needs that clean-up (its children exit through ``os._exit``), so
  :func:`register_exit_hook` registers an ``os._exit`` handler; ``graphdist._proc.server``, the
  preload after TensorFlow, calls it again so that it runs before TensorFlow's own handlers.
- The fork server's socket lives in its owner's ``graphdist-forkserver-<owner pid>-*`` folder
  (:data:`FOLDER_ENV`), which the owner removes at a normal exit. An owner that dies of a signal
  (``graphdist run`` re-delivers SIGTERM, SIGINT or SIGHUP to itself once its tasks are stopped;
  SIGKILL) cannot, so the fork server removes it when it exits because its owner is gone, on
  either path: the watcher's, or multiprocess's "alive" pipe (closed by the kernel a moment
  before the owner's pidfd says it is gone: the exit hook waits up to
  :data:`_OWNER_EXIT_WAIT_S` for that). A fork server that exits while its owner lives (never
  seen: the owner closes the pipe only once it is dead) leaves the folder to the owner.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import sys
import threading
from collections.abc import Callable

from graphdist._proc.pidwatch import gone_within

__all__ = [
    "FOLDER_ENV",
    "IN_FORK_SERVER",
    "LOG_ENV",
    "OWNER",
    "OWNER_ENV",
    "exit_when_gone",
    "register_exit_hook",
]

#: The environment variable that carries the fork server's owner pid.
OWNER_ENV = "GRAPHDIST_FORKSERVER_OWNER"
#: The environment variable that carries the owner's folder of the fork server's socket.
FOLDER_ENV = "GRAPHDIST_FORKSERVER_DIR"
#: The environment variable that carries the file for the fork server's own output (unset: the
#: owner's stdout and stderr, as with ``GRAPHDIST_TF_LOGS=1``).
LOG_ENV = "GRAPHDIST_FORKSERVER_LOG"
_POLL_S = 0.05
_OWNER_EXIT_WAIT_S = 1.0


def _exit_now() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    # In the fork server, multiprocess's loop ended: its "alive" pipe closed (the owner dies)
    if (
        _FOLDER is not None
        and os.getpid() == _HOME
        and OWNER is not None
        and gone_within(OWNER, _OWNER_PIDFD, _OWNER_EXIT_WAIT_S, _POLL_S)
    ):
        _remove_owner_folder()
    os._exit(0)


def register_exit_hook() -> None:
    """(Re-)register the ``os._exit`` handler last, so that it runs first at exit."""
    atexit.unregister(_exit_now)
    atexit.register(_exit_now)


def exit_when_gone(
    pid: int,
    *,
    already_gone_status: int = 0,
    message: str | None = None,
    poll_s: float = _POLL_S,
    before_exit: Callable[[], None] | None = None,
) -> int | None:
    """End this process with ``os._exit(0)`` (after printing ``message`` and calling
    ``before_exit``) as soon as process ``pid`` dies, however it dies; ``os._exit(already_gone_
    status)`` at once (after ``before_exit``) if it is gone already. A daemon thread waits on a
    pidfd (exact, no polling, immune to pid reuse) and falls back to polling every ``poll_s``
    seconds where pidfds are missing. Returns the pidfd (None: polled)."""
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        if before_exit is not None:
            with contextlib.suppress(Exception):
                before_exit()
        os._exit(already_gone_status)
    except (OSError, AttributeError):
        pidfd = None

    def watch() -> None:
        gone_within(pid, pidfd, None, poll_s)
        if message:
            print(message, flush=True)
        if before_exit is not None:
            with contextlib.suppress(Exception):
                before_exit()
        os._exit(0)

    threading.Thread(target=watch, name=f"graphdist-watch-{pid}", daemon=True).start()
    return pidfd


def _owner_pid() -> int | None:
    value = os.environ.pop(OWNER_ENV, "")  # popped: the servers it forks need not see it
    return int(value) if value.isdigit() else None


def _owner_folder(owner: int) -> str | None:
    """The owner's fork-server folder from :data:`FOLDER_ENV` (popped: the servers need not see
    it); only an absolute ``graphdist-forkserver-<owner>-*`` folder, never anything else."""
    value = os.environ.pop(FOLDER_ENV, "")
    name = os.path.basename(value.rstrip("/"))
    if not os.path.isabs(value) or not name.startswith(f"graphdist-forkserver-{owner}-"):
        return None
    return value


def _remove_owner_folder() -> None:
    """Remove the owner's fork-server folder (the owner is gone and cannot); in the fork server
    itself only, never in a process it forked."""
    if _FOLDER is not None and os.getpid() == _HOME:
        shutil.rmtree(_FOLDER, ignore_errors=True)


def _log_to_file(owner: int) -> None:
    """Send fds 1 and 2 to the file :data:`LOG_ENV` names (popped), before TensorFlow is imported:
    its import-time lines (absl, oneDNN, cuInit) and those of spares before they have a task stay
    out of the owner's stderr (a notebook cell that starts a fleet). Only a plain file in the
    owner's fork-server folder; anything else leaves the output where it is."""
    value = os.environ.pop(LOG_ENV, "")
    folder = os.path.basename(os.path.dirname(value))
    if not os.path.isabs(value) or not folder.startswith(f"graphdist-forkserver-{owner}-"):
        return
    try:
        fd = os.open(value, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    except OSError:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


#: The fork server's owner's pid (from :data:`OWNER_ENV`), None outside a fork server and its
#: owner: what a pool's spare ties its life to (:func:`graphdist._proc.server.prepare_spare`).
OWNER = _owner_pid()
#: True only inside a fork server: the owner imports this module too (for :data:`OWNER_ENV`),
#: and an ``os._exit(0)`` hook there would turn every exit status of the owner into 0.
IN_FORK_SERVER = OWNER is not None and os.getpid() != OWNER
_HOME = os.getpid()  # the fork server (its children are forks: they have another pid)
_FOLDER: str | None = None
_OWNER_PIDFD: int | None = None
if IN_FORK_SERVER:
    assert OWNER is not None
    _FOLDER = _owner_folder(OWNER)
    _log_to_file(OWNER)
    _OWNER_PIDFD = exit_when_gone(OWNER, before_exit=_remove_owner_folder)
    register_exit_hook()
