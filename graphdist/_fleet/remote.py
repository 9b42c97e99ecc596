"""A client of servers that other machines run: :func:`graphdist.connect`.

``graphdist serve`` (systemd, Kubernetes, Slurm, or by hand) runs one server per host; this is
the other side, the client process with the cluster's spec. It offers what every
:class:`~graphdist._fleet.client.Fleet` does (devices checked against the cluster, sessions whose
failures name the task and its address, health over gRPC, the master for some fetches) and owns
nothing: its servers' processes are on other machines, so it knows them only by what they answer
(``pid`` is ``None``; ``alive`` is what the last probe heard). :meth:`~RemoteFleet.kill` and
:meth:`~RemoteFleet.restart` are refused: the host's own supervisor (systemd's ``Restart=``,
Kubernetes, Slurm) restarts its server.

A server that dies (its host is up, its port closed) fails the next run in milliseconds, and the
session's diagnosis asks every task over gRPC which one it was; a host that went away, or a
frozen server, is found by the same probes once the run fails or its operation timeout ends.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time

from graphdist._cluster import Cluster, ClusterLike, Task
from graphdist._exceptions import (
    CredentialsError,
    FleetError,
    FleetStartError,
    StartTimeoutError,
)
from graphdist._failures import DEAD, NOT_ANSWERING
from graphdist._fleet.client import Fleet, FleetState
from graphdist._fleet.health import probe_all
from graphdist._fleet.task import TaskView
from graphdist._net.probe import PROBE_TIMEOUT_S, REFUSED_WAIT_S, tcp_connect_error
from graphdist._validate import timeout_ms
from graphdist._validate import timeout_s as check_timeout_s

__all__ = ["RemoteFleet", "RemoteTask", "connect"]

DEFAULT_CONNECT_TIMEOUT_S = 60.0
"""How long :func:`connect` waits for every server to answer (servers still starting)."""
GATEWAY_GONE_S = 0.5
"""TLS mode: how long a server's gateway may still listen once its server died (it polls its
owner every 0.1 s), when a failed task is told ``dead`` or not."""


def _closed(error: str | None) -> bool:
    """Whether a failed probe's error says the connection was closed or reset (not refused,
    nor timed out): only then is :func:`closed_at_accept` asked."""
    text = (error or "").lower()
    return "closed" in text or "reset" in text


def _not_busy(
    missed: list[tuple[RemoteTask, str | None]], timeout_s: float
) -> list[tuple[RemoteTask, str | None]]:
    """``missed`` (a task whose GetStatus failed, and the error) less the servers that are
    busy, not silent: GetStatus timed out, but the liveness call is answered within
    ``timeout_s``. TensorFlow answers GetStatus on its compute pool, so a server whose pool
    threads all sit in another client's kernels misses it for as long as they run; a frozen
    one answers neither. (A gRPC server that is not TensorFlow's answers GetStatus at once,
    ``UNIMPLEMENTED``: never taken for a busy one.)"""
    late = [t for t, e in missed if (e or "").startswith("DEADLINE_EXCEEDED")]
    if not late:
        return missed
    alive = probe_all([t.address for t in late], timeout_s, alive=True)
    busy = {id(t) for t, (ok, _) in zip(late, alive, strict=True) if ok}
    return [(t, e) for t, e in missed if id(t) not in busy]


def closed_at_accept(address: str, wait_s: float = REFUSED_WAIT_S) -> bool:
    """Whether the server at ``address`` accepts this machine's TCP connection and closes it
    before sending a byte: what graphdist's shim does to a machine that is not a member (its
    log names the address). A refused port, a silent or an answering server: False."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=wait_s) as sock:
            sock.settimeout(wait_s)
            return sock.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except (OSError, ValueError):  # refused, unreachable, timed out: not a members refusal
        return False


class RemoteTask(TaskView):
    """A server another machine runs: its task and what the last probe heard."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.alive = True  # until a probe of this client hears otherwise
        self.pid: int | None = None
        self.exitcode: int | None = None
        self.restarts = 0
        self.log_path: str | None = None

    def log_tail(self, lines: int = 12) -> list[str]:
        """Nothing: the server's log is on its own host (``journalctl``, ``kubectl logs``)."""
        return []

    def __repr__(self) -> str:
        return f"<RemoteTask {self.name} at {self.address}>"


