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
import stat
import tempfile

from graphdist._exceptions import StateError
from graphdist._validate import path_text

__all__ = ["private_dir", "runtime_dir"]


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
