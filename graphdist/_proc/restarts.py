"""The one restart policy of graphdist: it decides, the restart loops act.

Three loops restart things: ``graphdist run --max-restarts`` a whole run (every task of an
attempt), the same launcher one parameter-server worker on its address, and a detached fleet's
supervisor one server. Each tells its :class:`RestartPolicy` that the thing failed
(:meth:`~RestartPolicy.failed`) and gets a :class:`Decision`: restart after ``wait_s`` seconds,
or give up, and why; the decision renders its own words (:meth:`Decision.words`), so every loop
says the same thing the same way, and every count it prints is the window's.

The rules, with their numbers in one place (:data:`BACKOFF`, :data:`DEFAULT_RESTART_WINDOW_S`,
:data:`DEFAULT_MIN_UPTIME_S`, :data:`STARTUP_FAILURES`; help texts are generated from them):

- at most ``max_restarts`` restarts within any ``window_s`` seconds (a sliding window); the
  next failure within it is final (``"budget"``);
- a back-off before each restart: none after a first failure (most failures are one-offs: a
  killed or frozen task, a lost node, and each second of waiting is a second of lost training),
  then 0.5 s after a second failure in a row, doubling with each further one, at most 30 s;
  something that ran for a whole window before it failed starts again at once;
- a *preemption* (the thing was asked to stop and said so: every task of a run exited with the
  preemption exit code after a SIGTERM) restarts at once and spends no restart;
- a *start-up failure*: something that failed :data:`STARTUP_FAILURES` times in a row, each
  time within ``min_uptime_s`` of being started, gives up early (``"startup"``): a script that
  cannot start (an import error, a bad path) will not start on the next try either; where the
  caller can tell the failure's error is one that no restart fixes (``failed(error=...)``: a
  missing module, a syntax error, a script that does not exist), the first such start-up
  failure gives up at once; one that ran out of memory (``failed(oom=...)``) at each of its
  last :data:`OOM_STARTUPS` starts, each within ``min_uptime_s``, gives up then: the same
  memory limit ends the same start the same way.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from graphdist._exceptions import ArgumentError
from graphdist._validate import show

__all__ = [
    "BACKOFF",
    "DEFAULT_MAX_RESTARTS",
    "DEFAULT_MIN_UPTIME_S",
    "DEFAULT_RESTART_WINDOW_S",
    "OOM_STARTUPS",
    "STARTUP_FAILURES",
    "Backoff",
    "Decision",
    "RestartPolicy",
    "backoff_s",
    "check_min_uptime",
]

DEFAULT_MAX_RESTARTS = 3
"""Restarts within one window before graphdist gives up (a detached fleet's default)."""
DEFAULT_RESTART_WINDOW_S = 60.0
"""Seconds of the sliding window restarts are counted in."""
DEFAULT_MIN_UPTIME_S = 10.0
"""Seconds something must have run before its failure stops counting as a start-up failure."""
STARTUP_FAILURES = 3
"""Start-up failures in a row after which the policy gives up, whatever the budget says."""
OOM_STARTUPS = 2
"""Starts in a row ended by running out of memory after which the policy gives up."""


@dataclass(frozen=True)
class Backoff:
    """Seconds to wait before a restart: ``first_s`` after the first failure in a row,
    ``min_s`` after the second, times ``factor`` for each further one, at most ``max_s``."""

    min_s: float = 0.5
    factor: float = 2.0
    max_s: float = 30.0
    first_s: float = 0.0

    def delay(self, failures: int) -> float:
        """The wait before restarting something that failed ``failures`` times in a row."""
        if failures <= 1:
            return min(self.first_s, self.max_s)
        return min(self.min_s * self.factor ** min(failures - 2, 64), self.max_s)

    def describe(self) -> str:
        """``"at once, then 0.5 s, doubling, at most 30 s"``, for help texts and docstrings."""
        grows = "doubling" if self.factor == 2 else f"times {self.factor:g}"
        first = "at once" if self.first_s == 0 else f"{self.first_s:g} s"
        return f"{first}, then {self.min_s:g} s, {grows}, at most {self.max_s:g} s"


BACKOFF = Backoff()


def backoff_s(failures: int) -> float:
    """:data:`BACKOFF`'s wait after ``failures`` failures in a row (0, 0.5, 1, 2 ... 30 s)."""
    return BACKOFF.delay(failures)


Reason = Literal["failed", "preempted", "budget", "startup"]


@dataclass(frozen=True)
class Decision:
    """What the policy decided about one failure of ``what`` (``"the run"``, ``"worker-1"``):
    ``restart`` after ``wait_s`` seconds, or not; ``reason`` is ``"failed"`` or ``"preempted"``
    (a restart), ``"budget"`` or ``"startup"`` (giving up). ``restart_number`` is the restart
    this one would be within the window (1 for the first), ``in_window`` the restarts already
    in it; ``startup_failures`` the start-up failures in a row so far."""

    what: str
    restart: bool
    wait_s: float
    reason: Reason
    in_window: int
    max_restarts: int
    window_s: float
    startup_failures: int = 0
    min_uptime_s: float = DEFAULT_MIN_UPTIME_S
    error: str | None = None  # a start-up failure's error that no restart fixes (its line)
    oom: str | None = None  # out of memory at each of the last OOM_STARTUPS starts: how

    @property
    def restart_number(self) -> int:
        return self.in_window + 1

    def words(self) -> str:
        """The decision in one phrase, the same wherever it is shown."""
        limit = f"at most {self.max_restarts} within {self.window_s:g} s"
        if self.reason == "preempted":
            return f"restarting {self.what} at once (a preemption spends no restart)"
        if self.restart:
            when = "at once" if self.wait_s == 0 else f"in {self.wait_s:g} s"
            return f"restarting {self.what} {when} (restart {self.restart_number} of {limit})"
        if self.reason == "startup" and self.oom is not None:
            return (
                f"gave up on {self.what}: it ran out of memory at each of its last "
                f"{OOM_STARTUPS} starts, within {self.min_uptime_s:g} s of starting; restarts "
                "will not fix that: give it more memory, or make it use less"
            )
        if self.reason == "startup" and self.error is not None:
            return (
                f"gave up on {self.what}: it failed within {self.min_uptime_s:g} s of starting "
                f"with {self.error}, an error that restarts will not fix"
            )
        if self.reason == "startup":
            return (
                f"gave up on {self.what}: it failed {self.startup_failures} times in a row "
                f"within {self.min_uptime_s:g} s of starting, a start-up failure that restarts "
                "will not fix"
            )
        if self.max_restarts == 0:
            return f"not restarting {self.what} (max_restarts is 0)"
        return f"gave up on {self.what} after {self.in_window} restart(s) ({limit})"


class RestartPolicy:
    """The restart policy of one thing that may fail again and again (the module docstring).

    ``backoff`` defaults to :data:`BACKOFF` as it is when the policy is made; ``clock`` (default
    ``time.monotonic``) is read at every call, so tests drive it."""

    def __init__(
        self,
        max_restarts: int,
        window_s: float = DEFAULT_RESTART_WINDOW_S,
        *,
        what: str = "it",
        min_uptime_s: float = DEFAULT_MIN_UPTIME_S,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.what = what
        self.min_uptime_s = min_uptime_s
        self.backoff = BACKOFF if backoff is None else backoff
        self._clock = clock
        self._recent: deque[float] = deque()  # when the restarts within the window happened
        self._in_a_row = 0  # failures in a row (the back-off's exponent)
        self._startup_in_a_row = 0
        self._oom_in_a_row = 0  # start-up failures in a row that ran out of memory
        self._up_since = clock()
        self.restarts = 0  # restarts done in all, preemptions included

    def _window(self, now: float) -> int:
        while self._recent and self._recent[0] <= now - self.window_s:
            self._recent.popleft()
        return len(self._recent)

    @property
    def in_window(self) -> int:
        """Restarts within the window now."""
        return self._window(self._clock())

    def started(self) -> None:
        """The thing (re)started now: its uptime counts from here."""
        self._up_since = self._clock()

    def failed(
        self,
        *,
        preempted: bool = False,
        what: str | None = None,
        startup: bool = True,
        error: str | None = None,
        oom: str | None = None,
    ) -> Decision:
        """The thing failed now (``preempted``: it was asked to stop and did): the decision.
        ``what`` names what failed when it is a part of the thing (``"the server of
        worker-1"``), whose failure spends the same budget; ``startup=False``: a part whose
        failure says nothing of the whole's start-up; ``error``: the failure's error, where it
        is one that no restart fixes (a missing module, a syntax error): within
        ``min_uptime_s`` of a start it gives up at once; ``oom``: it ran out of memory (how, in
        words): the :data:`OOM_STARTUPS`-th such start-up failure in a row gives up."""
        now = self._clock()
        in_window = self._window(now)
        named = what or self.what
        if preempted:
            return self._decision(named, in_window, True, 0.0, "preempted")
        if startup:
            uptime = now - self._up_since
            short = uptime < self.min_uptime_s
            self._startup_in_a_row = self._startup_in_a_row + 1 if short else 0
            self._oom_in_a_row = self._oom_in_a_row + 1 if short and oom is not None else 0
        if in_window >= self.max_restarts:
            return self._decision(named, in_window, False, 0.0, "budget")
        if startup and self._startup_in_a_row and error is not None:
            return self._decision(named, in_window, False, 0.0, "startup", error)
        if startup and self._oom_in_a_row >= OOM_STARTUPS:
            return self._decision(named, in_window, False, 0.0, "startup", oom=oom)
        if startup and self._startup_in_a_row >= STARTUP_FAILURES:
            return self._decision(named, in_window, False, 0.0, "startup")
        stable = now - self._up_since >= self.window_s
        self._in_a_row = 1 if stable else self._in_a_row + 1
        wait = self.backoff.delay(self._in_a_row)
        return self._decision(named, in_window, True, wait, "failed")

    def _decision(
        self,
        what: str,
        in_window: int,
        restart: bool,
        wait_s: float,
        reason: Reason,
        error: str | None = None,
        oom: str | None = None,
    ) -> Decision:
        return Decision(
            what,
            restart,
            wait_s,
            reason,
            in_window,
            self.max_restarts,
            self.window_s,
            self._startup_in_a_row,
            self.min_uptime_s,
            error,
            oom,
        )

    def restarted(self, decision: Decision) -> None:
        """The restart ``decision`` allowed happened now (a preemption spends none)."""
        now = self._clock()
        if decision.reason != "preempted":
            self._recent.append(now)
        if decision.what == self.what:  # the whole started again (not one part of it)
            self._up_since = now
        self.restarts += 1

    def reset(self) -> None:
        """A restart by hand: the back-off and start-up count start over (the window keeps its
        restarts)."""
        self._in_a_row = 0
        self._startup_in_a_row = 0
        self._oom_in_a_row = 0
        self._up_since = self._clock()


def check_min_uptime(value: float) -> float:
    """``min_uptime_s`` if it is a finite number >= 0 (0 turns the start-up rule off)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ArgumentError(
            f"min_uptime_s must be a finite number of seconds >= 0, not {show(value)}",
            name="min_uptime_s",
            value=value,
        )
    if value < 0:
        raise ArgumentError(
            f"min_uptime_s must be >= 0 seconds, not {show(value)}",
            name="min_uptime_s",
            value=value,
        )
    return float(value)
