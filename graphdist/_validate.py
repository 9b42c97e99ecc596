"""Checks of argument values, one home each, used by the library and the CLI alike.

Every timeout graphdist accepts goes through :func:`timeout_s` or :func:`timeout_ms` where it is
accepted: ``None`` means "the default" and nothing else; a value must be a finite number > 0
(``0``, ``nan`` and ``inf`` would each mean "wait forever" somewhere below). Counts go through
:func:`count`. Each raises :class:`ArgumentError` (a ``ValueError``) naming the argument.
"""

from __future__ import annotations

import math
from typing import overload

from graphdist._exceptions import ArgumentError

__all__ = ["count", "timeout_ms", "timeout_s"]


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
            f"{name} must be a number of seconds, not {value!r}", name=name, value=value
        )
    if not math.isfinite(value) or value <= 0:
        raise ArgumentError(
            f"{name} must be a finite number of seconds > 0, not {value!r}", name=name, value=value
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
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ArgumentError(
            f"{name} must be a whole number of milliseconds > 0, not {value!r}",
            name=name,
            value=value,
        )
    return value


def count(value: int, name: str, minimum: int = 1) -> int:
    """``value`` if it is a whole number >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ArgumentError(
            f"{name} must be a whole number >= {minimum}, not {value!r}", name=name, value=value
        )
    return value
