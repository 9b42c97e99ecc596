"""TLS mode: no TensorFlow server on a host address, one mutual-TLS gateway per host instead.

TensorFlow's gRPC servers take no credentials and encrypt nothing. In TLS mode every server
stays on loopback, where graphdist's shim lets in only its own user, and everything between
hosts crosses a gateway that speaks mutual TLS with the cluster's credentials
(:mod:`graphdist._net.tlscerts`). TensorFlow itself is unchanged: every process of the cluster,
on every host, sees the same ClusterSpec (:func:`tls_cluster`), in which each task is at a
loopback *alias* of its host (``127.A.B.C``, derived from the host's name as the cluster spells
it, :func:`alias`) and its own port:

- on the task's own host, its server listens on that alias (the shim's ``GRAPHDIST_BIND_ADDR``);
  the gateway listens on the task's real address and port (the cluster file's), admits only a
  peer whose certificate the cluster's CA signed, and relays to the alias (an *inbound* route);
- on every other host, and on a client's, a gateway listens on the alias and port, and relays
  over mutual TLS to the task's real address, checking that the certificate there is the one
  the CA made for that host (an *outbound* route).

A gateway is its own small process (``python -m graphdist._net.gateway``, no TensorFlow), with
the bind shim loaded: its loopback listeners let in only its user, as a server's do, and its
listeners on host addresses let in every machine (``GRAPHDIST_ALLOW=*``), which then has to pass
the TLS handshake. Outbound listeners are bound with ``SO_REUSEPORT``, so the gateways of two
``serve`` processes, or of a client, on one host share them (the kernel admits that only
between sockets of one user). A gateway reads its routes as JSON on stdin, says ``ready`` on
stdout once every listener is bound (or one ``error:`` line, exit 2), and exits with its parent
(it checks every 0.1 s) or on SIGTERM. The relay (:mod:`graphdist._net.relay`) is one thread,
asyncio's loop: coroutines accept, handshake and dial, then readiness callbacks move each
connection's bytes between its two non-blocking sockets themselves (no asyncio transports); TLS
is OpenSSL's (Python's ``ssl.SSLObject`` over memory buffers), no crypto of graphdist's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict

from graphdist._cluster import Cluster, Task
from graphdist._exceptions import (
    ClusterSpecError,
    CredentialsError,
    from_wire,
)
from graphdist._net.loopback import bind_address_for
from graphdist._net.relay import Gateway, Route
from graphdist._proc.process import stop_processes

__all__ = [
    "Gateway",
    "Route",
    "alias",
    "is_here",
    "read_line",
    "routes",
    "start_gateway",
    "stop_gateway",
    "tls_cluster",
    "tls_refusal",
]

READY_S = 15.0
"""How long a gateway may take to bind its listeners (a Python start, no TensorFlow)."""
STOP_S = 5.0
"""How long a gateway gets to exit on SIGTERM (at once: it has nothing to save) before SIGKILL."""
OWNER_POLL_S = 0.1
"""How often a gateway checks that its owner still runs (it exits within this once not)."""
_ALIAS_FIRST = 128  # aliases lie in 127.128.0.0/9, away from 127.0.0.1 and its neighbours


def alias(host: str) -> str:
    """The loopback alias of ``host`` (as the cluster spells it, case aside): 127.128.0.0/9."""
    digest = hashlib.sha256(host.strip("[]").lower().encode()).digest()
    return f"127.{_ALIAS_FIRST + digest[0] % 127}.{digest[1]}.{digest[2]}"


def tls_cluster(cluster: Cluster) -> Cluster:
    """``cluster`` as TensorFlow sees it in TLS mode: each task on a host address at its host's
    alias and its own port (tasks on loopback unchanged). Raises :class:`ClusterSpecError` if
    two hosts of the cluster share an alias (one chance in ~8 million per pair)."""
    seen: dict[str, str] = {}
    jobs: dict[str, list[str]] = {}
    for task in cluster:
        host = task.host
        if bind_address_for(host) is None:
            mapped = alias(host)
            other = seen.setdefault(mapped, host.lower())
            if other != host.lower():
                raise ClusterSpecError(
                    f"Hosts {other!r} and {host!r} of the cluster share the loopback alias "
                    f"{mapped} of TLS mode; spell one of them another way (its IP address or "
                    "its full name)",
                    host,
                )
            host = mapped
        jobs.setdefault(task.job, []).append(f"{host}:{task.port}")
    return Cluster.parse({job: addresses for job, addresses in jobs.items()})


def is_here(host: str) -> bool:
    """Whether ``host`` is this machine: it resolves to an address a socket here can bind."""
    if bind_address_for(host) is not None:
        return True
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((sockaddr[0], 0))
                return True
            except OSError:
                continue
    return False


def routes(cluster: Cluster, serving: Iterable[Task] = ()) -> list[Route]:
    """The routes of a gateway on this machine for ``cluster`` (real addresses): inbound for
    each task in ``serving``, outbound for each task whose host is not this machine."""
    own = {(t.job, t.index) for t in serving}
    here: dict[str, bool] = {}
    found = []
    for task in cluster:
        if bind_address_for(task.host) is not None:
            continue
        name = f"/job:{task.job}/task:{task.index}"
        mapped = (alias(task.host), task.port)
        real = (task.host.strip("[]"), task.port)
        if (task.job, task.index) in own:
            found.append(Route(name, task.host, real, mapped, inbound=True))
        elif not here.setdefault(task.host, is_here(task.host)):
            found.append(Route(name, task.host, mapped, real, inbound=False))
    return found


def _end_with(parent: int) -> None:
    """Exit at once when ``parent`` is no longer this process's parent (it ended)."""
    while os.getppid() == parent:
        time.sleep(OWNER_POLL_S)
    os._exit(0)


