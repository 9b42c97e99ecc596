"""Warm task interpreters: a run's Python tasks forked from an interpreter that has imported
TensorFlow (and tf-keras) once, instead of each task importing them again.

A :class:`Zygote` is this module run as a program (``python -m graphdist._distribute.warm
MODULE...``), the launcher's child: it imports the run's preloads (:func:`check_preload`; by
default TensorFlow, tf-keras and NumPy), says ``ready`` and then, for each task the launcher
asks for, forks a child that is that task's guard (:func:`graphdist._proc.process.guard`: the
same subreaper, death signal and tree ending as a cold task's guard, in the forked process
instead of ``python -I -S process.py``). The guard forks the task, which sets what a fresh
interpreter would have (:func:`_run_task`): its environment, ``sys.argv``, ``sys.path[0]``, its
working folder, its stdin/stdout/stderr (passed with the request over the zygote's socket), the
signals' default handlers, no ``atexit`` handler of the zygote's; then runs the script, ``-m``
module or ``-c`` code as ``__main__`` and exits as the interpreter does (``sys.exit``, an
exception's traceback and exit 1, a KeyboardInterrupt's SIGINT, ``atexit``, non-daemon threads
joined). The process tree is ``launcher - zygote - guard - task``: ``os.getppid()`` in a task is
its guard, as for a cold task.

The zygote never starts TensorFlow's runtime: it only imports, so no task forks from a process
with the runtime's threads. It dies with the launcher (``PR_SET_PDEATHSIG``), and its guards with
it (their death signal), each ending its task's tree.

Which tasks run warm (:func:`warm_target`): ``PY SCRIPT ARGS``, ``PY -m MODULE ARGS`` and ``PY -c
CODE ARGS`` (``-u`` allowed before them), ``PY`` being the interpreter graphdist runs in, and an
environment that agrees with the zygote's in every variable read when the preloads are imported
(:data:`IMPORT_TIME_ENV` and every ``PYTHON*``). Anything else runs cold, as before, and the
``task-started`` event says which way each task ran and why not warm.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

from graphdist._exceptions import ArgumentError
from graphdist._proc.process import (
    _PR_SET_CHILD_SUBREAPER,
    _prctl,
    descendants,
    guard,
    set_parent_death_signal,
)

__all__ = [
    "IMPORT_TIME_ENV",
    "PRELOAD_DEFAULT",
    "READY_TIMEOUT_S",
    "WarmProc",
    "WarmTarget",
    "Zygote",
    "check_preload",
    "warm_target",
]

#: ``--preload``'s default: what a TensorFlow task imports first, where it is installed.
PRELOAD_DEFAULT = ("numpy", "tensorflow", "tf_keras")
#: Environment variables that the preloaded modules (or the libraries they load) read once, as
#: they are imported: a task whose value differs from the zygote's runs cold. Besides these,
#: every ``PYTHON*`` variable (read by the interpreter at its start). Variables read when
#: TensorFlow's runtime starts (``CUDA_VISIBLE_DEVICES``, ``TF_CONFIG``,
#: ``TF_FORCE_GPU_ALLOW_GROWTH``...) may differ: the zygote never starts it.
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
_FD_ENV = "GRAPHDIST_ZYGOTE_FD"
_MSG_MAX = 1 << 20  # one request: a task's environment and command
#: Seconds the launcher waits for a zygote's preloads to import before it gives up on it.
READY_TIMEOUT_S = 300.0


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
        try:
            found = ok and importlib.util.find_spec(str(name)) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ArgumentError(
                f"preload names a module that this Python cannot import: {name!r}; name "
                "installed modules (comma-separated), `auto` for TensorFlow and Keras, or `none`"
                " for cold tasks",
                name="preload",
                value=value,
            )
        checked.append(str(name))
    return tuple(checked)


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
    keys = {*IMPORT_TIME_ENV, *(k for k in (*env, *zygote_env) if k.startswith("PYTHON"))}
    for key in sorted(keys):
        if env.get(key) != zygote_env.get(key):
            return f"its {key} differs from the warm interpreter's (read at import)"
    if preload is not None:
        wanted = {name.split(".")[0] for name in preload} | {"graphdist"}
        imported = _imports(target)
        if isinstance(imported, str):
            return imported
        if not imported & wanted:
            return f"its code imports none of {', '.join(sorted(wanted))}"
    return target


def _imports(target: WarmTarget) -> set[str] | str:
    """The top-level names of every module the task's own code imports (anywhere in it), or
    why they cannot be read."""
    import ast

    if target.mode == "code":
        source, where = target.target, "its -c code"
    else:
        path = target.target if target.mode == "script" else _module_source(target.target)
        where = path or f"module {target.target}"
        if path is None:
            return f"the source of -m {target.target} is not found from {os.getcwd()}"
        try:
            with open(path, "rb") as f:
                source = f.read().decode("utf-8", "replace")
        except OSError as exc:
            return f"{path} cannot be read ({exc.strerror or exc})"
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
    return names


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

    def __init__(self, zygote: Zygote, pid: int, stdout: IO[bytes]) -> None:
        self._zygote = zygote
        self.pid = pid
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

    def __init__(self, preload: Sequence[str], env: Mapping[str, str]) -> None:
        self.preload = tuple(preload)
        self.env = dict(env)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self._lock = threading.Lock()
        self._procs: dict[int, WarmProc] = {}
        self._early: dict[int, int] = {}  # exits told before their spawn's answer was read
        self._answers: dict[int, dict[str, Any]] = {}
        self._next = 0
        self._gone = False
        self._ready: bool | str | None = None  # True, or the error that stopped the zygote
        self.failed_import = False  # a preload failed to import (ready's answer says which)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _ZYGOTE_CODE, *self.preload],
                env={**self.env, _FD_ENV: str(theirs.fileno())},
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
        stdin: int | None,
    ) -> WarmProc:
        """Fork ``command``'s guard and task (``target``) with ``env``, this process's working
        folder, ``stdin`` (a file descriptor, or None: /dev/null) and ``report_fd``; its output
        is the returned proc's ``stdout``. OSError when the zygote cannot."""
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
                "stdin": stdin is not None,
            }
            fds = [out_w, report_fd] + ([stdin] if stdin is not None else [])
            socket.send_fds(self._sock, [json.dumps(request).encode()], fds)
            deadline = time.monotonic() + 30.0
            while ident not in self._answers:
                if self._gone or time.monotonic() > deadline:
                    raise OSError("the warm interpreter did not start the task")
                self.wait_message(0.05)
                self.pump()
            answer = self._answers.pop(ident)
            if "error" in answer:
                raise OSError(answer["error"])
            proc = WarmProc(self, int(answer["pid"]), os.fdopen(out_r, "rb"))
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
                    data = self._sock.recv(_MSG_MAX, socket.MSG_DONTWAIT)
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
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.pump()
        self._sock.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# -- the zygote's side --------------------------------------------------------------------------


