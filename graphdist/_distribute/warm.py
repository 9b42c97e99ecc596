"""Warm task interpreters, the launcher's side: a run's Python tasks forked from an interpreter
that has imported TensorFlow (and tf-keras) once, instead of each task importing them again.

A :class:`Zygote` starts the warm interpreter (:mod:`graphdist._distribute.zygote`, its own
side), the launcher's child: it imports the run's preloads (:func:`check_preload`; by default
TensorFlow, tf-keras and NumPy), says ``ready`` and then, for each task the launcher asks for,
forks a child that is that task's guard (:func:`graphdist._proc.process.guard`: the same
subreaper, death signal and tree ending as a cold task's guard, in the forked process instead
of ``python -I -S process.py``). The guard forks the task, which sets what a fresh interpreter
would have: its environment, ``sys.argv``, ``sys.path[0]``, its working folder, its
stdin/stdout/stderr (passed with the request over the zygote's socket), the signals' default
handlers, no ``atexit`` handler of the zygote's; then runs the script, ``-m`` module or ``-c``
code as ``__main__`` and exits as the interpreter does (``sys.exit``, an exception's traceback
and exit 1, a KeyboardInterrupt's SIGINT, ``atexit``, non-daemon threads joined). The process
tree is ``launcher - zygote - guard - task``: ``os.getppid()`` in a task is its guard, as for a
cold task.

The zygote never starts TensorFlow's runtime: it only imports, so no task forks from a process
with the runtime's threads. It dies with the launcher (``PR_SET_PDEATHSIG``), and its guards with
it (their death signal), each ending its task's tree.

Which tasks run warm (:func:`warm_target`): ``PY SCRIPT ARGS``, ``PY -m MODULE ARGS`` and ``PY -c
CODE ARGS`` (``-u`` allowed before them), ``PY`` being the interpreter graphdist runs in, an
environment that agrees with the zygote's in every variable read when the preloads are imported
(:data:`IMPORT_TIME_ENV` and every ``PYTHON*``), and code that imports a preload (or graphdist).
Anything else runs cold, as before, and the ``task-started`` event says which way each task ran
and why not warm.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.machinery
import importlib.util
import io
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

from graphdist._exceptions import ArgumentError
from graphdist._proc.pidwatch import PidWatch
from graphdist._proc.process import proc_stat, stop_processes
from graphdist._registry import Option

__all__ = [
    "FD_ENV",
    "IMPORT_TIME_ENV",
    "MSG_MAX",
    "PRELOAD_DEFAULT",
    "PRELOAD_OPTION",
    "READY_TIMEOUT_S",
    "ZYGOTE_STOP_S",
    "WarmProc",
    "WarmTarget",
    "Zygote",
    "check_preload",
    "env_differences",
    "env_differs",
    "import_time_env",
    "peer_credentials",
    "warm_target",
]

#: ``--preload``'s default: what a TensorFlow task imports first, where it is installed.
PRELOAD_DEFAULT = ("numpy", "tensorflow", "tf_keras")
#: Environment variables that the preloaded modules (or the libraries they load) read once, as
#: they are imported: a task whose value differs from the zygote's runs cold. Besides these,
#: every ``PYTHON*`` variable (read by the interpreter at its start). Variables read when
#: TensorFlow's runtime starts (``CUDA_VISIBLE_DEVICES``, ``TF_CONFIG``,
#: ``TF_FORCE_GPU_ALLOW_GROWTH``...) may differ: the zygote never starts it. Measured for
#: ``TF_CPP_MIN_LOG_LEVEL`` (TF 2.x): TensorFlow's C++ logging keeps the level it read at its first
#: log line, which ``import tensorflow`` writes (oneDNN, CUDA notices); set after the import, 0 or 3
#: changes nothing of what a server logs later, so a task cannot inherit it from a zygote.
IMPORT_TIME_ENV = (
    "TF_USE_LEGACY_KERAS",
    "TF_CPP_MIN_LOG_LEVEL",
    "TF_CPP_MAX_VLOG_LEVEL",
    "TF_CPP_VMODULE",
    "TF_ENABLE_ONEDNN_OPTS",
    "KERAS_BACKEND",
    "KERAS_HOME",
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
)
#: The environment variable that hands a zygote its end of the launcher's socket (an fd).
FD_ENV = "GRAPHDIST_ZYGOTE_FD"
#: The longest message on a zygote's or a warm agent's socket: one request, a task's
#: environment and command.
MSG_MAX = 1 << 20
#: Seconds the launcher waits for a zygote's preloads to import before it gives up on it.
READY_TIMEOUT_S = 300.0
#: Seconds a zygote (or a warm agent's session) gets to end its guards, each of which grants
#: its task the guard's grace, before it is SIGKILLed.
ZYGOTE_STOP_S = 10.0


#: ``--preload``: a run backend's option where its tasks can run warm (local, slurm, ray).
PRELOAD_OPTION = Option(
    "preload",
    "modules a warm interpreter imports once, from which the run's Python tasks are "
    "forked instead of each importing them again: comma-separated, `auto` (default: "
    "NumPy, TensorFlow, tf-keras) or `none` (every task a fresh process)",
    metavar="MODULES",
)


def check_preload(value: object) -> tuple[str, ...]:
    """``--preload``'s value as module names: ``auto`` (:data:`PRELOAD_DEFAULT`, those
    installed), ``none`` (no warm tasks: every task cold), or comma-separated module names,
    each of which must be found (ArgumentError naming the first that is not)."""
    if value is None or value == "auto":
        return tuple(m for m in PRELOAD_DEFAULT if importlib.util.find_spec(m) is not None)
    if value == "none":
        return ()
    if isinstance(value, str):
        names: Sequence[object] = [v.strip() for v in value.split(",")]
    elif isinstance(value, (list, tuple)):
        names = value
    else:
        names = [value]
    checked = []
    for name in names:
        ok = isinstance(name, str) and all(part.isidentifier() for part in name.split("."))
        if not (ok and _module_found(str(name))):
            raise ArgumentError(
                f"preload names a module that this Python cannot import: {name!r}; name "
                "installed modules (comma-separated), `auto` for TensorFlow and Keras, or `none`"
                " for cold tasks",
                name="preload",
                value=value,
            )
        checked.append(str(name))
    return tuple(checked)


def _module_found(name: str) -> bool:
    """Whether module ``name`` can be found. ``find_spec("a.b")`` imports package ``a`` (its
    code runs: seconds for TensorFlow, and it may print or raise), so a dotted name's parts are
    first looked up one by one in their parent's search path, importing nothing; only a name
    not found so (a package that makes its submodules as it imports, as TensorFlow's
    ``compat``) is looked up by importing its parents, with their output kept off this
    process's stdout and any exception taken as "cannot import"."""
    parts = name.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])  # a top-level name: nothing imported
        for depth in range(1, len(parts)):
            if spec is None or spec.submodule_search_locations is None:
                break
            full = ".".join(parts[: depth + 1])
            loaded = sys.modules.get(full)
            spec = getattr(loaded, "__spec__", None) or importlib.machinery.PathFinder.find_spec(
                full, list(spec.submodule_search_locations)
            )
        if spec is not None and spec.name == name:
            return True
        if len(parts) == 1 or importlib.util.find_spec(parts[0]) is None:
            return False
        with contextlib.redirect_stdout(io.StringIO()):
            return importlib.util.find_spec(name) is not None
    except Exception:  # a finder, a package's own code, a broken install: it cannot import
        return False


