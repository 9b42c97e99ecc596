"""graphdist: TensorFlow's graph-mode distributed runtime, without the fragile parts.

``import graphdist`` does not import TensorFlow; the parts that need it import it on first use.
An unsupported Python or TensorFlow (see ``graphdist._version``) is refused here, in one line.
"""

from graphdist._version import __version__
from graphdist._version import check_versions as _check_versions

_check_versions()

from graphdist._cluster import Cluster, Task
from graphdist._distribute.launcher import TaskResult, run_command, run_function
from graphdist._distribute.strategy import (
    checkpoint_dir,
    global_batch_size,
    is_chief,
    shard,
    strategy_from_environment,
)
from graphdist._distribute.tfconfig import TFConfig, cluster_resolver, parse_tf_config, tf_config
from graphdist._exceptions import (
    ArgumentError,
    ClusterSpecError,
    CorruptStateError,
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
from graphdist._fleet.base import Fleet, FleetState, ReopeningSession, TaskExit, TaskView
from graphdist._fleet.detached import DetachedFleet, attach
from graphdist._fleet.gpus import available_gpus
from graphdist._fleet.guard import FLEET_OPERATION_TIMEOUT_MS
from graphdist._fleet.health import TaskHealth
from graphdist._fleet.local import DEFAULT_START_TIMEOUT_S, FleetTask, LocalFleet
from graphdist._fleet.ray import RayFleet, RayTask  # imports Ray only when a RayFleet starts
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
    "PictureError",
    "Placement",
    "PlacementError",
    "Plan",
    "PortInUseError",
    "RayFleet",
    "RayTask",
    "ReopeningSession",
    "RoundRobin",
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
    "check_device",
    "checkpoint_dir",
    "cluster_resolver",
    "device",
    "global_batch_size",
    "initialize_uninitialized",
    "is_chief",
    "master_for",
    "no_folding_config",
    "normalize_device",
    "parse_device",
    "parse_tf_config",
    "run_command",
    "run_function",
    "run_traced",
    "session",
    "session_config",
    "shard",
    "shared_variable",
    "split",
    "strategy_from_environment",
    "tf_config",
]
