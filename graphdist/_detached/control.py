"""The control channel of a detached fleet's supervisor.

The supervisor owns its servers (they are forked from its fork server), so only it can restart
one. It serves a Unix domain socket ``control.sock`` in the state folder, mode 0600 (only its
user can connect), from a background thread, one request at a time.

Protocol: one request per connection. The client sends one JSON object and a newline; the
supervisor answers with one JSON object and a newline, then closes the connection.

- ``{"op": "ping"}`` -> ``{"ok": true, "pid": SUPERVISOR_PID}``
- ``{"op": "kill", "job": J, "index": I, "sig": N}`` -> the supervisor sends signal ``N``
  (default SIGKILL) to that server, waits until it is gone (SIGKILL, SIGTERM), rewrites
  ``fleet.json`` and answers ``{"ok": true}``
- ``{"op": "restart", "job": J, "index": I}`` -> it restarts that server on the same address,
  waits until it answers, rewrites ``fleet.json`` and answers ``{"ok": true}``

A request that fails is answered ``{"ok": false, "error": E}``, ``E`` being the exception as
:func:`graphdist._exceptions.to_wire` gives it: the client raises the same class, with the same
attributes (:func:`~graphdist._exceptions.from_wire`). Paths longer than a socket address
allows are reached through ``/proc/self/fd/N/control.sock``, ``N`` being the state folder opened
as a directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from graphdist._detached.state import CONTROL_SOCKET
from graphdist._exceptions import FleetError, GraphdistError, from_wire, to_wire

__all__ = ["ControlServer", "request"]

log = logging.getLogger("graphdist.supervisor")

MAX_MESSAGE_BYTES = 1 << 16
CONNECT_TIMEOUT_S = 5.0
_POLL_S = 0.25
_SUN_PATH_MAX = 100  # sockaddr_un.sun_path is 108 bytes on Linux, with its NUL; keep a margin

Handler = Callable[[dict[str, Any]], dict[str, Any]]


@contextlib.contextmanager
def _socket_path(state_dir: str) -> Iterator[str]:
    """The address of ``control.sock`` in ``state_dir``, short enough for ``bind``/``connect``."""
    path = os.path.join(state_dir, CONTROL_SOCKET)
    if len(os.fsencode(path)) < _SUN_PATH_MAX:
        yield path
        return
    fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{CONTROL_SOCKET}"
    finally:
        os.close(fd)


def _encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message).encode("utf-8") + b"\n"


def _decode(data: bytes) -> dict[str, Any]:
    message = json.loads(data.decode("utf-8"))
    if not isinstance(message, dict):
        raise ValueError(f"expected a JSON object, not {type(message).__name__}")
    return message


class ControlServer:
    """Serves ``control.sock`` in ``state_dir`` from a daemon thread, passing each request to
    ``handler`` (which returns the reply, or raises: the reply then carries the error)."""

    def __init__(self, state_dir: str, handler: Handler) -> None:
        self.state_dir = state_dir
        self.path = os.path.join(state_dir, CONTROL_SOCKET)
        self._handler = handler
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> ControlServer:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)  # left by a supervisor that was killed
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with _socket_path(self.state_dir) as address:
                sock.bind(address)
            # Nobody can connect before listen(), so there is no window with a wider mode.
            os.chmod(self.path, 0o600)
            sock.listen(8)
            sock.settimeout(_POLL_S)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="graphdist-control", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop serving (waiting up to ``timeout_s`` for a request in progress) and remove the
        socket. Safe to repeat."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if not self._stop.is_set():
                    log.error("control: %s stopped serving (%s)", self.path, exc)
                return
            with conn:
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(CONNECT_TIMEOUT_S)
        try:
            data = b""
            while not data.endswith(b"\n") and len(data) < MAX_MESSAGE_BYTES:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
            req = _decode(data)
        except (OSError, ValueError) as exc:
            log.warning("control: unreadable request (%s)", exc)
            with contextlib.suppress(OSError):
                conn.sendall(_encode({"ok": False, "error": to_wire(exc)}))
            return
        try:
            reply = self._handler(req)
        except Exception as exc:
            if not isinstance(exc, GraphdistError | ValueError):
                log.exception("control: request %r failed", req)
            reply = {"ok": False, "error": to_wire(exc)}
        with contextlib.suppress(OSError):
            conn.sendall(_encode(reply))


def request(
    state_dir: str,
    message: dict[str, Any],
    timeout_s: float,
    alive: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """Send ``message`` to the supervisor of ``state_dir`` and return its ``ok`` reply.

    A failed request raises the error the supervisor raised, as the same class with the same
    attributes (a :class:`FleetError` naming it where it is not graphdist's: a bad request).
    Waits at most ``timeout_s``, and stops waiting as soon as ``alive()`` (the supervisor's
    liveness) turns false."""
    what = f"{message.get('op')!r} request"
    path = os.path.join(state_dir, CONTROL_SOCKET)
    deadline = time.monotonic() + timeout_s
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(min(CONNECT_TIMEOUT_S, timeout_s))
        try:
            with _socket_path(state_dir) as address:
                sock.connect(address)
            sock.sendall(_encode(message))
        except OSError as exc:
            raise FleetError(
                f"Cannot reach the supervisor of {state_dir} through {path} "
                f"({exc.strerror or exc}); is the fleet still running (`graphdist status`)?"
            ) from None
        data = b""
        while not data.endswith(b"\n"):
            if alive is not None and not alive():
                raise FleetError(f"The supervisor of {state_dir} exited during a {what}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise FleetError(
                    f"The supervisor of {state_dir} did not answer a {what} within "
                    f"{timeout_s:g} s (log: {os.path.join(state_dir, 'supervisor.log')})"
                )
            sock.settimeout(min(_POLL_S, left))
            try:
                chunk = sock.recv(4096)
            except TimeoutError:
                continue
            except OSError as exc:
                raise FleetError(f"The {what} to {path} failed: {exc}") from None
            if not chunk:
                break
            data += chunk
    try:
        reply = _decode(data)
    except ValueError:
        raise FleetError(f"The supervisor of {state_dir} gave no answer to a {what}") from None
    if reply.get("ok") is True:
        return reply
    error = from_wire(reply.get("error"))
    if type(error) is FleetError:  # not one of graphdist's own: say who refused what
        raise FleetError(f"The supervisor of {state_dir} refused a {what}: {error}")
    raise error
