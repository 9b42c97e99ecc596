"""graphdist's fork servers: processes that imported TensorFlow once and fork one child per server.

A fleet of N servers costs one TensorFlow import, not N: the fork server imports TensorFlow and
:mod:`graphdist._fleet.server` (:data:`PRELOAD`) once, then forks a child per request, which only
has to build its server. Each distinct start environment (today: with or without the
``LD_PRELOAD`` bind shim) gets its own fork server, spawned on first use and shared by every fleet
of the process; it exits at once (``os._exit``, no interpreter shutdown) when its owner is gone.

The protocol is small and lives here, on the standard library alone, so that neither the owner nor
the fork server pays for a general-purpose process library (``multiprocess`` and ``dill`` cost
about 70 ms to import on each side, before the TensorFlow import could start) and a request does
not wait for the one before it:

* the owner holds one stream socket to the fork server and sends one byte per request, carrying
  two descriptors (``SCM_RIGHTS``): the write end of a *status* pipe and one end of a *channel*
  socket pair. Requests are pipelined: the owner never waits for a fork.
* the fork server forks, writes the child's pid and later its exit code (as ``os.waitpid``
  reports it) to the status pipe, and closes its copies of both descriptors.
* the child reads its target and arguments (pickled by the owner) from the channel, runs
  ``target(*args, ready_fd=CHANNEL)`` and exits with ``os._exit``. The target writes one byte to
  the channel once it serves; the owner sees that byte, or the channel's end if the child died
  first, without polling (:func:`graphdist._fleet.probe.wait_serving`).

The fork server's own failures (it cannot be spawned, or it died) show as children that exit
with code 255 before they start.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable
from typing import Any

__all__ = [
    "FORK_FAILED",
    "MALLOC_TUNABLES",
    "PRELOAD",
    "ForkServer",
    "ServerProcess",
    "process_class",
]

PRELOAD = ("tensorflow", "graphdist._fleet.server")
"""Modules every fork server imports before it forks its first child."""
FORK_FAILED = 255
"""Exit code of a child whose fork server died (or could not start) before it forked it."""

_SIGNED = struct.Struct("q")  # pid, then exit code, on a child's status pipe
_LENGTH = struct.Struct("!I")  # before the pickled (target, args) on a child's channel
_REQUEST = b"F"
_WAIT_SLICE_S = 0.1  # the longest a handle waits on its status pipe before looking again
# The fork server's first lines: TensorFlow before graphdist (about 0.1 s less than the other way
# round: graphdist's own imports are then mostly done already).
_BOOT = """\
import sys, traceback
sys.path[:] = {path!r}
try:
    import tensorflow
except ImportError:
    traceback.print_exc()  # each server will say so in its own log, and fail
from graphdist._fleet.forkserver import main
main({sock}, {alive}, {drop!r})
"""
MALLOC_TUNABLES = (
    "glibc.malloc.top_pad=16777216"
    ":glibc.malloc.mmap_threshold=33554432"
    ":glibc.malloc.trim_threshold=67108864"
)
"""glibc malloc settings of the servers (``GLIBC_TUNABLES``; ignored by other C libraries), unless
the owner's environment sets ``GLIBC_TUNABLES`` itself (even empty: then it applies as is).

