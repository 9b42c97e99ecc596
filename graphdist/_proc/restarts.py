"""The one restart policy of graphdist: how many restarts within a sliding window, and the
back-off between them. A detached fleet's supervisor restarts one server with it, ``graphdist
run --max-restarts`` a whole run (or one parameter-server worker).

Back-off: 0.5 s before the first restart after a failure, doubling with each further failure in
a row (1, 2, 4 ... s), capped at 30 s; something that ran for a whole window before it failed
starts again from 0.5 s. At most ``max_restarts`` restarts happen within any ``window_s``
seconds; the next failure within it is final.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

__all__ = [
    "BACKOFF_MAX_S",
    "BACKOFF_MIN_S",
    "DEFAULT_MAX_RESTARTS",
    "DEFAULT_RESTART_WINDOW_S",
    "RestartBudget",
    "backoff_s",
]

DEFAULT_MAX_RESTARTS = 3
"""Restarts within one window before graphdist gives up (a detached fleet's default)."""
DEFAULT_RESTART_WINDOW_S = 60.0
"""Seconds of the sliding window restarts are counted in."""
BACKOFF_MIN_S = 0.5
"""Seconds before the first restart after a failure."""
BACKOFF_MAX_S = 30.0
"""The longest wait, in seconds, between two restarts."""


def backoff_s(failures: int) -> float:
    """Seconds to wait before restarting something that failed ``failures`` times in a row
    (>= 1): 0.5, 1, 2, 4 ... capped at 30."""
    return min(BACKOFF_MIN_S * 2.0 ** min(max(failures, 1) - 1, 32), BACKOFF_MAX_S)


class RestartBudget:
    """At most ``max_restarts`` restarts within any ``window_s`` seconds, with the back-off
    above. Call :meth:`failed` when the thing failed: it returns the seconds to wait before the
    restart, or ``None`` when the budget is spent (give up)."""

    def __init__(
        self,
        max_restarts: int,
        window_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._clock = clock
        self._recent: deque[float] = deque()
        self._failures = 0  # failures in a row (the back-off's exponent)
        self._up_since = clock()
        self.restarts = 0  # restarts done in all

    def failed(self) -> float | None:
        now = self._clock()
        while self._recent and self._recent[0] <= now - self.window_s:
            self._recent.popleft()
        if len(self._recent) >= self.max_restarts:
            return None
        stable = now - self._up_since >= self.window_s
        self._failures = 1 if stable else self._failures + 1
        return backoff_s(self._failures)

    @property
    def recent(self) -> int:
        """Restarts within the window, as :meth:`failed` last counted them."""
        return len(self._recent)

    def reset(self) -> None:
        """A restart by hand: the back-off starts over (the window keeps its restarts)."""
        self._failures = 0
        self._up_since = self._clock()

    def restarted(self) -> None:
        """A restart (allowed by :meth:`failed`) happened now."""
        now = self._clock()
        self._recent.append(now)
        self._up_since = now
        self.restarts += 1
