"""SIGINT, SIGTERM and SIGHUP for foreground loops.

- :func:`stop_on_signals` turns them into an event a foreground loop can wait on (``graphdist up``,
  ``graphdist serve``).
- :class:`SignalScope` is for an operation that owns child processes and must stop them whatever
  ends it (``graphdist run``): a stop signal interrupts it only at the points it marks
  :meth:`~SignalScope.interruptible` (raising :class:`Interrupted` there), never in the middle of
  starting or stopping a process; when the scope ends, the previous handlers are back and every
  signal that arrived is delivered to them, in order. So the operation cleans up first and then
  the process does what it would have done without the scope: die of SIGTERM or SIGHUP (a shell
  shows 128 + the signal), raise KeyboardInterrupt for SIGINT, or run its own handler.

Handlers (not a blocked signal mask plus ``sigwait``) because a process-directed signal may be
delivered to any thread whose mask allows it: gRPC and thread-pool threads do, and the signal
would then kill the process or surface as a stray KeyboardInterrupt instead of a clean stop.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType, TracebackType
from typing import Any

__all__ = [
    "STOP_SIGNALS",
    "Interrupted",
    "SignalScope",
    "on_stop_signals",
    "stop_on_signals",
    "wait_for_stop",
]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def stop_on_signals() -> threading.Event:
    """Install handlers (main thread only) that set and return one event on any stop signal."""
    event = threading.Event()

    def handler(signum: int, frame: FrameType | None) -> None:
        event.set()

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)
    return event


@contextlib.contextmanager
def on_stop_signals(handler: Callable[[int], object]) -> Iterator[None]:
    """Within: each stop signal calls ``handler(signum)`` (a second Ctrl-C while a foreground
    command stops: kill now); the previous handlers are back after. Main thread only: elsewhere
    nothing changes. A signal that is ignored (``nohup``'s SIGHUP) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) in (signal.SIG_IGN, None):
            continue
        previous[sig] = signal.signal(sig, lambda signum, frame: handler(signum))
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


#: Seconds between two looks at the stop event by :func:`wait_for_stop`.
STOP_POLL_S = 0.25


def wait_for_stop(event: threading.Event) -> None:
    """Wait in the main thread until ``event`` is set by a stop signal's handler. In slices: a
    process-directed signal that the kernel hands to another thread (gRPC's, Ray's) leaves an
    untimed wait asleep, since Python runs the handler only when the main thread next runs
    bytecode; ``graphdist up`` on Ray once ignored a Ctrl-C that way for over 60 s."""
    while not event.wait(STOP_POLL_S):
        pass


class Interrupted(BaseException):
    """A stop signal arrived during a :meth:`SignalScope.interruptible` section. A BaseException,
    like KeyboardInterrupt, so that ``except Exception`` on the way does not swallow it."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(f"stopped by {self.name}")


class SignalScope:
    """``with SignalScope() as scope:`` defers SIGINT, SIGTERM and SIGHUP (see the module
    docstring); ``notices`` (Slurm's SIGUSR1 warning, say) are signals that stop nothing: each
    is kept in :attr:`notices` for the operation to act on (:meth:`take_notice`). Only the main
    thread can install handlers: elsewhere the scope does nothing and
    the signals keep their handlers. A signal that is ignored (``nohup`` ignores SIGHUP) stays
    ignored, and so does one whose handler Python cannot restore (installed from C)."""

    def __init__(self, notices: tuple[int, ...] = ()) -> None:
        self.received: list[int] = []
        self.notices: list[int] = []  # signals of ``notices`` that arrived, not yet taken
        self._notice_signals = notices
        self._previous_notices: dict[int, Any] = {}
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int] = {}
        self._interruptible = 0
        #: When the operation must be over (``time.monotonic()``; a run's ``--timeout``), set by
        #: its owner: the waits inside the scope take :meth:`budget` for their own limits.
        self.deadline: float | None = None

    def budget(self, limit_s: float) -> float:
        """``limit_s``, or less where :attr:`deadline` comes sooner (at least 0.1 s: a wait past
        the deadline ends at once, and its error is then told as the deadline's)."""
        if self.deadline is None:
            return limit_s
        return max(0.1, min(limit_s, self.deadline - time.monotonic()))

    def __enter__(self) -> SignalScope:
        if threading.current_thread() is not threading.main_thread():
            return self
        for stop in STOP_SIGNALS:
            previous = signal.getsignal(stop)
            if previous is None or previous == signal.SIG_IGN:
                continue
            with contextlib.suppress(ValueError, OSError):
                signal.signal(stop, self._handler)
                self._previous[stop] = previous
        for sig in self._notice_signals:  # taken, never delivered again: they stop nothing
            with contextlib.suppress(ValueError, OSError):
                self._previous_notices[sig] = signal.signal(sig, self._notice)
        return self

    def _notice(self, signum: int, frame: FrameType | None) -> None:
        self.notices.append(signum)

    def take_notice(self) -> int | None:
        """The first notice signal that arrived and was not taken yet (None: none did)."""
        return self.notices.pop(0) if self.notices else None

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)
        if self._interruptible and len(self.received) == 1:
            raise Interrupted(signum)

    def check(self) -> None:
        """Raise :class:`Interrupted` now if a stop signal has arrived."""
        if self.received:
            raise Interrupted(self.received[0])

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A section a stop signal may interrupt: it raises :class:`Interrupted` inside (or at
        once, for a signal that came before)."""
        self.check()
        self._interruptible += 1
        try:
            yield
        finally:
            self._interruptible -= 1

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        notices, self._previous_notices = self._previous_notices, {}
        for sig, handler in notices.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(sig, handler)
        delivered = set()
        for sig in self.received:
            if sig in previous and sig not in delivered:
                delivered.add(sig)
                try:
                    signal.raise_signal(sig)  # SIG_DFL: the process ends here
                except BaseException as raised:  # KeyboardInterrupt, or the handler's own
                    raise raised from None
