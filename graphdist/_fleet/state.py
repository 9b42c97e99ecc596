"""The state folder of a detached fleet: who supervises it, which pids serve which tasks, and logs.

Layout of a state folder: ``fleet.json`` (written atomically once every server is ready, and again
whenever a task dies or is restarted), ``error.json`` (written instead when the start failed),
``control.sock`` (the supervisor's control channel, see ``graphdist._fleet.control``),
``supervisor.log`` and ``logs/JOB-INDEX.log``.
Pids are stored with their process start times, so a pid reused by an unrelated process is never
mistaken for one of ours (and never signalled).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

from graphdist._exceptions import StateError
from graphdist._fleet.process import STOP_GRACE_S, stop_all
from graphdist._private import private_dir

__all__ = [
    "STATE_DIR_ENV",
    "FleetRecord",
    "ProcessRef",
    "TaskRecord",
    "clear_state",
    "default_state_dir",
    "read_error",
    "read_state",
    "stop_processes",
    "write_state",
]

STATE_DIR_ENV = "GRAPHDIST_STATE_DIR"
STATE_FILE = "fleet.json"
ERROR_FILE = "error.json"
SUPERVISOR_LOG = "supervisor.log"
CONTROL_SOCKET = "control.sock"


def default_state_dir() -> str:
    """``$GRAPHDIST_STATE_DIR``, else ``$XDG_STATE_HOME/graphdist``, else
    ``~/.local/state/graphdist``: one default fleet per user."""
    if os.environ.get(STATE_DIR_ENV):
        return os.path.abspath(os.environ[STATE_DIR_ENV])
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state"
    )
    return os.path.join(base, "graphdist")


@dataclass(frozen=True)
class ProcessRef:
    """A pid plus its start time, so that a reused pid is not taken for ours."""

    pid: int
    create_time: float

    @classmethod
    def of(cls, pid: int) -> ProcessRef:
        return cls(pid, psutil.Process(pid).create_time())

    def alive(self) -> bool:
        try:
            proc = psutil.Process(self.pid)
            return (
                abs(proc.create_time() - self.create_time) < 0.01
                and proc.status() != psutil.STATUS_ZOMBIE
            )
        except psutil.Error:
            return False

    def running(self) -> bool:  # what graphdist._fleet.process.stop_all asks
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
    create_time: float
    log: str
    restarts: int = 0
    exitcode: int | None = None  # set once the supervisor has seen the process exit

    @property
    def process(self) -> ProcessRef:
        return ProcessRef(self.pid, self.create_time)


@dataclass(frozen=True)
class FleetRecord:
    supervisor: ProcessRef
    cluster: dict[str, Any]
    tasks: list[TaskRecord] = field(default_factory=list)
    started_at: float = 0.0
    restart_policy: str = "no"
    start_timeout_s: float = 60.0  # how long the supervisor waits for a (re)started server

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> FleetRecord:
        data = json.loads(text)
        return cls(
            supervisor=ProcessRef(**data["supervisor"]),
            cluster=data["cluster"],
            tasks=[TaskRecord(**t) for t in data["tasks"]],
            started_at=data.get("started_at", 0.0),
            restart_policy=data.get("restart_policy", "no"),
            start_timeout_s=data.get("start_timeout_s", 60.0),
        )


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_state(state_dir: str, record: FleetRecord) -> None:
    _write_atomic(os.path.join(state_dir, STATE_FILE), record.to_json())


def write_error(state_dir: str, kind: str, message: str) -> None:
    _write_atomic(
        os.path.join(state_dir, ERROR_FILE), json.dumps({"kind": kind, "message": message})
    )


def read_error(state_dir: str) -> dict[str, str] | None:
    try:
        with open(os.path.join(state_dir, ERROR_FILE), encoding="utf-8") as f:
            data: dict[str, str] = json.load(f)
            return data
    except (OSError, ValueError):
        return None


def read_state(state_dir: str) -> FleetRecord | None:
    """The fleet recorded in ``state_dir``, or ``None``; raises StateError if it is unreadable
    or the folder is not private to this user (a record there could name anyone's processes)."""
    private_dir(state_dir, "the fleet's state folder", create=False)
    path = os.path.join(state_dir, STATE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StateError(f"Cannot read {path}: {exc.strerror}", state_dir) from None
    try:
        return FleetRecord.from_json(text)
    except (ValueError, KeyError, TypeError) as exc:
        raise StateError(
            f"State file {path} is corrupt ({exc}); remove {state_dir} by hand", state_dir
        ) from None


def clear_state(state_dir: str) -> None:
    """Remove the state folder (fleet.json, error.json, logs)."""
    shutil.rmtree(state_dir, ignore_errors=True)


def stop_processes(refs: Iterable[ProcessRef], grace_s: float = STOP_GRACE_S) -> list[ProcessRef]:
    """SIGTERM each live process, wait up to ``grace_s``, SIGKILL the rest; return survivors
    (see :func:`graphdist._fleet.process.stop_all`)."""
    return stop_all(refs, grace_s)
