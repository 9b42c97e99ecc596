"""A guard's report, written and read: the lines :func:`graphdist._proc.process.guard` writes to
its ``report_fd`` (``pid PID``: its command's; ``exit CODE WALL_TIME``: its end, on the guard's
wall clock, which hosts agree on; ``progress JSON``: a record of the task's training progress,
relayed by :class:`ProgressRelay`). Read by the launcher (a task's guard) and by a warm session
(the pid of a command its node's kernel may have killed for memory).

The progress channel: a guard whose report its launcher reads gives its command a pipe of its
own, named by :data:`PROGRESS_ENV` (``FD:INODE``: an inherited fd, and the pipe's inode, so that
a descendant that inherited the variable but not the fd never writes to another pipe by that
number), where :func:`graphdist.step` writes one JSON record a line without ever blocking
(:mod:`graphdist._distribute.progress`); the guard's relay thread forwards each line that is a
JSON object, prefixed ``progress``, into the report, and drops it where the report pipe has less
than :data:`REPORT_RESERVE` bytes free: the guard's own lines always fit, and never wait behind
records a launcher has not read. The task never gets the report itself (the guard keeps it
from its command): the guard's own lines there are what the launcher's verdicts read.

The guard runs as a script (``python -I -S``), so this module imports the standard library only:
the guard loads it by its path when it relays (``process._relay_class``)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import re
import select
import stat
import struct
import termios
import threading
import time
import weakref
from typing import Any

__all__ = [
    "MAX_PROGRESS_LINE",
    "PROGRESS_ENV",
    "REPORT_RESERVE",
    "ProgressRelay",
    "channel_fd",
    "channel_value",
    "parse_progress",
    "parse_report",
]

#: The environment variable naming a task's progress channel: ``FD:INODE`` (the module docstring;
#: :data:`graphdist._proc.process.PROGRESS_ENV` is the same name, for a guard that relays none).
PROGRESS_ENV = "GRAPHDIST_PROGRESS_FD"
#: The longest progress record relayed (bytes, with its newline): one atomic pipe write.
MAX_PROGRESS_LINE = 2048
#: Bytes of the report pipe a relay leaves free for the guard's own lines.
REPORT_RESERVE = 4096
_PREFIX = b"progress "
_GUARD_LINE = re.compile(rb"pid [0-9]+|exit -?[0-9]+ [0-9.e+-]+")  # what a guard says of itself
_F_GETPIPE_SZ = 1032  # fcntl's F_GETPIPE_SZ (Linux), named by Python's fcntl from 3.10 on x86


def parse_report(text: bytes) -> tuple[int | None, tuple[int, float] | None]:
    """The command's pid (the last said) and its end ``(code, wall time)`` (the first said) in
    the whole lines of ``text`` (split at newlines only); None for what it does not say yet."""
    pid: int | None = None
    end: tuple[int, float] | None = None
    for words in (line.decode("ascii", "replace").split(" ") for line in text.split(b"\n")):
        try:
            if words[0] == "pid" and len(words) == 2 and words[1].isdigit():
                pid = int(words[1])
            elif words[0] == "exit" and len(words) == 3 and end is None:
                end = (int(words[1]), float(words[2]))
        except ValueError:  # not a line a guard writes
            continue
    return pid, end


def channel_value(fd: int) -> str:
    """:data:`PROGRESS_ENV`'s value for the pipe ``fd``: ``FD:INODE``."""
    return f"{fd}:{os.fstat(fd).st_ino}"


def channel_fd(value: str | None) -> int | None:
    """The fd :data:`PROGRESS_ENV`'s ``value`` names, when this process has it open and it is
    still that pipe; else None."""
    fd, _, inode = (value or "").partition(":")
    if not (fd.isdigit() and inode.isdigit()):
        return None
    try:
        st = os.fstat(int(fd))
    except OSError:
        return None
    return int(fd) if stat.S_ISFIFO(st.st_mode) and st.st_ino == int(inode) else None


def _count(value: object, least: int) -> int | None:
    return value if type(value) is int and value >= least else None


def _record(line: bytes) -> dict[str, Any] | None:
    """One progress record as the launcher takes it, or None for one it cannot trust: ``step``
    (steps done, an int >= 0), ``t`` (the task's wall clock), ``total`` (an int > 0, or None),
    ``first`` (the process's first record), ``scalars`` (name -> a finite float, or None for a
    number that is not finite), ``wait`` (seconds the task waited for the others in its step,
    ``graphdist.step``'s ``ready``; None where not said)."""
    try:
        data = json.loads(line)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    step, t, total = _count(data.get("step"), 0), data.get("t"), data.get("total")
    if step is None or not isinstance(t, int | float) or not math.isfinite(t):
        return None
    scalars: dict[str, float | None] = {}
    raw = data.get("scalars", {})
    for name, value in raw.items() if isinstance(raw, dict) else ():
        if type(value) in (int, float):
            scalars[str(name)] = float(value) if math.isfinite(value) else None
    wait = data.get("wait")
    if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait < math.inf:
        wait = None
    return {
        "step": step,
        "t": float(t),
        "total": _count(total, 1),
        "first": data.get("first") is True,
        "scalars": scalars,
        "wait": None if wait is None else float(wait),
    }


def parse_progress(text: bytes) -> list[dict[str, Any]]:
    """The progress records (:func:`_record`'s fields) in the whole lines of ``text``, in their
    order; lines that are not one are left out."""
    found = []
    for line in text.splitlines():
        if line.startswith(_PREFIX) and (record := _record(line[len(_PREFIX) :])) is not None:
            found.append(record)
    return found


