"""A run's log folder (``graphdist run --log-dir LOG_DIR``), made as graphdist makes its own
state folders.

Each run writes into a folder of its own, ``LOG_DIR/run-N`` (N one more than the highest there,
made with an exclusive ``mkdir``), so a reused ``LOG_DIR`` keeps runs apart. In a folder others
write to too (``/tmp``: the sticky bit), where a bare ``run-1`` says nothing of whose it is, it is
``LOG_DIR/graphdist-run-YYYYMMDD-HHMMSS-PID`` instead (the run's start, the launcher's pid)::

    LOG_DIR/run-N/attempt-K/TASK.log   every line a task of attempt K printed (K from 1)
    LOG_DIR/run-N/events.jsonl         the run's events, one JSON object a line, as they happen
    LOG_DIR/run-N/summary.txt          the run's summary, however it ended
    LOG_DIR/run-N/exits.json           every attempt's tasks: pid, exit code, how they ended

``run-N`` and everything in it is the user's alone: folders 0700, files 0600, created with
``O_EXCL | O_NOFOLLOW``, so nothing in it is a link or a file someone else made. ``LOG_DIR``
itself may be shared (``/tmp``) as long as no one else can replace what the run makes there: it
must be a folder owned by the user (or root) that others cannot write to, unless it has the
sticky bit (as ``/tmp`` has), and it is reached through no link another user made. Anything else
is refused with one line (:class:`~graphdist.ArgumentError`) before the run starts.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import stat
import threading
import time
from collections.abc import Iterator, Sequence
from typing import IO, TYPE_CHECKING, Any

from graphdist._exceptions import ArgumentError
from graphdist._validate import show

if TYPE_CHECKING:
    from graphdist._distribute.events import Event

__all__ = [
    "RunLogs",
    "check_log_dir",
    "check_output_folder",
    "check_output_name",
    "folder_refusal",
]

_RUN = re.compile(r"run-([0-9]{1,9})")


def _refuse(path: str, why: str, value: object) -> ArgumentError:
    return ArgumentError(
        f"Cannot keep logs in {path}: {why}; pass another log_dir",
        name="log_dir",
        value=value,
    )


def check_log_dir(log_dir: object) -> str:
    """``log_dir`` as an absolute path once it is a folder a run may write into (the module
    docstring); a missing one is made (0700). Raises :class:`ArgumentError`."""
    if isinstance(log_dir, bytes) or not isinstance(log_dir, str | os.PathLike):
        raise ArgumentError(
            f"log_dir must be a path (a str or os.PathLike), not {show(log_dir)}",
            name="log_dir",
            value=log_dir,
        )
    text = os.fspath(log_dir)
    if not isinstance(text, str) or not text.strip() or "\0" in text:
        raise ArgumentError(
            f"log_dir must name a folder, not {show(text)}", name="log_dir", value=log_dir
        )
    path = os.path.abspath(text)
    try:
        os.lstat(path)
    except FileNotFoundError:
        try:
            os.makedirs(path, mode=0o700)
        except OSError as exc:
            raise _refuse(path, exc.strerror or str(exc), log_dir) from None
    except OSError as exc:
        raise _refuse(path, exc.strerror or str(exc), log_dir) from None
    why = folder_refusal(path, shared_ok=True)
    if why is not None:
        raise _refuse(path, why, log_dir)
    return path


def folder_refusal(path: str, *, shared_ok: bool, what: str = "the run's folder") -> str | None:
    """Why a run may not write into the folder ``path``, in words, or None: it must be a folder
    (or a link to one that the user or root made) owned by the user or root, that the user can
    write to and no one else can, except, with ``shared_ok``, where the sticky bit keeps others
    from replacing what the run makes there (``/tmp``)."""
    me = os.getuid()
    try:
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode):
            if info.st_uid not in (me, 0):
                return f"it is a symbolic link made by uid {info.st_uid}"
            info = os.stat(path)
    except OSError as exc:
        return exc.strerror or str(exc)
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a folder"
    if info.st_uid not in (me, 0):
        return f"it belongs to uid {info.st_uid}, not to you (uid {me})"
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022 and not (shared_ok and mode & stat.S_ISVTX):
        if shared_ok:
            return (
                f"others can write to it (mode {mode:04o}, no sticky bit) and could replace {what}"
            )
        return f"others can write to it (mode {mode:04o}) and could replace what the run writes"
    if not os.access(path, os.W_OK | os.X_OK):
        return "you cannot write to it"
    return None


def check_output_name(value: object, *, name: str, suffixes: tuple[str, ...], why: str = "") -> str:
    """``value`` as an absolute path once it names a file (not a folder's path, ``x/``) whose
    name ends in one of ``suffixes`` and is no hidden one (``why``: why only those);
    :class:`ArgumentError` naming the argument ``name``. Its folder: :func:`check_output_folder`."""
    if isinstance(value, bytes) or not isinstance(value, str | os.PathLike):
        raise ArgumentError(f"{name} must be a path, not {show(value)}", name=name, value=value)
    text = os.fspath(value)
    full = os.path.abspath(text) if isinstance(text, str) and "\0" not in text else ""
    base = os.path.basename(full)
    if (
        not base.endswith(suffixes)
        or base in suffixes
        or base.startswith(".")
        or text.endswith(os.sep)
    ):
        raise ArgumentError(
            f"{name} must name a file ending in {' or '.join(suffixes)}, not a hidden one{why}, "
            f"not {show(text)}",
            name=name,
            value=value,
        )
    return full


def check_output_folder(
    full: str, value: object, *, name: str, what: str, shared_ok: bool = False
) -> str:
    """``full`` (from :func:`check_output_name`) once its folder is one to write ``what`` into
    and replace it by a rename: :func:`folder_refusal`'s (``shared_ok``: a sticky folder, such
    as ``/tmp``, too), and ``full`` no folder itself; :class:`ArgumentError` naming ``name``."""
    folder = os.path.dirname(full)
    refusal = folder_refusal(folder, shared_ok=shared_ok, what=what)
    if refusal is None and os.path.isdir(full):
        refusal = f"{os.path.basename(full)} is a folder"
    if refusal is not None:
        raise ArgumentError(
            f"Cannot write {what} in {folder}: {refusal}; pass another {name}",
            name=name,
            value=value,
        )
    return full


def _shared(folder: str) -> bool:
    """Whether others may make entries in ``folder`` (it passed :func:`check_log_dir`: then only
    with the sticky bit, as ``/tmp``)."""
    try:
        return bool(os.stat(folder).st_mode & 0o022)
    except OSError:
        return False


def _names(base: str) -> Iterator[str]:
    """The run folder's name in ``base``, then the next to try where it is taken: ``run-N``, or
    in a shared folder ``graphdist-run-<start time>-<pid>`` (``-2``, ``-3``... after it)."""
    if _shared(base):
        stem = f"graphdist-run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        yield stem
        yield from (f"{stem}-{k}" for k in itertools.count(2))
    taken: list[int] = []
    with contextlib.suppress(OSError):
        taken = [int(m[1]) for n in os.listdir(base) if (m := _RUN.fullmatch(n))]
    yield from (f"run-{n}" for n in itertools.count(max(taken, default=0) + 1))


class RunLogs:
    """One run's folder ``LOG_DIR/run-N`` (see the module docstring)."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        base = check_log_dir(log_dir)
        for name in _names(base):
            path = os.path.join(base, name)
            try:
                os.mkdir(path, 0o700)
                break
            except FileExistsError:  # another run took it (or a file by that name is there)
                continue
            except OSError as exc:
                raise _refuse(base, exc.strerror or str(exc), log_dir) from None
        self.path = path
        self._exits: list[dict[str, Any]] = []
        self._events: IO[bytes] | None = None
        self._lock = threading.Lock()

    def attempt(self, attempt: int) -> str:
        """The folder of attempt ``attempt`` (from 1), made now."""
        folder = os.path.join(self.path, f"attempt-{attempt}")
        os.mkdir(folder, 0o700)
        return folder

    @staticmethod
    def open(path: str) -> IO[bytes]:
        """A new file of ours (0600, never a link, never one that was there), for appending."""
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        return os.fdopen(fd, "ab", buffering=0)

    def record_event(self, event: Event) -> None:
        """Append ``event`` to ``events.jsonl`` (best effort, like every record here)."""
        with self._lock:
            try:
                if self._events is None:
                    self._events = self.open(os.path.join(self.path, "events.jsonl"))
                self._events.write((event.to_json() + "\n").encode())
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            events, self._events = self._events, None
        if events is not None:
            with contextlib.suppress(OSError):
                events.close()

    def record_exits(self, attempt: int, rows: Sequence[dict[str, Any]]) -> None:
        """Every task of attempt ``attempt``, to ``exits.json`` (rewritten whole each time)."""
        self._exits.extend({"attempt": attempt, **row} for row in rows)
        self._write("exits.json", json.dumps(self._exits, indent=1) + "\n")

    def write_summary(self, text: str) -> None:
        self._write("summary.txt", text + "\n")

    def _write(self, name: str, text: str) -> None:
        """Best effort: a full disk must not turn the run's ending into a traceback."""
        tmp = os.path.join(self.path, f".{name}.tmp")
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        try:
            with self.open(tmp) as f:
                f.write(text.encode())
            os.replace(tmp, os.path.join(self.path, name))
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
