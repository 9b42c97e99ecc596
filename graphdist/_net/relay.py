"""TLS mode's relay: the listeners of a gateway process and the connections it relays.

One thread, asyncio's loop (or uvloop's): coroutines accept, handshake and dial, then readiness
callbacks move each connection's bytes between its two non-blocking sockets themselves (one
:class:`_Relay` per connection, no asyncio transports); TLS is OpenSSL's (Python's
``ssl.SSLObject`` over memory buffers). The process around it, its routes and its owner's side
are :mod:`graphdist._net.gateway`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import socket
import ssl
import struct
import sys
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, cast

from graphdist._exceptions import PortInUseError

__all__ = ["Gateway", "Route"]

DIAL_S = 10.0
"""How long a relay waits for the far end (TCP and the TLS handshake)."""
HANDSHAKE_S = 10.0
"""How long a peer may take to finish its TLS handshake with an inbound route."""
LOG_INTERVAL_S = 10.0
LOG_LINES = 20
"""At most this many refusal lines per interval: an outsider cannot fill the disk."""
CHUNK = 256 * 1024
"""What a relay reads from a socket at once (both ways)."""
HANDSHAKE_READ = 64 * 1024
"""What a handshake reads from its socket at once."""
ACCEPT_PAUSE_S = 1.0
"""How long a listener rests when accept() fails (out of descriptors or memory)."""


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