@dataclass(frozen=True)
class WarmTarget:
    """What a warm task runs: ``mode`` ``script`` (a path), ``module`` (``-m``) or ``code``
    (``-c``), its ``target``, ``argv`` (``sys.argv`` as Python would set it) and whether
    ``-u`` asked for unbuffered output."""

    mode: str
    target: str
    argv: tuple[str, ...]
    unbuffered: bool


def warm_target(
    command: Sequence[str],
    env: Mapping[str, str],
    zygote_env: Mapping[str, str],
    preload: Sequence[str] | None = None,
) -> WarmTarget | str:
    """The :class:`WarmTarget` of ``command`` run with ``env``, or why it runs cold. With
    ``preload``, also cold where the task's own code (its script, ``-m`` module or ``-c`` code,
    as :mod:`ast` reads it) imports none of them, nor graphdist: it would wait for imports it
    does not use."""
    found = shutil.which(command[0], path=env.get("PATH", os.defpath))
    exe = os.path.abspath(sys.executable)
    if found is None or not _same_interpreter(os.path.abspath(found), exe):
        return f"{command[0]} is not graphdist's Python ({exe})"
    args = list(command[1:])
    unbuffered = False
    while args[:1] == ["-u"]:
        unbuffered, args = True, args[1:]
    if not args:
        return "an interactive Python (no script, -m or -c)"
    if args[0] in ("-m", "-c"):
        if len(args) < 2:
            return f"{args[0]} without its argument"
        mode = "module" if args[0] == "-m" else "code"
        argv = (args[0], *args[2:]) if mode == "code" else ("-m", *args[2:])
        target = WarmTarget(mode, args[1], argv, unbuffered)
    elif args[0].startswith("-"):
        return f"the Python option {args[0]} (only -u, then a script, -m or -c, runs warm)"
    else:
        target = WarmTarget("script", args[0], tuple(args), unbuffered)
    differs = env_differs(env, zygote_env)
    if differs is not None:
        return f"its {differs} differs from the warm interpreter's (read at import)"
    if preload is not None:
        wanted = {name.split(".")[0] for name in preload} | {"graphdist"}
        imported = _imports(target)
        if isinstance(imported, str):
            return imported
        if not imported & wanted:
            return f"its code imports none of {', '.join(sorted(wanted))}"
    return target


