"""Ask a TensorFlow server over gRPC whether it is really serving, without importing TensorFlow.

An open port is not enough (gRPC may be listening while the server is still being built), so
readiness and health are checked with a real call: ``WorkerService/GetStatus`` with an empty
request, which every TensorFlow gRPC server answers with the devices it owns. Raw bytes travel
both ways, so only ``grpcio`` (a TensorFlow dependency, 0.1 s to import) is needed.
"""

from __future__ import annotations

import contextlib
import os
import select
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["PROBE_TIMEOUT_S", "Prober", "Readiness", "wait_serving"]

PROBE_TIMEOUT_S = 1.0
_GET_STATUS = "/tensorflow.WorkerService/GetStatus"
# Short reconnect back-off, so a server that starts a moment after a failed probe is seen at once
# instead of after gRPC's default 1 s back-off.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 200),
    ("grpc.enable_retries", 0),
]


class Prober:
    """One gRPC channel to one server's address; :meth:`probe` returns whether it answered."""

    def __init__(self, address: str) -> None:
        import grpc

        self.address = address
        self._grpc = grpc
        self._channel: Any = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self._call = self._channel.unary_unary(_GET_STATUS)
        self.last_error: str | None = None

    def probe(self, timeout_s: float = PROBE_TIMEOUT_S, *, wait_for_ready: bool = False) -> bool:
        """True if the server answered GetStatus within ``timeout_s`` seconds. With
        ``wait_for_ready``, a refused connection is retried (with gRPC's back-off) until then,
        instead of failing at once."""
        try:
            self._call(b"", timeout=timeout_s, wait_for_ready=wait_for_ready)
        except self._grpc.RpcError as exc:
            self.last_error = f"{exc.code().name}: {exc.details()}"
            return False
        self.last_error = None
        return True

    def call(self, timeout_s: float = PROBE_TIMEOUT_S, *, wait_for_ready: bool = False) -> Any:
        """Start a GetStatus call and return at once: a ``grpc.Future`` to pass to
        :meth:`answered` once done (see :meth:`probe` for the arguments)."""
        return self._call.future(b"", timeout=timeout_s, wait_for_ready=wait_for_ready)

    def answered(self, call: Any) -> bool:
        """Whether the finished ``call`` (from :meth:`call`) got an answer; sets ``last_error``."""
        error = call.exception()
        if error is None:
            self.last_error = None
            return True
        code = error.code() if hasattr(error, "code") else None
        details = error.details() if hasattr(error, "details") else str(error)
        self.last_error = f"{code.name if code else type(error).__name__}: {details}"
        return False

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Prober:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_T = TypeVar("_T")


@dataclass
class Readiness(Generic[_T]):
    """How :func:`wait_serving` ended: ``ready`` tasks answered; ``exited`` is the task whose
    process ended before it answered, ``late`` the first that had not answered by the deadline
    (with ``last_error``, its last gRPC error); both ``None`` when every task answered."""

    ready: int
    exited: _T | None = None
    late: _T | None = None
    last_error: str | None = None


def wait_serving(
    tasks: Sequence[_T],
    *,
    address: Callable[[_T], str],
    ready_fd: Callable[[_T], int | None],
    alive: Callable[[_T], bool],
    timeout_s: float,
    retry_s: float = 0.02,
) -> Readiness[_T]:
    """Wait until every task's server answers a GetStatus call, at most ``timeout_s`` seconds.

    A task's ``ready_fd`` becomes readable when its process says its server is up (it reads one
    byte) or when the process ended first (it reads empty); only then is the task called, with the
    server already listening: no polling, no refused connection, no gRPC back-off. Calls run
    concurrently, so a slow answer delays no other task. A task with no ready_fd (``None``) is
    called at once, and again every ``retry_s`` seconds until it answers, as is a task whose call
    failed although it said it was up, while ``alive`` says its process runs.
    """
    deadline = time.monotonic() + timeout_s
    probers = [Prober(address(task)) for task in tasks]  # imports gRPC while servers start
    signals: dict[int, int] = {}  # fd -> index of a task that has not said it is up
    due: dict[int, float] = {}  # index -> when to call it (next)
    for i, task in enumerate(tasks):
        fd = ready_fd(task)
        if fd is None:
            due[i] = 0.0
        else:
            signals[fd] = i
    calls: dict[int, Any] = {}  # index -> its GetStatus call in flight
    answered: set[int] = set()
    wake_r, wake_w = os.pipe()  # written when a call completes
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)

    def wake(_: object) -> None:
        with contextlib.suppress(OSError):
            os.write(wake_w, b".")

    try:
        while True:
            now = time.monotonic()
            for i, when in list(due.items()):
                if when <= now:
                    del due[i]
                    remaining = max(0.05, min(PROBE_TIMEOUT_S, deadline - now))
                    calls[i] = probers[i].call(remaining, wait_for_ready=True)
                    calls[i].add_done_callback(wake)
            for i, call in list(calls.items()):
                if not call.done():
                    continue
                del calls[i]
                if probers[i].answered(call):
                    answered.add(i)
                elif alive(tasks[i]):
                    due[i] = time.monotonic() + retry_s
                else:
                    return Readiness(len(answered), exited=tasks[i])
            if len(answered) == len(tasks):
                return Readiness(len(answered))
            now = time.monotonic()
            if now >= deadline:
                late = min(set(range(len(tasks))) - answered)
                error = probers[late].last_error or "it never said its server was up"
                return Readiness(len(answered), late=tasks[late], last_error=error)
            wait = min([deadline, *due.values()]) - now
            readable = select.select([*signals, wake_r], [], [], max(0.0, wait))[0]
            if wake_r in readable:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
            for fd in readable:
                if fd == wake_r:
                    continue
                i = signals.pop(fd)
                try:
                    said = os.read(fd, 1)
                except OSError:
                    said = b""
                if not said:
                    return Readiness(len(answered), exited=tasks[i])
                due[i] = 0.0
    finally:
        for call in calls.values():
            call.cancel()
        for prober in probers:
            prober.close()
        os.close(wake_r)
        os.close(wake_w)
