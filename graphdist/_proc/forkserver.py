"""graphdist's own fork servers: processes that imported TensorFlow once and fork one child per
server.

graphdist does not share ``multiprocess``'s global fork server: that one may already be running
(started by the user's code without TensorFlow preloaded, or without graphdist's loopback shim),
and its environment is fixed when it starts. Each distinct start environment here (today: with or
without the ``LD_PRELOAD`` bind shim) gets its own fork server, started on first use. A child does
not re-run the owner's ``__main__`` either: a server needs nothing from it, and re-running a user's
script (or failing to, for a notebook) in every server would be slow and surprising.

Its loop is :func:`graphdist._proc.forkserver_pool.main`: ``multiprocess``'s, with a pool of
*spares*, children forked ahead of time that wait for a server's definition, so that a warm start
or a restart hands each request to a process that is already there (``GRAPHDIST_SPARES``: how
many, 0 for none). Its own output (TensorFlow's import-time lines) goes to
:data:`FORK_SERVER_LOG` in the owner's fork-server folder, not to the owner's stderr, unless
``GRAPHDIST_TF_LOGS=1``.

A fork server exits at once when its owner is gone (:mod:`graphdist._proc.forkserver_exit`, its
first preload). One that died under its owner is found at the next start: that start raises
:class:`ForkServerDiedError` (LocalFleet turns it into a ``FleetStartError`` naming the task) and
the next one gets a fresh fork server.

Temporary folders: the fork server's socket lives in a folder of the owner's own,
``graphdist-forkserver-<owner pid>-*`` (not multiprocess's ``pymp-*``, which only a clean exit
removes), a fleet's logs in ``graphdist-fleet-<owner pid>-*`` and a TLS cluster's credentials
(private keys) in ``graphdist-tls-<owner pid>-*``. An owner killed by a signal cannot remove
them: its fork servers remove the socket folder as they exit after it
(:mod:`graphdist._proc.forkserver_exit`), and :func:`graphdist._private.sweep_stale_temp_dirs`
removes this user's folders whose owner is gone (the logs, kept for a post-mortem until the next
start) whenever a fleet starts or a new one of these folders is made.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import select
import shutil
import signal
import socket
import subprocess
import threading
import time
from typing import Any

from graphdist._net.loopback import with_preload
from graphdist._private import owned_temp_dir
from graphdist._proc.forkserver_exit import FOLDER_ENV, IN_FORK_SERVER, LOG_ENV, OWNER_ENV
from graphdist._proc.forkserver_pool import spares_wanted
from graphdist._tflog import tf_logs_live

__all__ = [
    "FORK_SERVER_LOG",
    "PRELOAD",
    "ForkServerDiedError",
    "owner_socket_dir",
    "process_class",
]

# forkserver_exit first: it watches the owner while TensorFlow is still being imported; lean
# before TensorFlow: servers import it without Keras and SciPy; this module last, so that its
# Process class is defined once there instead of in every child.
PRELOAD = [
    "graphdist._proc.forkserver_exit",
    "graphdist._proc.lean",
    "tensorflow",
    "graphdist._proc.server",
    "graphdist._proc.forkserver",
]
FORK_SERVER_LOG = "forkserver.log"
"""The fork server's own output (TensorFlow's import-time log lines, a spare's before it has a
task) goes to this file in the owner's fork-server folder, not to the owner's stderr; with
``GRAPHDIST_TF_LOGS=1`` (:data:`graphdist._tflog.TF_LOGS_ENV`, the CLI's switch too) it stays
live. A server's own output always goes to its ``JOB-INDEX.log``."""
_DEATH_WAIT_S = 1.0
# Longest socket folder path used: a socket path (folder + "/listener-XXXXXXXX") must fit in
# sun_path (108 bytes); past this, multiprocess's own (shorter) pymp-* folder is used.
_MAX_SOCKET_DIR = 80
_lock = threading.Lock()
_config_lock = threading.Lock()  # multiprocess's tempdir, ours while a fork server starts
_servers: dict[str, Any] = {}  # LD_PRELOAD value ("" for none) -> ForkServer
_socket_dir: tuple[int, str] | None = None  # (owner pid, folder) for the fork servers' sockets


class ForkServerDiedError(RuntimeError):
    """A fork server died (or stopped answering) while a process was being started from it."""


def owner_socket_dir() -> str:
    """This process's private folder for its sockets: its fork servers' and its fleets' ready
    notices (:mod:`graphdist._net.ready`); made on first use, removed at exit."""
    global _socket_dir
    if _socket_dir is None or _socket_dir[0] != os.getpid() or not os.path.isdir(_socket_dir[1]):
        path = owned_temp_dir("forkserver")
        atexit.register(shutil.rmtree, path, True)
        _socket_dir = (os.getpid(), path)
    return _socket_dir[1]


def _fork_server(preload_library: str) -> Any:
    with _lock:
        server = _servers.get(preload_library)
        if server is None:
            server = _new_fork_server(preload_library)
            server.set_forkserver_preload(PRELOAD)
            _servers[preload_library] = server
        return server


def _new_fork_server(preload_library: str) -> Any:
    from multiprocess import forkserver, process

    class ForkServer(forkserver.ForkServer):  # type: ignore[misc]
        def ensure_running(self) -> None:
            # The fork server gets an environment of its own: the owner's, plus LD_PRELOAD
            # (the user's own entries kept) and the owner's pid, folder and log. os.environ is
            # never changed for it: a subprocess that another thread of this process starts
            # meanwhile would inherit the bind shim and become a fork server's child (it
            # exits with us, its output in our fork-server log). Its socket goes in our own
            # folder, not multiprocess's pymp-* (swept when the owner dies; see above).
            spares = spares_wanted()  # checked here, in the owner: a bad value names itself
            env = dict(os.environ)
            saved = env.pop("LD_PRELOAD", None)
            if preload_library:
                env["LD_PRELOAD"] = with_preload(preload_library, saved)
            env[OWNER_ENV] = str(os.getpid())
            with _config_lock:
                config = process.current_process()._config
                saved_tempdir = config.get("tempdir")
                sockets_dir = owner_socket_dir()
                if len(sockets_dir) <= _MAX_SOCKET_DIR:
                    config["tempdir"] = sockets_dir
                    env[FOLDER_ENV] = sockets_dir  # removed by it if we die first
                if not tf_logs_live():  # TensorFlow's import-time lines: not in our stderr
                    env[LOG_ENV] = os.path.join(sockets_dir, FORK_SERVER_LOG)
                try:
                    self._ensure_running(spares, env)
                finally:
                    if saved_tempdir is None:
                        config.pop("tempdir", None)
                    else:
                        config["tempdir"] = saved_tempdir

        def _ensure_running(self, spares: int, env: dict[str, str]) -> None:
            # multiprocess's ForkServer.ensure_running, running graphdist's loop (a pool of
            # spares: forkserver_pool) instead of multiprocess's, and without __main__.
            from multiprocess import connection, resource_tracker, spawn, util

            state: Any = self  # multiprocess's attributes, untyped
            with state._lock:
                resource_tracker.ensure_running()
                if state._forkserver_pid is not None:
                    pid, _ = os.waitpid(state._forkserver_pid, os.WNOHANG)
                    if not pid:
                        return  # still running
                    os.close(state._forkserver_alive_fd)
                    state._forkserver_address = None
                    state._forkserver_alive_fd = None
                    state._forkserver_pid = None
                with socket.socket(socket.AF_UNIX) as listener:
                    address = connection.arbitrary_address("AF_UNIX")
                    listener.bind(address)
                    if not util.is_abstract_socket_namespace(address):
                        os.chmod(address, 0o600)
                    listener.listen()
                    # every owner holds the write end of "alive": when all are gone, the read
                    # end sees EOF and the fork server exits
                    alive_r, alive_w = os.pipe()
                    try:
                        # SIGINT: a Ctrl-C to the owner's group must not kill the fork server
                        # while it starts (with Python's traceback on the owner's stderr), as
                        # its loop ignores SIGINT later: it is born with SIGINT blocked (the
                        # mask survives exec, before Python has a handler), and ignores it,
                        # discarding one that came meanwhile, before anything else
                        cmd = (
                            "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                            "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
                            "from graphdist._proc.forkserver_pool import main; "
                            f"main({listener.fileno()}, {alive_r}, "
                            f"{list(state._preload_modules)!r}, spares={spares})"
                        )
                        exe = spawn.get_executable()
                        args = [exe, *util._args_from_interpreter_flags(), "-c", cmd]
                        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
                        try:
                            pid = _spawn(args, (listener.fileno(), alive_r), env)
                        finally:  # a SIGINT meanwhile stays pending for this process
                            signal.pthread_sigmask(signal.SIG_SETMASK, old)
                    except BaseException:
                        os.close(alive_w)
                        raise
                    finally:
                        os.close(alive_r)
                    state._forkserver_address = address
                    state._forkserver_alive_fd = alive_w
                    state._forkserver_pid = pid

        def discard(self) -> None:
            """Forget a fork server that failed a start (waiting briefly for it to be gone,
            killing it if it is not), so that the next start spawns a fresh one."""
            state: Any = self  # multiprocess's attributes, untyped
            with state._lock:
                pid = state._forkserver_pid
                if pid is None:
                    return
                deadline = time.monotonic() + _DEATH_WAIT_S
                while True:
                    try:
                        done, _ = os.waitpid(pid, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if done:
                        break
                    if time.monotonic() > deadline:
                        with contextlib.suppress(OSError):
                            os.kill(pid, signal.SIGKILL)
                        with contextlib.suppress(ChildProcessError):
                            os.waitpid(pid, 0)
                        break
                    time.sleep(0.01)
                with contextlib.suppress(OSError):
                    os.close(state._forkserver_alive_fd)
                if isinstance(state._forkserver_address, str):
                    with contextlib.suppress(OSError):
                        os.unlink(state._forkserver_address)
                state._forkserver_address = None
                state._forkserver_alive_fd = None
                state._forkserver_pid = None

    return ForkServer()


def _spawn(args: list[str], pass_fds: tuple[int, ...], env: dict[str, str]) -> int:
    """Start ``args`` with ``env`` and ``pass_fds`` (all other descriptors closed, the standard
    ones shared) and return its pid, as multiprocess's ``spawnv_passfds`` does but with an
    environment of its own. The caller reaps it (``os.waitpid``): the Popen is marked done, so
    that ``subprocess`` never polls a pid that may have been reused by then."""
    proc = subprocess.Popen(args, pass_fds=pass_fds, env=env, restore_signals=False)
    proc.returncode = 0  # not ours to wait for: see above
    return proc.pid


def process_class(preload_library: str = "") -> Any:
    """A factory for ``multiprocess`` Process objects whose ``start()`` forks from graphdist's
    fork server for ``preload_library`` (``""``: no ``LD_PRELOAD``); it takes Process's keyword
    arguments (``target``, ``args``, ``name``...).

    ``start()`` returns as soon as the request is sent: the fork server's answer (the pid) is read
    on first use of ``pid``, so that a fleet's requests are all queued before the first fork is
    awaited (``process._popen.pid_arrived()`` says whether that read would wait). A fork server
    that died under a start raises :class:`ForkServerDiedError` there."""
    _fork_server(preload_library)  # one per library, spawned on first start
    cls = __getattr__("GraphdistProcess")

    def make(**kwargs: Any) -> Any:
        process = cls(**kwargs)
        process._graphdist_preload = preload_library
        return process

    return make


def _define_classes() -> None:
    """Define :data:`GraphdistProcess` and its Popen (here, not at import: ``multiprocess`` is
    imported only when a fleet starts). They are module attributes so that a Process is pickled
    by reference: a class defined inside a function is pickled by value, 27 ms per server."""
    from multiprocess import (
        context,
        forkserver,
        popen_forkserver,
        reduction,
        spawn,
        util,
    )

    class GraphdistPopen(popen_forkserver.Popen):  # type: ignore[misc]
        _pid: int | None = None
        _server: Any = None
        _server_pid: int | None = None  # the fork server that took the request

        def __init__(self, process_obj: Any) -> None:
            # The sentinel carries two numbers, the pid and then the exit code, each read
            # once: a fleet's watcher thread asks for them while the owner's thread starts
            # or restarts a task, and two readers of the pid left one blocked for ever on
            # the exit code (a restart that never returned).
            self._reading = threading.RLock()
            super().__init__(process_obj)

        @property
        def pid(self) -> int | None:
            if self._pid is None and self._server is not None:
                self._read_pid()
            return self._pid

        @pid.setter
        def pid(self, value: int | None) -> None:
            self._pid = value

        def pid_arrived(self) -> bool:
            """Whether reading :attr:`pid` returns at once: read already, or the fork server's
            answer (or its end, a death to report) waits on the sentinel."""
            if self._pid is not None or self._server is None:
                return True
            return bool(select.select([self.sentinel], [], [], 0)[0])

        def _read_pid(self) -> None:
            with self._reading:
                if self._pid is not None or self._server is None:
                    return  # another thread read it meanwhile
                server, self._server = self._server, None
                try:
                    self._pid = forkserver.read_signed(self.sentinel)
                except (OSError, EOFError) as exc:
                    self.returncode = 255
                    raise _died(server, exc, self._server_pid) from exc

        def poll(self, flag: int = os.WNOHANG) -> int | None:
            # A plain select() for the common "still running?" (the fleet's watcher asks every
            # 0.1 s): multiprocess's wait() builds a selector object each time.
            ready = self.returncode is not None or flag != os.WNOHANG
            if not ready and not select.select([self.sentinel], [], [], 0)[0]:
                return None
            with self._reading:  # one reader of the sentinel at a time (see __init__)
                # the first number on the sentinel is the pid, the second the exit code
                if self._pid is None and self._server is not None:
                    try:
                        self._read_pid()
                    except ForkServerDiedError:
                        return self.returncode
                result: int | None = super().poll(flag)
                return result

        def _launch(self, process_obj: Any) -> None:
            # popen_forkserver.Popen._launch, with our fork server, without __main__, and
            # without waiting for the pid (see process_class).
            server = _fork_server(process_obj._graphdist_preload)
            prep_data = spawn.get_preparation_data(process_obj._name)
            prep_data.pop("init_main_from_path", None)
            prep_data.pop("init_main_from_name", None)
            buf = io.BytesIO()
            context.set_spawning_popen(self)
            try:
                reduction.dump(prep_data, buf)
                reduction.dump(process_obj, buf)
            finally:
                context.set_spawning_popen(None)
            server.ensure_running()  # a failure to spawn one is not a death: raised as it is
            try:
                self.sentinel, w = server.connect_to_new_process(self._fds)
                self._server_pid = server._forkserver_pid
                parent_w = os.dup(w)
                self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))
                with open(w, "wb", closefd=True) as f:
                    f.write(buf.getbuffer())
            except (OSError, EOFError) as exc:
                raise _died(server, exc) from exc
            self._server = server

    class GraphdistProcess(context.ForkServerProcess):  # type: ignore[misc]
        _graphdist_preload = ""

        @staticmethod
        def _Popen(process_obj: Any) -> Any:
            return GraphdistPopen(process_obj)

    for cls in (GraphdistPopen, GraphdistProcess):
        cls.__qualname__ = cls.__name__  # found by name here: pickled by reference
        globals()[cls.__name__] = cls


def _died(server: Any, exc: BaseException, dead_pid: int | None = None) -> ForkServerDiedError:
    """multiprocess reports a fork server that died under a start as a bare EOFError/OSError
    (then, at the next join, an AssertionError): say what it was, and forget that server.

    ``dead_pid`` is the fork server that took the request (default: the current one). Where
    multiprocess has replaced it since (it spawns a fresh one when a later request finds it
    dead), the fresh one is kept."""
    if dead_pid is None:
        dead_pid = server._forkserver_pid
    if server._forkserver_pid == dead_pid:
        server.discard()
    return ForkServerDiedError(
        f"graphdist's fork server (pid {dead_pid}) died or stopped answering while starting a "
        f"process ({type(exc).__name__}: {exc}); the next start uses a fresh one"
    )


def __getattr__(name: str) -> Any:
    # PEP 562: the classes exist once asked for, here or in a child unpickling a Process
    if name in ("GraphdistProcess", "GraphdistPopen"):
        with _lock:
            if name not in globals():
                _define_classes()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if IN_FORK_SERVER:  # preloaded: the children unpickle their Process class from here
    _define_classes()
