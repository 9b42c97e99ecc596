"""Drawing a run's report (:mod:`graphdist._distribute.report`): one matplotlib figure, from a
:class:`~graphdist._distribute.runtimeline.Timeline`, with matplotlib's object API (no pyplot, so a
notebook's backend is left as it is) under matplotlib's own defaults (:func:`style`), and the
page that shows it inline as SVG."""

from __future__ import annotations

import contextlib
import html
import io
from collections.abc import Iterator
from typing import TYPE_CHECKING

from graphdist._distribute.runtimeline import Timeline, order

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["COLOURS", "figure", "page", "style"]

#: A bar's colour by how the task's attempt ended.
COLOURS = {
    "done": "#2e7d32",
    "failed": "#c62828",
    "stopped": "#9e9e9e",
    "preempted": "#ef6c00",
    "running": "#1565c0",
}


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
def style() -> Iterator[None]:
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
        mine = sorted((s for s in tl.spans if s.attempt == attempt), key=lambda s: order(s.task))
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
