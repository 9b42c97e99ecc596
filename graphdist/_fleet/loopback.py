"""Loopback-only servers: the mechanism that keeps a local fleet unreachable from the network.

TensorFlow's gRPC server listens on every interface and has no authentication (its SECURITY.md
says it must not be reachable from untrusted networks). No TensorFlow option changes the bind
address, so graphdist loads a tiny shared library (``loopback.c`` beside this module) with
``LD_PRELOAD`` into the fork server that starts the fleet's servers; it rewrites a wildcard
``bind()`` to the task's loopback address. It needs no privileges, only a C compiler the first
time (the library is cached per user). Where it cannot be built, :func:`loopback_library` raises
:class:`LoopbackUnavailableError` rather than silently exposing the ports.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from importlib import resources

from graphdist._cluster import Task
from graphdist._exceptions import ClusterSpecError, LoopbackUnavailableError

__all__ = [
    "BIND_ADDR_ENV",
    "bind_address_for",
    "loopback_library",
    "server_bind_address",
    "shim_env",
]

BIND_ADDR_ENV = "GRAPHDIST_BIND_ADDR"
_lock = threading.Lock()


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "graphdist")


def loopback_library() -> str:
    """Path of the compiled bind shim, building it on first use; raises LoopbackUnavailableError."""
    source = resources.files("graphdist._fleet").joinpath("loopback.c").read_bytes()
    tag = hashlib.sha256(source + sys.platform.encode() + os.uname().machine.encode()).hexdigest()
    path = os.path.join(_cache_dir(), f"loopback-bind-{tag[:16]}.so")
    with _lock:
        if os.path.exists(path):
            return path
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            raise LoopbackUnavailableError(
                "Cannot keep the servers on loopback: no C compiler (cc/gcc) to build graphdist's "
                "bind shim. Install gcc, or pass expose=True (CLI: --expose) to accept servers "
                "that listen on every interface without authentication."
            )
        os.makedirs(_cache_dir(), exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "loopback.c")
            with open(src, "wb") as f:
                f.write(source)
            out = os.path.join(tmp, "loopback.so")
            result = subprocess.run(
                [compiler, "-shared", "-fPIC", "-O2", "-o", out, src, "-ldl"],
                capture_output=True,
                text=True,
            )
            if result.returncode != 0:
                raise LoopbackUnavailableError(
                    f"Cannot keep the servers on loopback: building the bind shim with {compiler} "
                    f"failed ({result.stderr.strip()[-300:]}). Pass expose=True (CLI: --expose) "
                    "to accept servers that listen on every interface."
                )
            shutil.move(out, path)  # atomic within the cache folder's file system is not needed
    return path


def bind_address_for(host: str) -> str | None:
    """The IPv4 loopback address a task on ``host`` should bind, or ``None`` if ``host`` is not a
    loopback name (then the fleet must be told to expose it)."""
    bare = host.strip("[]").lower()
    if bare in ("localhost", "::1", "ip6-localhost"):
        return "127.0.0.1"
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv4Address) and ip.is_loopback:
        return str(ip)
    return None


def server_bind_address(task: Task, *, expose: bool, allow_own_host: bool = False) -> str | None:
    """Where the server of ``task`` listens: the one place graphdist decides it.

    ``None`` with ``expose`` (TensorFlow's own default: every interface). Otherwise the loopback
    address of a loopback host (``localhost`` and ``[::1]`` → ``127.0.0.1``); with
    ``allow_own_host`` (a server on a real host, a Ray actor on its node) the IPv4 address the
    task's host resolves to; anything else raises :class:`ClusterSpecError` naming the task.
    """
    if expose:
        return None
    address = bind_address_for(task.host)
    if address is not None:
        return address
    if not allow_own_host:
        raise ClusterSpecError(
            f"Task {task.job}:{task.index} is on {task.host!r}, which is not a loopback "
            "address; servers stay on loopback unless you pass expose=True (CLI: --expose), "
            "which makes them reachable from the network without authentication",
            task.address,
        )
    host = task.host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, task.port, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ClusterSpecError(
            f"Host {host!r} of task {task.job}:{task.index} does not resolve to an IPv4 address "
            f"({exc.strerror}); use --bind-all to listen on every interface",
            task.address,
        ) from None
    return str(infos[0][4][0])


def shim_env(address: str) -> dict[str, str]:
    """The environment that makes a process's servers bind ``address`` instead of the wildcard
    (builds the shim on first use; raises :class:`LoopbackUnavailableError` where it cannot)."""
    return {"LD_PRELOAD": loopback_library(), BIND_ADDR_ENV: address}
