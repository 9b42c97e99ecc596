"""Spec text within bounds (:mod:`graphdist._cluster` reads cluster specs with it, and
:mod:`graphdist._distribute.tfconfig` TF_CONFIG): text takes at most ``MAX_SPEC_BYTES`` (1 MiB) in
UTF-8, JSON nests at most ``MAX_JSON_DEPTH`` (32) levels and names no key twice in one object, a
file is a regular file of UTF-8 text read without blocking or reading without bound. Each breach
is one :class:`ClusterSpecError` (or the caller's subclass) naming what was read."""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable
from typing import Any

from graphdist._exceptions import ClusterSpecError
from graphdist._validate import show

__all__ = ["MAX_JSON_DEPTH", "MAX_SPEC_BYTES", "check_size", "load_json", "read_text_file"]

MAX_SPEC_BYTES = 1 << 20  # spec text, a cluster file, a TF_CONFIG
MAX_JSON_DEPTH = 32

_JSON_TOKEN_RE = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


def _json_depth(text: str) -> int:
    """How deep the arrays and objects of JSON ``text`` nest (brackets inside strings aside)."""
    depth = deepest = 0
    for match in _JSON_TOKEN_RE.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_JSON_DEPTH:
                break
        elif token in "]}":
            depth -= 1
    return deepest


def check_size(
    text: str, what: str, error: Callable[[str, object], ClusterSpecError] = ClusterSpecError
) -> None:
    """Raise ``error`` if ``text`` takes more than ``MAX_SPEC_BYTES`` in UTF-8, as in a file."""
    size = len(text)
    if MAX_SPEC_BYTES // 4 < size <= MAX_SPEC_BYTES:  # a character takes 1 to 4 bytes
        size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_SPEC_BYTES:
        raise error(
            f"The {what} takes more than {MAX_SPEC_BYTES} bytes (1 MiB) in UTF-8; at most "
            f"{MAX_SPEC_BYTES}",
            size,
        )


def load_json(
    text: str, what: str, error: Callable[[str, object], ClusterSpecError] = ClusterSpecError
) -> Any:
    """JSON ``text`` parsed within bounds: at most ``MAX_SPEC_BYTES`` in UTF-8, nested at most
    ``MAX_JSON_DEPTH`` deep, no key twice in one object, no ``NaN``/``Infinity``. Raises
    ``error`` (ClusterSpecError or a subclass) naming ``what`` otherwise."""
    check_size(text, what, error)
    depth = _json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise error(f"The {what} nests deeper than {MAX_JSON_DEPTH} levels", depth)

    def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise error(
                    f"The {what} names key {show(key)} twice in one object; give each key once",
                    key,
                )
            out[key] = value
        return out

    def no_constant(name: str) -> Any:
        raise error(f"The {what} holds {name}, which is not JSON", name)

    try:
        return json.loads(text, object_pairs_hook=unique_keys, parse_constant=no_constant)
    except json.JSONDecodeError as exc:
        raise error(
            f"The {what} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})",
            text,
        ) from None
    except ClusterSpecError:
        raise
    except (ValueError, RecursionError) as exc:  # a number of thousands of digits, say
        raise error(f"The {what} is not usable JSON: {show(str(exc))}", text) from None


def read_text_file(path: str, what: str) -> str:
    """The UTF-8 text of the regular file ``path`` (at most ``MAX_SPEC_BYTES``); raises
    ClusterSpecError naming the file for anything else (a folder, a device such as
    ``/dev/zero``, a FIFO, bytes that are not UTF-8), without blocking or reading without
    bound."""
    shown = show(path, 4096)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ClusterSpecError(f"Cannot read {what} {shown}: {reason}", path) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            raise ClusterSpecError(f"Cannot read {what} {shown}: it is {kind}", path)
        if info.st_size > MAX_SPEC_BYTES:
            raise ClusterSpecError(
                f"The {what} {shown} holds {info.st_size} bytes; at most {MAX_SPEC_BYTES} (1 MiB)",
                path,
            )
        chunks: list[bytes] = []
        left = MAX_SPEC_BYTES + 1
        while left > 0:  # a file that grows while it is read is still read within the bound
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        raise ClusterSpecError(f"Cannot read {what} {shown}: {exc.strerror or exc}", path) from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > MAX_SPEC_BYTES:
        raise ClusterSpecError(
            f"The {what} {shown} holds more than {MAX_SPEC_BYTES} bytes (1 MiB)", path
        )
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ClusterSpecError(
            f"The {what} {shown} is not UTF-8 text (byte {data[exc.start]:#04x} at offset "
            f"{exc.start})",
            path,
        ) from None
