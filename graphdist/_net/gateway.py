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
(it checks every 0.1 s) or on SIGTERM. The relay is one thread, asyncio's loop: coroutines
accept, handshake and dial, then readiness callbacks move each connection's bytes between its
two non-blocking sockets themselves (no asyncio transports); TLS is OpenSSL's (Python's
``ssl.SSLObject`` over memory buffers), no crypto of graphdist's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import ipaddress
import json
import os
import signal
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, cast

from graphdist._cluster import Cluster, Task
from graphdist._exceptions import (
    ClusterSpecError,
    CredentialsError,
    PortInUseError,
    from_wire,
)
from graphdist._net.loopback import bind_address_for
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
DIAL_S = 10.0
"""How long a relay waits for the far end (TCP and the TLS handshake)."""
HANDSHAKE_S = 10.0
"""How long a peer may take to finish its TLS handshake with an inbound route."""
OWNER_POLL_S = 0.1
"""How often a gateway checks that its owner still runs (it exits within this once not)."""
LOG_INTERVAL_S = 10.0
LOG_LINES = 20
"""At most this many refusal lines per interval: an outsider cannot fill the disk."""
CHUNK = 256 * 1024
"""What a relay reads from a socket at once (both ways)."""
HANDSHAKE_READ = 64 * 1024
"""What a handshake reads from its socket at once."""
ACCEPT_PAUSE_S = 1.0
"""How long a listener rests when accept() fails (out of descriptors or memory)."""
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
        self.tasks: set[asyncio.Future[None]] = set()
        # one thread: every relay reads into this, and what it cannot pass on at once is copied
        self.scratch = memoryview(bytearray(CHUNK))

    def bind(self) -> None:
        """Bind every listener; raises :class:`PortInUseError` naming the first taken one."""
        for route in self.routes:
            host, port = route.listen
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
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

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(self._exception)
        for route, sock in self.sockets:
            self._spawn(self._listen(route, sock))
        await asyncio.Event().wait()

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)  # the loop keeps only a weak reference
        task.add_done_callback(self.tasks.discard)

    async def _listen(self, route: Route, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, peer = await loop.sock_accept(sock)
            except (ConnectionAbortedError, InterruptedError):  # gone before it was accepted
                continue
            except OSError as exc:  # out of descriptors or memory: a pause, as asyncio's servers
                self.log.say(f"cannot accept on {route.listen[0]}:{route.listen[1]}: {_why(exc)}")
                await asyncio.sleep(ACCEPT_PAUSE_S)
                continue
            self._spawn(self._connection(route, conn, peer))

    async def _connection(self, route: Route, down: socket.socket, peer: object) -> None:
        """An accepted connection: the TLS handshake (inbound: its failure logged with the
        peer's address, bounded), the far end dialled, then the two relayed. Until then nothing
        is read from ``down`` but the handshake."""
        down.setblocking(False)
        _nodelay(down)
        inbio, outbio = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls: ssl.SSLObject | None = None
        if route.inbound:
            assert self.server_ctx is not None
            tls = self.server_ctx.wrap_bio(inbio, outbio, server_side=True)
            try:
                await asyncio.wait_for(_handshake(down, tls, inbio, outbio), HANDSHAKE_S)
            except (OSError, ssl.SSLError, asyncio.TimeoutError) as exc:
                address = peer[0] if isinstance(peer, tuple) and peer else "?"
                self.log.say(f"refused a connection from {address}: {_why(exc)}")
                _abort(down)  # a reset, at once, and no alert: nothing for a prober to read
                return
            except BaseException:
                _abort(down)
                raise
        try:
            up, joined = await asyncio.wait_for(self._dial(route, inbio, outbio, tls), DIAL_S)
        except (OSError, ssl.SSLError, asyncio.TimeoutError) as exc:
            if not route.inbound:
                self.log.say(f"{route.task} at {route.host}:{route.to[1]}: {_why(exc)}")
            _abort(down)  # a reset, at once: the caller sees the task unreachable
            return
        except BaseException:
            _abort(down)
            raise
        plain, secure = (up, down) if route.inbound else (down, up)
        _Relay(plain, secure, joined, inbio, outbio, self.scratch).start()

    async def _dial(
        self, route: Route, inbio: ssl.MemoryBIO, outbio: ssl.MemoryBIO, tls: ssl.SSLObject | None
    ) -> tuple[socket.socket, ssl.SSLObject]:
        """The far end of ``route``: plain to the alias (inbound: ``tls`` is the peer's side),
        or TLS to the task's host (outbound: handshaken here; its certificate must name it)."""
        up = await _connect(*route.to)
        try:
            if tls is None:
                name = route.host.strip("[]")
                tls = self.client_ctx.wrap_bio(inbio, outbio, server_hostname=name)
                await _handshake(up, tls, inbio, outbio)
        except BaseException:
            _abort(up)
            raise
        return up, tls

    def _exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, object]) -> None:
        """Anything unforeseen: one bounded line, never a traceback."""
        exc = context.get("exception")
        what = _why(exc) if isinstance(exc, BaseException) else str(context.get("message"))
        self.log.say(f"refused a connection: {what}")


