"""The benchmark suite: every speed and memory figure, beside what a user would otherwise do, in
one run on this machine.

    python benchmarks/suite.py [--full] [--out DIR] [--readme README.md]
    python -m benchmarks.suite [...]

It reuses ``startup.py`` (fleet start-up and memory vs size: LocalFleet, the seed's spawned
processes, ``tf.test.create_local_cluster``, floor: a bare TensorFlow import; and the side by side
of a cold LocalFleet against a cold ``create_local_cluster`` at 8 and 16 servers and a warm
LocalFleet, in interleaved rounds that each measure the floor too), ``master_choice.py``
(step latency of the seeds' split graph, raw TF vs graphdist sessions, each master) and
``transfer.py`` (task-to-task bandwidth vs an in-process copy), adds how step latency grows with
the number of tasks, and fits a slope to every curve. It writes ``results.json`` (raw figures),
``results.md`` (the tables) and PNG plots to ``--out``, and prints the tables.

The record is never overwritten by accident. A plain run writes ``bench-results/`` at the
repository root, which git ignores, and touches no README: a quick run on a busy laptop cannot
replace the full-mode figures that are committed. Updating the record is explicit:
``--readme README.md`` replaces that README's benchmark section (between ``<!-- bench:start -->``
and ``<!-- bench:end -->``) and, unless ``--out`` says otherwise, writes the tracked
``benchmarks/results/`` whose start-up plot the section shows, so the two always agree;
``--out benchmarks/results`` alone updates the files without the README.

Every start-up figure is a ratio against the floor, a bare ``import tensorflow`` measured in the
same run ``FLOOR_REPEATS`` (3) times in every mode: after a warm-up import, once before the
start-up figures, at even points between them and once after, so its spread shows how the
machine's load moved while they were measured. A run whose floor varied by more than
``FLOOR_SPREAD_LIMIT`` (25 % of its median) between its repeats, or whose start-up figures beat
their own floor, says so in a warning at the top of its output and of ``results.md`` (so of the
README section too); the warnings are also listed in ``results.json``. See ``_common.py``.

The quick mode (default) takes about five minutes here, three of them for the side by side's three
rounds; ``--full`` adds 16 servers, 256 MB tensors and repeats (five side-by-side rounds).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from typing import Any

try:
    from . import master_choice, startup, transfer
    from ._common import (
        FLOOR_REPEATS,
        FLOOR_SPREAD_LIMIT,
        HERE,
        REPO,
        WARNING,
        floor_warnings,
        slope,
        write_json,
    )
except ImportError:  # run as a script, or imported with benchmarks/ on sys.path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import master_choice
    import startup
    import transfer
    from _common import (
        FLOOR_REPEATS,
        FLOOR_SPREAD_LIMIT,
        HERE,
        REPO,
        WARNING,
        floor_warnings,
        slope,
        write_json,
    )

MODES: dict[str, dict[str, Any]] = {
    "quick": {
        "sizes": [1, 2, 4, 8],
        "repeats": 1,
        "steps": 1000,
        "scale_tasks": [2, 4, 8],
        "transfer_mb": [1, 16, 64],
        "side_by_side": {"sizes": [8, 16], "warm_sizes": [8, 16], "repeats": 3},
    },
    "full": {
        "sizes": [1, 2, 4, 8, 16],
        "repeats": 3,
        "steps": 5000,
        "scale_tasks": [2, 4, 8, 16],
        "transfer_mb": [1, 4, 16, 64, 256],
        "side_by_side": {"sizes": [8, 16], "warm_sizes": [8, 16], "repeats": 5},
    },
}
LABELS = startup.LABELS
RECORD = os.path.join(HERE, "results")
"""The tracked record, written only on request (``--out`` or ``--readme``)."""
SCRATCH = os.path.join(REPO, "bench-results")
"""Where a plain run writes; ignored by git."""
START, END = "<!-- bench:start -->", "<!-- bench:end -->"


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


def floor_points(floor_repeats: int, rows: int) -> list[int]:
    """Before which start-up row (``rows`` = after the last) each repeat of the floor is measured:
    the first before every row, the last after every row, the others evenly between."""
    if floor_repeats < 2:
        return [0] * floor_repeats
    return [round(i * rows / (floor_repeats - 1)) for i in range(floor_repeats)]


def measure_startup(
    sizes: list[int], repeats: int, floor_repeats: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The floor (a bare TensorFlow import, ``floor_repeats`` times spread over the
    measurement) and one start-up row per size, each method ``repeats`` times."""
    startup.once("bare_import", 0)  # warm-up: a cold disk cache would count as noise
    points = floor_points(floor_repeats, len(sizes))
    floor_runs = []
    rows = []
    for i, n in enumerate([*sizes, None]):
        floor_runs += [startup.once("bare_import", 0) for p in points if p == i]
        if n is not None:
            rows.append({"servers": n, **{m: startup.measure(m, n, repeats) for m in LABELS}})
    return startup.summarize(floor_runs), rows


