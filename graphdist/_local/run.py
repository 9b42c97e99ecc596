"""``graphdist run`` on this machine (the ``local`` run backend): every command task a local
process under graphdist's guard (:class:`~graphdist._distribute.taskproc.GuardedTask`), a
parameter-server run's worker and ps tasks a :class:`~graphdist._local.fleet.LocalFleet`.

Each attempt gets a fresh cluster on free loopback ports (:func:`~graphdist._distribute.
runspec.launch_cluster`, given back when the attempt ends). Where the tasks' own servers listen
is decided as for a fleet's (:class:`~graphdist._net.policy.NetPolicy`): loopback,
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
from graphdist._distribute.runspec import RunSpec, launch_cluster
from graphdist._distribute.taskproc import GuardedTask, RunSink
from graphdist._distribute.warm import (
    PRELOAD_OPTION,
    READY_TIMEOUT_S,
    Zygote,
    check_preload,
    warm_target,
)
from graphdist._distribute.warmagent import attach
from graphdist._exceptions import ArgumentError
from graphdist._net.policy import NetPolicy
from graphdist._ports import release_ports
from graphdist._proc.signals import SignalScope
from graphdist._registry import Option

if TYPE_CHECKING:
    from graphdist._net.tlsmode import TlsMode

__all__ = ["LocalRun"]


class _LocalPlacement:
    def __init__(self, spec: RunSpec, attempt: int, warm: Zygote | str) -> None:
        self.spec = spec
        self._warm = warm  # the run's warm interpreter, or why its tasks run cold
        self.cluster: Cluster = launch_cluster(spec.workers, spec.ps, spec.chief)
        self._ports = [t.port for t in self.cluster]
        self._tls: TlsMode | None = None
        host = socket.gethostname()
        self.nodes = {t.name: host for t in self.cluster}
        # exposed: the members are resolved once, before any task starts (members only)
        self.net = NetPolicy(expose=spec.expose, tls=spec.tls).tasks(self.cluster)
        if spec.tls:
            try:
                self._start_tls(attempt)
            except BaseException:
                self.close()
                raise

    def prepare_next(self, count: int) -> None:
        """A failed attempt is being stopped: have the warm interpreter fork ``count`` guards
        for the next attempt's tasks now (:meth:`Zygote.prepare`)."""
        if isinstance(self._warm, Zygote):
            self._warm.prepare(count)

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
        from graphdist._local.fleet import LocalFleet

        # TLS mode: the servers on the alias (loopback), behind the attempt's gateway
        fleet = LocalFleet(self.cluster, jobs=jobs, expose=self.spec.expose, log_dir=log_folder)
        fleet.start_within(signals)
        self._start_gateway()
        return fleet

    def _start_gateway(self) -> None:
        if self._tls is not None:
            self._tls.start(self._tls.real.tasks)

    def task_env(self, task: Task) -> Mapping[str, str]:
        # Exposed or not, the shim is loaded: an exposed task keeps TensorFlow's wildcard bind
        # and the shim lets in only the members (as an exposed LocalFleet's servers). Without
        # it an exposed task listened on every interface and let every machine run code in it.
        return self.net.env(self.net.bind(task), self.spec.base_env.get("LD_PRELOAD"), inherit=True)

    def start_task(
        self, task: Task, env: Mapping[str, str], run: RunSink, log_path: str | None
    ) -> GuardedTask:
        self._start_gateway()
        if isinstance(self._warm, str):
            return GuardedTask(task, self.spec.command, env, run, log_path, cold_because=self._warm)
        return GuardedTask(task, self.spec.command, env, run, log_path, zygote=self._warm)

    def close(self) -> None:
        if self._tls is not None:
            self._tls.close()
            self._tls = None
        release_ports(self._ports)


def zygote_env(base: Mapping[str, str]) -> dict[str, str]:
    """The environment of a local run's warm interpreter (or agent's) from the run's base
    environment: with the bind shim preloaded (at 127.0.0.1; each task sets its own address),
    which a forked task cannot load any more."""
    return {**base, **NetPolicy().env("127.0.0.1", base.get("LD_PRELOAD"), inherit=True)}


class LocalRun:
    """The ``local`` run backend: every task a process of this machine."""

    name: ClassVar[str] = "local"
    summary: ClassVar[str] = "every task a process of this machine (default)"
    requires: ClassVar[tuple[str, str] | None] = None
    tls: ClassVar[bool] = True
    options: ClassVar[tuple[Option, ...]] = (PRELOAD_OPTION,)

    @classmethod
    def check_options(cls, spec: RunSpec, options: Mapping[str, Any]) -> dict[str, Any]:
        checked = dict(options)
        checked["preload"] = check_preload(options.get("preload", "auto"))
        return checked

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self._warm: Zygote | str = self._start_warm()

    _agent_said = False  # the line on a warm agent passed over was printed (_start_warm)

    def _start_warm(self) -> Zygote | str:
        """The run's warm interpreter (:mod:`graphdist._distribute.warm`) once it has imported
        the preloads, or why the run's tasks run cold. A preload that fails to import is an
        ArgumentError, before anything starts."""
        preload = self.spec.options.get("preload", ())
        if not preload:
            return "no warm interpreter in this run (--preload none)"
        env = zygote_env(self.spec.base_env)
        target = warm_target(self.spec.command, env, env, preload)
        if isinstance(target, str):
            return target
        session = attach(preload, env)  # a warm agent's (graphdist warm start), if one runs
        if isinstance(session, Zygote):
            return session
        if session.said is not None and not self._agent_said:  # once a run, not per attempt
            self._agent_said = True
            print(session.said, file=sys.stderr, flush=True)
        zygote = Zygote(preload, env)
        why = zygote.ready(min(READY_TIMEOUT_S, self.spec.timeout_s or READY_TIMEOUT_S))
        if why is not None:
            zygote.close()
            if not zygote.failed_import:  # slow or gone: the run goes on, cold
                return f"{why} (its tasks run cold)"
            raise ArgumentError(
                f"preload: {why}; name modules that import in this Python, or pass "
                "--preload none to run every task cold",
                name="preload",
                value=",".join(preload),
            )
        return zygote

    def place(self, attempt: int, signals: SignalScope) -> _LocalPlacement:
        if isinstance(self._warm, Zygote) and not self._warm.alive:
            self._warm.close()  # killed, say: a new one for this attempt
            self._warm = self._start_warm()
        return _LocalPlacement(self.spec, attempt, self._warm)

    def close(self) -> None:
        if isinstance(self._warm, Zygote):
            self._warm.close()
            self._warm = "the run has ended"
