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
(it checks every 0.1 s) or on SIGTERM. The relay is asyncio's: one thread, TLS through OpenSSL
(Python's ``ssl``), no crypto of graphdist's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import hashlib
import ipaddress
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

from graphdist._cluster import Cluster, Task
from graphdist._exceptions import (
    ArgumentError,
    ClusterSpecError,
    CredentialsError,
    PortInUseError,
    from_wire,
)

__all__ = [
    "Gateway",
    "Route",
    "alias",
    "is_here",
    "routes",
    "start_gateway",
    "stop_gateway",
    "tls_cluster",
    "tls_flag",
    "tls_refusal",
]

READY_S = 15.0
"""How long a gateway may take to bind its listeners (a Python start, no TensorFlow)."""
DIAL_S = 10.0
"""How long a relay waits for the far end (TCP and the TLS handshake)."""
HANDSHAKE_S = 10.0
"""How long a peer may take to finish its TLS handshake with an inbound route."""
OWNER_POLL_S = 0.1
"""How often a gateway checks that its owner still runs (it exits within this once not)."""
LOG_INTERVAL_S = 10.0
LOG_LINES = 20
"""At most this many refusal lines per interval: an outsider cannot fill the disk."""
_ALIAS_FIRST = 128  # aliases lie in 127.128.0.0/9, away from 127.0.0.1 and its neighbours


def tls_flag(tls: bool, *, expose: bool = False, allow: object = None) -> bool:
    """``tls`` checked as a security switch (never read by truthiness), and refused with
    ``expose`` or ``allow``: in TLS mode no server listens on a host address, and the gateways
    admit by certificate, not by address (:class:`ArgumentError` naming the one given)."""
    from graphdist._validate import flag

    if flag(tls, "tls") and (allow or expose):
        name = "allow" if allow else "expose"
        raise ArgumentError(
            f"{name} does nothing with tls=True: no server listens on a host address, and the "
            "gateways admit by certificate, not by address; drop it",
            name=name,
            value=allow if allow else expose,
        )
    return tls


def alias(host: str) -> str:
    """The loopback alias of ``host`` (as the cluster spells it, case aside): 127.128.0.0/9."""
    digest = hashlib.sha256(host.strip("[]").lower().encode()).digest()
    return f"127.{_ALIAS_FIRST + digest[0] % 127}.{digest[1]}.{digest[2]}"


def _loopback(host: str) -> bool:
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def tls_cluster(cluster: Cluster) -> Cluster:
    """``cluster`` as TensorFlow sees it in TLS mode: each task on a host address at its host's
    alias and its own port (tasks on loopback unchanged). Raises :class:`ClusterSpecError` if
    two hosts of the cluster share an alias (one chance in ~8 million per pair)."""
    seen: dict[str, str] = {}
    jobs: dict[str, list[str]] = {}
    for task in cluster:
        host = task.host
        if not _loopback(host):
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
    if _loopback(host):
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


@dataclass(frozen=True)
class Route:
    """One listener of a gateway: ``inbound`` (TLS in on the task's real address, plain out to
    its alias) or outbound (plain in on the alias, TLS out to the task's real address, whose
    certificate must name ``host``)."""

    task: str
    host: str
    listen: tuple[str, int]
    to: tuple[str, int]
    inbound: bool


def routes(cluster: Cluster, serving: Iterable[Task] = ()) -> list[Route]:
    """The routes of a gateway on this machine for ``cluster`` (real addresses): inbound for
    each task in ``serving``, outbound for each task whose host is not this machine."""
    own = {(t.job, t.index) for t in serving}
    here: dict[str, bool] = {}
    found = []
    for task in cluster:
        if _loopback(task.host):
            continue
        name = f"/job:{task.job}/task:{task.index}"
        mapped = (alias(task.host), task.port)
        real = (task.host.strip("[]"), task.port)
        if (task.job, task.index) in own:
            found.append(Route(name, task.host, real, mapped, inbound=True))
        elif not here.setdefault(task.host, is_here(task.host)):
            found.append(Route(name, task.host, mapped, real, inbound=False))
    return found


class _Limiter:
    """At most LOG_LINES lines per LOG_INTERVAL_S; the rest counted and said once."""

    def __init__(self) -> None:
        self.window = 0.0
        self.lines = 0
        self.unsaid = 0

    def say(self, line: str) -> None:
        now = time.monotonic()
        if now - self.window >= LOG_INTERVAL_S:
            if self.unsaid:
                print(
                    f"graphdist gateway: {self.unsaid} more refusal(s) not logged",
                    flush=True,
                    file=sys.stderr,
                )
            self.window, self.lines, self.unsaid = now, 0, 0
        if self.lines >= LOG_LINES:
            self.unsaid += 1
            return
        self.lines += 1
        print(f"graphdist gateway: {line}", file=sys.stderr, flush=True)


class Gateway:
    """The relay (in the gateway's own process): listeners bound by :meth:`bind`, served by
    :meth:`serve` until the process ends."""

    def __init__(self, routes_: Sequence[Route], credentials: str) -> None:
        from graphdist._net.tlscerts import client_context, load_credentials, server_context

        creds = load_credentials(credentials)
        self.routes = list(routes_)
        self.server_ctx = server_context(creds) if any(r.inbound for r in self.routes) else None
        self.client_ctx = client_context(creds)
        self.sockets: list[tuple[Route, socket.socket]] = []
        self.log = _Limiter()

    def bind(self) -> None:
        """Bind every listener; raises :class:`PortInUseError` naming the first taken one."""
        for route in self.routes:
            host, port = route.listen
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are
            # TCP; without it Nagle and delayed ACKs stall a gRPC step ~40 ms
            sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if not route.inbound:  # shared with the other gateways of this user on this host
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            try:
                sock.bind((host, port))
                sock.listen(128)
            except OSError as exc:
                sock.close()
                what = "taken" if exc.errno == errno.EADDRINUSE else exc.strerror
                raise PortInUseError(
                    f"The TLS gateway cannot listen on {host}:{port} for {route.task} ({what})",
                    port=port,
                    task=route.task,
                    address=f"{host}:{port}",
                ) from None
            sock.setblocking(False)
            self.sockets.append((route, sock))

    async def _relay(self, route: Route, down: _Pipe) -> None:
        """Dial the far end of ``route`` for the accepted connection ``down`` (its reading
        paused until then) and join the two."""
        loop = asyncio.get_running_loop()
        up = _Pipe()
        try:
            await asyncio.wait_for(
                loop.create_connection(
                    lambda: up,
                    *route.to,
                    ssl=None if route.inbound else self.client_ctx,
                    server_hostname=None if route.inbound else route.host.strip("[]"),
                ),
                DIAL_S,
            )
        except (OSError, ssl.SSLError, asyncio.TimeoutError) as exc:
            if not route.inbound:
                self.log.say(f"{route.task} at {route.host}:{route.to[1]}: {_why(exc)}")
            down.abort()  # a reset, at once: the caller sees the task unreachable
            return
        down.join(up)

    async def _upgrade(self, route: Route, down: _Pipe, transport: asyncio.BaseTransport) -> None:
        """An inbound connection: the TLS handshake (its failure logged with the peer's
        address, bounded), then the relay."""
        loop = asyncio.get_running_loop()
        peer = transport.get_extra_info("peername")
        assert self.server_ctx is not None
        # what arrives between the handshake and connection_made(tls) is kept, not paused on
        # the raw transport (which would never be resumed)
        down.transport = None
        try:
            tls = await loop.start_tls(
                transport,
                down,
                self.server_ctx,
                server_side=True,
                ssl_handshake_timeout=HANDSHAKE_S,
            )
        except (OSError, ssl.SSLError, asyncio.TimeoutError, ConnectionError) as exc:
            self.log.say(f"refused a connection from {peer[0] if peer else '?'}: {_why(exc)}")
            transport.abort()  # type: ignore[attr-defined]
            return
        if tls is None:  # the peer left during the handshake
            return
        down.connection_made(tls)  # start_tls does not call it
        await self._relay(route, down)

    def _accepted(self, route: Route) -> _Pipe:
        """The protocol of a connection accepted on ``route``'s listener: reading paused until
        the TLS handshake (inbound) and the far end's connection are done."""
        down = _Pipe()

        def made(transport: asyncio.BaseTransport) -> None:
            down.transport = transport  # type: ignore[assignment]
            transport.pause_reading()  # type: ignore[attr-defined]
            if route.inbound:
                down.task = asyncio.ensure_future(self._upgrade(route, down, transport))
            else:
                down.task = asyncio.ensure_future(self._relay(route, down))

        down.on_made = made
        return down

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(self._exception)
        servers = [
            await loop.create_server(functools.partial(self._accepted, route), sock=sock)
            for route, sock in self.sockets
        ]
        del servers
        await asyncio.Event().wait()

    def _exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, object]) -> None:
        """A failed handshake (no certificate, another CA's, not TLS at all): one bounded line,
        never a traceback."""
        exc = context.get("exception")
        peer = ""
        transport = context.get("transport")
        if transport is not None:
            with contextlib.suppress(Exception):
                info = transport.get_extra_info("peername")  # type: ignore[attr-defined]
                peer = f" from {info[0]}" if info else ""
        what = _why(exc) if isinstance(exc, BaseException) else str(context.get("message"))
        self.log.say(f"refused a connection{peer}: {what}")


