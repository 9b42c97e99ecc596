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
"""

from __future__ import annotations

import atexit
import contextlib
import os
import select
import sys
import threading
import time

__all__ = ["IN_FORK_SERVER", "OWNER_ENV", "exit_when_gone", "register_exit_hook"]

#: The environment variable that carries the fork server's owner pid.
OWNER_ENV = "GRAPHDIST_FORKSERVER_OWNER"
_POLL_S = 0.05


def _exit_now() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    os._exit(0)


def register_exit_hook() -> None:
    """(Re-)register the ``os._exit`` handler last, so that it runs first at exit."""
    atexit.unregister(_exit_now)
    atexit.register(_exit_now)


def exit_when_gone(
    pid: int, *, already_gone_status: int = 0, message: str | None = None, poll_s: float = _POLL_S
) -> None:
    """End this process with ``os._exit(0)`` (after printing ``message``) as soon as process
    ``pid`` dies, however it dies; ``os._exit(already_gone_status)`` at once if it is gone
    already. A daemon thread waits on a pidfd (exact, no polling, immune to pid reuse) and
    falls back to polling every ``poll_s`` seconds where pidfds are missing."""
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(already_gone_status)
    except (OSError, AttributeError):
        pidfd = None

    def watch() -> None:
        if pidfd is not None:
            select.select([pidfd], [], [])
        else:
            while True:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                except PermissionError:
                    pass
                time.sleep(poll_s)
        if message:
            print(message, flush=True)
        os._exit(0)

    threading.Thread(target=watch, name=f"graphdist-watch-{pid}", daemon=True).start()


def _owner_pid() -> int | None:
    value = os.environ.pop(OWNER_ENV, "")  # popped: the servers it forks need not see it
    return int(value) if value.isdigit() else None


_OWNER = _owner_pid()
#: True only inside a fork server: the owner imports this module too (for :data:`OWNER_ENV`),
#: and an ``os._exit(0)`` hook there would turn every exit status of the owner into 0.
IN_FORK_SERVER = _OWNER is not None and os.getpid() != _OWNER
if IN_FORK_SERVER:
    assert _OWNER is not None
    exit_when_gone(_OWNER)
    register_exit_hook()
