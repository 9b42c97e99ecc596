"""Ready notices: a server process tells its fleet's owner the moment its server serves.

A start used to find its servers by probing them in rounds (:func:`graphdist._net.probe.
wait_answering`) while they were still being built: on a warm 16-server start (2 CPUs) every
server had started by 151 ms, the owner saw the last at 540 ms, since a probe of a started server
took 75-250 ms while 14 others were being built (2-5 ms after) and took CPU from those builds.

So each server process sends one datagram, ``"JOB-INDEX PID"``, to its owner's
:class:`ReadyNotices` socket right after ``tf.distribute.Server`` has started (:func:`notify`),
and the owner probes nothing until every silent server has said so, then all of them in one
round of GetStatus calls. A notice is a hint, never the proof: a server counts as ready only once
it answered that call, and the listening check that follows reads the kernel's sockets as
before. A lost notice (or a forged one: the socket lives in the owner's
private fork-server folder, mode 0700) costs at most a round of the fallback probes, which still
run every :data:`FALLBACK_ROUND_S` for the servers that sent nothing.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import uuid

__all__ = ["FALLBACK_ROUND_S", "READY_SOCKET_KEY", "ReadyNotices", "notify"]

FALLBACK_ROUND_S = 1.0
"""How often a start still probes, in a round, the servers that sent no notice."""
READY_SOCKET_KEY = "ready_socket"
"""The key of a server's spec that names its owner's notice socket (absent: no notice)."""
_MAX_PATH = 107  # sun_path is 108 bytes with its NUL


class ReadyNotices:
    """The owner's end: a datagram socket in ``folder`` that server processes send to."""

    def __init__(self, folder: str) -> None:
        path = os.path.join(folder, f"ready-{uuid.uuid4().hex[:8]}")
        if len(path.encode()) > _MAX_PATH:
            raise ValueError(f"socket path too long: {path}")
        self.path = path
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.bind(path)
            os.chmod(path, 0o600)
        except OSError:
            self.close()
            raise
        self._sock.setblocking(False)

    def wait(self, timeout_s: float) -> list[tuple[str, int]]:
        """The notices that came (``(name, pid)``: ``"local-1"``, its pid), waiting up to
        ``timeout_s`` seconds for the first; an unreadable one is dropped."""
        sock = self._sock
        if sock is None:
            return []
        if not select.select([sock], [], [], max(0.0, timeout_s))[0]:
            return []
        out: list[tuple[str, int]] = []
        while True:
            try:
                data = sock.recv(256)
            except OSError:  # none left (BlockingIOError), or the socket broke
                return out
            name, _, pid = data.decode(errors="replace").partition(" ")
            if pid.isdigit():
                out.append((name, int(pid)))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    def __del__(self) -> None:
        if getattr(self, "_sock", None) is None:
            return  # closed (a fleet closes its own), or never made (its path too long)
        try:  # noqa: SIM105 - contextlib may be None at interpreter exit
            self.close()
        except Exception:
            pass


def notify(path: str | None, name: str) -> bool:
    """In a server process: tell the owner at ``path`` that ``name`` (its task's name,
    ``"local-1"``) serves; whether the notice was sent. Never raises: the owner's fallback
    probes find the server anyway."""
    if not path:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(f"{name} {os.getpid()}".encode(), path)
    except OSError:
        return False
    return True
