"""The graphdist exception tree.

Every error graphdist raises on purpose derives from :class:`GraphdistError` and carries the
values that explain it as attributes, so callers can react without parsing messages::

    GraphdistError
    ├── ArgumentError           an argument value that cannot work (a timeout of 0, a count of -1)
    │   └── UsageError          bad command-line arguments (the CLI exits 2)
    ├── ClusterSpecError        a cluster spec that cannot be used (bad job, address, port, count)
    │   ├── TFConfigError       a TF_CONFIG that is not valid for its cluster
    │   └── NoFreePortsError    not enough free ports for a job=N spec
    ├── PlacementError          a device string that is malformed or not in the cluster
    ├── SplitError              a split plan that does not fit the graph (unknown op, no rule)
    ├── VariableError           a shared variable whose name is taken in the graph
    ├── PictureError            a placement picture or log that cannot be written
    ├── StrategyError           a tf.distribute strategy this task cannot build
    ├── FleetError              something about a running fleet of servers
    │   ├── FleetStartError     a server did not come up (carries task, address, log tail)
    │   │   ├── PortInUseError  a port is already taken (carries port and holder pid)
    │   │   ├── StartTimeoutError  servers were not ready in time (ready / expected / timeout)
    │   │   └── ExposedServerError  a server listens where it must not (carries its sockets)
    │   ├── LoopbackUnavailableError  no way to keep servers on loopback (and expose not asked)
    │   ├── TaskFailedError     a task died or stopped answering during a run (names the task)
    │   ├── SessionInterruptedError  a session closed to cancel a step KeyboardInterrupt stopped
    │   ├── FleetClosedError    the fleet is closed or closing
    │   └── TaskNotFoundError   no such job or task index in the fleet
    ├── LaunchError             a multi-process run did not succeed (carries every task's result)
    │   ├── TaskExitError       a task exited non-zero; the others were stopped
    │   └── LaunchTimeoutError  the run outlived its timeout; every task was stopped
    ├── StateError              graphdist's folders: a detached fleet's state (none running, stale,
    │   │                       busy), or a folder that is not private to the user
    │   └── CorruptStateError   a fleet.json that is not a fleet record (down still stops the fleet)
    ├── CredentialsError        TLS credentials that cannot be made or used (a key others can read)
    └── UnsupportedVersionError  this Python or TensorFlow is outside the supported range

Errors a caller causes with a bad value also derive from ``ValueError`` (``ArgumentError``,
``ClusterSpecError``, ``PlacementError``, ``SplitError``, ``VariableError``), a missing task from
``KeyError`` and an unsupported version from ``ImportError``, as is conventional. A test walks
the classes and checks that this drawing matches them.

Errors cross process boundaries whole: :func:`to_wire` turns any of them into a JSON-able
mapping (its class name, message and attributes) and :func:`from_wire` makes the same class with
the same attributes again, in the process that reads it (a supervisor's ``error.json`` and its
control replies use them). :func:`copy_error` is the pair in one process: a fresh exception to
raise again, without the old one's traceback.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence
from typing import Any, Protocol

__all__ = [
    "ArgumentError",
    "ClusterSpecError",
    "CorruptStateError",
    "CredentialsError",
    "ExposedServerError",
    "FleetClosedError",
    "FleetError",
    "FleetStartError",
    "GraphdistError",
    "LaunchError",
    "LaunchTimeoutError",
    "LoopbackUnavailableError",
    "NoFreePortsError",
    "PictureError",
    "PlacementError",
    "PortInUseError",
    "SessionInterruptedError",
    "SplitError",
    "StartTimeoutError",
    "StateError",
    "StrategyError",
    "TFConfigError",
    "TaskExitError",
    "TaskFailedError",
    "TaskNotFoundError",
    "UnsupportedVersionError",
    "UsageError",
    "VariableError",
    "copy_error",
    "from_wire",
    "to_wire",
]


class GraphdistError(Exception):
    """Root of every error graphdist raises on purpose."""


class ArgumentError(GraphdistError, ValueError):
    """An argument value that cannot work; ``name`` is the argument, ``value`` what was given."""

    def __init__(self, message: str, *, name: str | None = None, value: object = None) -> None:
        super().__init__(message)
        self.name = name
        self.value = value


class UsageError(ArgumentError):
    """Bad command-line arguments: the CLI prints one ``Error:`` line and exits 2."""


class ClusterSpecError(GraphdistError, ValueError):
    """A cluster spec cannot be used; ``value`` is the offending piece."""

    def __init__(self, message: str, value: object = None) -> None:
        super().__init__(message)
        self.value = value


class TFConfigError(ClusterSpecError):
    """A TF_CONFIG text or mapping that is malformed or does not fit its cluster."""


class NoFreePortsError(ClusterSpecError):
    """Not enough free ports for the tasks of a ``job=N`` spec; ``count`` were wanted in
    ``low``-``high``."""

    def __init__(self, message: str, *, count: int, low: int, high: int) -> None:
        super().__init__(message, count)
        self.count = count
        self.low = low
        self.high = high


class PlacementError(GraphdistError, ValueError):
    """A device string is malformed or names a job, task or device the cluster lacks; ``op``:
    the graph's op that asks for it, when a fleet's session found it among a graph's ops (or
    eager execution is on, so no op can be placed on a fleet's device)."""

    def __init__(self, message: str, device: str | None = None, *, op: str | None = None) -> None:
        super().__init__(message)
        self.device = device
        self.op = op


