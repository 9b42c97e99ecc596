"""``graphdist run`` on this machine (the ``local`` run backend): every command task a local
process under graphdist's guard (:class:`~graphdist._distribute.taskproc.GuardedTask`), a
parameter-server run's worker and ps tasks a :class:`~graphdist._fleet.local.LocalFleet`.

Each attempt gets a fresh cluster on free loopback ports (:func:`~graphdist._distribute.
runspec.launch_cluster`, given back when the attempt ends). Where the tasks' own servers listen
is decided as for a fleet's (:func:`~graphdist._net.loopback.server_bind_address`): loopback,
or with ``expose`` every interface with members only (the cluster's hosts); the bind shim is
loaded into the command's processes either way, so the servers the strategies start in them are
held to it too.

With ``tls`` (TLS mode, :mod:`graphdist._net.gateway`) each attempt's tasks are at this
machine's network address (:func:`~graphdist._net.tlsmode.tls_host`) in the real cluster, and
at its loopback alias in every TF_CONFIG, where their servers listen (loopback: this user only);
the attempt's own credentials and gateway (inbound for every task) let other machines in by
certificate alone, and the client's folder is said on stderr for each attempt.
"""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from graphdist._cluster import Cluster, Task
from graphdist._distribute.runbackends import register, start_servers
from graphdist._distribute.runspec import RunSpec, launch_cluster
from graphdist._distribute.taskproc import GuardedTask, RunSink
from graphdist._net.loopback import server_bind_address, shim_env
from graphdist._net.members import KEEP_WILDCARD, members_env
from graphdist._net.ports import release_ports
from graphdist._proc.signals import SignalScope
from graphdist._registry import Option

if TYPE_CHECKING:
    from graphdist._net.tlsmode import TlsMode

__all__ = ["LocalRun"]


class _LocalPlacement:
    def __init__(self, spec: RunSpec, attempt: int) -> None:
        self.spec = spec
        self.cluster: Cluster = launch_cluster(spec.workers, spec.ps, spec.chief)
        self._ports = [t.port for t in self.cluster]
        self._tls: TlsMode | None = None
        host = socket.gethostname()
        self.nodes = {t.name: host for t in self.cluster}
        # exposed: the members are resolved once, before any task starts (members only)
        self.members = members_env(self.cluster) if spec.expose else {}
        if spec.tls:
            try:
                self._start_tls(attempt)
            except BaseException:
                self.close()
                raise

    def _start_tls(self, attempt: int) -> None:
        """TLS mode: the tasks at this machine's address, their servers on its alias, and the
        attempt's gateway in front of them all."""
        from graphdist._net.tlsmode import TlsMode, tls_host

        address = tls_host()
        host = f"[{address}]" if ":" in address else address
        real = Cluster(
            {job: [f"{host}:{t.port}" for t in self.cluster.tasks if t.job == job]
             for job in self.cluster.jobs}
        )  # fmt: skip
        # its gateway once the attempt's servers listen (a ps run's LocalFleet checks the ports)
        self._tls = TlsMode(real, start=False)
        self.cluster = self._tls.cluster
        print(
            f"graphdist: attempt {attempt} in TLS mode: its tasks are at {address} (TF_CONFIG's "
            f"ports) behind this run's TLS gateway; the client's credentials are in "
            f"{self._tls.client} until the attempt ends (graphdist.connect(CLUSTER, tls=FOLDER), "
            f"CLUSTER being {json.dumps(real.as_dict())})",
            file=sys.stderr,
            flush=True,
        )

    def start_servers(
        self, jobs: Sequence[str], log_folder: str | None, signals: SignalScope
    ) -> Any:
        from graphdist._fleet.local import LocalFleet

        # TLS mode: the servers on the alias (loopback), behind the attempt's gateway
        fleet = LocalFleet(self.cluster, jobs=jobs, expose=self.spec.expose, log_dir=log_folder)
        start_servers(fleet, signals)
        self._start_gateway()
        return fleet

    def _start_gateway(self) -> None:
        if self._tls is not None:
            self._tls.start(self._tls.real.tasks)

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
        self._start_gateway()
        return GuardedTask(task, self.spec.command, env, run, log_path)

    def close(self) -> None:
        if self._tls is not None:
            self._tls.close()
            self._tls = None
        release_ports(self._ports)


class LocalRun:
    """The ``local`` run backend: every task a process of this machine."""

    name: ClassVar[str] = "local"
    summary: ClassVar[str] = "every task a process of this machine (default)"
    requires: ClassVar[tuple[str, str] | None] = None
    tls: ClassVar[bool] = True
    options: ClassVar[tuple[Option, ...]] = ()

    @classmethod
    def check_options(cls, spec: RunSpec, options: Mapping[str, Any]) -> dict[str, Any]:
        return dict(options)

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec

    def place(self, attempt: int, signals: SignalScope) -> _LocalPlacement:
        return _LocalPlacement(self.spec, attempt)

    def close(self) -> None:
        pass


register(LocalRun)
