"""``graphdist run`` on this machine (the ``local`` run backend): every command task a local
process under graphdist's guard (:class:`~graphdist._distribute.taskproc.GuardedTask`), a
parameter-server run's worker and ps tasks a :class:`~graphdist._fleet.local.LocalFleet`.

Each attempt gets a fresh cluster on free loopback ports (:func:`~graphdist._distribute.
runspec.launch_cluster`, given back when the attempt ends). Where the tasks' own servers listen
is decided as for a fleet's (:func:`~graphdist._net.loopback.server_bind_address`): loopback,
or with ``expose`` every interface with members only (the cluster's hosts); the bind shim is
loaded into the command's processes either way, so the servers the strategies start in them are
held to it too.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from graphdist._cluster import Cluster, Task
from graphdist._distribute.runbackends import register, start_servers
from graphdist._distribute.runspec import RunSpec, launch_cluster
from graphdist._distribute.taskproc import GuardedTask, RunSink
from graphdist._net.loopback import server_bind_address, shim_env
from graphdist._net.members import KEEP_WILDCARD, members_env
from graphdist._net.ports import release_ports
from graphdist._proc.signals import SignalScope
from graphdist._registry import Option

__all__ = ["LocalRun"]


class _LocalPlacement:
    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.cluster: Cluster = launch_cluster(spec.workers, spec.ps, spec.chief)
        host = socket.gethostname()
        self.nodes = {t.name: host for t in self.cluster}
        # exposed: the members are resolved once, before any task starts (members only)
        self.members = members_env(self.cluster) if spec.expose else {}

    def start_servers(
        self, jobs: Sequence[str], log_folder: str | None, signals: SignalScope
    ) -> Any:
        from graphdist._fleet.local import LocalFleet

        fleet = LocalFleet(self.cluster, jobs=jobs, expose=self.spec.expose, log_dir=log_folder)
        return start_servers(fleet, signals)

    def task_env(self, task: Task) -> Mapping[str, str]:
        # Exposed or not, the shim is loaded: an exposed task keeps TensorFlow's wildcard bind
        # and the shim lets in only the members (as an exposed LocalFleet's servers). Without
        # it an exposed task listened on every interface and let every machine run code in it.
        address = server_bind_address(task, expose=self.spec.expose) or KEEP_WILDCARD
        env = shim_env(address, self.spec.base_env.get("LD_PRELOAD"), inherit=True)
        return {**env, **self.members}

    def start_task(
        self, task: Task, env: Mapping[str, str], run: RunSink, log_path: str | None
    ) -> GuardedTask:
        return GuardedTask(task, self.spec.command, env, run, log_path)

    def close(self) -> None:
        release_ports(t.port for t in self.cluster)


class LocalRun:
    """The ``local`` run backend: every task a process of this machine."""

    name: ClassVar[str] = "local"
    summary: ClassVar[str] = "every task a process of this machine (default)"
    requires: ClassVar[tuple[str, str] | None] = None
    options: ClassVar[tuple[Option, ...]] = ()

    @classmethod
    def check_options(cls, spec: RunSpec, options: Mapping[str, Any]) -> dict[str, Any]:
        return dict(options)

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec

    def place(self, attempt: int, signals: SignalScope) -> _LocalPlacement:
        return _LocalPlacement(self.spec)

    def close(self) -> None:
        pass


register(LocalRun)
