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
(``_common.floor_warnings``). Only the methods that import TensorFlow whole (``WHOLE_TF``) are
bounded by the floor: a LocalFleet's servers import it without Keras and SciPy
(``graphdist._proc.lean``), so a cold LocalFleet can start in less than a bare import.

``side_by_side`` is the head-to-head the suite puts first, measured in interleaved rounds: a
cold LocalFleet (a fresh process that starts the fleet, closes it and exits) against a cold
``create_local_cluster`` (a fresh process that starts its servers, checks each answers and exits),
at each size, and a warm LocalFleet ``start()`` (a second fleet in a process whose fork server is
already up) beside TensorFlow's own warm floor (the same number of servers built by
``create_local_cluster`` in one process that has TensorFlow imported and built a server already).
Each round also measures the floor, and every figure is the median over the rounds.

    python benchmarks/startup.py [--sizes 1 4 8] [--repeats 3] [--json out.json]
    python benchmarks/startup.py --side-by-side [--sizes 8 16] [--repeats 3]
    python -m benchmarks.startup ...
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
from typing import Any, TypedDict

try:
    from ._common import (
        FLOOR_REPEATS,
        HERE,
        Figures,
        add_json_option,
        floor_warnings,
        slope,
        spread,
        write_json,
    )
except ImportError:  # run as a script, or imported with benchmarks/ on sys.path
    from _common import (
        FLOOR_REPEATS,
        HERE,
        Figures,
        add_json_option,
        floor_warnings,
        slope,
        spread,
        write_json,
    )

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
        from graphdist._net.probe import Prober
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
# The methods whose processes import TensorFlow whole, as the floor does: none of their figures
# can be under the floor. A LocalFleet's servers import it without Keras and SciPy
# (graphdist._proc.lean) and its owner not at all, so its cold figures may be.
WHOLE_TF = ("seed_style", "create_local_cluster")
LABELS = {
    "local_fleet": "graphdist LocalFleet",
    "seed_style": "seed's way (spawn per server)",
    "create_local_cluster": "tf.test.create_local_cluster",
}


def run_child(
    code: str, *args: str, timeout_s: float = 180.0
) -> tuple[float, float, dict[str, Any]]:
    """Launch ``python -c code`` (or ``python FILE`` when ``code`` is a path) and return the
    seconds until it printed READY, the seconds until it exited, and the JSON it printed after
    READY (may be empty). Raises RuntimeError, with the end of the child's stderr, if it exits
    before READY, fails after it, or takes over ``timeout_s``."""
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
                    ready = time.perf_counter() - start
                    extra = line[len("READY") :].strip()
                    break
            else:
                status = proc.wait()
                raise RuntimeError(
                    f"benchmark child exited with {status} before READY:\n{_tail(stderr)}"
                )
            # A fleet's fork server shares this pipe and may outlive its owner by a moment: the
            # figure is the owner's own exit, and the pipe's end is awaited only after it, so that
            # the next measurement starts on a quiet machine.
            drain = threading.Thread(target=proc.stdout.read, daemon=True)
            drain.start()
            status = proc.wait()
            exited = time.perf_counter() - start
            drain.join(60)
        finally:
            timer.cancel()
        if status != 0:
            raise RuntimeError(f"benchmark child exited with {status}:\n{_tail(stderr)}")
    return ready, exited, json.loads(extra) if extra else {}


def _tail(stderr: Any) -> str:
    stderr.seek(0)
    return "".join(stderr.readlines()[-10:])


def time_to_ready(code: str, *args: str, timeout_s: float = 180.0) -> tuple[float, dict[str, Any]]:
    """Seconds from launching ``python -c code`` (or ``python FILE``) until it prints READY, and
    the JSON it printed after READY (see :func:`run_child`)."""
    ready, _, extra = run_child(code, *args, timeout_s=timeout_s)
    return ready, extra


def once(method: str, servers: int) -> tuple[float, dict[str, Any]]:
    """One start-up of ``method`` with ``servers`` servers: seconds and memory figures."""
    return time_to_ready(CHILDREN[method], str(servers))


