"""Milliseconds per step of the seeds' split graph, by session kind and master, in one run.

Three sessions run the same graph (``x - 66`` on task 0, ``x + 300`` and the sum on task 1) on one
two-task fleet: a raw ``tf.compat.v1.Session`` on the seed's master (task 0), graphdist's
``fleet.session`` on the same master, and graphdist's ``fleet.session_for(y)``, which picks the
task that owns ``y`` (task 1). Steps are timed in interleaved rounds so that machine noise hits
every kind alike; the figure is the median over rounds of the mean ms per step.

    python benchmarks/master_choice.py [--steps 2000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

import graphdist
from graphdist._graphs import SPLIT_GRAPH_RESULT, split_graph


def ms_per_step(sess, fetch, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        sess.run(fetch)
    return (time.perf_counter() - start) * 1000.0 / steps


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="steps per round (2000)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (7)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures here")
    args = parser.parse_args(argv)

    with graphdist.LocalFleet("local=2") as fleet:
        graph, y = split_graph(fleet.device("local", 0), fleet.device("local", 1))
        chosen = graphdist.master_for(y, fleet.cluster)
        sessions = {
            "raw TF, master task 0": tf.compat.v1.Session(fleet.target("local", 0), graph=graph),
            "graphdist, master task 0": fleet.session("local", 0, graph=graph),
            f"graphdist, chosen master ({chosen.job}:{chosen.index})": fleet.session_for(
                y, graph=graph
            ),
        }
        for sess in sessions.values():
            assert sess.run(y) == SPLIT_GRAPH_RESULT
            ms_per_step(sess, y, 200)  # warm-up
        samples: dict[str, list[float]] = {name: [] for name in sessions}
        for _ in range(args.rounds):
            for name, sess in sessions.items():
                samples[name].append(ms_per_step(sess, y, args.steps))
        for sess in sessions.values():
            sess.close()

    figures = {name: statistics.median(values) for name, values in samples.items()}
    raw, same, chosen_ms = figures.values()
    print(f"{'session':<36} {'ms/step':>8}")
    for name, value in figures.items():
        print(f"{name:<36} {value:>8.3f}")
    print(f"graphdist / raw TF on the same master: {same / raw:.3f}x (target <= 1.05)")
    print(f"seed's master / chosen master:         {same / chosen_ms:.2f}x faster (target >= 1.8)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return figures


if __name__ == "__main__":
    main()