def import_time_env(env: Mapping[str, str]) -> dict[str, str]:
    """What of ``env`` a warm interpreter's imports read (:data:`IMPORT_TIME_ENV`, ``PYTHON*``):
    what a task's environment must agree with to be forked from it."""
    return {k: v for k, v in env.items() if k in IMPORT_TIME_ENV or k.startswith("PYTHON")}


def env_differs(env: Mapping[str, str], zygote_env: Mapping[str, str]) -> str | None:
    """The first variable read at import whose value differs between ``env`` and the warm
    interpreter's ``zygote_env``, or None."""
    differ = env_differences(env, zygote_env)
    return differ[0] if differ else None


def env_differences(env: Mapping[str, str], zygote_env: Mapping[str, str]) -> list[str]:
    """Every variable read at import whose value differs between ``env`` and the warm
    interpreter's ``zygote_env`` (one set in only one of them included), sorted."""
    keys = {*IMPORT_TIME_ENV, *(k for k in (*env, *zygote_env) if k.startswith("PYTHON"))}
    return [key for key in sorted(keys) if env.get(key) != zygote_env.get(key)]


def _imports(target: WarmTarget) -> frozenset[str] | str:
    """The top-level names of every module the task's own code imports (anywhere in it), or
    why they cannot be read. A file is parsed once while it is unchanged (every task of every
    attempt of a run asks about the same script)."""
    if target.mode == "code":
        return _names_in(target.target, "its -c code")
    path = target.target if target.mode == "script" else _module_source(target.target)
    if path is None:
        return f"the source of -m {target.target} is not found from {os.getcwd()}"
    try:
        stat = os.stat(path)
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror or exc})"
    return _file_imports(os.path.abspath(path), path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=32)
def _file_imports(key: str, path: str, mtime_ns: int, size: int) -> frozenset[str] | str:
    """:func:`_names_in` of the file at ``path``; cached by its absolute path (``key``), time
    of change and size."""
    try:
        with open(path, "rb") as f:
            source = f.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror or exc})"
    return _names_in(source, path)


@functools.lru_cache(maxsize=32)
def _names_in(source: str, where: str) -> frozenset[str] | str:
    """The top-level module names ``source`` imports, or why it does not parse."""
    import ast

    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return f"{where} does not parse (Python says why)"
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return frozenset(names)


def _module_source(module: str) -> str | None:
    """The file ``python -m MODULE`` would run, looked up in this folder and sys.path without
    importing anything."""
    parts = module.split(".")
    for folder in [os.getcwd(), *sys.path[1:]]:
        base = os.path.join(folder or os.getcwd(), *parts)
        for path in (base + ".py", os.path.join(base, "__main__.py")):
            if os.path.isfile(path):
                return path
    return None


def _same_interpreter(found: str, exe: str) -> bool:
    """Whether ``found`` starts the same Python with the same packages as ``exe``: the same
    file once links are resolved, in the same folder (a venv's ``python`` links to the base
    interpreter, which has none of the venv's packages)."""
    if found == exe:
        return True
    same_dir = os.path.dirname(found) == os.path.dirname(exe)
    return same_dir and os.path.realpath(found) == os.path.realpath(exe)


# -- the launcher's side ------------------------------------------------------------------------