def _zygote_main(preload: Sequence[str]) -> int:
    sock = socket.socket(fileno=int(os.environ.pop(_FD_ENV)))
    set_parent_death_signal(signal.SIGKILL)
    launcher = os.getppid()
    if launcher == 1:
        return 1
    path0, sys.path[:1] = sys.path[:1], []  # preloads from the environment, not this folder
    for name in preload:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # an import that fails in any way: said in one line
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            sock.send(json.dumps({"ready": f"cannot import {name!r} ({why.strip()})"}).encode())
            return 2
    sys.path[:0] = path0
    # a subreaper: what a guard SIGKILLed left of its task's tree (a process forked without
    # exec, which carries no mark in /proc/PID/environ) comes here, and is ended (_orphans)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: None)  # the socket's end ends the loop
    sock.send(json.dumps({"ready": True}).encode())
    guards: set[int] = set()
    open_ = True
    while open_ or guards:
        with contextlib.suppress(InterruptedError):
            select.select([sock.fileno(), wake_r] if open_ else [wake_r], [], [], 1.0)
        with contextlib.suppress(BlockingIOError):
            while os.read(wake_r, 512):
                pass
        for pid, status in _reap():
            if pid in guards:
                guards.discard(pid)
                with contextlib.suppress(OSError):
                    sock.send(json.dumps({"exit": pid, "status": status}).encode())
        _end_orphans(guards)
        if not open_:
            continue
        try:
            data, fds = _recv_fds(sock)
        except BlockingIOError:
            continue
        except OSError:
            data, fds = b"", []
        if not data:  # the launcher closed its end (or is gone): stop every guard
            open_ = False
            for pid in guards:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            continue
        request = json.loads(data)
        try:
            pid = _fork_guard(request, fds, sock, (wake_r, wake_w))
        except OSError as exc:
            answer: dict[str, Any] = {"id": request["id"], "error": str(exc)}
        else:
            guards.add(pid)
            answer = {"id": request["id"], "pid": pid}
        finally:
            for fd in fds:
                os.close(fd)
        sock.send(json.dumps(answer).encode())
    return 0