def summarize(runs: list[tuple[float, dict[str, Any]]]) -> Figures:
    """Median seconds and memory of ``runs`` (from ``once``), and every run's seconds
    (``runs_s``, in the order measured)."""
    out: Figures = {"seconds": statistics.median(t for t, _ in runs)}
    pss = [m["pss_mib"] for _, m in runs if "pss_mib" in m]
    rss = [m["rss_mib"] for _, m in runs if "rss_mib" in m]
    if pss:
        out["pss_mib"] = statistics.median(pss)
    if rss:
        out["rss_mib"] = statistics.median(rss)
    out["runs_s"] = [t for t, _ in runs]
    return out


def measure(method: str, servers: int, repeats: int) -> Figures:
    """Median start-up seconds and memory of ``method`` with ``servers`` servers (``summarize``)."""
    return summarize([once(method, servers) for _ in range(repeats)])


def servers_label(method: str, servers: int, labels: dict[str, str] | None = None) -> str:
    """How a start-up figure is named in warnings: "graphdist LocalFleet, 8 servers"."""
    name = (labels or LABELS).get(method, method)
    return f"{name}, {servers} server{'' if servers == 1 else 's'}"


def startup_figures(rows: list[dict[str, Any]], methods: Any) -> list[tuple[str, float]]:
    """(label, seconds) of every start-up figure in ``rows`` that the floor bounds, for
    ``floor_warnings``: those of :data:`WHOLE_TF` (LocalFleet's servers import less)."""
    return [
        (servers_label(m, row["servers"]), row[m]["seconds"])
        for row in rows
        for m in methods
        if m in row and m in WHOLE_TF
    ]


# -- side by side: cold LocalFleet vs cold create_local_cluster, and a warm LocalFleet ----------

COLD = {
    "local_fleet": textwrap.dedent(
        """
        import sys
        import graphdist
        fleet = graphdist.LocalFleet(f"local={sys.argv[1]}").start()
        print("READY", flush=True)
        fleet.close()
        """
    ),
    # The same readiness check as LocalFleet's (a GetStatus call to every server), with gRPC
    # imported after TensorFlow (which makes it cheap) and nothing of graphdist's.
    "create_local_cluster": textwrap.dedent(
        """
        import os, sys
        import tensorflow as tf
        import grpc
        workers, _ = tf.test.create_local_cluster(int(sys.argv[1]), 0)
        for w in workers:
            with grpc.insecure_channel(w.target[len("grpc://"):]) as channel:
                get_status = channel.unary_unary("/tensorflow.WorkerService/GetStatus")
                get_status(b"", timeout=30, wait_for_ready=True)
        print("READY", flush=True)
        os._exit(0)  # its servers can never be stopped otherwise
        """
    ),
}
COLD_LABELS = {
    "local_fleet": "cold LocalFleet (launch, start, close, exit)",
    "create_local_cluster": "cold tf.test.create_local_cluster (launch, ready, exit)",
}
WARM = textwrap.dedent(
    """
    import json, sys, time
    import graphdist
    graphdist.LocalFleet("local=1").start().close()  # the fork server is up from here on
    out = {}
    for n in sys.argv[1:]:
        start = time.perf_counter()
        fleet = graphdist.LocalFleet(f"local={n}").start()
        started = time.perf_counter()
        fleet.close()
        out[n] = {"start_s": started - start, "close_s": time.perf_counter() - started}
    print("READY", json.dumps(out), flush=True)
    """
)

# TensorFlow's own floor for a warm start: servers built in a process that has TensorFlow
# imported and one server built already (its one-time costs paid), all in that one process,
# without a fork or a process per server. No design that runs a process per server can beat it.
WARM_TF = textwrap.dedent(
    """
    import json, os, sys, time
    import tensorflow as tf
    import grpc
    def ready(workers):
        for w in workers:
            with grpc.insecure_channel(w.target[len("grpc://"):]) as channel:
                get_status = channel.unary_unary("/tensorflow.WorkerService/GetStatus")
                get_status(b"", timeout=30, wait_for_ready=True)
    ready(tf.test.create_local_cluster(1, 0)[0])
    out = {}
    for n in sys.argv[1:]:
        start = time.perf_counter()
        ready(tf.test.create_local_cluster(int(n), 0)[0])
        out[n] = {"start_s": time.perf_counter() - start}
    print("READY", json.dumps(out), flush=True)
    os._exit(0)  # its servers can never be stopped otherwise
    """
)


