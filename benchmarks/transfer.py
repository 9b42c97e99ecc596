"""Tensor transfer bandwidth between two tasks of a fleet, against an in-process copy.

A float32 variable of N MB lives on task 0; each step reads it on task 1 (``tf.identity`` placed
there) and fetches only a scalar sum, so the figure is task-to-task gRPC traffic, not the client's.
The ceiling is a NumPy copy of the same bytes in this process. Median of ``repeats`` steps.

    python benchmarks/transfer.py [--sizes-mb 1 16 64 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

try:
    from ._common import Bandwidth, add_json_option, quiet_tensorflow, write_json
except ImportError:  # run as a script, or imported with benchmarks/ on sys.path
    from _common import Bandwidth, add_json_option, quiet_tensorflow, write_json

quiet_tensorflow()


def measure(sizes_mb: list[int], repeats: int = 5) -> list[Bandwidth]:
    import tensorflow as tf

    import graphdist

    rows: list[Bandwidth] = []
    with graphdist.LocalFleet("local=2") as fleet:
        for mb in sizes_mb:
            n = mb * 2**20 // 4
            graph = tf.Graph()
            with graph.as_default():
                with tf.device(fleet.device("local", 0)):
                    var = tf.compat.v1.Variable(tf.zeros([n], tf.float32), name=f"blob{mb}")
                with tf.device(fleet.device("local", 1)):
                    total = tf.reduce_sum(tf.identity(var) + 1.0)
            with fleet.session_for(total, graph=graph, config=graphdist.no_folding_config()) as s:
                graphdist.initialize_uninitialized(s)
                s.run(total)  # warm-up
                seconds = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    s.run(total)
                    seconds.append(time.perf_counter() - start)
            array = np.zeros(n, np.float32)
            copies = []
            for _ in range(repeats):
                start = time.perf_counter()
                array.copy()
                copies.append(time.perf_counter() - start)
            transfer = mb / 1024 / statistics.median(seconds)
            ceiling = mb / 1024 / statistics.median(copies)
            rows.append({"mb": mb, "gb_per_s": transfer, "in_process_gb_per_s": ceiling})
    return rows


def main(argv: list[str] | None = None) -> list[Bandwidth]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    add_json_option(parser)
    args = parser.parse_args(argv)
    rows = measure(args.sizes_mb, args.repeats)
    print(f"{'MB':>5} {'task->task GB/s':>16} {'in-process GB/s':>16} {'ratio':>6}")
    for r in rows:
        gbs, ceiling = r["gb_per_s"], r["in_process_gb_per_s"]
        print(f"{r['mb']:>5} {gbs:>16.2f} {ceiling:>16.2f} {gbs / ceiling:>6.3f}")
    write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
