"""The benchmark suite: every speed and memory figure, beside what a user would otherwise do, in
one run on this machine, and every target checked.

    python benchmarks/suite.py [--full | --smoke] [--out DIR] [--readme docs/benchmarks.md]
    python -m benchmarks.suite [...]

It reuses ``startup.py`` (fleet start-up and memory vs size: LocalFleet, the seed's spawned
processes, ``tf.test.create_local_cluster``, against two floors: a bare TensorFlow import and the
lean one a LocalFleet server makes; and the side by side of a cold LocalFleet against a cold
``create_local_cluster`` at 8 and 16 servers and a warm LocalFleet beside TensorFlow's warm
floor), ``master_choice.py`` (step latency of the seeds' split graph, raw TF vs graphdist
sessions, each master) and ``transfer.py`` (task-to-task bandwidth vs an in-process copy), adds
how step latency grows with the number of tasks, and fits a slope to every curve. It writes
``results.json`` (raw figures), ``results.md`` (the tables) and PNG plots to ``--out``, prints
the tables, then each target as ``met`` or ``MISSED`` (:func:`targets`: a warm start within 1.25x
of TensorFlow's warm floor at 8 and 16 servers, one task's warm ``restart()`` to serving within
0.25 s, master_choice's step-latency targets), and exits 1 if one was missed.

The record is never overwritten by accident. A plain run writes ``bench-results/`` at the
repository root, which git ignores, and touches no page: a quick run on a busy laptop cannot
replace the figures that are committed. Updating the record is explicit: ``--readme
docs/benchmarks.md`` replaces that page's section ``suite`` (between ``<!--
bench:suite:start -->`` and ``<!-- bench:suite:end -->``, ``_common.update_readme_section``,
which names the command and the date)
and, unless ``--out`` says otherwise, writes the tracked ``benchmarks/results/`` whose start-up
plot the section shows, so the two always agree; ``--out benchmarks/results`` alone updates the
files without the page.

Every start-up figure is measured in interleaved rounds (each round runs every method at every
size and both floors, in a rotated order: ``_common.interleaved``) and is a ratio against the
floor of the import its processes make, measured in the same rounds. Memory counts every process
a method runs, read after its READY. A run whose floor varied by more than
``FLOOR_SPREAD_LIMIT`` (25 % of its median) between its rounds, whose start-up figures beat their
own floor, or whose floors were measured fewer than ``FLOOR_REPEATS`` (3) times, says so in a
warning at the top of its output and of ``results.md`` (so of the README section too); the
warnings are also listed in ``results.json``. See ``_common.py``.

The quick mode (default) runs three rounds of 1, 4 and 8 servers and three side-by-side rounds;
``--full`` adds 2 and 16 servers, 256 MB tensors, more steps and five side-by-side rounds;
``--smoke`` runs everything once at its smallest size, for the test suite.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import platform
import sys
import time
from typing import Any

try:
    from . import master_choice, startup, transfer
    from ._common import (
        FLOOR_SPREAD_LIMIT,
        HERE,
        REPO,
        WARNING,
        finish,
        parse_targets,
        report_targets,
        section_markers,
        slope,
        update_readme_section,
        write_json,
    )
except ImportError:  # run as a script, or imported with benchmarks/ on sys.path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import master_choice
    import startup
    import transfer
    from _common import (
        FLOOR_SPREAD_LIMIT,
        HERE,
        REPO,
        WARNING,
        finish,
        parse_targets,
        report_targets,
        section_markers,
        slope,
        update_readme_section,
        write_json,
    )

MODES: dict[str, dict[str, Any]] = {
    "quick": {
        "sizes": [1, 4, 8],
        "repeats": 3,
        "steps": 1000,
        "scale_tasks": [2, 4, 8],
        "transfer_mb": [1, 16, 64],
        "transfer_repeats": 5,
        "side_by_side": {"sizes": [8, 16], "warm_sizes": [8, 16], "repeats": 3},
    },
    "full": {
        "sizes": [1, 2, 4, 8, 16],
        "repeats": 3,
        "steps": 5000,
        "scale_tasks": [2, 4, 8, 16],
        "transfer_mb": [1, 4, 16, 64, 256],
        "transfer_repeats": 5,
        "side_by_side": {"sizes": [8, 16], "warm_sizes": [8, 16], "repeats": 5},
    },
    # Every measuring function at its smallest size, for the test suite: its figures say nothing,
    # the shape of its output is what is checked (tests/test_bench.py).
    "smoke": {
        "sizes": [1],
        "repeats": 1,
        "steps": 20,
        "scale_tasks": [2],
        "transfer_mb": [1],
        "transfer_repeats": 1,
        "side_by_side": {"sizes": [1], "warm_sizes": [1], "repeats": 1},
    },
}
LABELS = startup.LABELS
RECORD = os.path.join(HERE, "results")
"""The tracked record, written only on request (``--out`` or ``--readme``)."""
SCRATCH = os.path.join(REPO, "bench-results")
"""Where a plain run writes; ignored by git."""
SECTION = "suite"
"""The README section this suite rewrites (``_common.section_markers``)."""


def scale_latency(task_counts: list[int], steps: int) -> list[dict[str, float]]:
    """Step latency of a graph that gathers one value from every task, by number of tasks."""
    import tensorflow as tf

    import graphdist

    rows = []
    for n in task_counts:
        with graphdist.LocalFleet(f"local={n}") as fleet:
            graph = tf.Graph()
            with graph.as_default():
                parts = []
                for i in range(n):
                    with tf.device(fleet.device("local", i)):
                        parts.append(tf.add(tf.constant(float(i)), 1.0))
                with tf.device(fleet.device("local", 0)):
                    total = tf.add_n(parts)
            config = graphdist.no_folding_config()
            with fleet.session("local", 0, graph=graph, config=config) as sess:
                master_choice.timed_steps(sess, total, 100)
                figures = master_choice.summarize(master_choice.timed_steps(sess, total, steps))
        rows.append({"tasks": n, **figures})
    return rows


def machine() -> str:
    import psutil

    mem = psutil.virtual_memory().total / 2**30
    return (
        f"{os.cpu_count()} CPU cores, {mem:.0f} GiB RAM, {platform.system()} {platform.machine()}"
    )


def tensorflow_version() -> str:
    import tensorflow as tf

    return str(tf.__version__)


def measure_startup(sizes: list[int], repeats: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Both floors and one start-up row per size, every method and floor in each of ``repeats``
    interleaved rounds (``startup.startup_rounds``), after a warm-up import that is not counted
    (a cold disk cache would count as noise)."""
    startup.once("bare_import", 0)
    return startup.startup_rounds(startup.METHODS, sizes, repeats)