class Timing(TypedDict):
    """One figure of the side-by-side: the median over the rounds, every round's seconds in the
    order measured, and the median as a multiple of the floor."""

    seconds: float
    runs_s: list[float]
    ratio: float


class ColdRow(TypedDict):
    """Cold start-ups at one size: each method's whole process (launch to exit) and its time to
    ready (launch to every server answering)."""

    servers: int
    local_fleet: Timing
    local_fleet_ready: Timing
    create_local_cluster: Timing
    create_local_cluster_ready: Timing


class WarmRow(TypedDict):
    """A warm LocalFleet at one size: ``start()`` and ``close()`` of a fleet in a process whose
    fork server is already up; and TensorFlow's own floor, the same number of servers built in
    one process that has TensorFlow imported (``WARM_TF``)."""

    servers: int
    start: Timing
    close: Timing
    tf_in_process: Timing


class SideBySide(TypedDict):
    """The side-by-side (:func:`side_by_side`): its rounds, floor, rows, slopes (seconds per
    server) and the warnings of its floor (``_common.floor_warnings``)."""

    repeats: int
    floor: Timing
    cold: list[ColdRow]
    warm: list[WarmRow]
    slopes: dict[str, float]
    warnings: list[str]


def measure_side(key: str, servers: int, warm_sizes: list[int]) -> dict[str, float]:
    """One measurement of the side-by-side (``key``: "floor", "warm" or a method of ``COLD``)."""
    if key == "floor":
        ready, _ = time_to_ready(CHILDREN["bare_import"])
        return {"ready_s": ready}
    if key in ("warm", "warm_tf"):
        _, _, out = run_child(WARM if key == "warm" else WARM_TF, *map(str, warm_sizes))
        return {f"{k}[{n}]": v for n, figures in out.items() for k, v in figures.items()}
    ready, exited, _ = run_child(COLD[key], str(servers))
    return {"ready_s": ready, "exit_s": exited}


def _timing(runs: list[float], floor_s: float) -> Timing:
    median = statistics.median(runs)
    return {"seconds": median, "runs_s": runs, "ratio": median / floor_s}


def side_by_side(sizes: list[int], warm_sizes: list[int], repeats: int = 3) -> SideBySide:
    """Cold LocalFleet vs cold ``create_local_cluster`` at each of ``sizes`` and a warm
    LocalFleet at each of ``warm_sizes``, with the floor, in ``repeats`` interleaved rounds (each
    round starts one later in the plan, so no method always runs first); medians over rounds."""
    plan = [("floor", 0), *((m, n) for n in sizes for m in COLD), ("warm", 0), ("warm_tf", 0)]
    runs: dict[tuple[str, int], list[dict[str, float]]] = {key: [] for key in plan}
    for r in range(repeats):
        k = r % len(plan)
        for key in plan[k:] + plan[:k]:
            runs[key].append(measure_side(*key, warm_sizes))

    floor_runs = [m["ready_s"] for m in runs[("floor", 0)]]
    floor_s = statistics.median(floor_runs)

    def timing(key: tuple[str, int], figure: str) -> Timing:
        return _timing([m[figure] for m in runs[key]], floor_s)

    cold: list[ColdRow] = [
        {
            "servers": n,
            "local_fleet": timing(("local_fleet", n), "exit_s"),
            "local_fleet_ready": timing(("local_fleet", n), "ready_s"),
            "create_local_cluster": timing(("create_local_cluster", n), "exit_s"),
            "create_local_cluster_ready": timing(("create_local_cluster", n), "ready_s"),
        }
        for n in sizes
    ]
    warm: list[WarmRow] = [
        {
            "servers": n,
            "start": timing(("warm", 0), f"start_s[{n}]"),
            "close": timing(("warm", 0), f"close_s[{n}]"),
            "tf_in_process": timing(("warm_tf", 0), f"start_s[{n}]"),
        }
        for n in warm_sizes
    ]
    slopes = {
        f"cold_s_per_server[{m}]": slope(sizes, [r[m]["seconds"] for r in cold]) for m in COLD
    }
    slopes["warm_s_per_server[local_fleet]"] = slope(
        warm_sizes, [r["start"]["seconds"] for r in warm]
    )
    floor: Timing = {"seconds": floor_s, "runs_s": floor_runs, "ratio": 1.0}
    figures = [
        (f"{COLD_LABELS[m]}, {r['servers']} servers", r[m]["seconds"])
        for r in cold
        for m in COLD
        if m in WHOLE_TF
    ]
    return {
        "repeats": repeats,
        "floor": floor,
        "cold": cold,
        "warm": warm,
        "slopes": slopes,
        "warnings": floor_warnings(floor, figures),
    }


