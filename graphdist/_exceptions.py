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
    └── UnsupportedVersionError  this Python or TensorFlow is outside the supported range

Errors a caller causes with a bad value also derive from ``ValueError`` (``ArgumentError``,
``ClusterSpecError``, ``PlacementError``, ``SplitError``, ``VariableError``), a missing task from
``KeyError`` and an unsupported version from ``ImportError``, as is conventional. A test walks
the classes and checks that this drawing matches them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from graphdist._distribute.launcher import TaskResult

__all__ = [
    "ArgumentError",
    "ClusterSpecError",
    "CorruptStateError",
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
    """A device string is malformed or names a job, task or device the cluster lacks."""

    def __init__(self, message: str, device: str | None = None) -> None:
        super().__init__(message)
        self.device = device


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
    """A placement picture or TensorBoard log cannot be written to ``path``."""

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


class LaunchError(GraphdistError):
    """A launched run did not succeed; ``results`` holds every task's ``TaskResult``."""

    def __init__(self, message: str, results: Sequence[TaskResult]) -> None:
        super().__init__(message)
        self.results = list(results)


class TaskExitError(LaunchError):
    """A task exited with a non-zero code; the other tasks were stopped. ``failed`` is its
    ``TaskResult``."""

    def __init__(self, message: str, results: Sequence[TaskResult], failed: TaskResult) -> None:
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

    def __init__(self, path: str, reason: str, state_dir: str) -> None:
        super().__init__(
            f"State file {path} is corrupt ({reason}); `graphdist down` stops the fleet's "
            "processes (found by their marker) and cleans the folder",
            state_dir,
        )
        self.reason = reason
