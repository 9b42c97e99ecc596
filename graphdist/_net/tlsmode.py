"""TLS mode on the owner's side: what a TLS fleet or a TLS run's attempt holds in this process.

A :class:`TlsMode` is made for one cluster of real addresses (the cluster file's, the nodes'):
its credentials (a new CA, a folder per host and the client's, :func:`graphdist._net.tlscerts.
make_credentials`) in a private folder, the cluster as TensorFlow sees it (:attr:`TlsMode.
cluster`, every task at its host's loopback alias) and this process's gateway: inbound for the
tasks it serves, outbound for the tasks on other hosts. The hosts' own gateways get their
credentials from :meth:`TlsMode.host_files` over a private channel (a Slurm step's stdin, Ray's
object channel); :meth:`TlsMode.close` stops the gateway and removes every file.

:class:`~graphdist._local.fleet.LocalFleet`, :class:`~graphdist._fleet.command.SlurmFleet` and the
local and Slurm run backends use it; :class:`~graphdist._ray.actors.TlsGateways` adds Ray's
node gateways around one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence

from graphdist._cluster import Cluster, Task
from graphdist._exceptions import ClusterSpecError, CredentialsError

__all__ = [
    "TlsMode",
    "credentials_from_stdin",
    "received_gateway",
    "tls_host",
    "write_received",
]


class TlsMode:
    """TLS mode for ``real`` (see the module docstring). ``serving``: the tasks whose server is
    in this process's care on this machine (its gateway's inbound routes; their host's
    credentials are the gateway's); otherwise it uses the client's. ``folder``: where the
    credentials are made (a detached fleet's state folder), else a new private one; either is
    removed at :meth:`close`. Raises :class:`CredentialsError`, :class:`PortInUseError`."""

    def __init__(
        self,
        real: Cluster,
        serving: Iterable[Task] = (),
        *,
        folder: str | None = None,
        log_path: str | None = None,
        start: bool = True,
    ) -> None:
        from graphdist._net.gateway import tls_cluster
        from graphdist._net.tlscerts import make_credentials
        from graphdist._private import owned_temp_dir

        self.real = real
        self.cluster = tls_cluster(real)  # what TensorFlow sees: the aliases
        self.gateway: subprocess.Popen[bytes] | None = None
        self.folder = owned_temp_dir("tls") if folder is None else folder
        try:
            hosts = list(dict.fromkeys(t.host.strip("[]") for t in real))
            self.folders = make_credentials(hosts, os.path.join(self.folder, "credentials"))
            if start:
                self.start(serving, log_path=log_path)
        except BaseException:
            self.close()
            raise

    def start(self, serving: Iterable[Task] = (), *, log_path: str | None = None) -> None:
        """Start this process's gateway (``start=False``: once the servers it fronts listen, or
        a fleet's port check would find their ports taken by it); nothing when it runs."""
        from graphdist._net.gateway import routes, start_gateway
        from graphdist._net.tlscerts import CLIENT

        if self.gateway is not None:
            return
        served = list(serving)
        route_list = routes(self.real, served)
        if route_list:
            own = served[0].host.strip("[]") if served else CLIENT
            self.gateway = start_gateway(route_list, self.folders[own], log_path=log_path)

    @property
    def client(self) -> str:
        """The client's credentials folder (for ``graphdist.connect(real, tls=...)``)."""
        from graphdist._net.tlscerts import CLIENT

        return self.folders[CLIENT]

    def host_files(self, host: str) -> dict[str, bytes]:
        """``host``'s credentials (its CA, certificate and key files) as bytes, for a private
        channel to it."""
        from graphdist._net.tlscerts import CA_FILE, CERT_FILE, KEY_FILE

        files = {}
        for name in (CA_FILE, CERT_FILE, KEY_FILE):
            with open(os.path.join(self.folders[host.strip("[]")], name), "rb") as f:
                files[name] = f.read()
        return files

    def host_json(self, host: str) -> bytes:
        """:meth:`host_files` as the JSON that ``graphdist serve --tls -`` reads on stdin."""
        files = self.host_files(host)
        return json.dumps({name: data.decode() for name, data in files.items()}).encode()

    def close(self) -> None:
        """Stop this process's gateway and remove the credentials' folder; again is nothing."""
        from graphdist._net.gateway import stop_gateway

        stop_gateway(self.gateway)
        self.gateway = None
        shutil.rmtree(self.folder, ignore_errors=True)


def tls_host() -> str:
    """This machine's address for a local TLS run's gateway: what its host name resolves to, if
    that is an address of this machine's other than loopback, else its first such address
    (:func:`~graphdist._net.exposure.host_addresses`). Raises :class:`ClusterSpecError` on a
    machine with none (TLS mode is for reaching tasks from other machines)."""
    import socket

    from graphdist._net.exposure import host_addresses

    found = host_addresses()
    try:
        named = socket.gethostbyname(socket.gethostname())
    except OSError:
        named = ""
    if named in found:
        return named
    if not found:
        raise ClusterSpecError(
            "tls=True puts a run's tasks behind a TLS gateway on this machine's network "
            "address, and it has none but loopback: drop tls (a run on loopback needs none)",
            socket.gethostname(),
        )
    return found[0]


#: What :func:`write_received`'s folders are called (a glob, in the temporary folder).
RECEIVED_GLOB = "graphdist-tls-*-received-*"


def write_received(files: Mapping[str, bytes]) -> str:
    """Credentials received over a private channel (:meth:`TlsMode.host_files`) written to a new
    private folder ``graphdist-tls-<pid>-received-*`` (0700; every file 0600 from its creation),
    for a gateway to read; returns the folder, which the caller removes once it has. One whose
    process was killed before it could is swept, as any ``graphdist-tls-<pid>-*`` folder, by the
    next graphdist process on the host that makes one
    (:func:`graphdist._private.sweep_stale_temp_dirs`)."""
    from graphdist._private import owned_temp_dir

    folder = owned_temp_dir("tls", "received")
    for name, data in files.items():
        path = os.path.join(folder, os.path.basename(name))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    return folder


MAX_STDIN_CREDENTIALS = 64 * 1024


def credentials_from_stdin() -> str:
    """A host's credentials sent on stdin (``graphdist serve --tls -``, a Slurm TLS run's task:
    :meth:`TlsMode.host_json`), written to a new private folder (:func:`write_received`);
    returns the folder. :class:`CredentialsError` when stdin holds something else."""
    import sys

    from graphdist._net.tlscerts import CA_FILE, CERT_FILE, KEY_FILE

    text = sys.stdin.read(MAX_STDIN_CREDENTIALS + 1)
    try:
        data = json.loads(text) if len(text) <= MAX_STDIN_CREDENTIALS else None
    except ValueError:
        data = None
    names = (CA_FILE, CERT_FILE, KEY_FILE)
    if not isinstance(data, dict) or not all(isinstance(data.get(n), str) for n in names):
        raise CredentialsError(
            f"--tls - reads the credentials from stdin as a JSON object of {', '.join(names)} "
            "texts, and stdin held something else; pass a credentials folder instead"
        )
    return write_received({name: data[name].encode() for name in names})


def received_gateway(
    real: Cluster, serving: Sequence[Task], files: Mapping[str, bytes]
) -> subprocess.Popen[bytes]:
    """Start a host's gateway (:func:`~graphdist._net.gateway.start_gateway`: inbound for
    ``serving``, outbound for the tasks on other hosts) with credentials received as bytes,
    on disk only until it has read them."""
    from graphdist._net.gateway import routes, start_gateway

    folder = write_received(files)
    try:
        return start_gateway(routes(real, serving), folder)
    finally:  # read by the gateway (or refused): not left on the host, whatever happens next
        shutil.rmtree(folder, ignore_errors=True)