def side_by_side_lines(r: SideBySide) -> list[str]:
    """The side-by-side as Markdown: one table, its slopes and how noisy its rounds were."""
    floor = r["floor"]
    sizes = [row["servers"] for row in r["cold"]]

    def cell(t: Timing) -> str:
        return f"{t['seconds']:.2f} s ({t['ratio']:.2f}x)"

    out = [
        f"**Start-up side by side** ({r['repeats']} interleaved rounds, medians; floor: bare "
        f"`import tensorflow` = {floor['seconds']:.2f} s, spread {spread(floor['runs_s']):.0%})",
        "",
        "| | " + " | ".join(f"{n} servers" for n in sizes) + " | s/server |",
        "|---|" + "---:|" * (len(sizes) + 1),
    ]
    for m, label in COLD_LABELS.items():
        cells = [cell(row[m]) for row in r["cold"]]
        per = r["slopes"][f"cold_s_per_server[{m}]"]
        out.append(f"| {label} | " + " | ".join(cells) + f" | {per:.3f} |")
    for m in COLD:
        cells = [cell(row[f"{m}_ready"]) for row in r["cold"]]
        out.append(f"| ... of which to ready: {m} | " + " | ".join(cells) + " | |")
    ratio = [
        f"{row['local_fleet']['seconds'] / row['create_local_cluster']['seconds']:.2f}x"
        for row in r["cold"]
    ]
    out.append("| cold LocalFleet / create_local_cluster | " + " | ".join(ratio) + " | |")
    by_size = {row["servers"]: row for row in r["warm"]}
    warm_cells = [cell(by_size[n]["start"]) if n in by_size else "" for n in sizes]
    per = r["slopes"]["warm_s_per_server[local_fleet]"]
    out.append("| warm LocalFleet `start()` (fork server up) | " + " | ".join(warm_cells))
    out[-1] += f" | {per:.3f} |"
    close_cells = [cell(by_size[n]["close"]) if n in by_size else "" for n in sizes]
    out.append("| warm LocalFleet `close()` | " + " | ".join(close_cells) + " | |")
    tf_cells = [cell(by_size[n]["tf_in_process"]) if n in by_size else "" for n in sizes]
    out.append(
        "| TensorFlow's floor, warm: the servers built in one process that imported it "
        "| " + " | ".join(tf_cells) + " | |"
    )
    spreads = ", ".join(
        f"{m} {row['servers']}: {spread(row[m]['runs_s']):.0%}" for row in r["cold"] for m in COLD
    )
    out += ["", f"Spread of the cold figures over the rounds ((max - min) / median): {spreads}."]
    return out


def main(argv: list[str] | None = None) -> Any:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", help="(default 1 4 8; side by side: 8 16)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=["local_fleet", "seed_style"])
    parser.add_argument(
        "--side-by-side",
        action="store_true",
        help="cold LocalFleet vs cold create_local_cluster at --sizes (default 8 16) and a warm "
        "LocalFleet at --warm-sizes, in --repeats interleaved rounds",
    )
    parser.add_argument("--warm-sizes", type=int, nargs="+", default=[8, 16])
    add_json_option(parser)
    args = parser.parse_args(argv)
    if args.side_by_side:
        side = side_by_side(args.sizes or [8, 16], args.warm_sizes, args.repeats)
        print("\n".join(side_by_side_lines(side)))
        for line in side["warnings"]:
            print(line)
        write_json(args.json, side)
        return side

    floor = measure("bare_import", 0, max(FLOOR_REPEATS, args.repeats))
    sizes = args.sizes or [1, 4, 8]
    rows = [{"servers": n, **{m: measure(m, n, args.repeats) for m in args.methods}} for n in sizes]
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