def _recv_fds(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One request and its file descriptors, without waiting (BlockingIOError where none is
    there: socket.recv_fds passes no flags to recvmsg on every Python this supports)."""
    import array

    fds = array.array("i")
    space = socket.CMSG_SPACE(3 * fds.itemsize)
    data, ancdata, _, _ = sock.recvmsg(
        _MSG_MAX, space, socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC
    )
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
    return data, list(fds)


def _end_orphans(guards: set[int]) -> None:
    """SIGKILL every child of the zygote that is none of its guards: an orphan of a task whose
    guard is gone (the zygote is a subreaper), which nobody else would end."""
    me = os.getpid()
    for pid in descendants(me):
        if pid not in guards and _parent(pid) == me:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _reap() -> list[tuple[int, int]]:
    reaped: list[tuple[int, int]] = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        reaped.append((pid, status))


def _fork_guard(
    request: dict[str, Any], fds: list[int], sock: socket.socket, wake: tuple[int, int]
) -> int:
    zygote = os.getpid()
    pid = os.fork()
    if pid != 0:
        return pid
    code = 70
    try:  # the guard: never returns
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        sock.close()
        for fd in wake:
            os.close(fd)
        out, report = fds[0], fds[1]
        stdin = fds[2] if request["stdin"] else os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        for fd in {out, stdin}:
            if fd > 2:
                os.close(fd)
        os.set_inheritable(report, True)
        os.setsid()
        _title(f"graphdist-guard --name {request['name']} -- {' '.join(request['command'])}")
        code = guard(
            request["command"],
            zygote,
            float(request["grace_s"]),
            report_fd=report,
            run_child=lambda: _run_task(request, report),
        )
    except BaseException:
        code = 70
    finally:
        os._exit(code)


def _title(text: str) -> None:
    """The process's command line as ``ps`` shows it, where setproctitle is installed."""
    try:
        import setproctitle
    except ImportError:
        return
    with contextlib.suppress(Exception):
        setproctitle.setproctitle(text)


def _run_task(request: dict[str, Any], report: int) -> None:
    """The task, in the guard's forked child: a fresh interpreter's state, then its code as
    ``__main__``; exits as the interpreter would. Never returns."""
    code = 1
    try:
        os.close(report)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, ())
        _fresh_stdio(request["unbuffered"] or bool(request["env"].get("PYTHONUNBUFFERED")))
        import atexit

        atexit._clear()
        _title(" ".join(request["command"]))
        code = _run_main(request)
    except BaseException:  # graphdist's own failure before the task's code ran
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _fresh_stdio(unbuffered: bool) -> None:
    """New sys.stdin/stdout/stderr on fds 0-2 (the zygote's were its own), buffered as a
    fresh interpreter's would be."""
    encoding = sys.stdout.encoding if sys.stdout is not None else "utf-8"
    errors = sys.stdout.errors if sys.stdout is not None else "strict"

    def opened(fd: int, mode: str) -> io.TextIOWrapper:
        interactive = os.isatty(fd)
        raw = io.FileIO(fd, mode, closefd=False)
        binary: Any = raw
        if not (unbuffered and mode == "wb"):
            binary = io.BufferedWriter(raw) if mode == "wb" else io.BufferedReader(raw)
        return io.TextIOWrapper(
            binary,
            encoding=encoding,
            errors="backslashreplace" if fd == 2 else errors,
            line_buffering=(interactive or fd == 2) and not unbuffered,
            write_through=unbuffered and mode == "wb",
        )

    sys.stdin, sys.stdout, sys.stderr = opened(0, "rb"), opened(1, "wb"), opened(2, "wb")
    for name in ("stdin", "stdout", "stderr"):
        setattr(sys, f"__{name}__", getattr(sys, name))


