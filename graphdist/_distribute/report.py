"""``graphdist report RUN_DIR``: a run's picture, drawn from its log folder's ``events.jsonl``.

One figure, drawn once with matplotlib (its object API: no pyplot, so a notebook's backend is
left as it is), written either as one self-contained HTML page (the figure as inline SVG, its
glyphs drawn as paths, no script, no font, nothing fetched) or as a PNG:

- **lanes**: one per task, one bar per attempt, coloured by how the task's attempt ended: done
  (exit 0), failed (the task the restart or the end names as its cause), stopped (stopped by
  the launcher once another task failed, or by a stop signal), preempted, or running (no exit in
  the events: a run still going, or a launcher that died); restarts, preemptions and stop
  signals as lines across the lanes, stragglers marked where they were named;
- **steps done** per task over time, **steps/s** and the **loss**, when the script reported them
  (:func:`graphdist.step`, :func:`graphdist.progress`).

What a bar says is decided by a rule over the events' facts (:func:`timeline`), never by their
order: an attempt's cause is the task its ``restarting`` or ``gave-up`` event names, with that
task's pid; a task that exited 0 is done; every other exit in an attempt that had a cause, a
preemption or a stop signal was stopped (or preempted, with the preemption's code); an exit in
an attempt with none of those failed on its own.

The page also says, in text, each attempt's tasks and how they ended, and the run's summary
(the words ``graphdist run`` printed: :func:`graphdist._distribute.events.summary`).
"""

from __future__ import annotations

import contextlib
import html
import io
import json
import math
import os
import re
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from graphdist._distribute.events import Event, summary
from graphdist._distribute.runlogs import check_output_folder, check_output_name
from graphdist._exceptions import ArgumentError, GraphdistError
from graphdist._validate import show

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["Span", "Timeline", "read_run", "timeline", "write_report"]

#: A bar's colour by how the task's attempt ended.
COLOURS = {
    "done": "#2e7d32",
    "failed": "#c62828",
    "stopped": "#9e9e9e",
    "preempted": "#ef6c00",
    "running": "#1565c0",
}
FORMATS = (".html", ".png")
_JOBS = {"chief": 0, "worker": 1, "ps": 2, "evaluator": 3}
_TASK = re.compile(r"(.*)-([0-9]+)")
_LINE = '{"event": "line", '  # how Event.to_json starts a task's output line
_PROGRESS = '{"event": "progress", '
#: Progress records drawn per task and attempt: a long run's are thinned to at most twice as
#: many, evenly spread as they are read (its first and last kept).
MAX_POINTS = 1000


@dataclass
class Span:
    """One task's part of one attempt: from its start to its exit (``end_s`` None: no exit)."""

    task: str
    attempt: int
    start_s: float
    end_s: float | None = None
    exitcode: int | None = None
    how: str | None = None
    pid: int | None = None
    server: bool = False
    state: str = "running"


@dataclass
class Point:
    """One progress record of a task."""

    at_s: float
    attempt: int
    step: int
    steps_per_s: float | None
    loss: float | None
    redone: int


@dataclass
class Timeline:
    """What the report draws, read from a run's events (:func:`timeline`)."""

    tasks: list[str]
    spans: list[Span]
    attempts: dict[int, float]  # attempt -> when it started
    ends: dict[int, str]  # attempt -> how it ended, in words
    marks: list[tuple[float, str, str | None, str]]  # (at_s, kind, task, words)
    progress: dict[str, list[Point]] = field(default_factory=dict)
    took_s: float = 0.0
    outcome: str | None = None  # None: the events have no run-ended (a run going on, or lost)
    steps: dict[str, int] = field(default_factory=dict)
    redone: int = 0
    summary: str = ""
    skipped: int = 0  # lines of events.jsonl that were no event


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
            key=_order,  # run-2 before run-10
        )
        hint = (
            f"it holds runs ({', '.join(runs[:5])}{', ...' if len(runs) > 5 else ''}): pass one"
            if runs
            else "pass a run's log folder (LOG_DIR/run-N of graphdist run --log-dir)"
        )
        raise _refuse(path, f"it is not a run's log folder (no events.jsonl); {hint}")
    events: list[tuple[int, Event]] = []  # (line number, event): progress thinned as read
    thinned: dict[tuple[str, int], _Thin] = {}
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
                    thinned.setdefault(key, _Thin()).add((number, event))
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


