"""Plumbing shared by the benchmark scripts: paths, quiet TensorFlow logs, the ``--json`` option,
and the checks that tell a run's reader when its figures cannot be trusted.

Every start-up figure is a ratio against a floor measured in the same run: a bare ``import
tensorflow``, or for graphdist's LocalFleet, whose servers import TensorFlow without Keras and
SciPy, the same lean import (:data:`FLOORS`). Two things make such a run unreliable, and both are
reported, never hidden:

* the floor varied too much between its repeats: its spread, ``(max - min) / median`` of the
  repeats' seconds, is over ``FLOOR_SPREAD_LIMIT``;
* a start-up figure beat its own floor: every fleet start imports TensorFlow at least as its
  floor does, so a figure under the floor means the machine's load changed during the run.

Measurements of several methods are taken in interleaved rounds (:func:`interleaved`), so that
the machine's load moves every method's figures alike and no method always runs first.

This module imports nothing heavy: importing it (or any benchmark script) never imports
TensorFlow.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, TypedDict, TypeVar

Key = TypeVar("Key", bound=Hashable)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

FLOOR_REPEATS = 3
"""The floor is measured at least this many times in every mode, so that its spread exists."""
FLOOR_SPREAD_LIMIT = 0.25
"""The most the floor may vary between its repeats, as a fraction of their median
((max - min) / median; 0.25 = 25 %), before a run is reported as noisy."""
WARNING = "Warning: "


class Floor(TypedDict):
    """What a floor is, in a warning's words: its ``name`` and what a start does that it bounds."""

    name: str
    bounds: str


FLOORS: dict[str, Floor] = {
    "bare_import": {
        "name": "bare `import tensorflow`",
        "bounds": "imports TensorFlow whole",
    },
    "lean_import": {
        "name": "lean `import tensorflow` (without Keras and SciPy, as a LocalFleet server)",
        "bounds": "imports TensorFlow as a LocalFleet server does",
    },
}
"""The start-up floors, by key: a bare import, and the import a LocalFleet's servers make
(``graphdist._proc.lean``)."""


class Figures(TypedDict, total=False):
    """One start-up figure (``startup.summarize``): the median ``seconds`` over its repeats,
    ``runs_s`` (every repeat, in the order measured) and, where measured, the median memory of
    every process the method ran (:func:`tree_memory`) and how many they were."""

    seconds: float
    runs_s: list[float]
    pss_mib: float
    rss_mib: float
    processes: int


class Latency(TypedDict):
    """Milliseconds per step (``master_choice.summarize``)."""

    median_ms: float
    p99_ms: float
    mean_ms: float
    steps: int


class Bandwidth(TypedDict):
    """Task-to-task transfer of one tensor size (``transfer.measure``), with its ceiling."""

    mb: int
    gb_per_s: float
    in_process_gb_per_s: float