class _Pipe(asyncio.Protocol):
    """One end of a relay: what it receives goes to its peer's transport, with flow control
    both ways (a peer that cannot take more pauses this end's reading); either end closing
    closes the other. Until :meth:`join`, its reading is paused."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Pipe | None = None
        self.task: asyncio.Future[None] | None = None
        self.on_made: Callable[[asyncio.BaseTransport], None] | None = None
        self.closed = False
        self.early: list[bytes] = []  # received before the far end was connected

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self.on_made is not None:
            made, self.on_made = self.on_made, None
            made(transport)

    def join(self, up: _Pipe) -> None:
        self.peer, up.peer = up, self
        for one, other in ((self, up), (up, self)):
            if other.transport is not None:
                for data in one.early:
                    other.transport.write(data)
            one.early = []
        if self.closed or up.closed:  # one side left while the other was being connected
            self.close()
            up.close()
            return
        for one in (self, up):
            if one.transport is not None:
                one.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.write(data)
        else:  # a TLS transport reads from its start: kept, and no more read until joined
            self.early.append(data)
            if self.transport is not None:
                self.transport.pause_reading()

    def eof_received(self) -> bool:
        if self.peer is not None:
            self.peer.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.peer is not None:
            if exc is None:
                self.peer.close()
            else:
                self.peer.abort()

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


def _why(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return f"TLS: {exc.reason or str(exc) or 'the peer ended the handshake'}"
    if isinstance(exc, asyncio.TimeoutError):
        return "no answer in time"
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return type(exc).__name__


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
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    asyncio.run(gateway.serve())
    return 0


def start_gateway(
    route_list: Sequence[Route], credentials: str, *, log_path: str | None = None
) -> subprocess.Popen[bytes]:
    """Start a gateway process for ``route_list`` with the credentials folder ``credentials``
    (checked first: :class:`CredentialsError`); returns once every listener is bound. Its
    inbound routes let in every machine, at the TLS handshake; its loopback ones only this
    user. Raises :class:`PortInUseError`, :class:`CredentialsError`. The caller stops it
    (SIGTERM); it also ends within 0.1 s of the caller's process."""
    from graphdist._net.loopback import shim_env
    from graphdist._net.members import ALLOW_ENV, DIAL_ENV
    from graphdist._net.tlscerts import load_credentials

    load_credentials(credentials)
    env = {k: v for k, v in os.environ.items() if k not in (ALLOW_ENV, DIAL_ENV)}
    env.update(shim_env("127.0.0.1", os.environ.get("LD_PRELOAD")))
    if any(r.inbound for r in route_list):
        env[ALLOW_ENV] = "*"
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
    line = _read_line(proc, READY_S)
    if line == "ready":
        return proc
    with contextlib.suppress(OSError):
        proc.kill()
    proc.wait()
    if line.startswith("error: "):
        with contextlib.suppress(ValueError):
            raise from_wire(json.loads(line[len("error: ") :]))
    raise CredentialsError(f"The TLS gateway did not start ({line or 'no answer'})")


def _read_line(proc: subprocess.Popen[bytes], wait_s: float) -> str:
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
    with contextlib.suppress(OSError):
        proc.terminate()
    try:
        proc.wait(5.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


if __name__ == "__main__":
    sys.exit(_main())