class RemoteFleet(Fleet[RemoteTask]):
    """The servers of ``cluster``, run elsewhere (see the module docstring); from
    :func:`connect`. Leaving ``with`` (or :meth:`close`) closes this client's sessions only."""

    def __init__(
        self,
        cluster: ClusterLike,
        *,
        operation_timeout_ms: int | None = None,
        tls: str | None = None,
    ) -> None:
        super().__init__()
        self.real_cluster = Cluster.parse(cluster)
        self.operation_timeout_ms = timeout_ms(operation_timeout_ms, "operation_timeout_ms")
        self.tls = tls
        self._gateway: subprocess.Popen[bytes] | None = None
        if tls is not None:
            from graphdist._net.gateway import routes, start_gateway, tls_cluster
            from graphdist._net.tlscerts import identity_folder, load_credentials

            self.tls = tls = identity_folder(tls)  # the whole folder `certs` made: its client/
            load_credentials(tls)
            self.cluster = tls_cluster(self.real_cluster)
            outbound = routes(self.real_cluster)
            self._gateway = start_gateway(outbound, tls) if outbound else None
        else:
            self.cluster = self.real_cluster
        self.start_timeout_s = DEFAULT_CONNECT_TIMEOUT_S
        for task in self.cluster:
            self._tasks[(task.job, task.index)] = RemoteTask(task)

    def _real(self, task: RemoteTask) -> Task:
        """The task's address in the cluster as given (its alias is what TensorFlow sees in
        TLS mode)."""
        return self.real_cluster.task(task.job, task.index)

    def wait_answering(self, wait_s: float) -> None:
        """Return once every server answers (a busy one counts); :class:`StartTimeoutError`
        naming the silent ones after ``wait_s`` seconds (a refusal is said at once)."""
        deadline = time.monotonic() + wait_s
        silent = list(self._tasks.values())
        errors: list[str | None] = []
        while silent:
            results = probe_all([t.address for t in silent], min(2.0, wait_s), alive=False)
            missed = [(t, e) for t, (ok, e) in zip(silent, results, strict=True) if not ok]
            self._refused([t for t, e in missed if _closed(e)])
            left = deadline - time.monotonic()
            missed = _not_busy(missed, min(PROBE_TIMEOUT_S, max(0.1, left)))
            silent, errors = [t for t, _ in missed], [e for _, e in missed]
            if not silent or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        if silent:
            names = ", ".join(f"{t.name} at {t.address}" for t in silent)
            raise StartTimeoutError(
                f"{len(silent)} of {len(self._tasks)} server(s) did not answer within "
                f"{wait_s:g} s: {names} ({errors[0] or 'no answer'}); is `graphdist serve` "
                "running on those hosts, and is this machine a member of the cluster or given "
                "to their --allow? (Servers in TLS mode, serve --tls, answer only "
                "connect(..., tls=CLIENT_FOLDER).)",
                ready=len(self._tasks) - len(silent),
                expected=len(self._tasks),
                timeout_s=wait_s,
            )

    def _refused(self, closed: list[RemoteTask]) -> None:
        """Raise :class:`FleetStartError` at once where a server whose probe saw its
        connection closed closes a plain one as soon as it accepts it (members only: waiting
        out the timeout changes nothing)."""
        if self.tls is not None:
            self._tls_refused(closed)
            return
        refused = [t for t in closed if closed_at_accept(t.address)]
        if not refused:
            return
        names = ", ".join(f"{t.name} at {t.address}" for t in refused)
        hosts = ", ".join(dict.fromkeys(t.task.host for t in refused))
        raise FleetStartError(
            f"Refused by {hosts} (not a member): {names} closed this machine's connection as "
            "soon as it was accepted, as graphdist's servers do to a machine that is neither a "
            "host of the cluster nor on its --allow list (the server's log names this "
            "machine's address); connect from a member host, or serve with --allow naming "
            "this machine",
            task=refused[0].name,
            address=refused[0].address,
        )

    def _tls_refused(self, closed: list[RemoteTask]) -> None:
        """Raise :class:`CredentialsError` at once where a task's gateway, asked directly,
        fails this client's TLS handshake (another cluster's credentials, a certificate not for
        that host): the reason, from OpenSSL, is in the message."""
        from graphdist._net.gateway import tls_refusal

        assert self.tls is not None
        for task in closed:
            real = self._real(task)
            why = tls_refusal(real.host, real.port, self.tls)
            if why:
                raise CredentialsError(
                    f"{task.name} at {real.address} refused TLS with the credentials in "
                    f"{self.tls}: {why}; use the client folder `graphdist certs` made for "
                    "this cluster",
                    self.tls,
                )

    def close(self) -> None:
        """Close this client's sessions (and its TLS gateway); the servers keep running on
        their hosts."""
        if self._state is FleetState.RUNNING:
            self._close_sessions()
        self._state = FleetState.CLOSED
        from graphdist._net.gateway import stop_gateway

        stop_gateway(self._gateway)
        self._gateway = None
        self._changed()

    def __enter__(self) -> RemoteFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _kill_task(self, task: RemoteTask, sig: int) -> None:
        raise FleetError(
            f"{task.name} at {task.address} is run by another machine ({signal.Signals(sig).name} "
            "not sent): stop or restart it there (systemctl, kubectl, scancel)"
        )

    def _bring_back(self, task: RemoteTask) -> None:
        self._kill_task(task, signal.SIGTERM)

    def _explain(self, task: RemoteTask, status: str, detail: str) -> tuple[str, str]:
        """A task whose host refuses the connection (it is up, but nothing listens on the port:
        the server is gone) is ``dead``, not ``not answering``."""
        if self.tls is not None and status == NOT_ANSWERING:
            real = self._real(task)
            if _port_refused(real.host, real.port, GATEWAY_GONE_S):
                return DEAD, (
                    f"its host {real.host} refuses connections to port {real.port} (its TLS "
                    "gateway is gone with its server)"
                )
            return status, f"{detail} (host {real.address}, through TLS)"
        if status == NOT_ANSWERING and "Connection refused" in detail:
            return DEAD, f"its host refuses connections to port {task.task.port}"
        return status, detail

    def __repr__(self) -> str:
        tasks = ", ".join(f"{t.name}={t.address}" for t in self.cluster)
        return f"<RemoteFleet {self.state.value} [{tasks}]>"


