"""Sessions that cannot hang: every config graphdist hands to TensorFlow has an operation timeout.

Without ``operation_timeout_in_ms`` a session whose peer died, whose master died, or whose peer is
frozen blocks forever, session creation included (TF_FACTS, "Faults"); ``RunOptions.timeout_in_ms``
does not cover creation. So graphdist fills in :data:`DEFAULT_OPERATION_TIMEOUT_MS` whenever a
config leaves the field at 0, and keeps any value the caller set.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from graphdist._validate import timeout_ms

if TYPE_CHECKING:
    import tensorflow as tf

__all__ = ["DEFAULT_OPERATION_TIMEOUT_MS", "session", "session_config"]

log = logging.getLogger("graphdist.session")

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
    :class:`ArgumentError` (a ``ValueError``) for a timeout that is not a positive whole number of
    milliseconds.
    """
    import tensorflow as tf

    out = tf.compat.v1.ConfigProto()
    if config is not None:
        out.CopyFrom(config)
    operation_timeout_ms = timeout_ms(operation_timeout_ms, "operation_timeout_ms")
    if operation_timeout_ms is not None:
        out.operation_timeout_in_ms = operation_timeout_ms
    elif out.operation_timeout_in_ms <= 0:
        out.operation_timeout_in_ms = DEFAULT_OPERATION_TIMEOUT_MS
    return out


TASK_FAILURE_ERRORS = frozenset(
    {"UnavailableError", "DeadlineExceededError", "AbortedError", "CancelledError"}
)
"""TensorFlow errors that a dead, restarted or frozen task causes."""

Diagnose = Callable[[BaseException, int], Exception | None]
_session_class: Any = None


def _graphdist_session_class() -> Any:
    """``tf.compat.v1.Session`` plus error diagnosis; built once, on first use (imports TF)."""
    global _session_class
    if _session_class is None:
        import tensorflow as tf

        class GraphdistSession(tf.compat.v1.Session):  # type: ignore[misc]
            """A ``tf.compat.v1.Session`` whose failed runs name the task that caused them."""

            _graphdist_diagnose: Diagnose | None = None

            def run(
                self,
                fetches: Any,
                feed_dict: Any = None,
                options: Any = None,
                run_metadata: Any = None,
            ) -> Any:
                try:
                    return super().run(fetches, feed_dict, options, run_metadata)
                except tf.errors.OpError as exc:
                    diagnose = self._graphdist_diagnose
                    if diagnose is None or type(exc).__name__ not in TASK_FAILURE_ERRORS:
                        raise
                    error = diagnose(exc, self._config.operation_timeout_in_ms)
                    if error is None:
                        raise
                    raise error from exc

            def close(self) -> None:
                # Closing asks every task to drop this session's state; a dead or frozen task
                # cannot answer, and that must not mask the error that ended the session. The
                # master frees its own side regardless.
                try:
                    super().close()
                except tf.errors.OpError as exc:
                    if type(exc).__name__ not in TASK_FAILURE_ERRORS:
                        raise
                    log.info("session close: a task did not answer (%s); ignored", exc.message)

        _session_class = GraphdistSession
    return _session_class


def session(
    target: str | None = None,
    graph: tf.Graph | None = None,
    config: tf.compat.v1.ConfigProto | None = None,
    *,
    operation_timeout_ms: int | None = None,
    diagnose: Diagnose | None = None,
) -> Any:
    """A ``tf.compat.v1.Session`` on ``target`` (``grpc://host:port``; ``None`` or ``""`` for an
    in-process session) whose config carries a bounded operation timeout (see
    :func:`session_config`). Use it as a context manager to close it.

    ``diagnose(error, timeout_ms)`` (used by fleets) may turn a task-failure error of ``run``
    into a graphdist error naming the task; it is raised with TensorFlow's error as its cause.
    """
    sess = _graphdist_session_class()(
        target or "",
        graph=graph,
        config=session_config(config, operation_timeout_ms=operation_timeout_ms),
    )
    sess._graphdist_diagnose = diagnose
    return sess