def _run_main(request: dict[str, Any]) -> int:
    """Run the task's code as ``python`` would, in a ``__main__`` module of its own: a script
    (``__file__`` its path), ``-m`` (runpy, as ``python -m``) or ``-c``."""
    import runpy
    import tokenize
    import types

    mode, target = request["mode"], request["target"]
    sys.argv = list(request["argv"])
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    if mode == "script":
        path = os.path.abspath(target)
        try:
            with tokenize.open(path) as f:
                source = f.read()
        except OSError as exc:
            print(
                f"{sys.executable}: can't open file {path!r}: [Errno {exc.errno}] {exc.strerror}",
                file=sys.stderr,
            )
            return 2
        sys.path[0] = os.path.dirname(os.path.realpath(path))
        main.__file__ = path  # absolute, as Python 3.9+ sets it
    else:
        sys.path[0] = os.getcwd() if mode == "module" else ""
    try:
        if mode == "module":
            runpy._run_module_as_main(target, alter_argv=True)  # type: ignore[attr-defined]
        else:
            sys.modules["__main__"] = main
            filename = os.path.abspath(target) if mode == "script" else "<string>"
            exec(compile(source if mode == "script" else target, filename, "exec"), main.__dict__)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except KeyboardInterrupt as exc:
        _print_exception(exc)
        _at_exit()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130
    except BaseException as exc:
        _print_exception(exc)
        code = 1
    return _at_exit(code)


def _print_exception(exc: BaseException) -> None:
    """The uncaught exception as the interpreter prints it: sys.excepthook, with the traceback
    from the task's own first frame (the hook prints the exception's ``__traceback__``)."""
    exc.__traceback__ = _own_frames_cut(exc.__traceback__)
    sys.excepthook(type(exc), exc, exc.__traceback__)


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    with contextlib.suppress(Exception):
        print(exc.code, file=sys.stderr)
    return 1


def _at_exit(code: int = 0) -> int:
    """What the interpreter does at its end: join non-daemon threads, run ``atexit``, flush."""
    import atexit

    with contextlib.suppress(Exception):
        threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            code = code or 120
    return code


def _own_frames_cut(tb: Any) -> Any:
    """A traceback without this module's frames at its top, as a fresh interpreter's starts
    at the script's own frame (``-m``'s keeps runpy's, as ``python -m`` shows them)."""
    ours = os.path.abspath(__file__)
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) == ours:
        tb = tb.tb_next
    return tb


#: How the launcher starts a zygote: ``-c``, so that this module is no ``__main__`` (a task's
#: ``__main__`` is a module of its own) and ``sys.path[0]`` is ``''`` as for ``-c``.
_ZYGOTE_CODE = (
    "import sys; from graphdist._distribute.warm import _zygote_main; "
    "sys.exit(_zygote_main(sys.argv[1:]))"
)
