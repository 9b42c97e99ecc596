"""A run's live line on a terminal: one line under the tasks' output, redrawn in place, that says
the attempt, the restarts, each task's steps per second (their spread past four tasks), the last
failure and, when the script said its total (:func:`graphdist.step`'s ``total``), a bar of the
slowest task's steps with an end estimate.

It is a tqdm bar (the well-kept progress bar library), driven by the run: the run's events set
what it says, and it is drawn at most every :data:`REFRESH_S`. The tasks' lines are written as
they are, byte for byte, as without it: before a line the bar is cleared (tqdm's ``clear``: the
line overwritten, the cursor back at its start), the next refresh draws it again below, so no
task line is ever mixed into it and a burst of lines costs one clear. Every write, the bar's
included, happens under the run's output lock (:class:`graphdist._distribute.taskproc.Output`).
There is none where the output is not a terminal (a pipe, a file, ``--output-format jsonl``) or
is a dumb one (``TERM=dumb``); it is gone once the run ends.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import threading
from collections.abc import Callable
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from graphdist._distribute.events import Event

__all__ = ["LiveLine"]

#: Seconds between two draws of the line.
REFRESH_S = 0.5
#: Tasks named one by one with their rates; past it, their spread.
NAMED_TASKS = 4
# the counts and the estimate first: a narrow terminal cuts the words, not them
_WITH_TOTAL = "{n_fmt}/{total_fmt} |{bar:20}| {elapsed}<{remaining} | {desc}"
_WITHOUT = "{desc}"


def _terminal(stream: IO[str] | None) -> bool:
    try:
        return stream is not None and stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError, OSError):  # a closed or odd stream
        return False


class LiveLine:
    """The live line of one run (the module docstring): fed with its events (:meth:`feed`),
    cleared before each line the run writes (:meth:`before_line`), drawn by its own thread."""

    @classmethod
    def maybe(cls, stream: IO[str] | None, lock: threading.Lock, jsonl: bool) -> LiveLine | None:
        """A live line on ``stream`` drawn under ``lock`` (the output's), or None where there is
        to be none."""
        if jsonl or not _terminal(stream):
            return None
        assert stream is not None
        return cls(stream, lock)

    def __init__(self, stream: IO[str], lock: threading.Lock) -> None:
        from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]

        self.lock = lock
        self.attempt = 1
        self.restarts = 0
        self.rates: dict[str, float] = {}
        self.steps: dict[str, int] = {}
        self.total: int | None = None
        self.failure: str | None = None
        self.shown = True
        self.drawn = False
        self.started = False  # drawn from the first attempt on: not over an engine's start-up
        with self.lock:
            self.bar = tqdm(
                total=None,
                file=stream,
                leave=False,
                dynamic_ncols=True,
                bar_format=_WITHOUT,
                desc=self._words(),
                mininterval=REFRESH_S,
                miniters=1,  # no dynamic miniters, and no longest interval: tqdm's monitor
                maxinterval=float("inf"),  # thread never draws it, only ours, under the lock
                delay=REFRESH_S,  # nothing drawn by tqdm itself before the first refresh
            )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._draw, daemon=True, name="graphdist-live")
        self._thread.start()

    def _draw(self) -> None:
        while not self._stop.wait(REFRESH_S):
            with self.lock:
                if self.shown and self.started:
                    self._safely(lambda: self.bar.refresh(nolock=True))
                    self.drawn = self.shown

    def _safely(self, write: Callable[[], object]) -> None:
        """A write of the bar; one that fails (the terminal gone, a non-blocking one full) ends
        the line, never the run: the output's own next write says whether it is lost."""
        try:
            write()
        except (OSError, ValueError):
            self.shown = False

    def before_line(self) -> None:
        """The bar away before a line of the run (the output's lock is held)."""
        if self.drawn:
            self.bar.clear(nolock=True)
            self.drawn = False

    def feed(self, event: Event) -> None:
        """What ``event`` changes of the line (drawn at the next refresh)."""
        data = event.data
        if event.kind == "attempt-started":
            self.attempt, self.rates, self.steps = event.attempt, {}, {}
            self.started = True
        elif event.kind == "restarting":
            self.restarts += 1
            self.failure = f"{data['cause']['task']} {data['cause']['how']}"
        elif event.kind == "gave-up":
            self.failure = f"{data['cause']['task']} {data['cause']['how']}"
        elif event.kind == "progress" and event.task is not None:
            self.steps[event.task] = int(data["step"])
            if data.get("steps_per_s") is not None:
                self.rates[event.task] = float(data["steps_per_s"])
            self.total = max(self.total or 0, data.get("total") or 0) or None
        elif event.kind == "task-exited" and event.task in self.rates:
            self.rates[event.task] = 0.0
        else:
            return
        with self.lock:
            if self.shown:
                self._safely(self._set)

    def _set(self) -> None:
        self.bar.set_description_str(self._words(), refresh=False)
        self.bar.bar_format = _WITH_TOTAL if self.total else _WITHOUT
        slowest = min(self.steps.values()) if self.steps else 0
        if self.total != self.bar.total or slowest < self.bar.n:
            self.bar.reset(total=self.total)  # the estimate starts again from here
            self.bar.n = self.bar.last_print_n = slowest
            self.drawn = True
        elif slowest > self.bar.n:
            self.bar.update(slowest - self.bar.n)  # its rate, for the end estimate
            self.drawn = self.drawn or self.bar.last_print_n == self.bar.n

    def _words(self) -> str:
        words = [f"attempt {self.attempt}"]
        if self.restarts:
            words.append(f"{self.restarts} restart{'s' if self.restarts != 1 else ''}")
        rates = sorted(self.rates.items())
        if 0 < len(rates) <= NAMED_TASKS:
            words.append(", ".join(f"{task} {rate:.1f} steps/s" for task, rate in rates))
        elif rates:
            values = [rate for _, rate in rates]
            low, mid, high = min(values), statistics.median(values), max(values)
            words.append(f"{len(values)} tasks {low:.1f}-{high:.1f} steps/s (median {mid:.1f})")
        if self.failure:
            words.append(f"last failure: {self.failure}")
        return " | ".join(words)

    def stop(self) -> None:
        """Take the line away, for good (the output's lock is not held)."""
        self._stop.set()
        with self.lock:
            if self.shown:
                self.shown = False
                with contextlib.suppress(OSError, ValueError):
                    self.before_line()
                    self.bar.close()
