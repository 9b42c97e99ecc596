"""Fleet start-up and memory: graphdist's LocalFleet against the seed's way, TensorFlow's
``create_local_cluster`` and a bare TensorFlow import.

Each figure is the wall time from launching a fresh Python process until every server of the
fleet has answered a gRPC GetStatus call, the median of ``--repeats`` runs, all measured in this
one run on this machine, and printed as ratios against the floor, a bare ``python -c "import
tensorflow"``. The seed's way is one ``multiprocessing`` ``spawn`` process per server
(``seed_style_fleet.py``). Once ready, each child also reports the PSS and RSS of its server
processes (for ``create_local_cluster``, of its one process, which holds every server).
The floor is measured at least ``FLOOR_REPEATS`` (3) times; a run whose floor varied more than
``FLOOR_SPREAD_LIMIT`` between its repeats, or with a figure under its floor, prints a warning
(``_common.floor_warnings``).

    python benchmarks/startup.py [--sizes 1 4 8] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from typing import Any

from _common import FLOOR_REPEATS, HERE, add_json_option, floor_warnings, write_json

QUIET = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}

MEMORY = textwrap.dedent(
    """
    def memory(pids):
        import psutil
        infos = [psutil.Process(p).memory_full_info() for p in pids]
        return {"pss_mib": sum(i.pss for i in infos) / 2**20,
                "rss_mib": sum(i.rss for i in infos) / 2**20}
    """
)

CHILDREN = {
    "bare_import": MEMORY
    + textwrap.dedent(
        """
        import json, os, sys
        import tensorflow
        print("READY", json.dumps(memory([os.getpid()])), flush=True)
        """
    ),
    "local_fleet": MEMORY
    + textwrap.dedent(
        """
        import json, sys
        import graphdist
        fleet = graphdist.LocalFleet(f"local={sys.argv[1]}").start()
        print("READY", json.dumps(memory(fleet.pids)), flush=True)
        fleet.close()
        """
    ),
    "create_local_cluster": MEMORY
    + textwrap.dedent(
        """
        import json, os, sys
        import tensorflow as tf
        from graphdist._fleet.probe import Prober
        workers, _ = tf.test.create_local_cluster(int(sys.argv[1]), 0)
        for w in workers:
            with Prober(w.target[len("grpc://"):]) as p:
                assert p.probe(30)
        print("READY", json.dumps(memory([os.getpid()])), flush=True)
        os._exit(0)  # its servers can never be stopped otherwise
        """
    ),
    "seed_style": os.path.join(HERE, "seed_style_fleet.py"),
}
METHODS = ("local_fleet", "seed_style", "create_local_cluster")
LABELS = {
    "local_fleet": "graphdist LocalFleet",
    "seed_style": "seed's way (spawn per server)",
    "create_local_cluster": "tf.test.create_local_cluster",
}


def time_to_ready(code: str, *args: str, timeout_s: float = 180.0) -> tuple[float, dict[str, Any]]:
    """Seconds from launching ``python -c code`` (or ``python FILE`` when ``code`` is a path)
    until it prints READY, and the JSON it printed after READY (memory figures, may be empty).
    Raises RuntimeError, with the end of the child's stderr, if it exits first or takes over
    ``timeout_s``."""
    argv = [code] if code.endswith(".py") else ["-c", code]
    with tempfile.TemporaryFile("w+") as stderr:
        start = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, *argv, *args],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=QUIET,
        )
        assert proc.stdout is not None
        timer = threading.Timer(timeout_s, proc.kill)
        timer.start()
        try:
            for line in proc.stdout:
                if line.startswith("READY"):
                    elapsed = time.perf_counter() - start
                    extra = line[len("READY") :].strip()
                    break
            else:
                status = proc.wait()
                stderr.seek(0)
                tail = "".join(stderr.readlines()[-10:])
                raise RuntimeError(f"benchmark child exited with {status} before READY:\n{tail}")
        finally:
            timer.cancel()
        proc.stdout.read()
        proc.wait(60)
    return elapsed, json.loads(extra) if extra else {}


def once(method: str, servers: int) -> tuple[float, dict[str, Any]]:
    """One start-up of ``method`` with ``servers`` servers: seconds and memory figures."""
    return time_to_ready(CHILDREN[method], str(servers))


def summarize(runs: list[tuple[float, dict[str, Any]]]) -> dict[str, Any]:
    """Median seconds and memory of ``runs`` (from ``once``), and every run's seconds
    (``runs_s``, in the order measured)."""
    out: dict[str, Any] = {"seconds": statistics.median(t for t, _ in runs)}
    for key in ("pss_mib", "rss_mib"):
        values = [m[key] for _, m in runs if key in m]
        if values:
            out[key] = statistics.median(values)
    out["runs_s"] = [t for t, _ in runs]
    return out


def measure(method: str, servers: int, repeats: int) -> dict[str, Any]:
    """Median start-up seconds and memory of ``method`` with ``servers`` servers (``summarize``)."""
    return summarize([once(method, servers) for _ in range(repeats)])


def servers_label(method: str, servers: int, labels: dict[str, str] | None = None) -> str:
    """How a start-up figure is named in warnings: "graphdist LocalFleet, 8 servers"."""
    name = (labels or LABELS).get(method, method)
    return f"{name}, {servers} server{'' if servers == 1 else 's'}"


def startup_figures(rows: list[dict[str, Any]], methods: Any) -> list[tuple[str, float]]:
    """(label, seconds) of every start-up figure in ``rows``, for ``floor_warnings``."""
    return [
        (servers_label(m, row["servers"]), row[m]["seconds"])
        for row in rows
        for m in methods
        if m in row
    ]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=["local_fleet", "seed_style"])
    add_json_option(parser)
    args = parser.parse_args(argv)

    floor = measure("bare_import", 0, max(FLOOR_REPEATS, args.repeats))
    rows = [
        {"servers": n, **{m: measure(m, n, args.repeats) for m in args.methods}} for n in args.sizes
    ]
    bare = floor["seconds"]
    print(f"bare `import tensorflow`: {bare:.2f} s (median of {len(floor['runs_s'])}; the floor)")
    header = "".join(f"  {m:>22}" for m in args.methods)
    print(f"{'servers':>7}{header}")
    for r in rows:
        cells = "".join(
            f"  {r[m]['seconds']:>8.2f} s = {r[m]['seconds'] / bare:>5.2f}x" for m in args.methods
        )
        print(f"{r['servers']:>7}{cells}")
    if "seed_style" in args.methods and "local_fleet" in args.methods:
        last = rows[-1]
        ratio = last["seed_style"]["seconds"] / last["local_fleet"]["seconds"]
        print(f"seed-style / LocalFleet at {last['servers']} servers: {ratio:.2f}x")
    warnings = floor_warnings(floor, startup_figures(rows, args.methods))
    for line in warnings:
        print(line)
    result = {"bare_import": floor, "repeats": args.repeats, "rows": rows, "warnings": warnings}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
