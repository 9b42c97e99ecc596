"""Folders only their owner can touch: port locks, detached-fleet state, the bind shim's cache.

Each folder graphdist keeps for itself is created with mode 0700 and, whether new or found,
checked before use: a real folder (not a symbolic link), owned by the user running graphdist,
and open to no one else (an existing folder of ours with wider permissions is narrowed to 0700).
Anything else — a folder another user created first at a predictable path, a link planted there —
raises :class:`StateError` with one line that names the path and what to do; graphdist never
shares such a folder or follows such a link.

The per-user runtime location is ``$XDG_RUNTIME_DIR/graphdist`` where the system provides a
runtime folder of the user's own (systemd-logind does), else ``<temp folder>/graphdist-<uid>``.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile

from graphdist._exceptions import StateError
from graphdist._validate import path_text

__all__ = ["owned_temp_dir", "private_dir", "runtime_dir", "sweep_stale_temp_dirs"]

#: The owned temporary folders: ``graphdist-KIND-<owner pid>-*`` (a fleet's logs, a fork
#: server's socket folder, a TLS cluster's credentials), swept once their owner is gone.
_STALE_DIR = re.compile(r"^graphdist-(?:fleet|forkserver|tls)-(\d+)-")


def private_dir(path: str, what: str = "graphdist's folder", *, create: bool = True) -> str:
    """Create ``path`` (and missing parents) with mode 0700 if needed, check that it is private
    to this user (see the module docstring) and return it; raises :class:`StateError`. With
    ``create=False`` a missing folder is left missing (nothing in it can be read)."""
    shown = path_text(path)
    try:
        if create:
            os.makedirs(path, mode=0o700, exist_ok=True)
        elif not os.path.lexists(path):
            return path
        info = os.lstat(path)
    except OSError as exc:
        raise StateError(
            f"Cannot create {what} {shown}: {exc.strerror or exc}; choose another location",
            path,
        ) from None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise StateError(
            f"{shown} ({what}) is a symbolic link or not a folder; graphdist does not follow it. "
            "Remove it if it is not yours, or choose another location",
            path,
        )
    if info.st_uid != os.getuid():
        raise StateError(
            f"{shown} ({what}) belongs to uid {info.st_uid}, not to you (uid {os.getuid()}); "
            "graphdist will not share it. Remove it if you can, or choose another location",
            path,
        )
    if stat.S_IMODE(info.st_mode) & 0o077:
        try:
            os.chmod(path, 0o700)
        except OSError as exc:
            raise StateError(
                f"Cannot make {what} {shown} private (mode 0700): {exc.strerror or exc}", path
            ) from None
    return path


def runtime_dir() -> str:
    """This user's private runtime folder for graphdist (see the module docstring)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base:
        try:
            info = os.stat(base)
        except OSError:
            info = None
        if info is not None and stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
            return private_dir(os.path.join(base, "graphdist"), "graphdist's runtime folder")
    return private_dir(
        os.path.join(tempfile.gettempdir(), f"graphdist-{os.getuid()}"),
        "graphdist's runtime folder",
    )


def owned_temp_dir(kind: str, what: str = "") -> str:
    """A new private temporary folder ``graphdist-KIND-<this pid>-[WHAT-]*`` (see the module
    doc), once the folders of owners that are gone are swept."""
    sweep_stale_temp_dirs()
    return tempfile.mkdtemp(prefix=f"graphdist-{kind}-{os.getpid()}-{what + '-' if what else ''}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_temp_dirs(root: str | None = None) -> list[str]:
    """Remove this user's ``graphdist-fleet-<pid>-*``, ``graphdist-forkserver-<pid>-*`` and
    ``graphdist-tls-<pid>-*`` folders in ``root`` (the temp folder) whose owner pid is no longer
    running; return them.

    Only real folders (not links) owned by this uid are touched: never another user's."""
    root = root or tempfile.gettempdir()
    removed: list[str] = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    uid = os.getuid()
    for name in names:
        match = _STALE_DIR.match(name)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
