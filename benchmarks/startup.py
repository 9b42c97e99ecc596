"""Fleet start-up: graphdist's LocalFleet against the seed's way and a bare TensorFlow import.

Each figure is the wall time from launching a fresh Python process until every server of the
fleet has answered a gRPC GetStatus call, the median of ``--repeats`` runs, all measured in this
one run on this machine. Printed as ratios against the floor, a bare ``python -c "import
tensorflow"``. The seed's way is one ``multiprocessing`` ``spawn`` process per server, each
importing TensorFlow and building its server, as in the legacy tutorial.

    python benchmarks/startup.py [--sizes 1 4 8] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import threading
import time

QUIET = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}

BARE = "import tensorflow\nprint('READY', flush=True)"

SEED_STYLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seed_style_fleet.py")

LOCAL_FLEET = textwrap.dedent(
    """
    import sys
    import graphdist
    fleet = graphdist.LocalFleet(f"local={sys.argv[1]}").start()
    print("READY", flush=True)
    fleet.close()
    """
)


def time_to_ready(code: str, *args: str, timeout_s: float = 180.0) -> float:
    """Seconds from launching ``python -c code`` (or ``python FILE`` when ``code`` is a path) until
    it prints READY; raises RuntimeError if it exits first or takes over ``timeout_s``."""
    argv = [code] if code.endswith(".py") else ["-c", code]
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, *argv, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=QUIET,
    )
    assert proc.stdout is not None
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    for line in proc.stdout:
        if line.strip() == "READY":
            elapsed = time.perf_counter() - start
            break
    else:
        timer.cancel()
        raise RuntimeError(f"benchmark child exited with {proc.wait()} before READY")
    timer.cancel()
    proc.wait(60)
    return elapsed


def median_of(repeats: int, code: str, *args: str) -> float:
    return statistics.median(time_to_ready(code, *args) for _ in range(repeats))


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="PATH", help="also write the raw figures here")
    args = parser.parse_args(argv)

    bare = median_of(args.repeats, BARE)
    rows = []
    for n in args.sizes:
        seed = median_of(args.repeats, SEED_STYLE, str(n))
        fleet = median_of(args.repeats, LOCAL_FLEET, str(n))
        rows.append({"servers": n, "seed_style_s": seed, "local_fleet_s": fleet})

    print(f"bare `import tensorflow`: {bare:.2f} s (median of {args.repeats}; the floor)")
    print(
        f"{'servers':>7}  {'seed-style':>12}  {'LocalFleet':>12}  {'seed/floor':>10}  "
        f"{'fleet/floor':>11}  {'seed/fleet':>10}"
    )
    for r in rows:
        seed, fleet = r["seed_style_s"], r["local_fleet_s"]
        print(
            f"{r['servers']:>7}  {seed:>10.2f} s  {fleet:>10.2f} s  {seed / bare:>10.2f}  "
            f"{fleet / bare:>11.2f}  {seed / fleet:>10.2f}"
        )
    result = {"bare_import_s": bare, "repeats": args.repeats, "rows": rows, "cpus": os.cpu_count()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
