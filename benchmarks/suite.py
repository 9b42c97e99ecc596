"""The benchmark suite: every speed and memory figure, beside what a user would otherwise do, in
one run on this machine.

    python benchmarks/suite.py [--full] [--out benchmarks/results] [--readme README.md]

It reuses ``startup.py`` (fleet start-up and memory vs size: LocalFleet, the seed's spawned
processes, ``tf.test.create_local_cluster``, floor: a bare TensorFlow import), ``master_choice.py``
(step latency of the seeds' split graph, raw TF vs graphdist sessions, each master) and
``transfer.py`` (task-to-task bandwidth vs an in-process copy), adds how step latency grows with
the number of tasks, and fits a slope to every curve. It writes ``results.json`` (raw figures),
``results.md`` (the tables) and PNG plots to ``--out``; with ``--readme`` it also replaces the
README's benchmark section (between ``<!-- bench:start -->`` and ``<!-- bench:end -->``).
The quick mode (default) takes about two minutes here; ``--full`` adds 16 servers, 256 MB tensors
and repeats.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import master_choice  # noqa: E402
import startup  # noqa: E402
import transfer  # noqa: E402

MODES: dict[str, dict[str, Any]] = {
    "quick": {
        "sizes": [1, 2, 4, 8],
        "repeats": 1,
        "steps": 1000,
        "scale_tasks": [2, 4, 8],
        "transfer_mb": [1, 16, 64],
    },
    "full": {
        "sizes": [1, 2, 4, 8, 16],
        "repeats": 3,
        "steps": 5000,
        "scale_tasks": [2, 4, 8, 16],
        "transfer_mb": [1, 4, 16, 64, 256],
    },
}
LABELS = {
    "local_fleet": "graphdist LocalFleet",
    "seed_style": "seed's way (spawn per server)",
    "create_local_cluster": "tf.test.create_local_cluster",
}
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


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` against ``xs``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def machine() -> str:
    import psutil

    mem = psutil.virtual_memory().total / 2**30
    return (
        f"{os.cpu_count()} CPU cores, {mem:.0f} GiB RAM, {platform.system()} {platform.machine()}"
    )


def run(mode: str) -> dict[str, Any]:
    cfg = MODES[mode]
    t0 = time.monotonic()
    floor = startup.measure("bare_import", 0, max(3, cfg["repeats"]))  # the floor of every ratio
    rows = [
        {"servers": n, **{m: startup.measure(m, n, cfg["repeats"]) for m in startup.METHODS}}
        for n in cfg["sizes"]
    ]
    import tensorflow as tf

    results: dict[str, Any] = {
        "mode": mode,
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "tensorflow": tf.__version__,
        "python": platform.python_version(),
        "bare_import": floor,
        "startup": rows,
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
    return results


def markdown(r: dict[str, Any]) -> str:
    bare = r["bare_import"]["seconds"]
    out = [
        f"Measured on {r['date']}, {r['machine']}, Python {r['python']}, TensorFlow "
        f"{r['tensorflow']} ({r['mode']} mode, {r['elapsed_s']:.0f} s). Written by "
        "`benchmarks/suite.py`.",
        "",
        f"**Start-up** (launch to every server answering gRPC; floor: bare `import tensorflow` = "
        f"{bare:.2f} s)",
        "",
        "| servers | " + " | ".join(LABELS[m] for m in startup.METHODS) + " |",
        "|---:|" + "---:|" * len(startup.METHODS),
    ]
    for row in r["startup"]:
        cells = [f"{row[m]['seconds']:.2f} s ({row[m]['seconds'] / bare:.2f}x)" for m in LABELS]
        out.append(f"| {row['servers']} | " + " | ".join(cells) + " |")
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the full mode (longer)")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--readme", help="README whose benchmark section to rewrite")
    args = parser.parse_args(argv)
    results = run("full" if args.full else "quick")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    block = markdown(results)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(block)
    paths = plots(results, args.out)
    print(block)
    print("wrote", ", ".join([os.path.join(args.out, "results.json"), *paths]))
    if args.readme:
        update_readme(args.readme, block, paths[0])
    return results


if __name__ == "__main__":
    main()
