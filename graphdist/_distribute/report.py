"""``graphdist report RUN_DIR``: a run's picture, drawn from its log folder's ``events.jsonl``.

:func:`read_run` reads the events (task lines passed over unparsed; progress records thinned
as they are read, :class:`~graphdist._distribute.runtimeline.Thin`), :func:`~graphdist.
_distribute.runtimeline.timeline` makes them bars by its rule, and :mod:`graphdist._distribute.
reportdraw` draws one figure, written as one self-contained HTML page (the figure as inline
SVG, its glyphs drawn as paths: no script, no font, nothing fetched) or as a PNG:

- **lanes**: one per task, one bar per attempt, coloured by how the task's attempt ended: done,
  failed, stopped, preempted, or running (no exit in the events: a run still going, or a
  launcher that died); restarts, preemptions and stop signals as lines across the lanes,
  stragglers marked where they were named;
- **steps done** per task over time, **steps/s** and the **loss**, when the script reported them
  (:func:`graphdist.step`, :func:`graphdist.progress`).

The page also says, in text, each attempt's tasks and how they ended, and the run's summary
(the words ``graphdist run`` printed: :func:`graphdist._distribute.events.summary`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile

from graphdist._distribute.events import Event
from graphdist._distribute.runlogs import check_output_folder, check_output_name
from graphdist._distribute.runtimeline import Thin, order, timeline
from graphdist._exceptions import ArgumentError, PictureError
from graphdist._validate import show

__all__ = ["FORMATS", "check_output", "read_run", "write_report"]

FORMATS = (".html", ".png")
_LINE = '{"event": "line", '  # how Event.to_json starts a task's output line
_PROGRESS = '{"event": "progress", '


def _refuse(run_dir: str, why: str) -> ArgumentError:
    return ArgumentError(f"Cannot report on {show(run_dir)}: {why}", name="run_dir", value=run_dir)


def read_run(run_dir: object) -> tuple[list[Event], int]:
    """The events of the run folder ``run_dir`` (``LOG_DIR/run-N`` of ``graphdist run
    --log-dir``) and how many of its lines were no event (a line cut by a launcher that died);
    :class:`ArgumentError` naming it for a folder that is not a run's."""
    if isinstance(run_dir, bytes) or not isinstance(run_dir, str | os.PathLike):
        raise ArgumentError(
            f"run_dir must be a path, not {show(run_dir)}", name="run_dir", value=run_dir
        )
    path = os.fspath(run_dir)
    if not os.path.isdir(path):
        why = "no such folder" if not os.path.lexists(path) else "it is not a folder"
        raise _refuse(path, f"{why}; pass a run's log folder (LOG_DIR/run-N)")
    if not os.access(path, os.R_OK | os.X_OK):
        raise _refuse(path, "you cannot read it")
    events_file = os.path.join(path, "events.jsonl")
    if not os.path.isfile(events_file):
        runs = sorted(
            (n for n in _listdir(path) if os.path.isfile(os.path.join(path, n, "events.jsonl"))),
            key=order,  # run-2 before run-10
        )
        hint = (
            f"it holds runs ({', '.join(runs[:5])}{', ...' if len(runs) > 5 else ''}): pass one"
            if runs
            else "pass a run's log folder (LOG_DIR/run-N of graphdist run --log-dir)"
        )
        raise _refuse(path, f"it is not a run's log folder (no events.jsonl); {hint}")
    events: list[tuple[int, Event]] = []  # (line number, event): progress thinned as read
    thinned: dict[tuple[str, int], Thin] = {}
    skipped = 0
    try:
        with open(events_file, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f):
                if line.startswith(_LINE):  # a task's output line: not drawn, and the many
                    continue
                try:
                    event = _progress(line) if line.startswith(_PROGRESS) else Event.from_json(line)
                except (ValueError, KeyError, TypeError, ArithmeticError, RecursionError):
                    event = None
                if event is None or not math.isfinite(event.at_s):
                    skipped += 1
                elif event.kind == "progress" and event.task is not None:
                    key = (event.task, event.attempt)
                    thinned.setdefault(key, Thin()).add((number, event))
                else:
                    events.append((number, event))
    except OSError as exc:
        raise _refuse(path, f"cannot read events.jsonl: {exc.strerror or exc}") from None
    for thin in thinned.values():
        events.extend(thin.items())
    events.sort(key=lambda pair: pair[0])
    if not any(e.kind == "attempt-started" for _, e in events):
        raise _refuse(
            path, "its events.jsonl has no run's events (no attempt started); pass a run's folder"
        )
    return [event for _, event in events], skipped


def _progress(line: str) -> Event | None:
    """A progress line as an event, read without the dataclass check every other kind gets
    (a long run has hundreds of thousands), its fields checked for what is drawn."""
    data = json.loads(line)
    head = (data.pop("event"), data.pop("at_s"), data.pop("attempt"), data.pop("task", None))
    kind, at_s, attempt, task = head
    if type(attempt) is not int or type(data.get("step")) is not int or not isinstance(task, str):
        return None
    return Event(kind, float(at_s), attempt, task, data)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def check_output(run_dir: str, output: object) -> str:
    """Where the report goes, as an absolute path: ``output``, or ``RUN_DIR/report.html``; it
    must end in .html or .png and lie in a folder that is the user's alone, or sticky."""
    if output is None:
        output = os.path.join(run_dir, "report.html")
    full = check_output_name(output, name="output", suffixes=FORMATS)
    # in a sticky folder too (/tmp): the report is written aside and renamed into place
    return check_output_folder(full, output, name="output", what="the report", shared_ok=True)


def write_report(
    run_dir: str | os.PathLike[str], output: str | os.PathLike[str] | None = None
) -> str:
    """Draw the run of ``run_dir`` (a ``LOG_DIR/run-N`` folder) into ``output`` (``.html``: one
    self-contained page; ``.png``: the figure), by default ``RUN_DIR/report.html``, replaced
    whole; returns its path. :class:`ArgumentError` for a folder that is not a run's or an
    output refused before anything is written, :class:`PictureError` for a write that failed
    (a full disk)."""
    from graphdist._distribute.reportdraw import figure, page, style  # matplotlib: only here

    events, skipped = read_run(run_dir)
    path = check_output(os.path.abspath(os.fspath(run_dir)), output)
    tl = timeline(events, skipped)
    folder = os.path.dirname(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".report-", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "wb") as f, style():
            if path.endswith(".png"):
                figure(tl).savefig(f, format="png", dpi=100, metadata={"Software": None})
            else:  # a path that is no UTF-8 (bytes a file system allows) shown escaped
                text = page(tl, os.path.abspath(os.fspath(run_dir)))
                f.write(text.encode("utf-8", "backslashreplace"))
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(exc, OSError):
            raise PictureError(
                f"Cannot write the report {path}: {exc.strerror or exc}", path
            ) from None
        raise
    return path