def connect(
    cluster: ClusterLike,
    *,
    timeout_s: float | None = None,
    operation_timeout_ms: int | None = None,
    tls: str | None = None,
) -> RemoteFleet:
    """A client of the servers of ``cluster`` that other processes run (``graphdist serve`` on
    each host), once every one answers::

        with graphdist.connect("cluster.json") as fleet:
            with fleet.session("local", 0, graph) as sess:
                sess.run(result)

    ``cluster``: a spec with real addresses (JSON text, a file, a dict, a :class:`Cluster`).
    Waits up to ``timeout_s`` (default 60 s) for every server to answer; raises
    :class:`StartTimeoutError` naming those that do not (not started, or this machine not let in:
    a server on a host address lets in only its cluster's hosts and its ``--allow`` list).

    ``tls``: the client credentials folder ``graphdist certs`` made for the cluster (or the
    whole folder it made: its ``client/`` is used), whose servers run ``graphdist serve
    --tls``: this client then reaches them through a mutual-TLS gateway of its own (a small
    process, stopped by :meth:`~RemoteFleet.close`), from any machine, member or not; raises
    :class:`CredentialsError` if they refuse its certificate.
    """
    wait_s = check_timeout_s(timeout_s, "timeout_s", DEFAULT_CONNECT_TIMEOUT_S)
    fleet = RemoteFleet(cluster, operation_timeout_ms=operation_timeout_ms, tls=tls)
    try:
        fleet.wait_answering(wait_s)
    except BaseException:
        fleet.close()
        raise
    fleet._state = FleetState.RUNNING
    return fleet


def _port_refused(host: str, port: int, within_s: float = 0.0) -> bool:
    """Whether ``host`` answers a TCP connection to ``port`` with a refusal (nothing listens),
    asked again for up to ``within_s`` seconds while something still answers."""
    deadline = time.monotonic() + within_s
    while True:
        exc = tcp_connect_error(host, port, REFUSED_WAIT_S)
        if exc is not None:
            return isinstance(exc, ConnectionRefusedError)
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
