"""A run's live line on a terminal: one line under the tasks' output, redrawn in place, that says
the attempt, the restarts, each task's steps per second (their spread past four tasks), the last
failure and, when the script said its total (:func:`graphdist.step`'s ``total``), a bar of the
slowest task's steps and an end estimate.

It is drawn by rich (a dependency of Keras, so of every TensorFlow install here; declared in our
own requirements too), whose ``Progress`` keeps the line below what is printed through its
console: every line the run writes goes through :meth:`LiveLine.print` while it is shown, so no
task line is ever mixed into it, and the line is gone once the run ends (``transient``). There is
none where the output is not a terminal (a pipe, a file, ``--output-format jsonl``) or is a dumb
one (``TERM=dumb``).
"""

from __future__ import annotations

import contextlib
import os
import statistics
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from graphdist._distribute.events import Event

__all__ = ["LiveLine"]

#: Redraws a second.
REFRESH_PER_S = 2
#: Tasks named one by one with their rates; past it, their spread.
NAMED_TASKS = 4


def _terminal(stream: IO[str] | None) -> bool:
    try:
        return stream is not None and stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError, OSError):  # a closed or odd stream
        return False


class LiveLine:
    """The live line of one run (the module docstring), fed with its events."""

    @classmethod
    def maybe(cls, stream: IO[str] | None, jsonl: bool) -> LiveLine | None:
        """A started live line on ``stream``, or None where there is to be none."""
        if jsonl or not _terminal(stream):
            return None
        assert stream is not None
        return cls(stream)

    def __init__(self, stream: IO[str]) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self.console = Console(file=stream, highlight=False, emoji=False, markup=False)
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=self.console,
            transient=True,
            redirect_stdout=False,
            redirect_stderr=False,  # stderr stays stderr: a line there is redrawn over
            refresh_per_second=REFRESH_PER_S,
        )
        self.attempt = 1
        self.restarts = 0
        self.rates: dict[str, float] = {}
        self.steps: dict[str, int] = {}
        self.total: int | None = None
        self.failure: str | None = None
        self._bar = self.progress.add_task(self._words(), total=None)
        self.progress.start()
        self.shown = True

    def print(self, line: str) -> None:
        """``line`` above the live line (OSError where the terminal is gone)."""
        self.console.out(line, highlight=False)

    def feed(self, event: Event) -> None:
        """What ``event`` changes of the line."""
        data = event.data
        if event.kind == "attempt-started":
            self.attempt, self.rates, self.steps = event.attempt, {}, {}
        elif event.kind == "restarting":
            self.restarts += 1
            self.failure = f"{data['cause']['task']} {data['cause']['how']}"
        elif event.kind == "gave-up":
            self.failure = f"{data['cause']['task']} {data['cause']['how']}"
        elif event.kind == "progress" and event.task is not None:
            self.steps[event.task] = int(data["step"])
            if data.get("steps_per_s") is not None:
                self.rates[event.task] = float(data["steps_per_s"])
            self.total = data.get("total") or self.total
        elif event.kind == "task-exited" and event.task in self.rates:
            self.rates[event.task] = 0.0
        else:
            return
        done = min(self.steps.values()) if self.steps else 0
        self.progress.update(self._bar, description=self._words(), total=self.total, completed=done)

    def _words(self) -> str:
        words = [f"attempt {self.attempt}"]
        if self.restarts:
            words.append(f"{self.restarts} restart{'s' if self.restarts != 1 else ''}")
        rates = sorted(self.rates.items())
        if 0 < len(rates) <= NAMED_TASKS:
            words.append(", ".join(f"{task} {rate:.1f}/s" for task, rate in rates))
        elif rates:
            values = [rate for _, rate in rates]
            low, mid, high = min(values), statistics.median(values), max(values)
            words.append(f"{len(values)} tasks {low:.1f}-{high:.1f}/s (median {mid:.1f})")
        if self.failure:
            words.append(f"last failure: {self.failure}")
        return " · ".join(words)

    def stop(self) -> None:
        """Take the line away (once; the terminal may be gone)."""
        if self.shown:
            self.shown = False
            with contextlib.suppress(OSError, ValueError):
                self.progress.stop()

    def __repr__(self) -> str:  # pragma: no cover - debugging
        return f"LiveLine({self._words()!r})"
