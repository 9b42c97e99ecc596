"""Loopback-only servers: the mechanism that keeps a local fleet unreachable from the network.

TensorFlow's gRPC server listens on every interface and has no authentication (its SECURITY.md
says it must not be reachable from untrusted networks). No TensorFlow option changes the bind
address, so graphdist loads a tiny shared library (``loopback.c`` beside this module) with
``LD_PRELOAD`` into the fork server that starts the fleet's servers; it rewrites a wildcard
``bind()`` to the task's loopback address. It needs no privileges, only a C compiler the first
time (the library is cached per user). Where it cannot be built, :func:`loopback_library` raises
:class:`LoopbackUnavailableError` rather than silently exposing the ports.

The same library accepts connections only from processes of the server's own user or root (see
the header of ``loopback.c``: the kernel's socket diagnostics name the owner of the client's
socket), and removes itself from ``LD_PRELOAD`` so programs a server starts do not inherit it
(``GRAPHDIST_SHIM_INHERIT=1`` keeps it: ``graphdist run`` tasks and Ray workers, which reach
their process through a shell). Each server's listening sockets are checked after it starts
(:mod:`graphdist._net.exposure`): the shim's effect is verified, not assumed.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from importlib import resources

from graphdist._exceptions import LoopbackUnavailableError
from graphdist._private import private_dir

__all__ = [
    "BIND_ADDR_ENV",
    "bind_address_for",
    "loopback_library",
    "shim_env",
]

BIND_ADDR_ENV = "GRAPHDIST_BIND_ADDR"
INHERIT_ENV = "GRAPHDIST_SHIM_INHERIT"
log = logging.getLogger("graphdist.fleet")
_lock = threading.Lock()


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "graphdist")


_validated: set[tuple[str, int, int, int]] = set()  # (path, inode, size, mtime) known to work
_PROBE = "import socket; s = socket.socket(); s.bind(('0.0.0.0', 0)); print(s.getsockname()[0])"


def _works(path: str) -> bool:
    """Whether the library at ``path`` really rewrites a wildcard bind to loopback: checked in a
    short child process (a truncated, empty or foreign file is skipped by the loader with only a
    warning, so its presence proves nothing)."""
    try:
        info = os.stat(path)
    except OSError:
        return False
    key = (path, info.st_ino, info.st_size, info.st_mtime_ns)
    if key in _validated:
        return True
    env = {"PATH": os.environ.get("PATH", ""), "LD_PRELOAD": path, BIND_ADDR_ENV: "127.0.0.1"}
    try:
        result = subprocess.run(
            [sys.executable, "-S", "-E", "-c", _PROBE],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    if result.returncode != 0 or result.stdout.strip() != "127.0.0.1":
        return False
    _validated.add(key)
    return True


_NEEDED = (
    "every server graphdist starts loads it, exposed ones included: on a host address it is what "
    "lets in only the cluster's members; nothing starts without it"
)


def _compiler() -> list[str]:
    """The C compiler's command: ``CC`` (split as a shell would: ``ccache gcc``) where set,
    else ``cc`` or ``gcc`` on ``PATH``; raises :class:`LoopbackUnavailableError` naming what
    is missing."""
    cc = os.environ.get("CC", "").strip()
    if cc:
        try:
            argv = shlex.split(cc)
        except ValueError:
            argv = []
        if not argv or shutil.which(argv[0]) is None:
            raise LoopbackUnavailableError(
                f"Cannot build graphdist's bind shim: CC={cc!r} names no program that can be run "
                f"here; point CC at a C compiler (CC=gcc), or unset it to use cc/gcc on PATH "
                f"({_NEEDED})"
            )
        return argv
    found = shutil.which("cc") or shutil.which("gcc")
    if found is None:
        raise LoopbackUnavailableError(
            "Cannot build graphdist's bind shim: no C compiler (cc/gcc on PATH, or CC); install "
            f"gcc, or set CC to one ({_NEEDED})"
        )
    return [found]


def _build(source: bytes, path: str) -> None:
    """Compile the shim to ``path`` atomically: into a temporary file in the same folder, then
    renamed over ``path``, so concurrent builders and interrupted ones never leave a partial
    library where others load it."""
    compiler = _compiler()
    folder = os.path.dirname(path)
    fd, tmp_so = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=folder)
    os.close(fd)
    tmp_c = tmp_so[: -len(".so")] + ".c"
    try:
        with open(tmp_c, "wb") as f:
            f.write(source)
        try:
            result = subprocess.run(
                [*compiler, "-shared", "-fPIC", "-O2", "-o", tmp_so, tmp_c, "-ldl"],
                capture_output=True,
                text=True,
                timeout=120,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise LoopbackUnavailableError(
                f"Cannot build graphdist's bind shim: running the C compiler {compiler[0]} "
                f"failed ({type(exc).__name__}: {exc}); point CC at a working C compiler "
                f"({_NEEDED})"
            ) from None
        if result.returncode != 0:
            raise LoopbackUnavailableError(
                f"Cannot build graphdist's bind shim: {compiler[0]} failed "
                f"({result.stderr.strip()[-300:]}); point CC at a working C compiler "
                f"({_NEEDED})"
            )
        os.chmod(tmp_so, 0o500)
        os.replace(tmp_so, path)
    finally:
        for leftover in (tmp_c, tmp_so):
            with contextlib.suppress(FileNotFoundError):
                os.remove(leftover)


def loopback_library() -> str:
    """Path of the compiled bind shim, built on first use and checked to work before it is
    used (rebuilt once if the cached copy does not); raises LoopbackUnavailableError."""
    source = resources.files("graphdist._net").joinpath("loopback.c").read_bytes()
    tag = hashlib.sha256(source + sys.platform.encode() + os.uname().machine.encode()).hexdigest()
    folder = private_dir(_cache_dir(), "graphdist's cache folder")
    path = os.path.join(folder, f"loopback-bind-{tag[:16]}.so")
    with _lock:
        if _works(path):
            return path
        if os.path.exists(path):
            log.warning("the cached bind shim %s does not work; building it again", path)
        _build(source, path)
        if not _works(path):
            raise LoopbackUnavailableError(
                f"graphdist's bind shim {path} was built but does not rewrite a wildcard bind "
                f"here: is LD_PRELOAD honoured (not a static or setuid Python)? ({_NEEDED})"
            )
    return path


def bind_address_for(host: str) -> str | None:
    """The loopback address a task on ``host`` should bind (``127.x.y.z``; ``::1`` for an IPv6
    loopback host), or ``None`` if ``host`` is not a loopback name (then the fleet must be told
    to expose it). ``localhost`` binds ``127.0.0.1``, which gRPC clients of it reach."""
    bare = host.strip("[]").lower()
    if bare == "localhost":
        return "127.0.0.1"
    if bare == "ip6-localhost":
        return "::1"
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        return None
    if ip.is_loopback:
        return str(ip)
    return None


def with_preload(library: str, existing: str | None) -> str:
    """``LD_PRELOAD`` with ``library`` first and the user's own entries (``existing``) kept."""
    kept = [entry for entry in (existing or "").replace(" ", ":").split(":") if entry]
    return ":".join([library, *[entry for entry in kept if entry != library]])


def shim_env(
    address: str, existing_preload: str | None = None, *, inherit: bool = False
) -> dict[str, str]:
    """The environment that makes a process's servers bind ``address`` instead of the wildcard
    (builds the shim on first use; raises :class:`LoopbackUnavailableError` where it cannot).

    ``existing_preload`` is the process's own ``LD_PRELOAD``, kept after the shim. The shim
    removes itself from ``LD_PRELOAD`` when it loads, so programs the process starts do not get
    it, unless ``inherit`` (``graphdist run``: a task wrapped in ``sh -c`` must keep its servers
    on loopback too)."""
    env = {"LD_PRELOAD": with_preload(loopback_library(), existing_preload), BIND_ADDR_ENV: address}
    if inherit:
        env[INHERIT_ENV] = "1"
    return env