def _main() -> int:
    from graphdist._exceptions import to_wire
    from graphdist._net.members import shim_members

    parent = os.getppid()
    if parent == 1:  # the parent left already
        return 0
    # the gateway ends with its owner's process (not with the thread that started it, as
    # PR_SET_PDEATHSIG would: connect() may be called from a thread that then ends)
    threading.Thread(target=_end_with, args=(parent,), name="owner-watch", daemon=True).start()
    try:
        config = json.load(sys.stdin)
        route_list = [
            Route(r["task"], r["host"], tuple(r["listen"]), tuple(r["to"]), r["inbound"])
            for r in config["routes"]
        ]
        if shim_members() is None:
            raise CredentialsError(
                "graphdist's shim is not loaded in the TLS gateway, so its loopback listeners "
                "would let in other users: check that LD_PRELOAD is honoured"
            )
        gateway = Gateway(route_list, config["credentials"])
        gateway.bind()
    except Exception as exc:  # one line for the owner, which raises it as the same class
        print("error: " + json.dumps(to_wire(exc)), flush=True)
        return 2
    print("ready", flush=True)
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:  # ignored from its start: a
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # task's step's, ends with it
    try:  # libuv's loop: less added latency a step than asyncio's (benchmarks/tls.py)
        import uvloop
    except ImportError:  # a dependency, but the relay works on asyncio's own loop too
        asyncio.run(gateway.serve())
    else:
        uvloop.run(gateway.serve())
    return 0


def start_gateway(
    route_list: Sequence[Route], credentials: str, *, log_path: str | None = None
) -> subprocess.Popen[bytes]:
    """Start a gateway process for ``route_list`` with the credentials folder ``credentials``
    (checked first: :class:`CredentialsError`); returns once every listener is bound. Its
    inbound routes let in every machine, at the TLS handshake; its loopback ones only this
    user. Raises :class:`PortInUseError`, :class:`CredentialsError`. The caller stops it
    (SIGTERM); it also ends within 0.1 s of the caller's process."""
    from graphdist._net.policy import gateway_env
    from graphdist._net.tlscerts import load_credentials

    load_credentials(credentials)
    env = gateway_env(any(r.inbound for r in route_list))
    stderr = open(log_path, "ab") if log_path else None  # noqa: SIM115 - handed to the child
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "graphdist._net.gateway"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=env,
            close_fds=True,
        )
    finally:
        if stderr is not None:
            stderr.close()
    assert proc.stdin is not None and proc.stdout is not None
    config = {"credentials": credentials, "routes": [asdict(r) for r in route_list]}
    proc.stdin.write(json.dumps(config).encode())
    proc.stdin.close()
    line = read_line(proc, READY_S)
    if line == "ready":
        return proc
    with contextlib.suppress(OSError):
        proc.kill()
    proc.wait()
    if line.startswith("error: "):
        with contextlib.suppress(ValueError):
            raise from_wire(json.loads(line[len("error: ") :]))
    raise CredentialsError(f"The TLS gateway did not start ({line or 'no answer'})")


def read_line(proc: subprocess.Popen[bytes], wait_s: float) -> str:
    """The next line ``proc`` prints within ``wait_s`` seconds ('' if none): a ready line."""
    import selectors

    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(wait_s):
            return ""
    return proc.stdout.readline().decode(errors="replace").strip()


def tls_refusal(host: str, port: int, credentials: str, wait_s: float = 1.0) -> str:
    """Why the gateway at ``host:port`` refuses TLS with ``credentials`` (its certificate is not
    the CA's for ``host``, or it rejects this one), or "" where it does not, or cannot be
    reached (nothing listens yet)."""
    from graphdist._net.tlscerts import client_context, load_credentials

    context = client_context(load_credentials(credentials))
    name = host.strip("[]")
    try:
        with (
            socket.create_connection((name, port), timeout=wait_s) as raw,
            context.wrap_socket(raw, server_hostname=name) as tls,
        ):
            tls.settimeout(wait_s)
            # TLS 1.3: the server's verdict on this client's certificate comes after the
            # handshake, as an alert in place of the first record
            with contextlib.suppress(TimeoutError, ConnectionError):
                tls.recv(1)
    except ssl.SSLCertVerificationError as exc:
        return (
            f"its certificate is not the one this cluster's CA made for {host} "
            f"({exc.verify_message})"
        )
    except ssl.SSLError as exc:
        return f"it rejected this client's certificate ({exc.reason or exc})"
    except OSError:
        return ""
    return ""


def stop_gateway(proc: subprocess.Popen[bytes] | None) -> None:
    """Stop a gateway from :func:`start_gateway` and reap it (nothing if it is gone)."""
    if proc is None:
        return
    stop_processes([proc], grace_s=STOP_S)
    if proc.stdout is not None:
        proc.stdout.close()


if __name__ == "__main__":
    sys.exit(_main())