class _Thin:
    """At most ``2 * MAX_POINTS`` of one task's records in one attempt, evenly spread as they
    come: past that, every other one kept goes and the stride doubles. The first (with its
    ``redone``) and the newest are always kept."""

    def __init__(self) -> None:
        self.kept: list[Any] = []
        self.stride, self.seen = 1, 0
        self.newest: Any = None

    def add(self, item: Any) -> None:
        if self.seen % self.stride == 0:
            self.kept.append(item)
            self.newest = None
        else:
            self.newest = item
        self.seen += 1
        if len(self.kept) >= 2 * MAX_POINTS:
            self.kept = self.kept[::2]
            self.stride *= 2

    def items(self) -> list[Any]:
        return self.kept + ([] if self.newest is None else [self.newest])


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _order(task: str) -> tuple[int, int, str]:
    match = _TASK.fullmatch(task)
    if match is None:
        return (9, 0, task)
    return (_JOBS.get(match.group(1), 8), int(match.group(2)), task)


def timeline(events: Sequence[Event], skipped: int = 0) -> Timeline:
    """The report's content from a run's events, each bar's state by the rule of the module
    docstring."""
    spans: list[Span] = []
    open_: dict[str, Span] = {}
    attempts: dict[int, float] = {}
    causes: dict[int, tuple[str, int | None]] = {}  # attempt -> (task, pid) it names
    preempted: dict[int, int] = {}  # attempt -> the preemption code
    stopped: set[int] = set()  # attempts a stop signal ended
    ends: dict[int, str] = {}
    marks: list[tuple[float, str, str | None, str]] = []
    progress: dict[str, list[Point]] = {}
    tasks: set[str] = set()

    def close(task: str, end_s: float | None, **facts: Any) -> Span:
        span = open_.pop(task, None)
        if span is None:  # an exit with no start (a server, a task that never started)
            span = Span(task, attempt, attempts.get(attempt, end_s or 0.0))
        spans.append(span)
        span.end_s = end_s
        for name, value in facts.items():
            setattr(span, name, value)
        return span

    for e in events:
        attempt, d = e.attempt, e.data
        if e.task is not None:
            tasks.add(e.task)
        if e.kind == "attempt-started":
            attempts[attempt] = e.at_s
            for server in d.get("servers", []):
                open_[server] = Span(server, attempt, e.at_s, server=True)
                tasks.add(server)
            tasks.update(d.get("tasks", []))
            if attempt > 1:
                restarts = d.get("restarts", 0)
                again = f" (restart {restarts})" if restarts else ""
                marks.append((e.at_s, "attempt", None, f"attempt {attempt}{again}"))
        elif e.kind == "task-started" and e.task is not None:
            if e.task in open_:
                close(e.task, e.at_s)
            open_[e.task] = Span(e.task, attempt, e.at_s, pid=d.get("pid"))
        elif e.kind == "task-exited" and e.task is not None:
            ended = d.get("ended_at_s")
            close(
                e.task,
                e.at_s if ended is None else float(ended),
                exitcode=d.get("exitcode"),
                how=d.get("how"),
                pid=d.get("pid"),
                server=bool(d.get("server")),
            )
        elif e.kind in ("restarting", "gave-up"):
            cause = d["cause"]
            when = float(cause.get("ended_at_s", e.at_s))
            words = f"{cause['task']} {cause.get('how') or 'failed'}"
            if e.kind == "restarting" and d.get("scope") == "server":
                # the server alone restarts on its address; the attempt goes on
                close(cause["task"], when, exitcode=cause.get("exitcode"), how=cause.get("how"))
                spans[-1].state = "failed"
                spans[-1].server = True
                open_[cause["task"]] = Span(
                    cause["task"], attempt, e.at_s + float(d.get("wait_s", 0.0)), server=True
                )
                marks.append((when, "failure", cause["task"], f"{words}; its server restarted"))
                continue
            causes[attempt] = (cause["task"], cause.get("pid"))
            marks.append((when, "failure", cause["task"], words))
            ends[attempt] = f"{words}; {d.get('decision', '')}".rstrip("; ")
        elif e.kind == "preempted":
            preempted[attempt] = int(d["code"])
            ends[attempt] = f"preempted (every task exited {d['code']}); {d.get('decision', '')}"
            marks.append((e.at_s, "preempted", None, "preempted"))
        elif e.kind == "stopping":
            stopped.add(attempt)
            ends.setdefault(attempt, f"{d['signal']}: stopped")
            marks.append((e.at_s, "stopping", None, d["signal"]))
        elif e.kind == "straggler" and e.task is not None:
            marks.append((e.at_s, "straggler", e.task, "straggler"))
        elif e.kind == "progress" and e.task is not None:
            scalars = d.get("scalars")
            loss = scalars.get("loss") if isinstance(scalars, dict) else None
            progress.setdefault(e.task, []).append(
                Point(
                    e.at_s,
                    attempt,
                    int(d["step"]),
                    _finite(d.get("steps_per_s")),
                    _finite(loss),
                    int(d.get("redone") or 0),
                )
            )
    for task in list(open_):
        close(task, None)
    for task, series in progress.items():
        by_attempt: dict[int, _Thin] = {}
        for point in series:
            by_attempt.setdefault(point.attempt, _Thin()).add(point)
        progress[task] = [p for a in sorted(by_attempt) for p in by_attempt[a].items()]
    ended = next((e for e in reversed(events) if e.kind == "run-ended"), None)
    if ended is not None:  # the launcher ended the last attempt: its tasks' exits were stops
        stopped.add(ended.attempt)
    for span in spans:
        if span.state == "failed":  # a server's restart said so
            continue
        span.state = _state(span, causes.get(span.attempt), preempted.get(span.attempt), stopped)
    took = max((e.at_s for e in events), default=0.0)
    for attempt in attempts:
        if attempt not in ends:
            last = max(attempts)
            ends[attempt] = (
                (str(ended.data.get("outcome")) if ended is not None else "still running")
                if attempt == last
                else "ended"
            )
    return Timeline(
        tasks=sorted(tasks, key=_order),
        spans=spans,
        attempts=attempts,
        ends=ends,
        marks=sorted(marks, key=lambda m: m[0]),
        progress=progress,
        took_s=took,
        outcome=None if ended is None else str(ended.data.get("outcome")),
        steps=dict(ended.data.get("steps") or {}) if ended is not None else {},
        redone=int(ended.data.get("redone") or 0) if ended is not None else 0,
        summary=summary(events),
        skipped=skipped,
    )


