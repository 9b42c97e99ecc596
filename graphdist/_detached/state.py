"""The state folder of a detached fleet: who supervises it, which pids serve which tasks, and logs.

Layout of a state folder: ``fleet.json`` (written atomically once every server is ready, and again
whenever a task dies, is restarted or given up on), ``error.json`` (written instead when the start
failed), ``control.sock`` (the supervisor's control channel, see ``graphdist._detached.control``),
``lock`` (see below), ``supervisor.log`` and ``logs/JOB-INDEX.log``.

Pids are stored with their process start times, so a pid reused by an unrelated process is never
mistaken for one of ours (and never signalled).

Two things keep the folder from racing or rotting:

- **The lock.** A command that changes the folder (``up --detach`` from its check until the
  supervisor is ready, ``down``, the cleanup of a stale fleet) holds an exclusive ``flock`` on
  ``lock`` (:func:`lock_state`); the holder writes its pid there, for the message of whoever has
  to wait or give up. The lock is never unlinked on release; a ``down`` removes the folder while
  holding it, so a waiter that then gets the lock checks that its file is still the one at that
  path and otherwise starts over.
- **The marker.** Every process of a detached fleet (the supervisor, its fork server and the
  servers forked from it) carries ``GRAPHDIST_FLEET_MARK=<the folder's real path>`` in its
  environment from the moment it is executed (:data:`MARK_ENV`, :func:`fleet_mark`), so
  :func:`~graphdist._detached.marked.marked_processes` finds them even when ``fleet.json`` is
  missing, truncated or garbage.

A ``fleet.json`` that cannot be read as a fleet record (bad JSON, bad UTF-8, a field of the wrong
type) raises :class:`CorruptStateError`, a :class:`StateError`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import shlex
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from graphdist._exceptions import (
    CorruptStateError,
    GraphdistError,
    StateError,
    from_wire,
    to_wire,
)
from graphdist._failures import task_name
from graphdist._private import private_dir
from graphdist._proc.process import proc_stat

__all__ = [
    "MARK_ENV",
    "STATE_DIR_ENV",
    "CorruptStateError",
    "FleetRecord",
    "ProcessRef",
    "TaskRecord",
    "clear_state",
    "default_state_dir",
    "down_command",
    "fleet_command",
    "fleet_logs",
    "fleet_mark",
    "leftovers",
    "lock_state",
    "read_error",
    "read_state",
    "remove_leftovers",
    "write_state",
]

STATE_DIR_ENV = "GRAPHDIST_STATE_DIR"
MARK_ENV = "GRAPHDIST_FLEET_MARK"
STATE_FILE = "fleet.json"
ERROR_FILE = "error.json"
SUPERVISOR_LOG = "supervisor.log"
CONTROL_SOCKET = "control.sock"
LOCK_FILE = "lock"
SUPERVISOR_MODULE = "graphdist._detached.supervisor"
MAX_STATE_BYTES = 16 << 20
_LOCK_POLL_S = 0.05
TLS_DIR = "tls"  # a TLS fleet's credentials (private keys)
LOGS_DIR = "logs"
# What a fleet leaves in its folder that the next one must not mistake for its own.
_LEFTOVERS = (STATE_FILE, ERROR_FILE, CONTROL_SOCKET, TLS_DIR)
#: Everything a fleet keeps in its state folder (and ``NAME.tmpPID`` files being written):
#: :func:`clear_state` removes these and nothing else, and a folder holding anything else is
#: not taken for one (:func:`foreign_entries`).
STATE_ENTRIES = (
    STATE_FILE,
    ERROR_FILE,
    SUPERVISOR_LOG,
    CONTROL_SOCKET,
    LOCK_FILE,
    LOGS_DIR,
    TLS_DIR,
)


def default_state_dir() -> str:
    """``$GRAPHDIST_STATE_DIR``, else ``$XDG_STATE_HOME/graphdist``, else
    ``~/.local/state/graphdist``: one default fleet per user."""
    if os.environ.get(STATE_DIR_ENV):
        return os.path.abspath(os.environ[STATE_DIR_ENV])
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state"
    )
    return os.path.join(base, "graphdist")


def fleet_command(state_dir: str, command: str, *args: str) -> str:
    """``graphdist COMMAND ARGS`` for the fleet in ``state_dir``, as a user copies it from a
    hint: as it is where that finds the fleet (the default folder, :func:`default_state_dir`),
    else with ``--state-dir``; every word quoted for a shell."""
    words = ["graphdist", command, *args]
    if os.path.abspath(state_dir) != default_state_dir():
        words += ["--state-dir", state_dir]
    return " ".join(map(_shell_word, words))


def _shell_word(text: str) -> str:
    """``text`` quoted for a shell, on one line: a word with a newline or another character
    that does not print is written ``$'...'`` (bash, zsh), with each such character escaped."""
    if text.isprintable():
        return shlex.quote(text)
    escaped = "".join(
        c if c.isprintable() and c not in "\\'" else f"\\x{ord(c):02x}" if ord(c) < 256
        else f"\\U{ord(c):08x}"
        for c in text
    )  # fmt: skip
    return f"$'{escaped}'"


def down_command(state_dir: str) -> str:
    """The command that stops the fleet in ``state_dir`` (:func:`fleet_command`)."""
    return fleet_command(state_dir, "down")


def fleet_logs(state_dir: str) -> dict[str, str]:
    """Every log the fleet in ``state_dir`` has, running or not (a stale fleet's are kept):
    ``{"supervisor": PATH, TASK: PATH...}``, the tasks' as ``fleet.json`` names them where it is
    readable and as ``logs/TASK.log`` otherwise, sorted by name; only files that exist."""
    found: dict[str, str] = {}
    folder = os.path.join(state_dir, LOGS_DIR)
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            if name.endswith(".log"):
                found[name.removesuffix(".log")] = os.path.join(folder, name)
    with contextlib.suppress(StateError):
        record = read_state(state_dir)
        for t in record.tasks if record is not None else ():
            found[t.name] = t.log
    found = {k: v for k, v in sorted(found.items()) if os.path.isfile(v)}
    supervisor = os.path.join(state_dir, SUPERVISOR_LOG)
    return {"supervisor": supervisor, **found} if os.path.isfile(supervisor) else found


def fleet_mark(state_dir: str) -> str:
    """The marker value (:data:`MARK_ENV`) of the processes of the fleet in ``state_dir``: its
    real path, so two spellings of one folder give one marker."""
    return os.path.realpath(state_dir)


# -- records ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcessRef:
    """A pid plus when it started (seconds after boot, :class:`ProcStat`), so that a reused pid
    is not taken for ours, and a change of the wall clock does not make ours another's."""

    pid: int
    started: float

    @classmethod
    def of(cls, pid: int) -> ProcessRef:
        """The process ``pid`` is now; :class:`ProcessLookupError` if there is none."""
        stat = proc_stat(pid)
        if stat is None:
            raise ProcessLookupError(pid)
        return cls(pid, stat.started)

    def alive(self) -> bool:
        stat = proc_stat(self.pid)
        return (
            stat is not None
            and abs(stat.started - self.started) < 0.005  # one clock tick is 0.01 s
            and stat.state not in ("Z", "X")
        )

    def running(self) -> bool:  # what graphdist._proc.process.stop_all asks
        return self.alive()

    def signal(self, sig: int) -> None:
        """Send ``sig`` only if this is still the same process."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


@dataclass(frozen=True)
class TaskRecord:
    job: str
    task: int
    address: str
    pid: int
    started: float  # seconds after boot (ProcessRef)
    log: str
    restarts: int = 0
    exitcode: int | None = None  # set once the supervisor has seen the process exit
    gave_up: bool = False  # the restart policy gave up on it (too many restarts in the window)
    restart_at: float | None = None  # wall-clock time of its scheduled restart (backoff)

    @property
    def process(self) -> ProcessRef:
        return ProcessRef(self.pid, self.started)

    @property
    def name(self) -> str:
        return task_name(self.job, self.task)


@dataclass(frozen=True)
class FleetRecord:
    supervisor: ProcessRef
    cluster: dict[str, Any]
    tasks: list[TaskRecord] = field(default_factory=list)
    started_at: float = 0.0
    restart_policy: str = "no"
    start_timeout_s: float = 60.0  # how long the supervisor waits for a (re)started server
    max_restarts: int = 0  # with "on-failure": restarts per task within restart_window_s
    restart_window_s: float = 60.0
    real_cluster: dict[str, Any] | None = None  # TLS mode: the tasks' real addresses

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> FleetRecord:
        """The record in ``text``; raises ValueError naming the first field that is missing or
        of the wrong type."""
        data = _obj(json.loads(text), "the record")
        sup = _obj(_get(data, "supervisor"), "supervisor")
        tasks = _get(data, "tasks")
        if not isinstance(tasks, list):
            raise ValueError(f"tasks must be a list, not {type(tasks).__name__}")
        cluster = _get(data, "cluster")
        if not isinstance(cluster, dict):
            raise ValueError(f"cluster must be an object, not {type(cluster).__name__}")
        real = data.get("real_cluster")
        if real is not None and not isinstance(real, dict):
            raise ValueError(f"real_cluster must be an object, not {type(real).__name__}")
        return cls(
            supervisor=ProcessRef(_int(sup, "pid"), _num(sup, "started")),
            cluster=cluster,
            tasks=[_task(_obj(t, "a task")) for t in tasks],
            started_at=_num(data, "started_at", 0.0),
            restart_policy=_str(data, "restart_policy", "no"),
            start_timeout_s=_num(data, "start_timeout_s", 60.0),
            max_restarts=_int(data, "max_restarts", 0),
            restart_window_s=_num(data, "restart_window_s", 60.0),
            real_cluster=real,
        )


_MISSING: Any = object()


def _obj(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object, not {type(value).__name__}")
    return value


def _get(data: dict[str, Any], key: str, default: Any = _MISSING) -> Any:
    if key in data:
        return data[key]
    if default is _MISSING:
        raise ValueError(f"{key} is missing")
    return default


def _int(data: dict[str, Any], key: str, default: Any = _MISSING) -> int:
    value = _get(data, key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be a whole number, not {value!r:.40}")
    return value


def _num(data: dict[str, Any], key: str, default: Any = _MISSING) -> float:
    value = _get(data, key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{key} must be a number, not {value!r:.40}")
    return float(value)


def _str(data: dict[str, Any], key: str, default: Any = _MISSING) -> str:
    value = _get(data, key, default)
    if not isinstance(value, str):
        raise ValueError(f"{key} must be a string, not {value!r:.40}")
    return value


def _task(data: dict[str, Any]) -> TaskRecord:
    exitcode = _get(data, "exitcode", None)
    if exitcode is not None:
        exitcode = _int(data, "exitcode")
    restart_at = _get(data, "restart_at", None)
    if restart_at is not None:
        restart_at = _num(data, "restart_at")
    gave_up = _get(data, "gave_up", False)
    if not isinstance(gave_up, bool):
        raise ValueError(f"gave_up must be true or false, not {gave_up!r:.40}")
    return TaskRecord(
        job=_str(data, "job"),
        task=_int(data, "task"),
        address=_str(data, "address"),
        pid=_int(data, "pid"),
        started=_num(data, "started"),
        log=_str(data, "log"),
        restarts=_int(data, "restarts", 0),
        exitcode=exitcode,
        gave_up=gave_up,
        restart_at=restart_at,
    )


# -- files --------------------------------------------------------------------------------------


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_state(state_dir: str, record: FleetRecord) -> None:
    _write_atomic(os.path.join(state_dir, STATE_FILE), record.to_json())


def write_error(state_dir: str, error: BaseException) -> None:
    """Record why the supervisor's start failed, whole (see
    :func:`graphdist._exceptions.to_wire`)."""
    _write_atomic(os.path.join(state_dir, ERROR_FILE), json.dumps(to_wire(error)))


def _read_small(path: str) -> bytes:
    """The bytes of the regular file ``path`` (FileNotFoundError if missing; OSError if it is
    not a regular file or too large to be ours)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if info.st_size > MAX_STATE_BYTES:
            raise OSError(errno.EFBIG, f"larger than {MAX_STATE_BYTES} bytes")
        return f.read(MAX_STATE_BYTES + 1)


