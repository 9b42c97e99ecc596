"""The warm interpreter's own side (:mod:`graphdist._distribute.warm` is the launcher's): its
loop (:func:`zygote_main`: import the preloads, fork a guard per request, report the guards'
exits, end orphans as a subreaper), a guard's set-up in the forked child, and the task's
(:func:`_run_task`: a fresh interpreter's state, then the command's code as ``__main__``,
exiting as ``python`` does). Started by the launcher as ``python -c`` (``warm._ZYGOTE_CODE``).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from graphdist._distribute.warm import FD_ENV, MSG_MAX
from graphdist._proc import oom
from graphdist._proc.guardreport import PROGRESS_ENV, channel_value, parse_report
from graphdist._proc.process import (
    descendants,
    guard,
    proc_stat,
    set_child_subreaper,
    set_parent_death_signal,
)

__all__ = [
    "TASK_SIGNALS",
    "end_orphans",
    "import_preloads",
    "reap",
    "serve",
    "set_title",
    "zygote_main",
]


#: The signals a task gets back as a fresh interpreter has them, and those of them that the
#: zygote found ignored as it started (``nohup graphdist run``: SIGHUP): a cold task inherits
#: an ignored signal through exec, so a warm one keeps it ignored too.
TASK_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)
_ignored_at_start: frozenset[int] = frozenset()


def import_preloads(preload: Sequence[str]) -> str | None:
    """Import ``preload`` in order, from the environment's packages, not the current folder (a
    warm interpreter's, or a warm agent's); None, or the first failure in one line: ``cannot
    import NAME (Error: its first line)``."""
    path0, sys.path[:1] = sys.path[:1], []
    try:
        for name in preload:
            try:
                importlib.import_module(name)
            except BaseException as exc:  # an import that fails in any way: said in one line
                why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                return f"cannot import {name!r} ({why.strip()})"
    finally:
        sys.path[:0] = path0
    return None


def zygote_main(preload: Sequence[str]) -> int:
    global _ignored_at_start
    _ignored_at_start = frozenset(s for s in TASK_SIGNALS if signal.getsignal(s) == signal.SIG_IGN)
    sock = socket.socket(fileno=int(os.environ.pop(FD_ENV)))
    set_parent_death_signal(signal.SIGKILL)
    launcher = os.getppid()
    if launcher == 1:
        return 1
    why = import_preloads(preload)
    if why is not None:
        sock.send(json.dumps({"ready": why}).encode())
        return 2
    code = serve(sock)
    # every guard is gone and nothing here needs the interpreter's teardown, which takes ~1 s
    # with TensorFlow imported (2 s on a loaded machine) while the launcher waits for our end
    # (a Ctrl-C's too): flush, then end at once
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def serve(
    sock: socket.socket,
    ignored: frozenset[int] | None = None,
    *,
    preload: Sequence[str] = (),
    close_signal: int = signal.SIGTERM,
) -> int:
    """The zygote's loop on ``sock`` (its launcher's end): say ready, then fork a guard per
    request and report their exits, until the launcher closes its end (its guards then get
    ``close_signal``) and every guard is gone. Also a warm agent's session
    (:mod:`graphdist._distribute.warmagent`), with the signals its launcher found ``ignored``.

    A request names its task's ``mode``, ``target`` and ``argv`` (:class:`~graphdist.
    _distribute.warm.WarmTarget`), or only its ``command``: then it is decided here, against
    this process's environment and ``preload`` (a node client's, which cannot import graphdist),
    and a task that runs cold is answered ``{"id", "cold": why}``. Its descriptors are its
    output, its guard's report pipe, its stdin (where ``stdin``) and a progress channel (where
    ``progress``: a node client's guard's); ``"report": "session"``
    leaves the report pipe out, kept here instead: the exit message then says ``oom`` (in
    words) when the node's kernel killed the task for memory."""
    global _ignored_at_start
    if ignored is not None:
        _ignored_at_start = ignored
    # a subreaper: what a guard SIGKILLed left of its task's tree (a process forked without
    # exec, which carries no mark in /proc/PID/environ) comes here, and is ended (end_orphans)
    set_child_subreaper()
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: None)  # the socket's end ends the loop
    sock.send(json.dumps({"ready": True, "pid": os.getpid()}).encode())
    guards: set[int] = set()
    spares: dict[int, socket.socket] = {}  # forked guards that wait for their task's request
    reports: dict[int, tuple[int, float]] = {}  # guard: its report pipe's read end, started

    kmsg: list[int] = []  # the kernel's log, once opened here for a report

    def own_fds(*more: int) -> tuple[int, ...]:
        """What a forked child closes of ours besides sockets: the wake-up pipe, the report
        pipes kept here and the kernel's log read for them, and ``more``."""
        return (wake_r, wake_w, *(r for r, _ in reports.values()), *more, *kmsg)

    open_ = True
    while open_ or guards:
        with contextlib.suppress(InterruptedError):
            select.select([sock.fileno(), wake_r] if open_ else [wake_r], [], [], 1.0)
        with contextlib.suppress(BlockingIOError):
            while os.read(wake_r, 512):
                pass
        for pid, status in reap():
            if pid in spares:
                spares.pop(pid).close()
            elif pid in guards:
                guards.discard(pid)
                said: dict[str, Any] = {"exit": pid, "status": status}
                ran_out = _ran_out(*reports.pop(pid), status) if pid in reports else None
                if ran_out is not None:
                    said["oom"] = ran_out
                with contextlib.suppress(OSError):
                    sock.send(json.dumps(said).encode())
        end_orphans(guards | spares.keys())
        if not open_:
            continue
        got = receive(sock)
        if got is None:
            continue
        data, fds = got
        if not data:  # the launcher closed its end (or is gone): stop every guard
            open_ = False
            for pid in [*guards, *spares]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, close_signal if pid in guards else signal.SIGTERM)
            continue
        request = json.loads(data)
        if "spares" in request:  # fork them now: the next requests are answered at once
            while len(spares) < int(request["spares"]):
                try:
                    pid, waiting = _fork_spare(sock, own_fds(), [*spares.values()])
                except OSError:
                    break  # no more now: the next requests fork as before
                spares[pid] = waiting
            continue
        cold = _decided(request, preload)
        if cold is not None:
            for fd in fds:
                os.close(fd)
            sock.send(json.dumps({"id": request["id"], "cold": cold}).encode())
            continue
        report = None
        if request.get("report") == "session":  # its read end stays here (the exit's oom)
            report = os.pipe()
            watch = oom.shared()  # the kernel's log is read from before the task starts
            kmsg[:] = [] if watch.fd is None else [watch.fd]
            fds.insert(1, report[1])
        data = json.dumps(request).encode()  # as decided here: a spare gets it whole
        try:
            handed = _hand_to_spare(spares, data, fds)
            spare = handed is not None
            others = [*spares.values()]  # a fresh guard must not hold the spares' sockets
            mine = () if report is None else (report[0],)
            pid = (
                _fork_guard(request, fds, sock, own_fds(*mine), others)
                if handed is None
                else handed
            )
        except OSError as exc:
            answer: dict[str, Any] = {"id": request["id"], "error": str(exc)}
        else:
            guards.add(pid)
            answer = {"id": request["id"], "pid": pid, "spare": spare}
        finally:
            for fd in fds:
                os.close(fd)
        if report is not None and "pid" in answer:
            reports[answer["pid"]] = (report[0], time.monotonic())
        elif report is not None:
            os.close(report[0])
        sock.send(json.dumps(answer).encode())
    return 0


def _decided(request: dict[str, Any], preload: Sequence[str]) -> str | None:
    """Complete a request that names only its command (a node client's) with its warm target,
    decided here; why it runs cold instead, or None."""
    if "mode" in request:
        return None
    from graphdist._distribute.warm import warm_target

    target = warm_target(request["command"], request["env"], os.environ, preload)
    if isinstance(target, str):
        return target
    request.update(
        mode=target.mode, target=target.target, argv=list(target.argv), unbuffered=target.unbuffered
    )
    return None


def _ran_out(read: int, started_s: float, status: int) -> str | None:
    """``out of memory (...)`` when a guard that ended with ``status`` had its command killed
    by the node's kernel for memory (its report pipe ``read`` names the command's pid); None
    otherwise, or where the kernel's log cannot be read."""
    text = b""
    with contextlib.suppress(OSError):
        os.set_blocking(read, False)
        while chunk := os.read(read, 4096):
            text += chunk
    os.close(read)
    if os.waitstatus_to_exitcode(status) != -signal.SIGKILL:
        return None
    pid, _ = parse_report(text)
    killed = oom.shared().killed(pid, started_s)
    return None if killed is None else killed.words()


def _hand_to_spare(spares: dict[int, socket.socket], data: bytes, fds: list[int]) -> int | None:
    """Give a task's request and its file descriptors to a spare guard; its pid, or None where
    no spare is left (one that died meanwhile is skipped)."""
    while spares:
        pid, waiting = spares.popitem()
        try:
            socket.send_fds(waiting, [data], fds)
        except OSError:
            continue
        finally:
            waiting.close()
        return pid
    return None


def _fork_spare(
    sock: socket.socket, own: tuple[int, ...], others: list[socket.socket]
) -> tuple[int, socket.socket]:
    """Fork a guard ahead of its task (a restart's, while the failed attempt is stopped): it
    waits for the request the zygote hands it, then is that task's guard as a guard forked on
    request is. The zygote's end of its socket comes back with its pid."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    zygote = os.getpid()
    try:
        pid = os.fork()
    except OSError:
        ours.close()
        theirs.close()
        raise
    if pid != 0:
        theirs.close()
        return pid, ours
    code = 70
    try:  # the spare: never returns
        set_parent_death_signal(signal.SIGKILL)
        _leave_zygote(sock, own, [ours, *others])
        set_title("graphdist-guard (a spare: no task yet)")
        code = 0
        while os.getppid() == zygote:
            with contextlib.suppress(InterruptedError):
                select.select([theirs], [], [])
            with contextlib.suppress(BlockingIOError):
                data, fds = _recv_fds(theirs)
                theirs.close()
                if data:
                    _be_guard(json.loads(data), fds, zygote)
                break
    except BaseException:
        code = 70
    finally:
        os._exit(code)


def receive(sock: socket.socket) -> tuple[bytes, list[int]] | None:
    """One message on ``sock`` and its file descriptors; None where none is there yet, ``b""``
    once the peer closed its end (or it failed)."""
    try:
        return _recv_fds(sock)
    except BlockingIOError:
        return None
    except OSError:
        return b"", []


def _recv_fds(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One request and its file descriptors, without waiting (BlockingIOError where none is
    there: socket.recv_fds passes no flags to recvmsg on every Python this supports)."""
    import array

    fds = array.array("i")
    space = socket.CMSG_SPACE(4 * fds.itemsize)  # output, report, stdin, progress channel
    data, ancdata, _, _ = sock.recvmsg(
        MSG_MAX, space, socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC
    )
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
    return data, list(fds)


def end_orphans(guards: set[int]) -> None:
    """SIGKILL every child of the zygote that is none of its guards: an orphan of a task whose
    guard is gone (the zygote is a subreaper), which nobody else would end."""
    me = os.getpid()
    for pid in descendants(me):
        if pid not in guards and (proc_stat(pid) or ("X", 0))[1] == me:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def reap() -> list[tuple[int, int]]:
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
    request: dict[str, Any],
    fds: list[int],
    sock: socket.socket,
    own: tuple[int, ...],
    others: list[socket.socket],
) -> int:
    zygote = os.getpid()
    pid = os.fork()
    if pid != 0:
        return pid
    try:  # the guard: never returns
        _leave_zygote(sock, own, others)
        _be_guard(request, fds, zygote)
    finally:
        os._exit(70)


def _leave_zygote(sock: socket.socket, own: tuple[int, ...], others: list[socket.socket]) -> None:
    """In a forked child: none of the zygote's signal handling, sockets (its launcher's and
    its spares'), wake-up pipe or report pipes."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    for each in (sock, *others):
        each.close()
    for fd in own:
        os.close(fd)


def _be_guard(request: dict[str, Any], fds: list[int], zygote: int) -> None:
    """Be the guard of ``request``'s task, with its output and report pipes (and stdin) in
    ``fds``; exits with the guard's status, never returns."""
    code = 70
    try:
        out, report, *rest = fds
        stdin = rest.pop(0) if request["stdin"] else os.open(os.devnull, os.O_RDONLY)
        channel = rest.pop(0) if request.get("progress") else None  # a node client's
        os.dup2(stdin, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        for fd in {out, stdin}:
            if fd > 2:
                os.close(fd)
        os.set_inheritable(report, True)
        os.setsid()
        set_title(f"graphdist-guard --name {request['name']} -- {' '.join(request['command'])}")
        code = guard(
            request["command"],
            zygote,
            float(request["grace_s"]),
            report_fd=report,
            run_child=lambda: _run_task(request, report, channel),
            progress=request.get("report") != "session",  # a session reads it at the end only
        )
    except BaseException:
        code = 70
    finally:
        os._exit(code)


def set_title(text: str) -> None:
    """The process's command line as ``ps`` shows it, where setproctitle is installed."""
    try:
        import setproctitle
    except ImportError:
        return
    with contextlib.suppress(Exception):
        setproctitle.setproctitle(text)


def _run_task(request: dict[str, Any], report: int, channel: int | None = None) -> None:
    """The task, in the guard's forked child: a fresh interpreter's state, then its code as
    ``__main__``; exits as the interpreter would. ``channel``: where its progress records go (a
    node client's guard's channel), else its guard's own. Never returns."""
    code = 1
    try:
        os.close(report)
        progress = os.environ.get(PROGRESS_ENV) if channel is None else channel_value(channel)
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.pop(PROGRESS_ENV, None)  # never another process's
        if progress is not None:
            os.environ[PROGRESS_ENV] = progress
        os.chdir(request["cwd"])
        for sig in TASK_SIGNALS:
            fresh = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            signal.signal(sig, signal.SIG_IGN if sig in _ignored_at_start else fresh)
        signal.pthread_sigmask(signal.SIG_SETMASK, ())
        _fresh_stdio(request["unbuffered"] or bool(request["env"].get("PYTHONUNBUFFERED")))
        import atexit

        atexit._clear()
        set_title(" ".join(request["command"]))
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