def _finite(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def _state(
    span: Span, cause: tuple[str, int | None] | None, code: int | None, stopped: set[int]
) -> str:
    """How a task's attempt ended, by rule: no exit → running; exit 0 → done; the attempt's
    cause (its task, and its pid where both say one) → failed; the preemption's code in a
    preempted attempt → preempted; any other exit in an attempt that a cause, a preemption, a
    stop signal or the run's end ended (a timeout, a task that could not start: the launcher
    names a task's own failure as a cause, a ``gave-up`` at least), or a server's (the launcher
    ends them with the attempt) → stopped; else (a launcher that died) → failed."""
    if span.end_s is None or (span.exitcode is None and span.how is None):
        return "running"
    if span.exitcode == 0:
        return "done"
    if cause is not None and cause[0] == span.task and None in (cause[1], span.pid):
        return "failed"
    if cause is not None and cause == (span.task, span.pid):
        return "failed"
    if code is not None and span.exitcode == code:
        return "preempted"
    if span.server or cause is not None or code is not None or span.attempt in stopped:
        return "stopped"  # a server ends with its attempt: a failed one is a cause
    return "failed"


# -- drawing -------------------------------------------------------------------------------------


def figure(tl: Timeline, *, title: bool = True) -> Figure:
    """The report's figure: the lanes, then steps done, steps/s and the loss where reported;
    its time axis from the first attempt's start (before it, the launcher placed the tasks and
    imported TensorFlow: said in the axis' label). ``title``: the run in one line on top (the
    page says it in its text instead)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    points = [p for series in tl.progress.values() for p in series]
    panels = ["lanes"]
    if points:
        panels.append("steps")
    if any(p.steps_per_s for p in points):
        panels.append("rate")
    if any(p.loss is not None for p in points):
        panels.append("loss")
    heights = [max(1.6, 0.5 * len(tl.tasks) + 0.9)] + [2.0] * (len(panels) - 1)
    fig = Figure(figsize=(11, sum(heights) + 0.9), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, height_ratios=heights, squeeze=False)[:, 0]
    if title:
        fig.suptitle(_title(tl), fontsize=11, x=0.01, ha="left")
    lanes = axes[0]
    row = {task: i for i, task in enumerate(tl.tasks)}
    seen: dict[str, int] = {}
    for span in tl.spans:
        end = tl.took_s if span.end_s is None else span.end_s
        bar = lanes.barh(
            row[span.task],
            max(end - span.start_s, tl.took_s / 400),
            left=span.start_s,
            height=0.6,
            color=COLOURS[span.state],
            edgecolor="white",
        )
        gid = f"lane-{span.task}-attempt-{span.attempt}-{span.state}"
        seen[gid] = seen.get(gid, 0) + 1  # a server restarted twice in one attempt
        bar.patches[0].set_gid(gid if seen[gid] == 1 else f"{gid}-{seen[gid]}")
    for at_s, kind, task, words in tl.marks:
        if kind == "failure" and task in row:
            lanes.plot([at_s], [row[task]], marker="X", color="black", markersize=9)
            lanes.annotate(
                words, (at_s, row[task]), xytext=(6, 9), textcoords="offset points", fontsize=8
            )
        elif kind == "straggler" and task in row:
            lanes.plot([at_s], [row[task] - 0.38], marker="v", color="#6a1b9a", markersize=8)
        else:
            colour = {"preempted": COLOURS["preempted"], "stopping": "black"}.get(kind, "#555555")
            for ax in axes:
                ax.axvline(at_s, color=colour, linestyle="--", linewidth=0.9)
            lanes.annotate(
                words,
                (at_s, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(3, 2),
                textcoords="offset points",
                fontsize=8,
                va="bottom",
            )
    lanes.set_yticks(range(len(tl.tasks)), tl.tasks)
    lanes.set_ylim(len(tl.tasks) - 0.4, -0.8)
    first = min(tl.attempts.values(), default=0.0)
    lanes.set_xlim(
        first - (tl.took_s - first) * 0.02, tl.took_s + (tl.took_s - first) * 0.02 + 1e-3
    )
    lanes.legend(
        handles=[Patch(color=c, label=s) for s, c in COLOURS.items()],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
        frameon=False,
    )
    colours = {task: f"C{i % 10}" for i, task in enumerate(tl.tasks)}
    for name, ax in zip(panels[1:], axes[1:], strict=True):
        top = 0.0
        for task in tl.tasks:
            series = tl.progress.get(task, [])
            for attempt in sorted({p.attempt for p in series}):
                mine = [p for p in series if p.attempt == attempt]
                xs = [p.at_s for p in mine]
                if name == "steps":
                    ys: list[float | None] = [p.step for p in mine]
                elif name == "rate":
                    ys = [p.steps_per_s for p in mine]
                else:
                    ys = [p.loss for p in mine]
                kept = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
                if kept:
                    top = max(top, *(y for _, y in kept))
                    ax.plot(
                        *zip(*kept, strict=True),
                        color=colours.get(task, "C0"),
                        marker=".",
                        markersize=3,
                        linewidth=1.2,
                        label=task if attempt == min(p.attempt for p in series) else None,
                    )
                again = next((p for p in mine if p.redone), None)
                if name == "steps" and again is not None:
                    ax.annotate(
                        f"{task}: {again.redone} again",
                        (again.at_s, again.step),
                        xytext=(6, -10 - 10 * row.get(task, 0)),
                        textcoords="offset points",
                        fontsize=8,
                        color=colours.get(task, "C0"),
                    )
        ax.set_ylabel({"steps": "steps done", "rate": "steps/s", "loss": "loss"}[name])
        if name != "loss":
            ax.set_ylim(0, top * 1.12 or 1.0)
        ax.grid(True, linewidth=0.3)
        if name == "steps":
            ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    axes[-1].set_xlabel(f"seconds since the run started (its first attempt at {first:.1f} s)")
    return fig


@contextlib.contextmanager
def _style() -> Iterator[None]:
    """matplotlib's own defaults, whatever the user's matplotlibrc says (``text.usetex`` would
    need LaTeX), and no mathtext: a ``$`` in a task's words is a dollar sign."""
    import matplotlib.style

    with matplotlib.style.context("default"), matplotlib.rc_context({"text.parse_math": False}):
        yield


def _title(tl: Timeline) -> str:
    attempts = len(tl.attempts)
    head = f"{attempts} attempt{'' if attempts == 1 else 's'} in {tl.took_s:.1f} s"
    outcome = tl.outcome if tl.outcome is not None else "no end recorded (still running?)"
    steps = ""
    if tl.steps:
        steps = "; steps: " + ", ".join(f"{t} {n}" for t, n in sorted(tl.steps.items()))
        steps += f" ({tl.redone} done again)" if tl.redone else ""
    return f"{head}: {outcome}{steps}"


def _svg(fig: Figure) -> str:
    """The figure as an ``<svg>`` element to inline in a page: deterministic ids, no date, text
    drawn as paths (the page needs no font)."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": "graphdist", "svg.fonttype": "path"}):
        fig.savefig(buf, format="svg", metadata={"Date": None})  # in _style(): the defaults
    text = buf.getvalue()
    return text[text.index("<svg") :]


def page(tl: Timeline, run_dir: str) -> str:
    """The report as one self-contained HTML page."""
    rows = []
    for attempt, start in sorted(tl.attempts.items()):
        mine = sorted((s for s in tl.spans if s.attempt == attempt), key=lambda s: _order(s.task))
        cells = "".join(
            f'<li><span class="dot" style="background:{COLOURS[s.state]}"></span>'
            f"{html.escape(s.task)}: {html.escape(s.state)}"
            f"{html.escape(' (' + s.how + ')') if s.how and s.state != 'done' else ''}</li>"
            for s in mine
        )
        rows.append(
            f"<tr><td>{attempt}</td><td>{start:.1f} s</td><td><ul>{cells}</ul></td>"
            f"<td>{html.escape(tl.ends.get(attempt, ''))}</td></tr>"
        )
    skipped = (
        f"<p class=note>{tl.skipped} line(s) of events.jsonl were no event and are left out.</p>"
        if tl.skipped
        else ""
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>graphdist run report: {html.escape(run_dir)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
h1 {{ font-size: 1.3em; }} .note {{ color: #8a4b00; }}
svg {{ max-width: 100%; height: auto; }}
table {{ border-collapse: collapse; }} td, th {{ border: 1px solid #ccc; padding: 0.3em 0.6em;
vertical-align: top; text-align: left; }} ul {{ margin: 0; padding-left: 1em; list-style: none; }}
.dot {{ display: inline-block; width: 0.8em; height: 0.8em; margin-right: 0.4em; }}
pre {{ background: #f5f5f5; padding: 0.6em; overflow-x: auto; }}
</style></head>
<body>
<h1>graphdist run: {html.escape(run_dir)}</h1>
<p>{html.escape(_title(tl))}</p>{skipped}
<figure id="timeline">{_svg(figure(tl, title=False))}</figure>
<h2>Attempts</h2>
<table id="attempts"><tr><th>attempt</th><th>started</th><th>tasks</th><th>ended</th></tr>
{"".join(rows)}</table>
<h2>Summary</h2>
<pre>{html.escape(tl.summary)}</pre>
</body></html>
"""


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
    whole; returns its path. :class:`ArgumentError` for a folder that is not a run's, or an
    output that cannot be written."""
    events, skipped = read_run(run_dir)
    path = check_output(os.path.abspath(os.fspath(run_dir)), output)
    tl = timeline(events, skipped)
    folder = os.path.dirname(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".report-", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "wb") as f, _style():
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
            raise GraphdistError(f"Cannot write the report {path}: {exc.strerror or exc}") from None
        raise
    return path