A TensorFlow server starts dozens of gRPC service threads (72 with TensorFlow 2.21) that each
allocate about 650 KB of pending
calls; glibc grows each thread's arena 128 KB at a time with an ``mprotect`` (a TLB shootdown
across the process's threads), which was a fifth of the CPU time of a fleet's start. A 16 MB step
(``top_pad``) cuts a server's start-up CPU by about a third (about 57 ms to 38 ms here). Setting
``top_pad`` turns off glibc's dynamic mmap threshold, so the two thresholds are set to the values
that dynamic threshold settles at in a process that allocates large tensors (32 MB, and twice that
for trimming): large tensors are reused from the heap as before, not mapped and faulted in anew."""
_lock = threading.Lock()
_servers: dict[str, ForkServer] = {}  # LD_PRELOAD value ("" for none) -> ForkServer


def process_class(preload_library: str = "") -> ForkServer:
    """The fork server for ``preload_library`` (``""``: no ``LD_PRELOAD``), started now if it
    does not run yet, so that its TensorFlow import overlaps whatever the caller does next.
    Its :meth:`ForkServer.spawn` starts a process (the name is the one fleets use)."""
    with _lock:
        server = _servers.get(preload_library)
        if server is None:
            server = _servers[preload_library] = ForkServer(preload_library)
    server.ensure_running()
    return server


class ForkServer:
    """The owner's end of one fork server (see the module docstring)."""

    def __init__(self, preload_library: str = "") -> None:
        self.preload_library = preload_library
        self.pid: int | None = None
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._alive_w: int | None = None

    def ensure_running(self) -> None:
        """Spawn the fork server unless it runs (it starts importing :data:`PRELOAD` at once)."""
        with self._lock:
            self._ensure_running()

    def spawn(self, target: Callable[..., Any], args: tuple[Any, ...], name: str) -> ServerProcess:
        """Start ``target(*args, ready_fd=FD)`` in a new child of the fork server; returns at once,
        before the child exists. ``target`` and ``args`` must pickle (by reference, for
        functions); the target must write a byte to ``ready_fd`` once it is ready."""
        payload = pickle.dumps((target, args), protocol=pickle.HIGHEST_PROTOCOL)
        status_r, status_w = os.pipe()
        owner_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with self._lock:
                self._send_request(status_w, child_end.fileno())
        except BaseException:
            os.close(status_r)
            owner_end.close()
            raise
        finally:
            os.close(status_w)
            child_end.close()
        process = ServerProcess(name, status_r, owner_end)
        # After the request, so that a payload larger than the socket's buffer, which blocks
        # until the child reads it, cannot block the request itself.
        with contextlib.suppress(OSError):  # the child died at once: its status says how
            owner_end.sendall(_LENGTH.pack(len(payload)) + payload)
        return process

    # -- internals ------------------------------------------------------------------------------

    def _send_request(self, status_w: int, channel: int) -> None:
        for attempt in (1, 2):
            self._ensure_running()
            assert self._sock is not None
            try:
                socket.send_fds(self._sock, [_REQUEST], [status_w, channel])
                return
            except OSError:
                if attempt == 2:
                    raise
                self._forget()  # it died since it was last seen: spawn a new one, once

    def _running(self) -> bool:
        if self.pid is None:
            return False
        try:
            pid, _ = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # reaped by someone else's waitpid(-1): ask the kernel
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            return True
        return pid == 0

    def _ensure_running(self) -> None:
        if self._running():
            return
        self._forget()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        alive_r, alive_w = os.pipe()
        env, added = _fork_server_env(self.preload_library)
        code = _BOOT.format(
            path=[p for p in sys.path if isinstance(p, str)],
            sock=theirs.fileno(),
            alive=alive_r,
            drop=added,
        )
        # The owner's interpreter flags (-X, -W, -O, ...), as multiprocessing passes them on.
        flags: list[str] = getattr(subprocess, "_args_from_interpreter_flags", list)()
        argv = [sys.executable, *flags, "-c", code]
        try:
            os.set_inheritable(theirs.fileno(), True)
            os.set_inheritable(alive_r, True)
            # An empty signal mask: the owner may block signals (the supervisor does, to sigwait)
            # and a mask survives exec; the fork server needs SIGCHLD to report exit codes.
            self.pid = os.posix_spawn(sys.executable, argv, env, setsigmask=())
        except BaseException:
            ours.close()
            os.close(alive_w)
            raise
        finally:
            theirs.close()
            os.close(alive_r)
        self._sock = ours
        self._alive_w = alive_w  # the fork server exits when this closes: when this process ends

    def _forget(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._alive_w is not None:
            with contextlib.suppress(OSError):
                os.close(self._alive_w)
            self._alive_w = None
        if self.pid is not None:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, os.WNOHANG)
            self.pid = None


