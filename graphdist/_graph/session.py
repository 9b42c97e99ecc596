"""Sessions that cannot hang: every config graphdist hands to TensorFlow has an operation timeout.

Without ``operation_timeout_in_ms`` a session whose peer died, whose master died, or whose peer is
frozen blocks forever, session creation included (TF_FACTS, "Faults"); ``RunOptions.timeout_in_ms``
does not cover creation. So graphdist fills in :data:`DEFAULT_OPERATION_TIMEOUT_MS` whenever a
config leaves the field at 0, and keeps any value the caller set.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from graphdist._exceptions import ArgumentError, PlacementError
from graphdist._validate import show, timeout_ms

if TYPE_CHECKING:
    import tensorflow as tf

__all__ = ["DEFAULT_OPERATION_TIMEOUT_MS", "eager_error", "session", "session_config"]

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

EAGER_FIX = "call tf.compat.v1.disable_eager_execution() right after importing TensorFlow"
# What TensorFlow says when a session is given what eager execution made: a session on the
# (empty) default graph, a fetch that is an eager tensor.
_EAGER_SYMPTOMS = ("The Session graph is empty", "when eager execution is enabled")


def eager_error(exc: BaseException) -> PlacementError | None:
    """The one-line error to raise instead of TensorFlow's ``exc`` from a session's run when it
    comes of eager execution, on by default (TensorFlow ran each op at once in this process:
    a fleet's device is an "unknown device" there, and the session's graph holds none of them);
    ``None`` for any other error."""
    if not any(symptom in str(exc) for symptom in _EAGER_SYMPTOMS):
        return None
    from tensorflow.python.eager import context

    if context.default_execution_mode != context.EAGER_MODE:
        return None
    return PlacementError(
        "Eager execution is on: TensorFlow ran each op at once in this process, not in this "
        f"session's graph; {EAGER_FIX}"
    )


class RunGuard(Protocol):
    """What a fleet adds to its sessions (see :mod:`graphdist._fleet.guard`): runs that fail as
    soon as the fleet knows a task they need is gone, and closes that do not wait for it
    (``abandon_on_close``: whether closing must skip the RPC that a gone task cannot answer)."""

    def run(self, sess: Any, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any: ...

    def diagnose(self, exc: BaseException, timeout_ms: int) -> Exception | None: ...

    def abandon_on_close(self, sess: Any) -> bool: ...


_session_class: Any = None


def _graphdist_session_class() -> Any:
    """``tf.compat.v1.Session`` plus error diagnosis; built once, on first use (imports TF).

    It owns the native session's end. TensorFlow's ``BaseSession.__del__`` calls ``close()``
    and then, unconditionally, ``TF_DeleteSession``; a close that went on in another thread
    used the freed native session (SIGSEGV in gRPC, "Mutex corrupt": TF_FACTS, "Long-lived
    processes"). So ``close()`` finishes in the caller's thread, always: a session whose fleet
    knows a task is gone is abandoned without an RPC, any other is closed. The one close made
    from another thread is the guard's cancel of a running step, and that thread holds the
    session until the close returns (``__del__`` cannot run meanwhile).
    """
    global _session_class
    if _session_class is None:
        import tensorflow as tf

        base_run = tf.compat.v1.Session.run
        base_make_callable = tf.compat.v1.Session.make_callable

        class GraphdistSession(tf.compat.v1.Session):  # type: ignore[misc]
            """A ``tf.compat.v1.Session`` whose failed runs name the task that caused them."""

            _graphdist_diagnose: Diagnose | None = None
            _graphdist_guard: RunGuard | None = None

            def _diagnosed(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
                try:
                    return call(*args, **kwargs)
                except tf.errors.OpError as exc:
                    diagnose = self._graphdist_diagnose
                    if diagnose is None or type(exc).__name__ not in TASK_FAILURE_ERRORS:
                        raise
                    error = diagnose(exc, self._config.operation_timeout_in_ms)
                    if error is None:
                        raise
                    raise error from exc

            def run(
                self,
                fetches: Any,
                feed_dict: Any = None,
                options: Any = None,
                run_metadata: Any = None,
            ) -> Any:
                guard = self._graphdist_guard
                try:
                    if guard is None:
                        return self._diagnosed(
                            base_run, self, fetches, feed_dict, options, run_metadata
                        )
                    return guard.run(
                        self, base_run, self, fetches, feed_dict, options, run_metadata
                    )
                except (RuntimeError, AttributeError) as exc:
                    eager = eager_error(exc)
                    if eager is None:
                        raise
                    raise eager from exc

            def make_callable(
                self, fetches: Any, feed_list: Any = None, accept_options: bool = False
            ) -> Callable[..., Any]:
                guard = self._graphdist_guard
                args = (self, fetches, feed_list, accept_options)
                if guard is None:
                    inner = self._diagnosed(base_make_callable, *args)

                    def diagnosed(*args: Any, **kwargs: Any) -> Any:
                        return self._diagnosed(inner, *args, **kwargs)

                    return diagnosed
                # Making one talks to the master (it extends the graph there): guarded too.
                inner = guard.run(self, base_make_callable, *args)
                if feed_list is not None:
                    return inner  # type: ignore[no-any-return]  # calls self.run: guarded

                def guarded(*args: Any, **kwargs: Any) -> Any:
                    return guard.run(self, inner, *args, **kwargs)

                return guarded

            def close(self) -> None:
                # Closing asks the master to drop this session's state, and the master asks
                # every task; one that is dead or frozen cannot answer, and TensorFlow retries
                # until the operation timeout (ten minutes for a fleet's session). So a session
                # whose task is gone is abandoned instead: marked closed, no RPC; its native
                # session is freed by __del__, which costs nothing without a close (TF_FACTS,
                # "Long-lived processes"). Nothing goes on in another thread, so nothing can
                # race with TensorFlow's __del__ (which deletes the native session right after
                # close()) and crash the process.
                if not getattr(self, "_session", None) or getattr(self, "_closed", True):
                    return  # never opened, or closed already (TensorFlow's __del__ closes again)
                guard = self._graphdist_guard
                if guard is not None:
                    try:
                        abandon = guard.abandon_on_close(self)
                    except Exception:  # a half-torn-down fleet: do not wait on it
                        abandon = True
                    if abandon or sys.is_finalizing():
                        # At exit a close could wait out the operation timeout, and a fleet's
                        # servers die with this process anyway.
                        self._closed = True
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


_SCHEMES = ("grpc://", "grpc+verbs://", "local://")


def _check_target(target: str | None) -> str:
    """``target`` as TensorFlow takes it; raises :class:`ArgumentError` for one it would refuse
    in its own words ("No session factory registered for the given session options"), most
    often a task's address without ``grpc://``."""
    if target is None or target == "":
        return ""
    if not isinstance(target, str):
        raise ArgumentError(
            f"session target must be a string such as 'grpc://localhost:2222', not {show(target)}",
            name="target",
            value=target,
        )
    if not target.startswith(_SCHEMES):
        raise ArgumentError(
            f"session target {show(target)} names no protocol: TensorFlow takes "
            f"'grpc://{target.split('://')[-1]}' (a task's address after grpc://), or None for "
            "an in-process session",
            name="target",
            value=target,
        )
    return target


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
    ``guard`` (a fleet's) watches each run and close (see :class:`RunGuard`). A target without
    ``grpc://`` raises :class:`ArgumentError` (TensorFlow's own words for it name no cause).
    """
    sess = _graphdist_session_class()(
        _check_target(target),
        graph=graph,
        config=session_config(config, operation_timeout_ms=operation_timeout_ms),
    )
    sess._graphdist_diagnose = diagnose
    sess._graphdist_guard = guard
    return sess
