"""The loop of graphdist's fork servers: ``multiprocess``'s fork-server loop with a pool of spares.

A *spare* is a child the fork server forked ahead of time: it has TensorFlow loaded (everything
the fork server preloaded), has already done what every server process does before it knows its
task (:func:`graphdist._proc.server.prepare_spare`: its parent-death signal and the watch on the
owner, its own process group, SIGINT ignored, its process title ``graphdist spare (fork server
of pid N)``) and waits on a socket for its request. A request (``multiprocess``'s protocol: the
owner sends the child's fds, then writes the pickled Process to its pipe) is handed to a spare
as it is: the spare receives the fds and runs the Process exactly as a freshly forked child
would (``multiprocess.forkserver._serve_one``). So a warm ``LocalFleet.start()`` or a task's
``restart()`` pays neither the fork nor the spare's preparation; where no spare is left, the
request is forked as before.

The pool refills only when the fork server has been idle for :data:`REFILL_IDLE_S` (one spare
per idle moment), so that the forks never compete with servers that are starting. It holds
``max(spares, busiest)`` spares, at most :data:`MAX_SPARES`: ``spares`` is the owner's
:data:`SPARES_ENV` (default :data:`DEFAULT_SPARES`; 0 turns the pool off) and ``busiest`` the
most servers this fork server has had running at once, so that a fleet of that size started
again (or restarted whole) finds a spare for each of its servers.

Nothing outlives the fork server: a spare's parent is the fork server (``PR_SET_PDEATHSIG``),
and it also watches the owner itself, as a server does; a spare whose fork server closes its
socket exits at once (EOF). A spare that dies unused is forgotten quietly (its pid is no
request's). The pool's size is the fork server's only state: fleets come and go, the spares do
not accumulate.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import selectors
import signal
import socket
import sys
import time
from typing import Any

__all__ = ["DEFAULT_SPARES", "MAX_SPARES", "REFILL_IDLE_S", "SPARES_ENV", "main", "spares_wanted"]

#: The environment variable that sets how many spares a fork server keeps at least (0: none).
SPARES_ENV = "GRAPHDIST_SPARES"
DEFAULT_SPARES = 8
MAX_SPARES = 32
REFILL_IDLE_S = 0.3
"""How long the fork server must have had nothing to do before it forks the next spare."""
SPARE_TITLE = "graphdist spare"


def spares_wanted(environ: Any = None) -> int:
    """The owner's :data:`SPARES_ENV` as a number of spares (default :data:`DEFAULT_SPARES`);
    raises ArgumentError naming the value when it is not a whole number from 0 to MAX_SPARES."""
    from graphdist._exceptions import ArgumentError

    value = (os.environ if environ is None else environ).get(SPARES_ENV, "").strip()
    if not value:
        return DEFAULT_SPARES
    if not value.isdigit() or int(value) > MAX_SPARES:
        raise ArgumentError(
            f"{SPARES_ENV} must be a whole number from 0 to {MAX_SPARES} (spare server processes "
            f"a fork server keeps ready; 0: none), not {value!r}",
            name=SPARES_ENV,
            value=value,
        )
    return int(value)


class _Pool:
    """The fork server's spares: pid -> the fork server's end of the spare's socket."""

    def __init__(self, spares: int) -> None:
        self.minimum = spares
        self.busiest = 0
        self.spares: dict[int, socket.socket] = {}
        self.last_busy = time.monotonic()

    def target(self) -> int:
        if self.minimum <= 0:
            return 0
        return min(MAX_SPARES, max(self.minimum, self.busiest))

    def refill_timeout(self) -> float | None:
        """How long the loop may wait for a request before refilling (None: the pool is full)."""
        if len(self.spares) >= self.target():
            return None
        return max(0.0, self.last_busy + REFILL_IDLE_S - time.monotonic())

    def hand_over(self, fds: list[int]) -> int | None:
        """Give a request's ``fds`` to a spare; its pid, or None where no spare took them."""
        while self.spares:
            pid, sock = self.spares.popitem()
            try:
                from multiprocess.context import reduction

                reduction.sendfds(sock, fds)
            except OSError:  # it died meanwhile: its SIGCHLD is still to come
                continue
            finally:
                sock.close()
            return pid
        return None

    def forget(self, pid: int) -> bool:
        sock = self.spares.pop(pid, None)
        if sock is None:
            return False
        sock.close()
        return True


def _ignore(*_: object) -> None:
    """SIGCHLD's handler: it only wakes the loop up (through the wakeup fd)."""