async def _connect(host: str, port: int) -> socket.socket:
    """A TCP connection to ``host`` (an address, or a name: each of its addresses in turn)."""
    loop = asyncio.get_running_loop()
    try:
        literal = ipaddress.ip_address(host.partition("%")[0])
        kind = socket.AF_INET6 if literal.version == 6 else socket.AF_INET
        targets: list[tuple[int, tuple[Any, ...]]] = [(kind, (host, port))]
    except ValueError:  # a name: resolved off the loop's thread
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        targets = [(info[0], info[4]) for info in infos]
    error = OSError(errno.EHOSTUNREACH, f"{host} has no address")
    for family, address in targets:
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setblocking(False)
            _nodelay(sock)
            await loop.sock_connect(sock, address)
            return sock
        except OSError as exc:
            sock.close()
            error = exc
        except BaseException:
            sock.close()
            raise
    raise error


async def _handshake(
    sock: socket.socket, tls: ssl.SSLObject, inbio: ssl.MemoryBIO, outbio: ssl.MemoryBIO
) -> None:
    """The TLS handshake of ``tls`` over ``sock``; what the peer sends right after it (data
    already) stays in ``inbio`` for the relay."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            tls.do_handshake()
            done = True
        except ssl.SSLWantReadError:
            done = False
        if outbio.pending:
            await loop.sock_sendall(sock, outbio.read())
        if done:
            return
        data = await loop.sock_recv(sock, HANDSHAKE_READ)
        if not data:
            raise ConnectionResetError(errno.ECONNRESET, "the peer left during the handshake")
        inbio.write(data)


class _Relay:
    """One relayed connection: ``plain`` (to or from a loopback alias) and ``secure``, the TLS
    leg, whose TLS is ``tls`` (OpenSSL over the memory buffers ``inbio``/``outbio``). Both are
    non-blocking; each way is driven by the loop's readiness callbacks for its own sockets: a
    chunk read from one side is sent on to the other at once, and only what that cannot take
    yet is kept, no more read on that way until it is sent (flow control both ways). An end
    (EOF, or a TLS close) closes both, once what was read before it is sent; an error (a reset,
    a bad record, a TLS alert) resets both."""

    def __init__(
        self,
        plain: socket.socket,
        secure: socket.socket,
        tls: ssl.SSLObject,
        inbio: ssl.MemoryBIO,
        outbio: ssl.MemoryBIO,
        scratch: memoryview,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.plain, self.secure = plain, secure
        self.plain_fd, self.secure_fd = plain.fileno(), secure.fileno()
        self.tls, self.inbio, self.outbio = tls, inbio, outbio
        self.scratch = scratch
        self.to_plain: bytes | memoryview = b""  # decrypted, not yet taken by ``plain``
        self.to_secure: bytes | memoryview = b""  # encrypted, not yet taken by ``secure``
        self.ending = False
        # what each way waits for: (fd, _READ or _WRITE), or None; and what the loop was told
        self.inward_wait: tuple[int, int] | None = None
        self.outward_wait: tuple[int, int] | None = None
        self.waits: tuple[tuple[int, int] | None, tuple[int, int] | None] = (None, None)

    def start(self) -> None:
        self._run(inward=True, outward=True)

    def _on_inward(self) -> None:
        self._run(inward=True, outward=bool(self.to_secure))

    def _on_outward(self) -> None:
        self._run(inward=False, outward=True)

    def _run(self, *, inward: bool, outward: bool) -> None:
        """Move what can be moved now, then wait for what is missing, or end."""
        reset = done = False
        try:
            if inward:
                self.inward_wait = self._inward()
            if outward:
                self.outward_wait = self._outward()
            if self.ending:  # nothing more is read, what was is sent, then TLS's close
                self.inward_wait, self.outward_wait = self._inward(), self._outward()
                done = self.inward_wait is None and self.outward_wait is None
                if done:
                    self._close_tls()
        except OSError:  # ssl.SSLError too
            reset = done = True
        waits = (None, None) if done else (self.inward_wait, self.outward_wait)
        if waits != self.waits:  # most often the same as before: nothing to tell the loop
            self._wait(waits)
        if done:
            for sock in (self.plain, self.secure):
                if reset:
                    _abort(sock)
                else:
                    sock.close()

    def _inward(self) -> tuple[int, int] | None:
        """``secure`` -> ``plain``; what it waits for (None: nothing, it ended)."""
        scratch, short, budget = self.scratch, False, _ROUNDS
        while True:
            if self.to_plain:
                sent = _send(self.plain, self.to_plain)
                if sent < len(self.to_plain):
                    self.to_plain = self.to_plain[sent:]
                    return self.plain_fd, _WRITE
                self.to_plain = b""
            if self.ending:
                return None
            size = self._decrypt()
            if size:
                sent = _send(self.plain, scratch[:size])
                if sent < size:
                    self.to_plain = bytes(scratch[sent:size])
                    return self.plain_fd, _WRITE
                continue
            budget -= 1
            if short or self.ending or not budget:  # short: what there was is read
                break
            try:
                got = self.secure.recv_into(scratch)
            except (BlockingIOError, InterruptedError):
                break
            if not got:
                self.ending = True
                return None
            self.inbio.write(scratch[:got])
            short = got < len(scratch)
        return None if self.ending else (self.secure_fd, _READ)

    def _decrypt(self) -> int:
        """What ``tls`` can decrypt now, into the scratch buffer (its size at most)."""
        scratch, size = self.scratch, 0
        while size < len(scratch) and (self.inbio.pending or self.tls.pending()):
            try:
                # into a buffer, read() answers a count (typeshed says bytes)
                got = cast(int, self.tls.read(len(scratch) - size, scratch[size:]))
            except ssl.SSLWantReadError:  # the rest of a record is still on its way
                break
            except ssl.SSLZeroReturnError:  # the peer's TLS close
                self.ending = True
                break
            if not got:
                self.ending = True
                break
            size += got
        if self.outbio.pending:  # TLS's own answer to a record (a key update's)
            self.to_secure = b"".join((self.to_secure, self.outbio.read()))
        return size

    def _outward(self) -> tuple[int, int] | None:
        """``plain`` -> ``secure``; what it waits for (None: nothing, it ended)."""
        scratch, short, budget = self.scratch, False, _ROUNDS
        while True:
            if self.to_secure:
                sent = _send(self.secure, self.to_secure)
                if sent < len(self.to_secure):
                    self.to_secure = memoryview(self.to_secure)[sent:]
                    return self.secure_fd, _WRITE
                self.to_secure = b""
            budget -= 1
            if self.ending or short or not budget:
                break
            try:
                got = self.plain.recv_into(scratch)
            except (BlockingIOError, InterruptedError):
                break
            if not got:
                self.ending = True
                return None
            self.tls.write(scratch[:got])
            self.to_secure = self.outbio.read()
            short = got < len(scratch)
        return None if self.ending else (self.plain_fd, _READ)

    def _close_tls(self) -> None:
        """TLS's close (close_notify), sent if the socket takes it now; the peer's not awaited."""
        with contextlib.suppress(OSError, ValueError):
            self.tls.unwrap()
        if self.outbio.pending:
            with contextlib.suppress(OSError):
                self.secure.send(self.outbio.read())

    def _wait(self, waits: tuple[tuple[int, int] | None, tuple[int, int] | None]) -> None:
        """Have the loop call back for ``waits`` (each way's), and only those."""
        loop = self.loop
        old = {wait for wait in self.waits if wait is not None}
        new = {wait for wait in waits if wait is not None}
        for fd, event in old - new:
            if event == _READ:
                loop.remove_reader(fd)
            else:
                loop.remove_writer(fd)
        for fd, event in new - old:
            # secure readable or plain writable: the inward way's; the others the outward's
            inward = (fd == self.secure_fd) == (event == _READ)
            callback = self._on_inward if inward else self._on_outward
            if event == _READ:
                loop.add_reader(fd, callback)
            else:
                loop.add_writer(fd, callback)
        self.waits = waits


_READ, _WRITE = 1, 2
_ROUNDS = 16
"""At most this many chunks each way per wakeup of one relay: a fast one lets the others run."""


def _send(sock: socket.socket, data: bytes | memoryview) -> int:
    """What of ``data`` ``sock`` took now (0 where it takes nothing yet)."""
    try:
        return sock.send(data)
    except (BlockingIOError, InterruptedError):
        return 0


def _nodelay(sock: socket.socket) -> None:
    """No Nagle: with delayed ACKs it stalls a gRPC step ~40 ms."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _abort(sock: socket.socket) -> None:
    """Close ``sock`` with a reset (SO_LINGER 0), not a FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


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
