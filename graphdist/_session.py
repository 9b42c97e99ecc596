"""Sessions that cannot hang: every config graphdist hands to TensorFlow has an operation timeout.

Without ``operation_timeout_in_ms`` a session whose peer died, whose master died, or whose peer is
frozen blocks forever, session creation included (TF_FACTS, "Faults"); ``RunOptions.timeout_in_ms``
does not cover creation. So graphdist fills in :data:`DEFAULT_OPERATION_TIMEOUT_MS` whenever a
config leaves the field at 0, and keeps any value the caller set.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import tensorflow as tf

__all__ = ["DEFAULT_OPERATION_TIMEOUT_MS", "session", "session_config"]

DEFAULT_OPERATION_TIMEOUT_MS = 30_000
"""Default bound, in milliseconds, on every blocking session operation (creation included)."""


def session_config(
    config: tf.compat.v1.ConfigProto | None = None,
    *,
    operation_timeout_ms: int | None = None,
) -> tf.compat.v1.ConfigProto:
    """A copy of ``config`` (or a new ``ConfigProto``) whose operation timeout is bounded.

    ``operation_timeout_ms`` wins when given; otherwise a timeout already set in ``config`` is
    kept, and an unset one (0) becomes :data:`DEFAULT_OPERATION_TIMEOUT_MS`. Raises
    ``ValueError`` for a timeout that is not a positive whole number of milliseconds.
    """
    import tensorflow as tf

    out = tf.compat.v1.ConfigProto()
    if config is not None:
        out.CopyFrom(config)
    if operation_timeout_ms is not None:
        if (
            not isinstance(operation_timeout_ms, int)
            or isinstance(operation_timeout_ms, bool)
            or operation_timeout_ms <= 0
        ):
            raise ValueError(
                f"operation_timeout_ms must be a whole number of milliseconds > 0, not "
                f"{operation_timeout_ms!r}"
            )
        out.operation_timeout_in_ms = operation_timeout_ms
    elif out.operation_timeout_in_ms <= 0:
        out.operation_timeout_in_ms = DEFAULT_OPERATION_TIMEOUT_MS
    return out


def session(
    target: str | None = None,
    graph: tf.Graph | None = None,
    config: tf.compat.v1.ConfigProto | None = None,
    *,
    operation_timeout_ms: int | None = None,
) -> Any:
    """A ``tf.compat.v1.Session`` on ``target`` (``grpc://host:port``; ``None`` or ``""`` for an
    in-process session) whose config carries a bounded operation timeout (see
    :func:`session_config`). Use it as a context manager to close it."""
    import tensorflow as tf

    return tf.compat.v1.Session(
        target or "",
        graph=graph,
        config=session_config(config, operation_timeout_ms=operation_timeout_ms),
    )
