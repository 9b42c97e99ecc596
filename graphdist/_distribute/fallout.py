"""The console's side of a broken attempt: its fallout.

Once an attempt is broken (a task's failure, or a stop signal), the other tasks' output is mostly
their fall (a MultiWorkerMirroredStrategy collective failing without its peer: a 60-line
traceback per survivor). The console holds every line read from then on; when the cause is known,
its own held lines are shown, then the ``restarting`` or ``gave-up`` line, then one ``folded``
event's line per other task (:mod:`graphdist._distribute.events`). Which lines are held is a rule
over when each was read (:func:`is_fallout`) and when the attempt broke (a death's recorded end,
or a stop's moment), both taken under one lock, so that it never depends on which thread got
there first; lines wait :data:`SHOW_DELAY_S` before they are shown, so that a survivor's first
lines, read before its peer's death was reported, are still found. jsonl keeps every ``line``
event as it comes (a machine reads the order of events) and adds the ``folded`` events, so the
two formats tell the same story.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "DEATH_SLACK_S",
    "HELD_LINES",
    "SHOW_DELAY_S",
    "Fallout",
    "Released",
    "is_fallout",
]


#: The most lines of one task :class:`Fallout` holds (the rest are counted): the cause's are
#: shown when it is known, a survivor's are only counted.
HELD_LINES = 200


def is_fallout(read_at: float, broken_at: float | None) -> bool:
    """Whether a task's output line read at ``read_at`` is fallout of its attempt's break at
    ``broken_at`` (None: not broken): read at the break or after it, on one clock."""
    return broken_at is not None and read_at >= broken_at


@dataclass
class Released:
    """What :meth:`Fallout.release` gives back: the cause's held lines (to show before the
    restart's line), every other task's count of lines (one ``folded`` event each), and what
    broke the attempt when no task's end did (a stop signal)."""

    cause_lines: list[str]
    counts: dict[str, int]
    why: str | None


#: Seconds the console holds a task's line before showing it. A survivor learns of a peer's
#: death from its closed connection, before the dead task's guard has reaped it and said so: its
#: first lines of fall are read a few milliseconds before the death is known. Held this long,
#: they are still found to be fallout once it is (the rule is over when each line was read).
SHOW_DELAY_S = 0.2
#: Seconds before a death's recorded end from which a line counts as its fallout: the guard
#: records the end once it has reaped its command, a little after the peers saw it.
DEATH_SLACK_S = 0.05


class Fallout:
    """The task lines of a broken attempt (the module docstring): each line waits
    :data:`SHOW_DELAY_S` before ``show(task, text)`` writes it (a thread shows those due when no
    line comes); from the break on (a death's recorded end, less :data:`DEATH_SLACK_S`; a stop
    signal's moment) lines are held, and given back once the cause is known (:meth:`release`).
    ``deaths()``: the earliest recorded end of a failed task of the attempt on ``clock``, or
    None; asked before lines are shown, so a death its guard has reported is a break even
    before the supervising loop looks. ``keep`` (jsonl): every line is shown at once and the
    fallout only counted. Thread-safe: every decision is taken under one lock, by the rule
    (:func:`is_fallout`) over the times recorded."""

    def __init__(
        self,
        show: Callable[[str, str], None],
        *,
        keep: bool = False,
        deaths: Callable[[], float | None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
        delay_s: float = SHOW_DELAY_S,
    ) -> None:
        self._show = show
        self._keep = keep
        self._deaths = deaths
        self._clock = clock
        self._delay_s = 0.0 if keep else delay_s
        self._lock = threading.Lock()
        self.broken_at: float | None = None
        self._since = float("-inf")  # the last release: an end before it broke an attempt gone
        self._why: str | None = None
        self._held: dict[str, list[str]] = {}
        self._counts: dict[str, int] = {}
        self._pending: collections.deque[tuple[float, str, str]] = collections.deque()
        self._flusher: threading.Thread | None = None

    def broke(self, why: str | None = None, at: float | None = None) -> None:
        """The attempt is broken from ``at`` (a death's recorded end; default: now), or from an
        earlier break; ``why``: what broke it, in words, when it is no task's end (a stop)."""
        with self._lock:
            self._break(self._clock() if at is None else at, why)

    def _break(self, at: float, why: str | None) -> None:
        if at < self._since:
            return
        if self.broken_at is None:
            self._why = why
        self.broken_at = at if self.broken_at is None else min(at, self.broken_at)
        waiting, self._pending = self._pending, collections.deque()
        for read_at, task, text in waiting:  # read before the break: shown now, before its words
            if is_fallout(read_at, self.broken_at):
                self._hold(task, text)
            else:
                self._show(task, text)

    def _hold(self, task: str, text: str) -> None:
        """A line of the fallout: counted, and held to be given back; with ``keep``, shown at
        once instead (jsonl: every line event as it comes), whichever way it was found to be
        fallout (as it was read, or waiting when a reported death broke the attempt)."""
        self._counts[task] = self._counts.get(task, 0) + 1
        if self._keep:
            self._show(task, text)
            return
        held = self._held.setdefault(task, [])
        if len(held) < HELD_LINES:
            held.append(text)

    def line(self, task: str, text: str) -> None:
        """``task``'s line ``text``, read now: held if it is fallout, else shown once due."""
        with self._lock:
            read_at = self._clock()
            if is_fallout(read_at, self.broken_at):
                self._hold(task, text)
                return
            self._pending.append((read_at, task, text))
            self._flush(read_at - self._delay_s)
            if self._pending and self._flusher is None:
                self._flusher = threading.Thread(
                    target=self._flush_later, daemon=True, name="graphdist-run-lines"
                )
                self._flusher.start()

    def _flush(self, until: float) -> None:
        """Show the waiting lines read by ``until``, once a reported death has been looked for
        (under the lock)."""
        if not self._pending or self._pending[0][0] > until:
            return
        death = self._deaths()
        if death is not None:
            self._break(death, None)
        while self._pending and self._pending[0][0] <= until:
            _, task, text = self._pending.popleft()
            self._show(task, text)

    def _flush_later(self) -> None:
        """Show the lines that came due while no other line came (the thread ends once none
        waits; the next line starts another)."""
        while True:
            time.sleep(max(self._delay_s / 4, 0.01))
            with self._lock:
                self._flush(self._clock() - self._delay_s)
                if not self._pending:
                    self._flusher = None
                    return

    def release(self, cause: str | None) -> Released:
        """End the break: the lines read before it are shown now; ``cause``'s held lines, every
        other task's count and what broke it are given back."""
        with self._lock:
            death = self._deaths() if self.broken_at is None and self._pending else None
            if death is not None:
                self._break(death, None)
            while self._pending:
                _, task, text = self._pending.popleft()
                self._show(task, text)
            held, counts, why = self._held, self._counts, self._why
            self.broken_at, self._why, self._held, self._counts = None, None, {}, {}
            self._since = self._clock()
        if cause is None:
            return Released([], counts, why)
        counts.pop(cause, None)
        return Released(held.get(cause, []), counts, why)