class SplitError(GraphdistError, ValueError):
    """A plan that cannot be applied: an op name that does not exist, an op no rule covers."""


class VariableError(GraphdistError, ValueError):
    """A shared variable cannot have its exact name: ``name`` is taken by another op or by a
    variable on another device (``device``)."""

    def __init__(self, message: str, *, name: str, device: str | None = None) -> None:
        super().__init__(message)
        self.name = name
        self.device = device


class PictureError(GraphdistError):
    """A picture (a placement picture, a run's report) or a TensorBoard log cannot be written
    to ``path``."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class StrategyError(GraphdistError):
    """This task cannot build the tf.distribute strategy its TF_CONFIG asks for; ``task`` is
    ``"type:index"``."""

    def __init__(self, message: str, task: str | None = None) -> None:
        super().__init__(message)
        self.task = task


class FleetError(GraphdistError):
    """Something went wrong with a fleet of servers."""


class TaskNotFoundError(FleetError, KeyError):
    """A job name or task index that the fleet does not have."""

    def __init__(self, message: str, job: str | None = None, task: int | None = None) -> None:
        super().__init__(message)
        self.job = job
        self.task = task

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class FleetClosedError(FleetError):
    """An operation needs a running fleet, but this one is closed or closing."""


class SessionInterruptedError(FleetError):
    """A fleet session whose step ``KeyboardInterrupt`` stopped: graphdist closed it to cancel
    that step inside TensorFlow (the only way TensorFlow cancels one), so it runs no more; open
    a new session. Attribute: ``master`` (``"job:index"``)."""

    def __init__(self, message: str, *, master: str | None = None) -> None:
        super().__init__(message)
        self.master = master


class LoopbackUnavailableError(FleetError):
    """graphdist cannot keep the servers on loopback here, and ``expose`` was not asked for."""


class TaskFailedError(FleetError):
    """A task died, was restarted or stopped answering while a session used it.

    Attributes: ``task`` (``"job:index"``), ``address``, ``status`` (``"dead"``,
    ``"restarted"`` or ``"not answering"``), ``timeout_ms`` (the session's operation timeout).
    TensorFlow's error, where there was one, is the ``__cause__``.
    """

    def __init__(
        self,
        message: str,
        *,
        task: str | None = None,
        address: str | None = None,
        status: str | None = None,
        timeout_ms: int | None = None,
    ) -> None:
        super().__init__(message)
        self.task = task
        self.address = address
        self.status = status
        self.timeout_ms = timeout_ms


def _with_log(message: str, log_tail: Sequence[str]) -> str:
    if not log_tail:
        return message
    lines = "\n".join(f"    {line}" for line in log_tail)
    return f"{message}\n  last lines of its log:\n{lines}"


class FleetStartError(FleetError):
    """A server process failed to start; nothing of the fleet is left running.

    Attributes: ``task`` (``"job:index"``), ``address``, ``exitcode`` (``None`` if it was still
    running), ``log_path`` and ``log_tail`` (its last lines).
    """

    def __init__(
        self,
        message: str,
        *,
        task: str | None = None,
        address: str | None = None,
        exitcode: int | None = None,
        log_path: str | None = None,
        log_tail: Sequence[str] = (),
    ) -> None:
        super().__init__(_with_log(message, log_tail))
        self.summary = message
        self.task = task
        self.address = address
        self.exitcode = exitcode
        self.log_path = log_path
        self.log_tail = list(log_tail)


class ExposedServerError(FleetStartError):
    """A server listens on an address it was not meant to (a wildcard or a non-loopback address
    without ``expose``), or graphdist could not check where it listens: the fleet refuses it
    and stops it. ``sockets`` lists the offending ``(address, port)`` pairs."""

    def __init__(
        self,
        message: str,
        *,
        task: str | None = None,
        address: str | None = None,
        sockets: Sequence[tuple[str, int]] = (),
    ) -> None:
        super().__init__(message, task=task, address=address)
        self.sockets = list(sockets)


class PortInUseError(FleetStartError):
    """A port the cluster names is already in use; ``holder_pid`` is set when the system tells."""

    def __init__(
        self,
        message: str,
        *,
        port: int,
        holder_pid: int | None = None,
        task: str | None = None,
        address: str | None = None,
        log_tail: Sequence[str] = (),
    ) -> None:
        super().__init__(message, task=task, address=address, log_tail=log_tail)
        self.port = port
        self.holder_pid = holder_pid


class StartTimeoutError(FleetStartError):
    """Not every server answered within the start timeout."""

    def __init__(
        self,
        message: str,
        *,
        ready: int,
        expected: int,
        timeout_s: float,
        task: str | None = None,
        address: str | None = None,
        log_tail: Sequence[str] = (),
    ) -> None:
        super().__init__(message, task=task, address=address, log_tail=log_tail)
        self.ready = ready
        self.expected = expected
        self.timeout_s = timeout_s


class StateError(GraphdistError):
    """The state folder of a detached fleet (none running, stale, already in use), or one of
    graphdist's own folders that is not private to the user (a link, another owner)."""

    def __init__(self, message: str, state_dir: str | None = None) -> None:
        super().__init__(message)
        self.state_dir = state_dir


class CredentialsError(GraphdistError):
    """TLS credentials that cannot be made (a folder that is not empty, a host that is no IP
    address or DNS name) or used (a missing file, a key others can read, a certificate another
    CA signed or that expired); ``path`` is the file or folder, when there is one."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class TaskOutcome(Protocol):
    """What a launch error tells of each task (a :class:`graphdist.TaskResult`)."""

    @property
    def name(self) -> str: ...
    @property
    def pid(self) -> int | None: ...
    @property
    def exitcode(self) -> int | None: ...
    @property
    def tail(self) -> list[str]: ...
    @property
    def value(self) -> Any: ...


class LaunchError(GraphdistError):
    """A launched run did not succeed; ``results`` holds every task's ``TaskResult``."""

    def __init__(self, message: str, results: Sequence[TaskOutcome]) -> None:
        super().__init__(message)
        self.results = list(results)


class TaskExitError(LaunchError):
    """A task exited with a non-zero code; the other tasks were stopped. ``failed`` is its
    ``TaskResult``."""

    def __init__(self, message: str, results: Sequence[TaskOutcome], failed: TaskOutcome) -> None:
        super().__init__(message, results)
        self.failed = failed


class LaunchTimeoutError(LaunchError):
    """The run did not finish within ``timeout_s``; every task was stopped."""


class UnsupportedVersionError(GraphdistError, ImportError):
    """This Python or TensorFlow is outside the supported range (raised by ``import
    graphdist``); the message names the range and what was found."""


class CorruptStateError(StateError):
    """``fleet.json`` exists but is not a fleet record (``graphdist down`` still stops the
    fleet's processes, found by their marker, and cleans the folder); ``reason`` says why."""

    def __init__(
        self, path: str, reason: str, state_dir: str, down: str = "graphdist down"
    ) -> None:
        super().__init__(
            f"State file {path} is corrupt ({reason}); `{down}` stops the fleet's "
            "processes (found by their marker) and cleans the folder",
            state_dir,
        )
        self.reason = reason


# -- errors across processes ------------------------------------------------------------------


def _classes(root: type[GraphdistError] = GraphdistError) -> dict[str, type[GraphdistError]]:
    found = {root.__name__: root}
    for sub in root.__subclasses__():
        found.update(_classes(sub))
    return found


def _to_json(value: Any) -> Any:
    """``value`` as JSON, tagging what JSON would change: tuples, dataclasses (a task's result
    and its :class:`Task`), and anything else as its ``repr``."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [_to_json(v) for v in value]}
    if isinstance(value, list):
        return [_to_json(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"__dict__": {k: _to_json(v) for k, v in value.items()}}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        fields = {f.name: _to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"__dataclass__": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}
    return {"__repr__": repr(value)}


def _from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tuple__" in value:
        return tuple(_from_json(v) for v in value["__tuple__"])
    if "__dict__" in value:
        return {k: _from_json(v) for k, v in value["__dict__"].items()}
    if "__dataclass__" in value:
        module, _, name = str(value["__dataclass__"]).partition(":")
        if module.startswith("graphdist."):  # only graphdist's own classes are rebuilt
            cls = getattr(importlib.import_module(module), name, None)
            if dataclasses.is_dataclass(cls) and isinstance(cls, type):
                return cls(**{k: _from_json(v) for k, v in value["fields"].items()})
        return value["fields"]
    return value.get("__repr__", value)


def to_wire(exc: BaseException) -> dict[str, Any]:
    """``exc`` as a JSON-able mapping: ``kind`` (the class name), ``message`` and, for a
    graphdist error, ``attrs`` (every attribute). Any other exception keeps its class name and
    text only (:func:`from_wire` makes it a ``FleetError`` naming them)."""
    message = str(exc.args[0]) if len(exc.args) == 1 else str(exc)
    if not isinstance(exc, GraphdistError):
        return {"kind": type(exc).__name__, "message": message, "attrs": {}}
    attrs = {name: _to_json(value) for name, value in vars(exc).items()}
    return {"kind": type(exc).__name__, "message": message, "attrs": attrs}


def from_wire(data: Any) -> GraphdistError:
    """The error :func:`to_wire` described, as the same class with the same attributes. A
    class graphdist does not have (another library's error, a newer graphdist's) or a mapping
    that is not one arrives as a :class:`FleetError` that names the class and keeps the text."""
    if not isinstance(data, dict):
        return FleetError(f"an unreadable error report: {data!r}")
    kind, message = str(data.get("kind", "")), str(data.get("message", ""))
    cls = _classes().get(kind)
    if cls is None:
        return FleetError(f"{kind}: {message}" if kind else message)
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    attrs = data.get("attrs")
    if isinstance(attrs, dict):
        error.__dict__.update({str(k): _from_json(v) for k, v in attrs.items()})
    return error


def copy_error(exc: GraphdistError) -> GraphdistError:
    """A fresh ``exc`` (same class, message and attributes; no traceback, cause or context),
    to raise again where the first one was raised already."""
    return from_wire(to_wire(exc))


# Errors print under the name users import them by: `graphdist.PlacementError: ...` in a
# traceback, not the private module's path (httpx does the same). Pickles name it too, and
# `import graphdist` provides every one of them.
for _error in list(globals().values()):
    if isinstance(_error, type) and issubclass(_error, GraphdistError):
        _error.__module__ = "graphdist"
del _error