def run_warnings(r: dict[str, Any]) -> list[str]:
    """Why the run's figures cannot be trusted (``startup.startup_warnings``); empty if clean."""
    floors = {k: r[k] for k in startup.FLOOR_KEYS}
    out = startup.startup_warnings(floors, r["startup"], startup.METHODS)
    side = r.get("side_by_side")
    if side:
        out += [w.replace(WARNING, f"{WARNING}side by side: ", 1) for w in side["warnings"]]
    return out


def step_targets(latency: dict[str, Any]) -> list[tuple[str, bool]]:
    """``master_choice``'s own targets on the suite's step latencies: its check, run here with
    its printing kept, read back (``_common.parse_targets``), so that the targets are stated
    once, in master_choice.py."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        master_choice.check(latency)
    return [
        (f"{text} (benchmarks/master_choice.py)", met)
        for text, met in parse_targets(printed.getvalue())
    ]


def targets(r: dict[str, Any]) -> list[tuple[str, bool]]:
    """Every target the suite checks, (text, met): a warm start within
    ``startup.WARM_TARGET`` of TensorFlow's warm floor and one task's warm ``restart()`` within
    ``startup.RESTART_TARGET_S`` at each warm size, and master_choice's
    step-latency targets (graphdist's session within 1.05x of a raw one on each master, its
    choice of master 1.8x faster than the seed's)."""
    side = r.get("side_by_side")
    return [*(side["targets"] if side else []), *step_targets(r["step_latency"])]


def run(mode: str) -> dict[str, Any]:
    cfg = MODES[mode]
    t0 = time.monotonic()
    floors, rows = measure_startup(cfg["sizes"], cfg["repeats"])
    side = cfg["side_by_side"]
    side_by_side = startup.side_by_side(side["sizes"], side["warm_sizes"], side["repeats"])
    results: dict[str, Any] = {
        "mode": mode,
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "tensorflow": tensorflow_version(),
        "python": platform.python_version(),
        "floor_spread_limit": FLOOR_SPREAD_LIMIT,
        "repeats": cfg["repeats"],
        **floors,
        "startup": rows,
        "side_by_side": side_by_side,
        "step_latency": master_choice.measure(cfg["steps"], rounds=5),
        "scale_latency": scale_latency(cfg["scale_tasks"], cfg["steps"] // 2),
        "transfer": transfer.measure(cfg["transfer_mb"], repeats=cfg["transfer_repeats"]),
    }
    sizes = [r["servers"] for r in rows]
    results["slopes"] = {
        **{
            f"startup_s_per_server[{m}]": slope(sizes, [r[m]["seconds"] for r in rows])
            for m in startup.METHODS
        },
        **{
            f"pss_mib_per_server[{m}]": slope(sizes, [r[m]["pss_mib"] for r in rows])
            for m in startup.METHODS
        },
        "latency_ms_per_task": slope(
            [r["tasks"] for r in results["scale_latency"]],
            [r["median_ms"] for r in results["scale_latency"]],
        ),
    }
    results["elapsed_s"] = time.monotonic() - t0
    results["warnings"] = run_warnings(results)
    results["targets"] = targets(results)
    return results


def _cell(figures: dict[str, Any], floor: dict[str, Any]) -> str:
    return f"{figures['seconds']:.2f} s ({figures['seconds'] / floor['seconds']:.2f}x)"


def _floor_line(r: dict[str, Any], kind: str) -> str:
    floor = r[kind]
    runs = floor.get("runs_s", [])
    return f"{startup.FLOOR_LABELS[kind]} = {floor['seconds']:.2f} s (median of {len(runs)})"


def markdown(r: dict[str, Any]) -> str:
    """The run as Markdown: warnings first, then each benchmark's figures under its name, and
    every target as met or MISSED."""
    out = [f"> **Warning:** {w.removeprefix(WARNING)}\n" for w in run_warnings(r)]
    floor_of = {m: r[startup.FLOOR_OF[m]] for m in startup.METHODS}
    out += [
        f"Measured on {r['date']}, {r['machine']}, Python {r['python']}, TensorFlow "
        f"{r['tensorflow']} ({r['mode']} mode, {r['elapsed_s']:.0f} s). Written by "
        "`benchmarks/suite.py`.",
        "",
        "**Targets**",
        "",
        *(f"- {'met' if met else '**MISSED**'}: {text}" for text, met in r.get("targets", [])),
        "",
        f"**Start-up** (`benchmarks/startup.py`: launch to every server answering gRPC, median of "
        f"{r.get('repeats', 1)} interleaved rounds; floors: {_floor_line(r, 'bare_import')}, "
        f"{_floor_line(r, 'lean_import')}; each method against the floor of the import its "
        "servers make)",
        "",
        "| servers | "
        + " | ".join(
            f"{LABELS[m]} (x {'lean' if startup.FLOOR_OF[m] == 'lean_import' else 'bare'} floor)"
            for m in startup.METHODS
        )
        + " |",
        "|---:|" + "---:|" * len(startup.METHODS),
    ]
    for row in r["startup"]:
        cells = [_cell(row[m], floor_of[m]) for m in startup.METHODS]
        out.append(f"| {row['servers']} | " + " | ".join(cells) + " |")
    if r.get("side_by_side"):
        out += ["", *startup.side_by_side_lines(r["side_by_side"])]

    def memory(f: dict[str, Any]) -> str:
        return f"{f['pss_mib']:.0f} / {f['rss_mib']:.0f} ({f.get('processes', '?')})"

    out += [
        "",
        "**Memory of every process each method runs** (`benchmarks/startup.py`, read after "
        "READY; MiB, PSS / RSS (processes): a LocalFleet's owner, fork server, helper and "
        "servers; the seed's parent, servers and resource tracker; create_local_cluster's one "
        "process)",
        "",
        "| servers | " + " | ".join(LABELS[m] for m in startup.METHODS) + " |",
        "|---:|" + "---:|" * len(startup.METHODS),
    ]
    for row in r["startup"]:
        cells = [memory(row[m]) for m in startup.METHODS]
        out.append(f"| {row['servers']} | " + " | ".join(cells) + " |")
    for kind in startup.FLOOR_KEYS:
        if "pss_mib" in r[kind]:
            out.append(f"| {startup.FLOOR_LABELS[kind]} | {memory(r[kind])} | | |")
    out += [
        "",
        "**Step latency**, the seeds' split graph (`benchmarks/master_choice.py`, ms)",
        "",
        "| session | median | p99 |",
        "|---|---:|---:|",
    ]
    for name, f in r["step_latency"].items():
        out.append(f"| {name} | {f['median_ms']:.3f} | {f['p99_ms']:.3f} |")
    out += [
        "",
        "**Transfer** between two tasks (`benchmarks/transfer.py`)",
        "",
        "| MB | task → task | in-process copy |",
        "|---:|---:|---:|",
    ]
    for t in r["transfer"]:
        out.append(
            f"| {t['mb']} | {t['gb_per_s']:.2f} GB/s | {t['in_process_gb_per_s']:.2f} GB/s |"
        )
    out += [
        "",
        "**Scale** (`benchmarks/suite.py`: least-squares slopes of the curves above, and of the "
        "step latency of a graph that gathers a value from every task, by number of tasks)",
        "",
        "| curve | slope |",
        "|---|---:|",
    ]
    for name, value in r["slopes"].items():
        unit = "ms/task" if "latency" in name else ("MiB/server" if "pss" in name else "s/server")
        out.append(f"| {name} | {value:.3f} {unit} |")
    return "\n".join(out) + "\n"


SHOWN_PLOTS = {
    "startup.png": "fleet start-up",
    "memory.png": "fleet memory",
    "bandwidth.png": "task-to-task bandwidth",
}
"""The plots the page shows (the curves; the step latency's bars say no more than its table)."""


def plots(r: dict[str, Any], out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    sizes = [row["servers"] for row in r["startup"]]

    def save(fig: Any, name: str) -> None:
        path = os.path.join(out_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for m, label in LABELS.items():
        ax.plot(sizes, [row[m]["seconds"] for row in r["startup"]], marker="o", label=label)
    ax.axhline(r["bare_import"]["seconds"], color="grey", ls="--", label="bare import (floor)")
    if "lean_import" in r:
        ax.axhline(r["lean_import"]["seconds"], color="grey", ls=":", label="lean import (floor)")
    ax.set(xlabel="servers", ylabel="seconds to ready", title=f"Fleet start-up ({r['date']})")
    ax.legend(fontsize=8)
    save(fig, "startup.png")

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for m, label in LABELS.items():
        ax.plot(sizes, [row[m]["pss_mib"] for row in r["startup"]], marker="o", label=f"{label}")
    ax.set(xlabel="servers", ylabel="PSS of every process (MiB)", title="Fleet memory")
    ax.legend(fontsize=8)
    save(fig, "memory.png")

    fig, ax = plt.subplots(figsize=(6, 3.6))
    names = list(r["step_latency"])
    ax.barh(names, [r["step_latency"][n]["median_ms"] for n in names], label="median")
    ax.barh(names, [r["step_latency"][n]["p99_ms"] for n in names], alpha=0.3, label="p99")
    ax.set(xlabel="ms per step", title="Split-graph step latency")
    ax.legend(fontsize=8)
    save(fig, "latency.png")

    fig, ax = plt.subplots(figsize=(6, 3.6))
    mbs = [t["mb"] for t in r["transfer"]]
    ax.plot(mbs, [t["gb_per_s"] for t in r["transfer"]], marker="o", label="task → task (gRPC)")
    ax.plot(mbs, [t["in_process_gb_per_s"] for t in r["transfer"]], marker="o", label="in-process")
    ax.set(xscale="log", yscale="log", xlabel="tensor MB", ylabel="GB/s", title="Transfer")
    ax.legend(fontsize=8)
    save(fig, "bandwidth.png")
    return paths


def command(args: argparse.Namespace) -> str:
    """The command that printed a README section: named beside it (``update_readme_section``)."""
    mode = " --full" if args.mode == "full" else " --smoke" if args.mode == "smoke" else ""
    return f"python benchmarks/suite.py{mode} --readme {args.readme}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    start, end = section_markers(SECTION)
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="Without --readme no page is read or written; --readme is the only way this "
        "suite rewrites the benchmark section of a page (the record: docs/benchmarks.md).",
    )
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument(
        "--full",
        dest="mode",
        action="store_const",
        const="full",
        help="the full mode (about 15 minutes)",
    )
    modes.add_argument(
        "--smoke",
        dest="mode",
        action="store_const",
        const="smoke",
        help="every measurement at its smallest size, to check that the suite runs (its "
        "figures mean nothing)",
    )
    parser.set_defaults(mode="quick")
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="folder for results.json, results.md and the plots (default: "
        f"{os.path.relpath(SCRATCH, REPO)}/ at the repository root, ignored by git; with "
        f"--readme: {os.path.relpath(RECORD, REPO)}/, the tracked record docs/benchmarks.md shows)",
    )
    parser.add_argument(
        "--readme",
        metavar="PATH",
        help="explicitly rewrite this page's benchmark section (docs/benchmarks.md: between "
        f"'{start}' and '{end}') with the results; nothing else touches it",
    )
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = RECORD if args.readme else SCRATCH
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the suite, print and write its figures (and the README section, with ``--readme``),
    report its targets; return the results, with the texts of the targets missed under
    ``missed`` (the script then exits 1)."""
    args = parse_args(argv)
    results = run(args.mode)
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "results.json"), results)
    block = markdown(results)
    with open(os.path.join(args.out, "results.md"), "w", encoding="utf-8") as f:
        f.write(block)
    paths = plots(results, args.out)
    print(block)
    written = [os.path.join(args.out, "results.json"), os.path.join(args.out, "results.md")]
    if args.readme:
        here = os.path.dirname(os.path.abspath(args.readme))
        shown = [
            f"![{SHOWN_PLOTS[os.path.basename(p)]}]({os.path.relpath(p, here)})"
            for p in paths
            if os.path.basename(p) in SHOWN_PLOTS
        ]
        section = "\n\n".join([block, *shown])
        update_readme_section(args.readme, SECTION, section, command(args))
        written.append(f"{args.readme} (benchmark section)")
    print("wrote", ", ".join([*written, *paths]))
    for line in results["warnings"]:
        print(line, file=sys.stderr)
    return {**results, "missed": report_targets(results["targets"])}


if __name__ == "__main__":
    finish(None, None, main()["missed"])