def _run_spare(sock: socket.socket, old_handlers: dict[int, Any]) -> int:
    """In a spare: prepare, wait for a request's fds, then run it as a forked child would."""
    from multiprocess import forkserver
    from multiprocess.context import reduction

    signal.set_wakeup_fd(-1)
    for sig, val in old_handlers.items():
        signal.signal(sig, val)
    from graphdist._proc.server import prepare_spare

    prepare_spare()
    try:
        fds = reduction.recvfds(sock, forkserver.MAXFDS_TO_SEND + 1)
    except (EOFError, OSError):
        return 0  # the fork server is gone or dropped this spare
    finally:
        sock.close()
    child_r, *rest = fds
    code: int = forkserver._serve_one(child_r, rest, [], {})
    return code


def main(
    listener_fd: int,
    alive_r: int,
    preload: list[str],
    main_path: str | None = None,
    sys_path: list[str] | None = None,
    spares: int = DEFAULT_SPARES,
) -> None:
    """Run a fork server (``multiprocess.forkserver.main``'s loop, with the pool of spares)."""
    from multiprocess import forkserver, util
    from multiprocess.context import reduction

    for modname in preload:
        with contextlib.suppress(ImportError):
            __import__(modname)
    util._close_stdin()
    # Everything imported so far lives as long as the fork server: out of the collector's reach,
    # so that a child's collections do not write to (and copy) every page of it.
    gc.collect()
    gc.freeze()

    sig_r, sig_w = os.pipe()
    os.set_blocking(sig_r, False)
    os.set_blocking(sig_w, False)
    handlers: dict[int, Any] = {signal.SIGCHLD: _ignore, signal.SIGINT: signal.SIG_IGN}
    old_handlers: dict[int, Any] = {sig: signal.signal(sig, val) for sig, val in handlers.items()}
    signal.set_wakeup_fd(sig_w)
    pid_to_fd: dict[int, int] = {}  # a request's child -> where its pid and exit code go
    pool = _Pool(spares)

    with (
        socket.socket(socket.AF_UNIX, fileno=listener_fd) as listener,
        selectors.DefaultSelector() as selector,
    ):
        forkserver._forkserver._forkserver_address = listener.getsockname()
        selector.register(listener, selectors.EVENT_READ)
        selector.register(alive_r, selectors.EVENT_READ)
        selector.register(sig_r, selectors.EVENT_READ)

        def in_child(keep: socket.socket | None) -> None:
            """What a fresh child closes of the fork server's (``keep``: its own socket)."""
            listener.close()
            selector.close()
            for fd in (alive_r, sig_r, sig_w, *pid_to_fd.values()):
                os.close(fd)
            for sock in pool.spares.values():
                if sock is not keep:
                    sock.close()

        def fork_spare() -> None:
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    mine.close()
                    in_child(None)
                    code = _run_spare(theirs, old_handlers)
                except BaseException:
                    sys.excepthook(*sys.exc_info())
                    sys.stderr.flush()
                finally:
                    os._exit(code)
            theirs.close()
            pool.spares[pid] = mine

        def reap() -> None:
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    return
                if pid == 0:
                    return
                child_w = pid_to_fd.pop(pid, None)
                if child_w is not None:
                    with contextlib.suppress(BrokenPipeError):  # the owner vanished
                        forkserver.write_signed(child_w, os.waitstatus_to_exitcode(status))
                    os.close(child_w)
                elif not pool.forget(pid):
                    print(f"graphdist fork server: unexpected child {pid}", file=sys.stderr)

        def serve_request() -> None:
            with listener.accept()[0] as s:
                fds = reduction.recvfds(s, forkserver.MAXFDS_TO_SEND + 1)
            if len(fds) > forkserver.MAXFDS_TO_SEND:
                raise RuntimeError(f"Too many ({len(fds)}) fds to send")
            child_r, child_w, *rest = fds
            pid = pool.hand_over([child_r, *rest])
            if pid is None:
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:
                        os.close(child_w)
                        in_child(None)
                        code = forkserver._serve_one(child_r, rest, [], old_handlers)
                    except BaseException:
                        sys.excepthook(*sys.exc_info())
                        sys.stderr.flush()
                    finally:
                        os._exit(code)
            with contextlib.suppress(BrokenPipeError):  # the owner vanished
                forkserver.write_signed(child_w, pid)
            pid_to_fd[pid] = child_w
            for fd in (child_r, *rest):
                os.close(fd)
            pool.busiest = max(pool.busiest, len(pid_to_fd))
            pool.last_busy = time.monotonic()

        while True:
            try:
                ready = [key.fileobj for key, _ in selector.select(pool.refill_timeout())]
                if not ready:  # idle long enough: one more spare
                    fork_spare()
                    continue
                if alive_r in ready:  # every owner's end of the pipe is closed: the owner is gone
                    assert os.read(alive_r, 1) == b"", "Not at EOF?"
                    raise SystemExit
                if sig_r in ready:
                    os.read(sig_r, 65536)
                    reap()
                if listener in ready:
                    serve_request()
            except OSError as exc:
                if exc.errno != errno.ECONNABORTED:
                    raise