def quiet_tensorflow(level: str = "2") -> None:
    """Silence TensorFlow's C++ logs in this process (unless the caller chose a level)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", level)


def add_json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="PATH", help="also write the raw figures here")


def write_json(path: str | None, data: Any) -> None:
    """Write ``data`` as indented JSON to ``path``; nothing when ``path`` is None."""
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")


RECORD_PAGE = "docs/benchmarks.md"
"""The page that holds every benchmark's section, relative to the repository root: what
``--readme`` is given to update the record (the option kept its name from when README held it)."""


def section_markers(name: str) -> tuple[str, str]:
    """The two comment lines that enclose the README section benchmark ``name`` writes."""
    return f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"


def add_readme_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--readme",
        metavar="PATH",
        help="also rewrite this page's section of this benchmark (the record is "
        f"{RECORD_PAGE}: between its <!-- bench:NAME:start --> and <!-- bench:NAME:end --> "
        "lines) with this run's output",
    )


def update_readme_section(readme: str | None, name: str, markdown: str, command: str) -> None:
    """Replace the section ``name`` of ``readme`` (see :func:`section_markers`) by ``markdown``
    and a line naming the ``command`` that printed it and today's date; nothing when ``readme``
    is None. Raises SystemExit naming the markers when the README has no such section: a figure
    is never appended where nobody reads it."""
    if not readme:
        return
    import datetime

    start, end = section_markers(name)
    with open(readme, encoding="utf-8") as f:
        text = f.read()
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise SystemExit(f"{readme} has no single {start} ... {end} section to replace")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    stamp = f"<sub>Printed by `{command}` on {datetime.date.today().isoformat()}.</sub>"
    body = f"{start}\n{markdown.rstrip()}\n\n{stamp}\n{end}"
    with open(readme, "w", encoding="utf-8") as f:
        f.write(head + body + tail)


def tree_memory(pid: int | None = None) -> dict[str, float]:
    """PSS and RSS (MiB) of process ``pid`` (default: this one) and of every process under it,
    and how many they are: a fleet's owner, its fork server and helpers, and its servers all
    count, as every process a method uses does. A process that exits while being read is left
    out. Imports psutil when called."""
    import psutil

    root = psutil.Process(pid)
    pss = rss = 0.0
    count = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            info = proc.memory_full_info()
        except psutil.NoSuchProcess:
            continue
        pss, rss, count = pss + info.pss, rss + info.rss, count + 1
    return {"pss_mib": pss / 2**20, "rss_mib": rss / 2**20, "processes": count}


def interleaved(
    plan: Sequence[Key], rounds: int, measure: Callable[[Key], Any]
) -> dict[Key, list[Any]]:
    """``measure(key)`` for every key of ``plan`` in each of ``rounds`` rounds, round ``r``
    starting ``r`` places later in the plan (so no key always runs first); every key's results
    in the order measured."""
    out: dict[Key, list[Any]] = {key: [] for key in plan}
    for r in range(rounds):
        k = r % len(plan)
        for key in [*plan[k:], *plan[:k]]:
            out[key].append(measure(key))
    return out


def parse_targets(printed: str) -> list[tuple[str, bool]]:
    """The ``(target text, met)`` pairs in what :func:`report_targets` printed: a benchmark's
    own check can be reused (and shown again) without restating it."""
    out = []
    for line in printed.splitlines():
        for prefix, met in (("met     ", True), ("MISSED  ", False)):
            if line.startswith(prefix):
                out.append((line[len(prefix) :], met))
    return out


def report_targets(lines: Sequence[tuple[str, bool]]) -> list[str]:
    """Print each ``(target text, met)`` as ``met`` or ``MISSED``; the texts of those missed."""
    for text, met in lines:
        print(("met     " if met else "MISSED  ") + text)
    return [text for text, met in lines if not met]


def finish(path: str | None, figures: Any, missed: Sequence[str]) -> None:
    """Write ``figures`` to ``--json`` ``path`` (if any); exit 1 if a target was missed."""
    write_json(path, figures)
    if missed:
        sys.exit(1)


def spread(values: list[float]) -> float:
    """``(max - min) / median`` of ``values``: 0.0 for fewer than two values."""
    if len(values) < 2:
        return 0.0
    median = statistics.median(values)
    return (max(values) - min(values)) / median if median else float("inf")


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ``ys`` against ``xs`` (0.0 when every x is the same)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def floor_warnings(
    floor: Mapping[str, Any],
    figures: Iterable[tuple[str, float]],
    limit: float = FLOOR_SPREAD_LIMIT,
    kind: str = "bare_import",
) -> list[str]:
    """The warnings of a run whose floor of ``kind`` (a key of :data:`FLOORS`) is ``floor``
    (``seconds``: the median, ``runs_s``: every repeat) and whose start-up figures bounded by it
    are ``figures`` (label, seconds); empty for a clean run."""
    out = []
    what = FLOORS[kind]
    runs = list(floor.get("runs_s", []))
    if spread(runs) > limit:
        out.append(
            f"{WARNING}noisy run: the floor ({what['name']}) varied {spread(runs):.0%} "
            f"between its {len(runs)} repeats ({min(runs):.2f} s to {max(runs):.2f} s; limit "
            f"{limit:.0%} of their median); the ratios against it are unreliable."
        )
    low = floor["seconds"]
    for label, seconds in figures:
        if seconds < low:
            out.append(
                f"{WARNING}{label}: {seconds:.2f} s beat its own floor ({what['name']}, "
                f"{low:.2f} s), which no start that {what['bounds']} can do: the machine's load "
                "changed during the run; the ratios against the floor are unreliable."
            )
    return out


def report_targets_kept(lines: Sequence[tuple[str, bool]]) -> tuple[list[str], list[str]]:
    """:func:`report_targets`, also returning the lines it printed (for a README section that
    shows them as printed) before the texts of the targets missed."""
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        missed = report_targets(lines)
    sys.stdout.write(printed.getvalue())
    return printed.getvalue().splitlines(), missed


def update_readme_inline(readme: str | None, name: str, text: str, command: str) -> None:
    """Replace what lies between the markers of ``name`` (:func:`section_markers`) inside one
    line of ``readme`` (a figure in a sentence) by ``text`` and, after it, the ``command`` that
    printed it and today's date in parentheses; nothing when ``readme`` is None. Raises
    SystemExit naming the markers when they are not there once each, on one line."""
    if not readme:
        return
    import datetime
    import re

    start, end = section_markers(name)
    with open(readme, encoding="utf-8") as f:
        old = f.read()
    found = re.compile(re.escape(start) + "[^\n]*?" + re.escape(end))
    if len(found.findall(old)) != 1 or old.count(start) != 1:
        raise SystemExit(f"{readme} has no single line with {start} ... {end} to replace")
    stamp = f"(`{command}`, {datetime.date.today().isoformat()})"
    new = found.sub(lambda _: f"{start}{text} {stamp}{end}", old)
    with open(readme, "w", encoding="utf-8") as f:
        f.write(new)


def add_report_options(parser: argparse.ArgumentParser) -> None:
    """``--no-check`` (targets printed, but no exit 1 for a miss: a smoke run's option),
    ``--json`` and ``--readme``: the options of a benchmark that checks targets."""
    parser.add_argument(
        "--no-check", action="store_true", help="print the targets but exit 0 when one is missed"
    )
    add_json_option(parser)
    add_readme_option(parser)


def publish(
    args: argparse.Namespace,
    name: str,
    script: str,
    argv: Sequence[str] | None,
    report: tuple[str, Sequence[tuple[str, bool]]],
    figures: Any,
) -> None:
    """The end of a benchmark that checks targets (:func:`add_report_options`): print its
    ``report`` (text, targets), rewrite its section ``name`` of ``--readme`` with both, write
    ``--json`` and exit 1 for a missed target unless ``--no-check``."""
    text, targets = report
    print(text)
    printed, missed = report_targets_kept(targets)
    section = text + ("\n\n```\n" + "\n".join(printed) + "\n```" if printed else "")
    update_readme_section(args.readme, name, section, command_line(script, argv))
    finish(args.json, figures, [] if args.no_check else missed)


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """How ``benchmarks/SCRIPT`` was run with ``argv`` (None: this process's arguments), as a
    README stamp names it."""
    return " ".join([f"python benchmarks/{script}", *(sys.argv[1:] if argv is None else argv)])