class ProgressRelay:
    """A guard's progress channel (the module docstring): made, it names its pipe's write end in
    the environment the command inherits; from :meth:`started` a thread forwards each whole line
    to the report until every writer closed it; :meth:`finish` waits for that briefly.

    ``step=True``: the command is an engine's step (``srun``), whose stderr carries the report of
    the guard on its node (that guard's ``report_fd`` is 2, its command's stderr joined to its
    stdout) and the engine's own messages. Then the pipe is the command's stderr (the guard puts
    it there), no variable names it (``srun`` would carry it to the node), and the thread
    forwards the node guard's ``progress`` lines to the report, drops its ``pid`` and ``exit``
    lines (of a pid on another host) and writes every other line to stdout, as the command's
    own stderr went before."""

    #: Seconds a step-mode guard waits for srun's last words before it says srun's exit: srun
    #: has exited, so only a launcher that no longer reads its output keeps them waiting.
    DRAIN_S = 60.0

    def __init__(self, report_fd: int, *, step: bool = False) -> None:
        self.report_fd = report_fd
        self.step = step
        self._read, self.write_fd = os.pipe2(os.O_CLOEXEC)
        if not step:  # else the guard's child dups it onto its stderr
            os.set_inheritable(self.write_fd, True)
            os.environ[PROGRESS_ENV] = channel_value(self.write_fd)  # the exec'd command's
        _HOLDING.add(self)  # a warm command execs nothing: a forked child closes our read end
        self._thread = threading.Thread(target=self._relay, daemon=True, name="progress-relay")
        self._idle = False
        self._size: int | None = None  # not a pipe: its writes do not wait for a reader
        with contextlib.suppress(OSError):
            self._size = fcntl.fcntl(report_fd, _F_GETPIPE_SZ)

    def _release(self) -> None:
        """Give up the read end: forgotten first, so that a fork from now on (see
        :func:`_close_in_child`) never closes the number, which may be another file's by then."""
        fd, self._read = self._read, -1
        _HOLDING.discard(self)
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _room(self, size: int) -> bool:
        """Whether the report pipe has ``size`` bytes free beyond :data:`REPORT_RESERVE`."""
        if self._size is None:
            return True
        (held,) = struct.unpack("i", fcntl.ioctl(self.report_fd, termios.FIONREAD, b"\0" * 4))
        return bool(held + size + REPORT_RESERVE <= self._size)

    def started(self) -> None:
        """The command has its copy: ours goes, so that the relay ends with the command's tree,
        and the relay starts (after the fork: a process that forks has no thread to lose)."""
        if self.write_fd < 0:
            return
        with contextlib.suppress(OSError):
            os.close(self.write_fd)
        self.write_fd = -1
        os.environ.pop(PROGRESS_ENV, None)
        self._thread.start()

    def finish(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the last lines (the tree ended: the pipe's end is near)."""
        if self._thread.ident is not None:  # started
            self._thread.join(timeout_s)

    def drained(self) -> bool:
        """Whether everything written to the pipe so far was forwarded: the thread waits for
        more (not busy with a chunk, not blocked writing one to a slow stdout) and the pipe holds
        nothing. Once srun has exited nothing of its own comes any more, even while a leftover
        process still holds the pipe open."""
        if not self._idle:
            return False
        (held,) = struct.unpack("i", fcntl.ioctl(self._read, termios.FIONREAD, b"\0" * 4))
        return bool(held == 0)

    def drain(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` until :meth:`drained` (or the relay ended): in step mode the
        guard waits so before it says srun's exit (:attr:`DRAIN_S`), so that srun's last words
        (a lost node, a task out of memory), which it once wrote to stdout itself, are there
        before the launcher reads the exit, however slowly it reads; a leftover that holds the
        pipe open delays nothing."""
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive() and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if self.drained():
                    return
            self._thread.join(0.02)

    def _relay(self) -> None:
        pending = b""
        long = False  # in a line too long to be a record: passed on (step) or dropped, whole
        while True:
            self._idle = True  # set only between chunks: drained() reads it, then the pipe
            try:
                select.select([self._read], [], [])
                self._idle = False
                chunk = os.read(self._read, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            if long:
                rest, newline, chunk = chunk.partition(b"\n")
                if self.step:
                    _write_all(1, rest + newline)
                if not newline:
                    continue
                long = False
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                self._forward(line, b"\n")
            if len(pending) > MAX_PROGRESS_LINE:  # no line so long is ours
                if self.step:  # the engine's words, after those before them
                    _write_all(1, pending)
                pending, long = b"", True
        if pending:
            self._forward(pending, b"")
        self._release()

    def _forward(self, line: bytes, end: bytes) -> None:
        if self.step:
            record = line[len(_PREFIX) :] if line.startswith(_PREFIX) else None
            if record is None and _GUARD_LINE.fullmatch(line) is None:
                _write_all(1, line + end)  # srun's own words, the node's messages
                return
            line = b"" if record is None else record  # a guard's pid or exit: dropped
        if 0 < len(line) < MAX_PROGRESS_LINE - len(_PREFIX) and _is_object(line):
            with contextlib.suppress(OSError):
                if self._room(len(line) + len(_PREFIX) + 1):  # else: dropped
                    os.write(self.report_fd, _PREFIX + line + b"\n")


def _write_all(fd: int, data: bytes) -> None:
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(fd, data) :]


def _is_object(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


#: The relays whose read end is open: a forked child closes each (:func:`_close_in_child`).
_HOLDING: weakref.WeakSet[ProgressRelay] = weakref.WeakSet()


def _close_in_child() -> None:
    # One hook for every relay, registered once: a hook per relay would outlive it and close,
    # in every later fork's child, a number the process had since given to another file (a
    # Popen's pipe, whose child then failed with EBADF before its exec).
    for relay in list(_HOLDING):
        relay._release()


os.register_at_fork(after_in_child=_close_in_child)