def run_warnings(r: dict[str, Any]) -> list[str]:
    """Why the run's figures cannot be trusted (``_common.floor_warnings``); empty if clean."""
    out = floor_warnings(r["bare_import"], startup.startup_figures(r["startup"], LABELS))
    side = r.get("side_by_side")
    if side:
        out += [w.replace(WARNING, f"{WARNING}side by side: ", 1) for w in side["warnings"]]
    return out


def run(mode: str) -> dict[str, Any]:
    cfg = MODES[mode]
    t0 = time.monotonic()
    floor, rows = measure_startup(cfg["sizes"], cfg["repeats"], max(FLOOR_REPEATS, cfg["repeats"]))
    side = cfg["side_by_side"]
    side_by_side = startup.side_by_side(side["sizes"], side["warm_sizes"], side["repeats"])
    results: dict[str, Any] = {
        "mode": mode,
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "tensorflow": tensorflow_version(),
        "python": platform.python_version(),
        "floor_spread_limit": FLOOR_SPREAD_LIMIT,
        "bare_import": floor,
        "startup": rows,
        "side_by_side": side_by_side,
        "step_latency": master_choice.measure(cfg["steps"], rounds=5),
        "scale_latency": scale_latency(cfg["scale_tasks"], cfg["steps"] // 2),
        "transfer": transfer.measure(cfg["transfer_mb"], repeats=5),
    }
    sizes = [r["servers"] for r in rows]
    results["slopes"] = {
        **{
            f"startup_s_per_server[{m}]": slope(sizes, [r[m]["seconds"] for r in rows])
            for m in startup.METHODS
        },
        **{
            f"pss_mib_per_server[{m}]": slope(sizes, [r[m]["pss_mib"] for r in rows])
            for m in ("local_fleet", "seed_style")
        },
        "latency_ms_per_task": slope(
            [r["tasks"] for r in results["scale_latency"]],
            [r["median_ms"] for r in results["scale_latency"]],
        ),
    }
    results["elapsed_s"] = time.monotonic() - t0
    results["warnings"] = run_warnings(results)
    return results


def markdown(r: dict[str, Any]) -> str:
    bare = r["bare_import"]["seconds"]
    out = [f"> **Warning:** {w.removeprefix(WARNING)}\n" for w in run_warnings(r)]
    runs = r["bare_import"].get("runs_s", [])
    of = f", median of {len(runs)}" if len(runs) > 1 else ""
    out += [
        f"Measured on {r['date']}, {r['machine']}, Python {r['python']}, TensorFlow "
        f"{r['tensorflow']} ({r['mode']} mode, {r['elapsed_s']:.0f} s). Written by "
        "`benchmarks/suite.py`.",
        "",
        f"**Start-up** (launch to every server answering gRPC; floor: bare `import tensorflow` = "
        f"{bare:.2f} s{of})",
        "",
        "| servers | " + " | ".join(LABELS[m] for m in startup.METHODS) + " |",
        "|---:|" + "---:|" * len(startup.METHODS),
    ]
    for row in r["startup"]:
        cells = [f"{row[m]['seconds']:.2f} s ({row[m]['seconds'] / bare:.2f}x)" for m in LABELS]
        out.append(f"| {row['servers']} | " + " | ".join(cells) + " |")
    if r.get("side_by_side"):
        out += ["", *startup.side_by_side_lines(r["side_by_side"])]
    out += [
        "",
        "**Memory of the server processes** (MiB, PSS / RSS)",
        "",
        "| servers | " + " | ".join(LABELS[m] for m in startup.METHODS) + " |",
        "|---:|" + "---:|" * len(startup.METHODS),
    ]
    for row in r["startup"]:
        cells = [f"{row[m]['pss_mib']:.0f} / {row[m]['rss_mib']:.0f}" for m in LABELS]
        out.append(f"| {row['servers']} | " + " | ".join(cells) + " |")
    out += ["", "**Step latency**, the seeds' split graph (ms)", "", "| session | median | p99 |"]
    out.append("|---|---:|---:|")
    for name, f in r["step_latency"].items():
        out.append(f"| {name} | {f['median_ms']:.3f} | {f['p99_ms']:.3f} |")
    out += ["", "**Transfer** between two tasks", "", "| MB | task → task | in-process copy |"]
    out.append("|---:|---:|---:|")
    for t in r["transfer"]:
        out.append(
            f"| {t['mb']} | {t['gb_per_s']:.2f} GB/s | {t['in_process_gb_per_s']:.2f} GB/s |"
        )
    out += ["", "**Scale** (least-squares slopes)", "", "| curve | slope |", "|---|---:|"]
    for name, value in r["slopes"].items():
        unit = "ms/task" if "latency" in name else ("MiB/server" if "pss" in name else "s/server")
        out.append(f"| {name} | {value:.3f} {unit} |")
    return "\n".join(out) + "\n"


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
    ax.set(xlabel="servers", ylabel="seconds to ready", title=f"Fleet start-up ({r['date']})")
    ax.legend(fontsize=8)
    save(fig, "startup.png")

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for m, label in LABELS.items():
        ax.plot(sizes, [row[m]["pss_mib"] for row in r["startup"]], marker="o", label=f"{label}")
    ax.set(xlabel="servers", ylabel="PSS of server processes (MiB)", title="Fleet memory")
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


def update_readme(readme: str, block: str, plot: str) -> None:
    with open(readme, encoding="utf-8") as f:
        text = f.read()
    if START not in text or END not in text:
        raise SystemExit(f"{readme} has no {START} ... {END} section to replace")
    rel = os.path.relpath(plot, os.path.dirname(os.path.abspath(readme)))
    body = f"{START}\n{block}\n![fleet start-up]({rel})\n{END}"
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    with open(readme, "w", encoding="utf-8") as f:
        f.write(head + body + tail)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="Without --readme no README is read or written; --readme is the only way this "
        "suite rewrites a README's benchmark section.",
    )
    parser.add_argument("--full", action="store_true", help="the full mode (about 10 minutes)")
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="folder for results.json, results.md and the plots (default: "
        f"{os.path.relpath(SCRATCH, REPO)}/ at the repository root, ignored by git; with "
        f"--readme: {os.path.relpath(RECORD, REPO)}/, the tracked record the README shows)",
    )
    parser.add_argument(
        "--readme",
        metavar="PATH",
        help="explicitly rewrite this README's benchmark section (between "
        f"'{START}' and '{END}') with the results; nothing else touches a README",
    )
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = RECORD if args.readme else SCRATCH
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    results = run("full" if args.full else "quick")
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "results.json"), results)
    block = markdown(results)
    with open(os.path.join(args.out, "results.md"), "w", encoding="utf-8") as f:
        f.write(block)
    paths = plots(results, args.out)
    print(block)
    written = [os.path.join(args.out, "results.json"), os.path.join(args.out, "results.md")]
    if args.readme:
        update_readme(args.readme, block, paths[0])
        written.append(f"{args.readme} (benchmark section)")
    print("wrote", ", ".join([*written, *paths]))
    for line in results["warnings"]:
        print(line, file=sys.stderr)
    return results


if __name__ == "__main__":
    main()
