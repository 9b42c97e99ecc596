"""Sessions that cannot hang: every config graphdist hands to TensorFlow has an operation timeout.

Without ``operation_timeout_in_ms`` a session whose peer died, whose master died, or whose peer is
frozen blocks forever, session creation included (TF_FACTS, "Faults"); ``RunOptions.timeout_in_ms``
does not cover creation. So graphdist fills in :data:`DEFAULT_OPERATION_TIMEOUT_MS` whenever a
config leaves the field at 0, and keeps any value the caller set.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

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


class RunGuard(Protocol):
    """What a fleet adds to its sessions (see :mod:`graphdist._fleet.guard`): runs that fail as
    soon as the fleet knows a task they need is gone, and closes that do not wait for it."""

    def run(self, sess: Any, call: Callable[[], Any]) -> Any: ...

    def diagnose(self, exc: BaseException, timeout_ms: int) -> Exception | None: ...

    def close_in_background(self, sess: Any) -> bool: ...


_session_class: Any = None


def _graphdist_session_class() -> Any:
    """``tf.compat.v1.Session`` plus error diagnosis; built once, on first use (imports TF)."""
    global _session_class
    if _session_class is None:
        import tensorflow as tf

        class GraphdistSession(tf.compat.v1.Session):  # type: ignore[misc]
            """A ``tf.compat.v1.Session`` whose failed runs name the task that caused them."""

            _graphdist_diagnose: Diagnose | None = None
            _graphdist_guard: RunGuard | None = None

            def _diagnosed(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
                try:
                    return call(*args, **kwargs)
                except tf.errors.OpError as exc:
                    guard = self._graphdist_guard
                    diagnose = guard.diagnose if guard is not None else self._graphdist_diagnose
                    if diagnose is None or type(exc).__name__ not in TASK_FAILURE_ERRORS:
                        raise
                    error = diagnose(exc, self._config.operation_timeout_in_ms)
                    if error is None:
                        raise
                    raise error from exc

            def _guarded(self, call: Callable[[], Any]) -> Any:
                guard = self._graphdist_guard
                return call() if guard is None else guard.run(self, call)

            def run(
                self,
                fetches: Any,
                feed_dict: Any = None,
                options: Any = None,
                run_metadata: Any = None,
            ) -> Any:
                parent = super().run
                return self._guarded(
                    lambda: self._diagnosed(parent, fetches, feed_dict, options, run_metadata)
                )

            def make_callable(
                self, fetches: Any, feed_list: Any = None, accept_options: bool = False
            ) -> Callable[..., Any]:
                inner = super().make_callable(fetches, feed_list, accept_options)

                def call(*args: Any, **kwargs: Any) -> Any:
                    return self._guarded(lambda: self._diagnosed(inner, *args, **kwargs))

                return call

            def close(self) -> None:
                # Closing asks every task to drop this session's state; a dead or frozen task
                # cannot answer (TensorFlow then waits out the operation timeout), and that must
                # neither mask the error that ended the session nor keep the caller waiting: a
                # fleet that knows a task is gone closes in the background.
                if not getattr(self, "_session", None) or getattr(self, "_closed", True):
                    return  # never opened, or closed already (TensorFlow's __del__ closes again)
                guard = self._graphdist_guard
                if guard is not None and guard.close_in_background(self):
                    if sys.is_finalizing():
                        # The interpreter is exiting: a thread started now never runs (and on
                        # Python 3.11 its start() waits for ever), and closing here could wait
                        # out the operation timeout on a task that is gone or frozen: skip it.
                        # A fleet's servers die with this process; a detached fleet's master
                        # may keep this session's state (a broken session's only).
                        self._closed = True
                        return
                    threading.Thread(
                        target=self._close_quietly, name="graphdist-close", daemon=True
                    ).start()
                    return
                self._close_quietly()

            def _close_quietly(self) -> None:
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
    guard: RunGuard | None = None,
) -> Any:
    """A ``tf.compat.v1.Session`` on ``target`` (``grpc://host:port``; ``None`` or ``""`` for an
    in-process session) whose config carries a bounded operation timeout (see
    :func:`session_config`). Use it as a context manager to close it.

    ``diagnose(error, timeout_ms)`` (used by fleets) may turn a task-failure error of ``run``
    into a graphdist error naming the task; it is raised with TensorFlow's error as its cause.
    ``guard`` (a fleet's) watches each run and close (see :class:`RunGuard`).
    """
    sess = _graphdist_session_class()(
        target or "",
        graph=graph,
        config=session_config(config, operation_timeout_ms=operation_timeout_ms),
    )
    sess._graphdist_diagnose = diagnose
    sess._graphdist_guard = guard
    return sess