class WarmProc:
    """A warm task's guard as the launcher holds it: what :class:`subprocess.Popen` offers that
    :class:`~graphdist._distribute.taskproc.GuardedTask` uses (``pid``, ``stdout``, ``stdin``,
    ``poll``, ``wait``, ``returncode``). Its guard is the zygote's child; the zygote tells its
    exit status."""

    def __init__(
        self, zygote: Zygote, pid: int, stdout: IO[bytes] | None, spare: bool = False
    ) -> None:
        self._zygote = zygote
        self.pid = pid
        self.spare = spare  # its guard was a spare, forked before the task was asked for
        self.stdout: IO[bytes] | None = stdout
        self.stdin: IO[bytes] | None = None
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._zygote.pump()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(["warm task guard", str(self.pid)], timeout or 0)
            self._zygote.wait_message(0.05)
        assert self.returncode is not None
        return self.returncode


class Zygote:
    """The launcher's handle on a warm interpreter (the module docstring): started with
    ``env`` (the run's base environment, as every task's), it imports ``preload``;
    :meth:`ready` waits for that, :meth:`spawn` forks a task's guard, :meth:`close` ends it
    and what it still runs."""

    def __init__(
        self,
        preload: Sequence[str],
        env: Mapping[str, str],
        *,
        session: socket.socket | None = None,
    ) -> None:
        self.preload = tuple(preload)
        self.env = dict(env)
        self._lock = threading.Lock()
        self._procs: dict[int, WarmProc] = {}
        self._early: dict[int, int] = {}  # exits told before their spawn's answer was read
        self._answers: dict[int, dict[str, Any]] = {}
        self._next = 0
        self._gone = False
        self._ready: bool | str | None = None  # True, or the error that stopped the zygote
        self.failed_import = False  # a preload failed to import (ready's answer says which)
        self.pid: int | None = None  # the zygote's, once ready
        self._watch: PidWatch | None = None  # its pidfd: a kill can reach no reused pid
        self.proc: subprocess.Popen[bytes] | None = None  # None: a warm agent's session
        if session is not None:
            # a session of a warm agent (graphdist._distribute.warmagent): the agent forked
            # this zygote, which imported nothing (its agent had); ``env`` is the agent's
            self._sock = session
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _ZYGOTE_CODE, *self.preload],
                env={**self.env, FD_ENV: str(theirs.fileno())},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()

    def ready(self, timeout_s: float = READY_TIMEOUT_S) -> str | None:
        """Wait until the preloads are imported: None, or why the zygote cannot serve (a
        preload that failed to import, in one line)."""
        deadline = time.monotonic() + timeout_s
        while self._ready is None and not self._gone and time.monotonic() < deadline:
            self.wait_message(min(0.5, max(0.0, deadline - time.monotonic())))
            self.pump()
        if self._ready is True:
            return None
        self.failed_import = isinstance(self._ready, str)
        if isinstance(self._ready, str):
            return self._ready
        return "the warm interpreter " + ("exited" if self._gone else "did not get ready")

    @property
    def alive(self) -> bool:
        self.pump()
        return self._ready is True and not self._gone

    def spawn(
        self,
        command: Sequence[str],
        target: WarmTarget,
        env: Mapping[str, str],
        *,
        name: str,
        grace_s: float,
        report_fd: int,
    ) -> WarmProc:
        """Fork ``command``'s guard and task (``target``) with ``env``, this process's working
        folder, no stdin (/dev/null) and ``report_fd``; its output goes to a pipe, the returned
        proc's ``stdout``. OSError when the zygote cannot. (A node's client asks a session of
        its agent directly: :mod:`graphdist._distribute.nodewarm`.)"""
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        try:
            with self._lock:
                self._next += 1
                ident = self._next
            request = {
                "id": ident,
                "name": name,
                "command": list(command),
                "mode": target.mode,
                "target": target.target,
                "argv": list(target.argv),
                "unbuffered": target.unbuffered,
                "env": dict(env),
                "cwd": os.getcwd(),
                "grace_s": grace_s,
                "stdin": False,
            }
            socket.send_fds(self._sock, [json.dumps(request).encode()], [out_w, report_fd])
            deadline = time.monotonic() + 30.0
            while ident not in self._answers:
                if self._gone or time.monotonic() > deadline:
                    raise OSError("the warm interpreter did not start the task")
                self.wait_message(0.05)
                self.pump()
            answer = self._answers.pop(ident)
            if "error" in answer:
                raise OSError(answer["error"])
            proc = WarmProc(
                self, int(answer["pid"]), os.fdopen(out_r, "rb"), bool(answer.get("spare"))
            )
        except BaseException:
            os.close(out_r)
            raise
        finally:
            os.close(out_w)
        with self._lock:
            self._procs[proc.pid] = proc
            early = self._early.pop(proc.pid, None)
        if early is not None:
            proc.returncode = early
        return proc

    def prepare(self, count: int) -> None:
        """Have ``count`` guards forked ahead (spares): the next ``count`` :meth:`spawn` calls
        hand their task to one instead of waiting for a fork of the big zygote. Asked while a
        failed attempt is stopped, so that the restart pays no fork; never waits."""
        if count > 0 and not self._gone:
            with contextlib.suppress(OSError):
                self._sock.send(json.dumps({"spares": count}).encode(), socket.MSG_DONTWAIT)

    def wait_message(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the zygote to say something (or to be gone)."""
        if self._gone:
            time.sleep(timeout_s)
            return
        with contextlib.suppress(OSError, ValueError):
            select.select([self._sock], [], [], timeout_s)

    def pump(self) -> None:
        """Read what the zygote said: its readiness, spawns' answers, guards' exits."""
        with self._lock:
            while not self._gone:
                try:
                    data = self._sock.recv(MSG_MAX, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                except OSError:
                    data = b""
                if not data:
                    self._lost()
                    break
                self._said(json.loads(data))

    def _said(self, msg: dict[str, Any]) -> None:
        if "ready" in msg:
            self._ready = True if msg["ready"] is True else str(msg["ready"])
            self.pid = msg.get("pid")
            if self.proc is None and self.pid is not None and self._watch is None:
                self._watch = PidWatch(int(self.pid))  # an agent's session: runs while it talks
        elif "exit" in msg:
            pid, code = int(msg["exit"]), os.waitstatus_to_exitcode(int(msg["status"]))
            if pid in self._procs:
                self._procs.pop(pid).returncode = code
            else:
                self._early[pid] = code
        elif "id" in msg:
            self._answers[int(msg["id"])] = msg

    def _lost(self) -> None:
        """The zygote is gone: its guards, orphaned, got their death signal and end their
        tasks; each proc ends once its guard is gone (its exit status was the zygote's)."""
        self._gone = True
        if self.proc is not None:
            self.proc.poll()
        waiters = list(self._procs.values())
        threading.Thread(target=self._watch_orphans, args=(waiters,), daemon=True).start()

    def _watch_orphans(self, procs: list[WarmProc]) -> None:
        while procs:
            for proc in list(procs):
                if not _alive(proc.pid):
                    proc.returncode = -signal.SIGKILL
                    procs.remove(proc)
            time.sleep(0.05)

    def close(self) -> None:
        """End the zygote: its guards get their death signal and end their tasks."""
        if self.proc is None:
            self._end_session()
            return
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        stop_processes([self.proc], grace_s=ZYGOTE_STOP_S)
        self.pump()
        self._sock.close()

    def _end_session(self) -> None:
        """A warm agent's session ends as a zygote does once its launcher's end closes: it
        SIGTERMs its guards, which end their tasks, and exits once they are gone, which closes
        its end; SIGKILL (through its pidfd, taken while it ran: never a reused pid) if that
        takes over :data:`ZYGOTE_STOP_S`. Not :func:`stop_processes`: the stop is the socket's
        end, not a SIGTERM, and the session is not our child to reap."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + ZYGOTE_STOP_S
        while not self._gone and time.monotonic() < deadline:
            self.wait_message(0.1)
            self.pump()
        if not self._gone and self._watch is not None:
            self._watch.send(signal.SIGKILL)
        if self._watch is not None:
            self._watch.close()
        self._sock.close()


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket (``SO_PEERCRED``:
    the kernel's word, which the peer cannot forge)."""
    ucred = struct.Struct("3i")
    pid, uid, gid = ucred.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, ucred.size))
    return pid, uid, gid


def _alive(pid: int) -> bool:
    return (proc_stat(pid) or ("X", 0))[0] not in ("Z", "X")


#: How the launcher starts a zygote: ``-c``, so that no graphdist module is ``__main__`` (a task's
#: ``__main__`` is a module of its own) and ``sys.path[0]`` is ``''`` as for ``-c``.
_ZYGOTE_CODE = (
    "import sys; from graphdist._distribute.zygote import zygote_main; "
    "sys.exit(zygote_main(sys.argv[1:]))"
)
