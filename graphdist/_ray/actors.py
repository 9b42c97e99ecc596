"""The Ray actors of a :class:`~graphdist._ray.fleet.RayFleet` and a Ray run
(:mod:`graphdist._ray.run`): :class:`ServerActor`, one TensorFlow server in a Ray
actor's process, and :class:`TlsGateways`, TLS mode's gateways on Ray's nodes (one
:class:`_GatewayActor` per node) and in this process. Ray is imported only where they run.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

from graphdist._cluster import Cluster
from graphdist._exceptions import ClusterSpecError
from graphdist._net.exposure import is_loopback_ip
from graphdist._net.policy import bound_to

__all__ = ["ServerActor", "TlsGateways"]


class ServerActor:
    """Runs in a Ray actor: one TensorFlow server, started when the actor is (re)created.

    The process was started with the bind shim set to its node's address (so that Ray's own
    core worker, bound before this runs, stays reachable where Ray says it is); the server
    binds ``bind``, which the shim reads at each ``bind()`` call.
    """

    def __init__(self, cluster: dict[str, Any], job: str, index: int, bind: str) -> None:
        from graphdist._proc import lean

        lean.install()  # an actor's process is its own and only serves (see lean.py)
        from graphdist._proc.server import start_server

        with bound_to(bind):
            self._server = start_server(cluster, job, index)

    def pid(self) -> int:
        return os.getpid()

    def listening(self) -> list[tuple[str, int]]:
        """Every TCP socket this process listens on (the server's and Ray's own)."""
        from graphdist._net.exposure import listening_sockets

        return listening_sockets(os.getpid())


class _GatewayActor:
    """Runs in a Ray actor pinned to one node: that node's TLS gateway (TLS mode). Its
    credentials come over Ray's channel as bytes and are written to a private folder on the
    node (the key 0600) only until the gateway has read them; the gateway process ends with the
    actor's (its owner watch)."""

    def __init__(
        self, cluster: dict[str, Any], serving: list[list[Any]], files: dict[str, bytes]
    ) -> None:
        from graphdist._net.tlsmode import received_gateway

        real = Cluster.parse(cluster)
        own = [real.task(job, index) for job, index in serving]
        self.gateway = received_gateway(real, own, files)

    def pid(self) -> int:
        return self.gateway.pid

    def stop(self) -> None:
        from graphdist._net.gateway import stop_gateway

        stop_gateway(self.gateway)


class TlsGateways:
    """TLS mode on Ray (a RayFleet's or a Ray run's attempt): credentials for the nodes and this
    process, one :class:`_GatewayActor` per node (pinned to it; inbound for the tasks it holds,
    outbound for the others) and this process's own gateway for the tasks on other hosts.
    ``real`` has each task at its node's address; :attr:`cluster` is what TensorFlow sees (the
    aliases) and :attr:`aliases` each spot's bind address. :meth:`close` stops them all."""

    def __init__(
        self,
        real: Cluster,
        names: Sequence[tuple[str, int]],
        spots: Sequence[tuple[str, int, str]],
        timeout_s: float,
        *,
        folder: str | None = None,
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from graphdist._net.gateway import alias
        from graphdist._net.tlsmode import TlsMode

        away = sorted({ip for ip, _, _ in spots if is_loopback_ip(ip)})
        if away:
            raise ClusterSpecError(
                "tls=True needs Ray nodes on network addresses, and this Ray's node address is "
                "loopback (a Ray instance on this machine only, which no other machine reaches): "
                "drop tls, or join a Ray cluster started on network addresses",
                away,
            )
        self.actors: list[Any] = []
        # the credentials (in ``folder``: a detached fleet's), and this process's outbound gateway
        self._mode = TlsMode(real, folder=folder)
        self.cluster = self._mode.cluster
        self.aliases = [alias(ip) for ip, _, _ in spots]
        try:
            actor_class = ray.remote(_GatewayActor)
            for ip in dict.fromkeys(ip for ip, _, _ in spots):
                node = next(node for node_ip, _, node in spots if node_ip == ip)
                serving = [
                    [job, index]
                    for (job, index), (node_ip, _, _) in zip(names, spots, strict=True)
                    if node_ip == ip
                ]
                self.actors.append(
                    actor_class.options(
                        num_cpus=0,
                        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                    ).remote(real.as_dict(), serving, self._mode.host_files(ip))
                )
            ray.get([g.pid.remote() for g in self.actors], timeout=timeout_s)
        except BaseException:
            self.close()
            raise

    @property
    def folder(self) -> str:
        """The private folder of the credentials (``credentials/client`` the client's)."""
        return self._mode.folder

    def close(self, *, actors: bool = True) -> None:
        """Stop this process's gateway, remove the credentials and (``actors``: Ray can still
        be asked) stop and kill the node gateways' actors."""
        import ray

        self._mode.close()
        if actors and ray.is_initialized():
            for actor in self.actors:
                with contextlib.suppress(Exception):
                    ray.get(actor.stop.remote(), timeout=10.0)
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
        self.actors = []