def _fork_server_env(preload_library: str) -> tuple[dict[str, str], list[str]]:
    """The fork server's environment (the owner's, with ``LD_PRELOAD`` set to
    ``preload_library`` or removed, and :data:`MALLOC_TUNABLES`) and the names added for it
    alone, which it removes from its ``os.environ`` once started."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if preload_library:
        env["LD_PRELOAD"] = preload_library
    added = []
    if "GLIBC_TUNABLES" not in env:
        env["GLIBC_TUNABLES"] = MALLOC_TUNABLES
        added.append("GLIBC_TUNABLES")
    return env, added


class ServerProcess:
    """A child of a fork server, as its owner sees it: a ``multiprocessing.Process``-like handle
    (``pid``, ``is_alive()``, ``exitcode``, ``join()``; safe to use from several threads) and
    the channel on which the child says it is ready (``ready_fd``; ``None`` once closed)."""

    def __init__(self, name: str, status_fd: int, channel: socket.socket) -> None:
        self.name = name
        self._fds = _Descriptors(status_fd, channel)
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._exitcode: int | None = None
        weakref.finalize(self, self._fds.close)

    def __repr__(self) -> str:
        return f"<ServerProcess {self.name} pid={self._pid} exitcode={self._exitcode}>"

    @property
    def pid(self) -> int | None:
        """The child's pid; waits until the fork server has forked it (``None`` if it never
        will: the fork server died first)."""
        while self._pid is None and self._exitcode is None:
            self._read_status(None)
        return self._pid

    @property
    def exitcode(self) -> int | None:
        """The exit code (negative: killed by that signal); ``None`` while the child runs or is
        still to be forked."""
        while self._exitcode is None and self._read_status(0.0):
            pass
        return self._exitcode

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        """Wait until the child has exited, at most ``timeout`` seconds (``None``: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._exitcode is None:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining < 0:
                return
            self._read_status(remaining)

    @property
    def ready_fd(self) -> int | None:
        """The owner's end of the channel: readable once the child wrote its ready byte, or
        ended (then it reads empty). ``None`` once closed."""
        channel = self._fds.channel
        return None if channel is None else channel.fileno()

    def close_channel(self) -> None:
        self._fds.close_channel()

    def _read_status(self, timeout: float | None) -> bool:
        """Read the next value of the status pipe (the pid, then the exit code) if one comes
        within ``timeout`` seconds (``None``: no limit), and say whether anything changed.

        Waits in slices of at most ``_WAIT_SLICE_S`` outside the lock, then reads under it only
        what is there: another thread may have read it, or closed the pipe, meanwhile."""
        fd = self._fds.status
        if fd is not None and timeout != 0:
            with contextlib.suppress(OSError, ValueError):
                wait = _WAIT_SLICE_S if timeout is None else min(timeout, _WAIT_SLICE_S)
                select.select([fd], [], [], max(0.0, wait))
        with self._lock:
            if self._exitcode is not None:
                return True
            fd = self._fds.status
            if fd is None or select.select([fd], [], [], 0)[0]:
                value = None if fd is None else _read_signed(fd)
            else:
                return False
            if value is None:  # the fork server is gone: no fork, or no exit code to come
                self._exitcode = FORK_FAILED if self._pid is None else -signal.SIGKILL
            elif self._pid is None:
                self._pid = value
                return True
            else:
                self._exitcode = value
            self._fds.close_status()  # the exit code is known: nothing more will come
            return True


class _Descriptors:
    """What a :class:`ServerProcess` holds open, each closed once. The status pipe closes once
    the exit code is read; the channel only when its owner is done with it (a thread may be
    waiting on it), or with the handle."""

    def __init__(self, status: int, channel: socket.socket) -> None:
        self.status: int | None = status
        self.channel: socket.socket | None = channel

    def close_status(self) -> None:
        if self.status is not None:
            with contextlib.suppress(OSError):
                os.close(self.status)
            self.status = None

    def close_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def close(self) -> None:
        self.close_status()
        self.close_channel()


def _read_signed(fd: int) -> int | None:
    data = b""
    while len(data) < _SIGNED.size:
        try:
            chunk = os.read(fd, _SIGNED.size - len(data))
        except OSError:
            return None
        if not chunk:
            return None
        data += chunk
    return int(_SIGNED.unpack(data)[0])


# -- inside the fork server ---------------------------------------------------------------------


def main(sock_fd: int, alive_fd: int, drop_env: list[str] | tuple[str, ...] = ()) -> None:
    """The fork server: preload, then fork a child per request until the owner is gone.
    ``drop_env``: variables the owner added for this process only (read at its start)."""
    for name in drop_env:
        os.environ.pop(name, None)
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)  # servers never read stdin; the terminal's belongs to the owner
        os.close(devnull)
        for module in PRELOAD:
            try:
                __import__(module)
            except ImportError:
                traceback.print_exc()  # each server will say so in its own log, and fail
        _serve(socket.socket(fileno=sock_fd), alive_fd)
    except BaseException:
        traceback.print_exc()
    finally:
        # No interpreter shutdown: with TensorFlow loaded it takes seconds, and nothing here
        # needs it (children exit through os._exit and never run exit handlers either).
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(0)


def _serve(sock: socket.socket, alive_fd: int) -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd is written
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C in the owner's terminal is the owner's
    signal.set_wakeup_fd(wake_w)
    status: dict[int, int] = {}  # child pid -> write end of its status pipe
    requests = sock.fileno()
    while True:
        readable = select.select([requests, alive_fd, wake_r], [], [])[0]
        if alive_fd in readable:
            return  # the owner is gone (all it can send on this pipe is its end)
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
            _reap(status)
        if requests in readable:
            try:
                msg, fds, _, _ = socket.recv_fds(sock, 1, 2)
            except OSError:
                return  # the owner is gone
            if not msg:
                return  # the owner closed its end
            if len(fds) != 2:
                for fd in fds:
                    os.close(fd)
                continue
            status_w, channel = fds
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)  # 3.12: fork with threads
                    pid = os.fork()
            except OSError:
                traceback.print_exc()  # no memory or pids left: the owner sees FORK_FAILED
                os.close(status_w)
                os.close(channel)
                continue
            if pid == 0:
                inherited = [requests, alive_fd, wake_r, wake_w, status_w, *status.values()]
                _child(channel, inherited)
            os.close(channel)
            with contextlib.suppress(OSError):  # the owner may be gone already
                os.write(status_w, _SIGNED.pack(pid))
            status[pid] = status_w


def _reap(status: dict[int, int]) -> None:
    while True:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        status_w = status.pop(pid, None)
        if status_w is not None:
            with contextlib.suppress(OSError):
                os.write(status_w, _SIGNED.pack(os.waitstatus_to_exitcode(wait_status)))
            os.close(status_w)


def _child(channel_fd: int, inherited: list[int]) -> None:
    """In a fresh child of the fork server: run the requested target, then exit."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        for fd in inherited:
            with contextlib.suppress(OSError):
                os.close(fd)
        channel = socket.socket(fileno=channel_fd)
        header = _recv_exactly(channel, _LENGTH.size)
        target, args = pickle.loads(_recv_exactly(channel, _LENGTH.unpack(header)[0]))
        target(*args, ready_fd=channel.detach())
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError("the owner closed the channel before sending the request")
        data += chunk
    return bytes(data)
