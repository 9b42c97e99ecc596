"""graphdist: TensorFlow's graph-mode distributed runtime, without the fragile parts.

``import graphdist`` does not import TensorFlow; the parts that need it import it on first use.
An unsupported Python or TensorFlow (see ``graphdist._version``) is refused here, in one line.

The public names are loaded on first use (PEP 562, as scientific Python's SPEC 1 does): ``import
graphdist`` reads the exceptions and nothing else, so the command line, a fleet's owner and every
fork server start without importing modules they never use. :data:`_LAZY` says where each name
lives; the ``TYPE_CHECKING`` imports say the same for type checkers (a test keeps them in step).
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from graphdist._version import __version__
from graphdist._version import check_versions as _check_versions

_check_versions()

from graphdist._exceptions import (
    ArgumentError,
    ClusterSpecError,
    CorruptStateError,
    CredentialsError,
    ExposedServerError,
    FleetClosedError,
    FleetError,
    FleetStartError,
    GraphdistError,
    LaunchError,
    LaunchTimeoutError,
    LoopbackUnavailableError,
    NoFreePortsError,
    PictureError,
    PlacementError,
    PortInUseError,
    SessionInterruptedError,
    SplitError,
    StartTimeoutError,
    StateError,
    StrategyError,
    TaskExitError,
    TaskFailedError,
    TaskNotFoundError,
    TFConfigError,
    UnsupportedVersionError,
    UsageError,
    VariableError,
)

#: module -> the public names it provides (loaded by ``__getattr__`` on first use)
_LAZY: dict[str, tuple[str, ...]] = {
    "graphdist._cluster": ("Cluster", "Task"),
    "graphdist._distribute.launcher": ("TaskResult", "run_command", "run_function"),
    "graphdist._distribute.fitmarks": ("ready_time",),
    "graphdist._distribute.progress": ("progress", "step"),
    "graphdist._distribute.resume": (
        "backup_and_restore",
        "preemption_handler",
        "resume_checkpoint",
    ),
    "graphdist._distribute.strategy": (
        "checkpoint_dir",
        "global_batch_size",
        "is_chief",
        "shard",
        "strategy_from_environment",
    ),
    "graphdist._distribute.tfconfig": (
        "TFConfig",
        "cluster_resolver",
        "parse_tf_config",
        "tf_config",
    ),
    "graphdist._fleet.client": ("Fleet", "FleetState", "ReopeningSession"),
    "graphdist._fleet.lifecycle": ("OwnedFleet",),
    "graphdist._fleet.task": ("TaskExit", "TaskView"),
    "graphdist._detached.fleet": ("DetachedFleet", "attach"),
    "graphdist._proc.gpus": ("available_gpus",),
    "graphdist._fleet.guard": ("FLEET_OPERATION_TIMEOUT_MS",),
    "graphdist._fleet.health": ("TaskHealth",),
    "graphdist._local.fleet": ("DEFAULT_START_TIMEOUT_S", "FleetTask", "LocalFleet"),
    "graphdist._ray.fleet": ("RayFleet", "RayTask"),
    "graphdist._fleet.remote": ("RemoteFleet", "RemoteTask", "connect"),
    "graphdist._fleet.command": ("SlurmFleet", "SlurmTask"),
    "graphdist._graph.master": ("master_for",),
    "graphdist._graph.placement": (
        "DeviceSpec",
        "check_device",
        "device",
        "normalize_device",
        "parse_device",
    ),
    "graphdist._graph.session": ("DEFAULT_OPERATION_TIMEOUT_MS", "session", "session_config"),
    "graphdist._graph.split": ("AutoPlan", "ByName", "Plan", "RoundRobin", "SplitGraph", "split"),
    "graphdist._graph.trace": ("Placement", "no_folding_config", "run_traced"),
    "graphdist._graph.variables": ("initialize_uninitialized", "shared_variable"),
}
_WHERE = {name: module for module, names in _LAZY.items() for name in names}

if _TYPE_CHECKING:
    from graphdist._cluster import Cluster, Task
    from graphdist._detached.fleet import DetachedFleet, attach
    from graphdist._distribute.fitmarks import ready_time
    from graphdist._distribute.launcher import TaskResult, run_command, run_function
    from graphdist._distribute.progress import progress, step
    from graphdist._distribute.resume import (
        backup_and_restore,
        preemption_handler,
        resume_checkpoint,
    )
    from graphdist._distribute.strategy import (
        checkpoint_dir,
        global_batch_size,
        is_chief,
        shard,
        strategy_from_environment,
    )
    from graphdist._distribute.tfconfig import (
        TFConfig,
        cluster_resolver,
        parse_tf_config,
        tf_config,
    )
    from graphdist._fleet.client import Fleet, FleetState, ReopeningSession
    from graphdist._fleet.command import SlurmFleet, SlurmTask
    from graphdist._fleet.guard import FLEET_OPERATION_TIMEOUT_MS
    from graphdist._fleet.health import TaskHealth
    from graphdist._fleet.lifecycle import OwnedFleet
    from graphdist._fleet.remote import RemoteFleet, RemoteTask, connect
    from graphdist._fleet.task import TaskExit, TaskView
    from graphdist._graph.master import master_for
    from graphdist._graph.placement import (
        DeviceSpec,
        check_device,
        device,
        normalize_device,
        parse_device,
    )
    from graphdist._graph.session import DEFAULT_OPERATION_TIMEOUT_MS, session, session_config
    from graphdist._graph.split import AutoPlan, ByName, Plan, RoundRobin, SplitGraph, split
    from graphdist._graph.trace import Placement, no_folding_config, run_traced
    from graphdist._graph.variables import initialize_uninitialized, shared_variable
    from graphdist._local.fleet import DEFAULT_START_TIMEOUT_S, FleetTask, LocalFleet
    from graphdist._proc.gpus import available_gpus
    from graphdist._ray.fleet import RayFleet, RayTask


def __getattr__(name: str) -> _Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'graphdist' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "DEFAULT_OPERATION_TIMEOUT_MS",
    "DEFAULT_START_TIMEOUT_S",
    "FLEET_OPERATION_TIMEOUT_MS",
    "ArgumentError",
    "AutoPlan",
    "ByName",
    "Cluster",
    "ClusterSpecError",
    "CorruptStateError",
    "CredentialsError",
    "DetachedFleet",
    "DeviceSpec",
    "ExposedServerError",
    "Fleet",
    "FleetClosedError",
    "FleetError",
    "FleetStartError",
    "FleetState",
    "FleetTask",
    "GraphdistError",
    "LaunchError",
    "LaunchTimeoutError",
    "LocalFleet",
    "LoopbackUnavailableError",
    "NoFreePortsError",
    "OwnedFleet",
    "PictureError",
    "Placement",
    "PlacementError",
    "Plan",
    "PortInUseError",
    "RayFleet",
    "RayTask",
    "RemoteFleet",
    "RemoteTask",
    "ReopeningSession",
    "RoundRobin",
    "SessionInterruptedError",
    "SlurmFleet",
    "SlurmTask",
    "SplitError",
    "SplitGraph",
    "StartTimeoutError",
    "StateError",
    "StrategyError",
    "TFConfig",
    "TFConfigError",
    "Task",
    "TaskExit",
    "TaskExitError",
    "TaskFailedError",
    "TaskHealth",
    "TaskNotFoundError",
    "TaskResult",
    "TaskView",
    "UnsupportedVersionError",
    "UsageError",
    "VariableError",
    "__version__",
    "attach",
    "available_gpus",
    "backup_and_restore",
    "check_device",
    "checkpoint_dir",
    "cluster_resolver",
    "connect",
    "device",
    "global_batch_size",
    "initialize_uninitialized",
    "is_chief",
    "master_for",
    "no_folding_config",
    "normalize_device",
    "parse_device",
    "parse_tf_config",
    "preemption_handler",
    "progress",
    "ready_time",
    "resume_checkpoint",
    "run_command",
    "run_function",
    "run_traced",
    "session",
    "session_config",
    "shard",
    "shared_variable",
    "split",
    "step",
    "strategy_from_environment",
    "tf_config",
]
