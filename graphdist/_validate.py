"""Checks of argument values, one home each, used by the library and the CLI alike.

Every timeout graphdist accepts goes through :func:`timeout_s` or :func:`timeout_ms` where it is
accepted: ``None`` means "the default" and nothing else; a value must be a finite number > 0
(``0``, ``nan`` and ``inf`` would each mean "wait forever" somewhere below), and at most what the
waits below can take (``threading.TIMEOUT_MAX`` seconds, about 292 years; an int64 of
milliseconds, as TensorFlow's ``operation_timeout_in_ms``). Counts go through :func:`count`. Each
raises :class:`ArgumentError` (a ``ValueError``) naming the argument.
"""

from __future__ import annotations

import math
import os
import reprlib
import threading
from collections.abc import Mapping, Sequence
from typing import overload

from graphdist._exceptions import ArgumentError

__all__ = [
    "MAX_TIMEOUT_MS",
    "MAX_TIMEOUT_S",
    "check_argv",
    "check_env",
    "count",
    "flag",
    "is_ascii_digits",
    "show",
    "timeout_ms",
    "timeout_s",
]

MAX_TIMEOUT_S = threading.TIMEOUT_MAX
MAX_TIMEOUT_MS = 2**63 - 1

_short = reprlib.Repr()
_short.maxstring = _short.maxother = 80
_short.maxlist = _short.maxdict = _short.maxtuple = _short.maxset = 4
_short.maxlevel = 3


def show(value: object, width: int = 80) -> str:
    """``repr(value)`` cut to a readable length, for error messages (which are one line); a
    string of at most ``width`` characters (a file path, say) is shown whole."""
    if isinstance(value, str) and len(value) <= width:
        return repr(value)
    try:
        return _short.repr(value)
    except ValueError:  # an int of more digits than Python converts to text
        return f"<{type(value).__name__} too long to show>"


def path_text(path: str | os.PathLike[str]) -> str:
    """A path for a one-line message: as it is where every character prints, else its repr (a
    newline or a byte that is not UTF-8 would break the line)."""
    text = os.fspath(path)
    return text if text.isprintable() else repr(text)


def is_ascii_digits(text: str) -> bool:
    """True for a non-empty run of ``0``-``9`` (``str.isdigit`` also takes ``"٣"`` or ``"²"``)."""
    return text.isascii() and text.isdigit()


def ascii_int(text: str) -> int:
    """A whole number of ASCII digits, perhaps negative (``int()`` also takes ``"٣"``, ``" 3"``
    or ``"3_0"``); ValueError otherwise. Named ``int`` for argparse's "invalid int value"."""
    body = text[1:] if text.startswith("-") else text
    if not is_ascii_digits(body) or len(body) > 18:
        raise ValueError(text)
    return int(text)


ascii_int.__name__ = "int"


@overload
def timeout_s(value: float | None, name: str, default: float) -> float: ...
@overload
def timeout_s(value: float | None, name: str, default: None = None) -> float | None: ...
def timeout_s(value: float | None, name: str, default: float | None = None) -> float | None:
    """``value`` as float seconds, or ``default`` when ``value`` is ``None``."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ArgumentError(
            f"{name} must be a number of seconds, not {show(value)}", name=name, value=value
        )
    if not math.isfinite(value) or value <= 0:
        raise ArgumentError(
            f"{name} must be a finite number of seconds > 0, not {show(value)}",
            name=name,
            value=value,
        )
    if value > MAX_TIMEOUT_S:
        raise ArgumentError(
            f"{name} must be at most {MAX_TIMEOUT_S:g} seconds, not {show(value)}",
            name=name,
            value=value,
        )
    return float(value)


@overload
def timeout_ms(value: int | None, name: str, default: int) -> int: ...
@overload
def timeout_ms(value: int | None, name: str, default: None = None) -> int | None: ...
def timeout_ms(value: int | None, name: str, default: int | None = None) -> int | None:
    """``value`` as whole milliseconds (TensorFlow's ``operation_timeout_in_ms`` is an int64),
    or ``default`` when ``value`` is ``None``."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_TIMEOUT_MS:
        raise ArgumentError(
            f"{name} must be a whole number of milliseconds from 1 to {MAX_TIMEOUT_MS}, not "
            f"{show(value)}",
            name=name,
            value=value,
        )
    return value


def positive(value: float, name: str) -> float:
    """``value`` as a float if it is a finite number > 0 (a CPU share, a rate)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ArgumentError(f"{name} must be a number, not {show(value)}", name=name, value=value)
    if value <= 0:
        raise ArgumentError(f"{name} must be > 0, not {show(value)}", name=name, value=value)
    return float(value)


def count(value: int, name: str, minimum: int = 1, maximum: int | None = None) -> int:
    """``value`` if it is a whole number >= ``minimum`` (and <= ``maximum``, if given)."""
    if maximum is None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ArgumentError(
                f"{name} must be a whole number >= {minimum}, not {show(value)}",
                name=name,
                value=value,
            )
        return value
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ArgumentError(
            f"{name} must be a whole number from {minimum} to {maximum}, not {show(value)}",
            name=name,
            value=value,
        )
    return value


def flag(value: bool, name: str) -> bool:
    """``value`` if it is ``True`` or ``False``. A switch, security switches above all
    (``expose``), is never read by truthiness: ``"no"`` and ``"false"`` are true strings."""
    if not isinstance(value, bool):
        raise ArgumentError(
            f"{name} must be True or False, not {show(value)}", name=name, value=value
        )
    return value


def check_env(env: object) -> dict[str, str]:
    """``env`` (environment variables to add for a process) as a dict of str to str; ``None``
    is none. Names are non-empty str without ``=`` or NUL, values str without NUL."""
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise ArgumentError(
            f"env must be a mapping of variable names to str values, e.g. "
            f"{{'TF_CPP_MIN_LOG_LEVEL': '2'}}, not {show(env)}",
            name="env",
            value=env,
        )
    checked = {}
    for key, value in env.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise ArgumentError(
                f"env must have variable names (non-empty str without '=' or NUL) as keys, not "
                f"{show(key)}",
                name="env",
                value=env,
            )
        if not isinstance(value, str) or "\0" in value:
            raise ArgumentError(
                f"env[{key!r}] must be a str without NUL (an environment value), not {show(value)}",
                name="env",
                value=env,
            )
        checked[key] = value
    return checked


def check_argv(value: object, name: str) -> list[str]:
    """``value`` (a command line, or arguments to add to one) as a list of str: a sequence of
    str or ``os.PathLike``, never a str itself (whose letters would become the arguments), no
    NUL byte (a process cannot be given one)."""
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ArgumentError(
            f"{name} must be a list of arguments such as ['python', 'train.py'], not "
            f"{show(value)} (split a command line with shlex.split)",
            name=name,
            value=value,
        )
    argv = []
    for arg in value:
        text = os.fspath(arg) if isinstance(arg, os.PathLike) else arg
        if not isinstance(text, str) or "\0" in text:
            raise ArgumentError(
                f"Every argument of {name} must be a str without NUL bytes, not {show(arg)} "
                f"in {show(value)}",
                name=name,
                value=value,
            )
        argv.append(text)
    return argv