def read_error(state_dir: str) -> GraphdistError | None:
    """The error the supervisor recorded in ``error.json``, as the class it raised, or
    ``None``; an unreadable one reads as a StateError saying so."""
    path = os.path.join(state_dir, ERROR_FILE)
    try:
        data = json.loads(_read_small(path).decode("utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        return StateError(f"The supervisor's {path} is unreadable: {exc}", state_dir)
    if not isinstance(data, dict) or not isinstance(data.get("message"), str):
        return StateError(f"The supervisor's {path} is not a failure", state_dir)
    return from_wire(data)


def read_state(state_dir: str) -> FleetRecord | None:
    """The fleet recorded in ``state_dir``, or ``None``; raises StateError if the folder is not
    private to this user (a record there could name anyone's processes) or the file cannot be
    read, :class:`CorruptStateError` if it is not a fleet record."""
    private_dir(state_dir, "the fleet's state folder", create=False)
    path = os.path.join(state_dir, STATE_FILE)
    try:
        data = _read_small(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EINVAL, errno.EFBIG):
            raise CorruptStateError(
                path, str(exc.strerror), state_dir, down_command(state_dir)
            ) from None
        raise StateError(f"Cannot read {path}: {exc.strerror or exc}", state_dir) from None
    try:
        return FleetRecord.from_json(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError: ValueError
        text = str(exc).splitlines()[0] if str(exc) else ""
        reason = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
        raise CorruptStateError(path, reason[:120], state_dir, down_command(state_dir)) from None


def leftovers(state_dir: str) -> list[str]:
    """Files of an earlier fleet in ``state_dir`` that a new one must not inherit:
    ``fleet.json``, ``error.json``, ``control.sock`` and half-written ``*.tmpPID`` files."""
    try:
        names = os.listdir(state_dir)
    except OSError:
        return []
    return sorted(
        n for n in names if n in _LEFTOVERS or any(n.startswith(f"{f}.tmp") for f in _LEFTOVERS)
    )


def _ours(name: str) -> bool:
    return name in STATE_ENTRIES or any(name.startswith(f"{f}.tmp") for f in STATE_ENTRIES)


def foreign_entries(state_dir: str) -> list[str]:
    """What ``state_dir`` holds that no fleet puts there (a user's own files, in a folder given
    as the state folder by mistake); sorted, empty for a missing folder."""
    try:
        names = os.listdir(state_dir)
    except OSError:
        return []
    return sorted(n for n in names if not _ours(n))


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def remove_leftovers(state_dir: str) -> list[str]:
    """Remove :func:`leftovers` (only while holding :func:`lock_state`, no fleet running);
    return their names."""
    removed = []
    for name in leftovers(state_dir):
        _remove(os.path.join(state_dir, name))
        removed.append(name)
    return removed


def clear_state(state_dir: str, *, keep_logs: bool = False) -> None:
    """Remove a fleet's own entries (:data:`STATE_ENTRIES`: fleet.json, error.json, logs, TLS
    credentials, the lock...) from ``state_dir``, then the folder if that left it empty; never
    anything else it holds. ``keep_logs``: the logs stay (``supervisor.log``, ``logs/``; a
    fleet whose supervisor died, cleaned up without being asked: they say why)."""
    try:
        names = os.listdir(state_dir)
    except OSError:
        return
    kept = (SUPERVISOR_LOG, LOGS_DIR) if keep_logs else ()
    for name in names:
        if _ours(name) and name not in kept:
            _remove(os.path.join(state_dir, name))
    with contextlib.suppress(OSError):
        os.rmdir(state_dir)


# -- the lock -----------------------------------------------------------------------------------


def _lock_holder(path: str) -> str:
    """Who holds the lock: ``another graphdist command (pid N)``, as its file says."""
    try:
        text = _read_small(path).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return "another graphdist command" + (f" (pid {text})" if text.isdigit() else "")


@contextlib.contextmanager
def lock_state(
    state_dir: str,
    *,
    wait_s: float = 0.0,
    create: bool = False,
    on_wait: Callable[[str], None] | None = None,
) -> Iterator[bool]:
    """Hold the exclusive lock on ``state_dir`` (see the module docstring) for the ``with``
    block; yields ``True``, or ``False`` when the folder does not exist and ``create`` is not
    set (there is nothing to lock). With ``create`` the folder is made (mode 0700) first.

    Waits up to ``wait_s`` seconds for another holder (calling ``on_wait`` once, with who it
    is, if it has to wait), then raises :class:`StateError` naming it."""
    path = os.path.join(state_dir, LOCK_FILE)
    deadline = time.monotonic() + wait_s
    waited = False
    while True:
        if create:
            private_dir(state_dir, "the fleet's state folder")
        else:
            private_dir(state_dir, "the fleet's state folder", create=False)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            if create:
                continue  # removed by a `down` between the two calls: make it again
            yield False
            return
        except OSError as exc:
            raise StateError(f"Cannot open {path}: {exc.strerror or exc}", state_dir) from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise StateError(
                        f"{_lock_holder(path).capitalize()} is already starting or stopping "
                        f"the fleet in {state_dir}; wait for it to finish, or pass another "
                        "--state-dir",
                        state_dir,
                    ) from None
                if on_wait is not None and not waited:
                    on_wait(_lock_holder(path))
                waited = True
                os.close(fd)
                fd = -1
                time.sleep(_LOCK_POLL_S)
                continue
            # Locked; but a `down` that held it before us may have removed the folder.
            mine = os.fstat(fd)
            try:
                now = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                now = None
            if now is None or (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
                os.close(fd)
                fd = -1
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            yield True
            return
        finally:
            if fd >= 0:
                os.close(fd)
