"""Fleet start-up and memory: graphdist's LocalFleet against the seed's way, TensorFlow's
``create_local_cluster`` and two floors, a bare TensorFlow import and the lean one a LocalFleet
server makes.

Each figure is the wall time from launching a fresh Python process until every server of the
fleet has answered a gRPC GetStatus call (the child prints READY), the median of ``--repeats``
interleaved rounds (``_common.interleaved``: each round runs every method and both floors, in a
rotated order), all measured in this one run on this machine. Each is printed as a ratio against
the floor of the import its processes make (``FLOOR_OF``): a LocalFleet's servers import
TensorFlow without Keras and SciPy (``graphdist._proc.lean``), so its floor is ``python -c "from
graphdist._proc import lean; lean.install(); import tensorflow"``; the others' is a bare ``python
-c "import tensorflow"``. The seed's way is one ``multiprocessing`` ``spawn`` process per server
(``seed_style_fleet.py``). After READY, never before it, each child reports the PSS and RSS of
every process it ran (``_common.tree_memory``: the child and everything under it: a LocalFleet's
owner, fork server, helper and servers; the seed's parent, its children and multiprocessing's
resource tracker; ``create_local_cluster``'s one process).
A run whose floor varied more than ``FLOOR_SPREAD_LIMIT`` between its repeats, with a figure under
its own floor, or with a floor measured fewer than ``FLOOR_REPEATS`` (3) times, prints a warning
(``_common.floor_warnings``).

``side_by_side`` is the head-to-head the suite puts first, measured in interleaved rounds: a
cold LocalFleet (a fresh process that starts the fleet, closes it and exits) against a cold
``create_local_cluster`` (a fresh process that starts its servers, checks each answers and exits),
at each size, and a warm LocalFleet ``start()`` (a second fleet in a process whose fork server is
already up) beside TensorFlow's own warm floor (``WARM_TF``: the same number of servers built by
``create_local_cluster`` in one process that built one already, timed until each answered a
GetStatus call, as a LocalFleet start is; the time until it returned is printed beside it). Each
round also measures both floors, and every figure is the median over the rounds. Its target is
checked: a warm start within ``WARM_TARGET`` (1.25x) of the warm floor at every warm size, and one
task's ``restart()`` in that warm fleet back to serving within ``RESTART_TARGET_S`` (0.25 s); a
miss prints MISSED and the script exits 1. A LocalFleet gives its servers one gRPC completion queue
per CPU (``TF_GRPC_WORKER_CACHE_QUEUES``, not TensorFlow's 64): both create_local_cluster runs get
the same setting (``SAME_GRPC``), so that both sides start the same threads. The warm child
pauses ``SETTLE_S`` before each start and restart (its fork server refills its pool of spares
when idle), and runs once more with the pool off (``warm_forked``): the same run's figures of
every server forked when asked.

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
from collections.abc import Sequence
from typing import Any, TypedDict

try:
    from ._common import (
        FLOOR_REPEATS,
        HERE,
        WARNING,
        Figures,
        add_json_option,
        finish,
        floor_warnings,
        interleaved,
        report_targets,
        slope,
        spread,
        write_json,
    )
except ImportError:  # run as a script, or imported with benchmarks/ on sys.path
    from _common import (
        FLOOR_REPEATS,
        HERE,
        WARNING,
        Figures,
        add_json_option,
        finish,
        floor_warnings,
        interleaved,
        report_targets,
        slope,
        spread,
        write_json,
    )

from graphdist._local.fleet import GRPC_QUEUES_ENV, grpc_queues
from graphdist._proc.forkserver_pool import SPARES_ENV

QUIET = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}

# Every child prints READY the moment its servers answer (or TensorFlow is imported), and only
# then measures the memory of every process it runs (``_common.tree_memory``) and prints it as
# JSON on the next line: the time to READY never includes the memory reading.
_HEAD = f"import json, os, sys\nsys.path.append({HERE!r})  # for _common.tree_memory\n"
_REPORT = textwrap.dedent(
    """
    print("READY", flush=True)
    from _common import tree_memory
    print(json.dumps(tree_memory()), flush=True)
    """
)
CHILDREN = {
    "bare_import": _HEAD + "import tensorflow\n" + _REPORT,
    # What a LocalFleet server imports (its fork server installs graphdist._proc.lean first).
    "lean_import": _HEAD
    + "from graphdist._proc import lean\nlean.install()\nimport tensorflow\n"
    + _REPORT,
    "local_fleet": _HEAD
    + 'import graphdist\nfleet = graphdist.LocalFleet(f"local={sys.argv[1]}").start()\n'
    + _REPORT
    + "fleet.close()\n",
    "create_local_cluster": _HEAD
    + textwrap.dedent(
        """
        import tensorflow as tf
        from graphdist._net.probe import Prober
        workers, _ = tf.test.create_local_cluster(int(sys.argv[1]), 0)
        for w in workers:
            with Prober(w.target[len("grpc://"):]) as p:
                assert p.probe(30)
        """
    )
    + _REPORT
    + "os._exit(0)  # its servers can never be stopped otherwise\n",
    "seed_style": os.path.join(HERE, "seed_style_fleet.py"),
}
METHODS = ("local_fleet", "seed_style", "create_local_cluster")
FLOOR_KEYS = ("bare_import", "lean_import")
FLOOR_OF = {
    "local_fleet": "lean_import",
    "seed_style": "bare_import",
    "create_local_cluster": "bare_import",
}
"""The floor of each method: the import its processes make. A LocalFleet's servers import
TensorFlow without Keras and SciPy (``graphdist._proc.lean``) and its owner not at all, so the
lean import bounds it; the others import TensorFlow whole."""
LABELS = {
    "local_fleet": "graphdist LocalFleet",
    "seed_style": "seed's way (spawn per server)",
    "create_local_cluster": "tf.test.create_local_cluster",
}
FLOOR_LABELS = {
    "bare_import": "bare `import tensorflow`",
    "lean_import": "lean `import tensorflow` (as a LocalFleet server)",
}


def run_child(
    code: str,
    *args: str,
    timeout_s: float = 180.0,
    then_json: bool = False,
    env: dict[str, str] | None = None,
) -> tuple[float, float, dict[str, Any]]:
    """Launch ``python -c code`` (or ``python FILE`` when ``code`` is a path) and return the
    seconds until it printed READY, the seconds until it exited, and the JSON it printed on the
    READY line or, with ``then_json``, on the line after it (may be empty). Raises RuntimeError,
    with the end of the child's stderr, if it exits before READY, fails after it, prints no
    JSON where ``then_json`` expects it, or takes over ``timeout_s``. ``env``: variables added
    to its (quiet) environment."""
    argv = [code] if code.endswith(".py") else ["-c", code]
    with tempfile.TemporaryFile("w+") as stderr:
        start = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, *argv, *args],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env={**QUIET, **(env or {})},
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
            if then_json:
                extra = proc.stdout.readline().strip()
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
        if then_json and not extra:
            raise RuntimeError(f"benchmark child printed no figures after READY:\n{_tail(stderr)}")
    return ready, exited, json.loads(extra) if extra else {}


def _tail(stderr: Any) -> str:
    stderr.seek(0)
    return "".join(stderr.readlines()[-10:])


def time_to_ready(
    code: str, *args: str, timeout_s: float = 180.0, then_json: bool = False
) -> tuple[float, dict[str, Any]]:
    """Seconds from launching ``python -c code`` (or ``python FILE``) until it prints READY, and
    the JSON it printed (see :func:`run_child`)."""
    ready, _, extra = run_child(code, *args, timeout_s=timeout_s, then_json=then_json)
    return ready, extra


def once(method: str, servers: int) -> tuple[float, dict[str, Any]]:
    """One start-up of ``method`` (a key of ``CHILDREN``) with ``servers`` servers: seconds to
    READY and the memory of every process it ran, read after READY."""
    return time_to_ready(CHILDREN[method], str(servers), then_json=True)


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
    counts = [m["processes"] for _, m in runs if "processes" in m]
    if counts:
        out["processes"] = max(counts)
    out["runs_s"] = [t for t, _ in runs]
    return out


def measure(method: str, servers: int, repeats: int) -> Figures:
    """Median start-up seconds and memory of ``method`` with ``servers`` servers (``summarize``)."""
    return summarize([once(method, servers) for _ in range(repeats)])


def startup_rounds(
    methods: Sequence[str], sizes: Sequence[int], repeats: int
) -> tuple[dict[str, Figures], list[dict[str, Any]]]:
    """Both floors and every method at every size, in ``repeats`` interleaved rounds
    (``_common.interleaved``): the floors by key, and one row per size."""
    plan = [*((k, 0) for k in FLOOR_KEYS), *((m, n) for n in sizes for m in methods)]
    runs = interleaved(plan, repeats, lambda key: once(*key))
    floors = {k: summarize(runs[(k, 0)]) for k in FLOOR_KEYS}
    rows = [{"servers": n, **{m: summarize(runs[(m, n)]) for m in methods}} for n in sizes]
    return floors, rows


def servers_label(method: str, servers: int, labels: dict[str, str] | None = None) -> str:
    """How a start-up figure is named in warnings: "graphdist LocalFleet, 8 servers"."""
    name = (labels or LABELS).get(method, method)
    return f"{name}, {servers} server{'' if servers == 1 else 's'}"


def startup_figures(
    rows: list[dict[str, Any]], methods: Any, kind: str = "bare_import"
) -> list[tuple[str, float]]:
    """(label, seconds) of every start-up figure in ``rows`` that the floor ``kind`` bounds
    (:data:`FLOOR_OF`), for ``floor_warnings``."""
    return [
        (servers_label(m, row["servers"]), row[m]["seconds"])
        for row in rows
        for m in methods
        if m in row and FLOOR_OF[m] == kind
    ]


def startup_warnings(floors: dict[str, Any], rows: list[dict[str, Any]], methods: Any) -> list[str]:
    """Why a start-up table cannot be trusted: each floor's spread and the figures under their
    own floor (``_common.floor_warnings``), and floors measured too few times to have a spread."""
    out = []
    for kind in FLOOR_KEYS:
        out += floor_warnings(floors[kind], startup_figures(rows, methods, kind), kind=kind)
    return out + too_few_floors(min(len(floors[k].get("runs_s", [])) for k in FLOOR_KEYS))


def too_few_floors(repeats: int) -> list[str]:
    """The warning of floors measured ``repeats`` times, fewer than ``FLOOR_REPEATS``: a spread
    needs repeats; empty when there are enough."""
    if repeats >= FLOOR_REPEATS:
        return []
    return [
        f"{WARNING}the floors were measured {repeats} time{'' if repeats == 1 else 's'}, fewer "
        f"than {FLOOR_REPEATS}: how much the machine's load moved during the run is unknown."
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
SETTLE_S = 1.0
"""The pause before each warm start and each restart: a fleet's fork server refills its pool of
spares (``graphdist._proc.forkserver_pool``) once it has been idle for a moment, as it is between
a notebook's cells; TensorFlow's floor gets nothing from it and is timed without it."""
WARM = textwrap.dedent(
    f"""
    import json, sys, time
    import graphdist
    graphdist.LocalFleet("local=1").start().close()  # the fork server is up from here on
    out = {{}}
    for n in sys.argv[1:]:
        time.sleep({SETTLE_S})
        start = time.perf_counter()
        fleet = graphdist.LocalFleet(f"local={{n}}").start()
        started = time.perf_counter()
        time.sleep({SETTLE_S})
        begun = time.perf_counter()
        fleet.restart("local", 0)  # returns once the new server answers (and listens right)
        restarted = time.perf_counter()
        fleet.close()
        out[n] = {{
            "start_s": started - start,
            "restart_s": restarted - begun,
            "close_s": time.perf_counter() - restarted,
        }}
    print("READY", json.dumps(out), flush=True)
    """
)
SAME_GRPC = {GRPC_QUEUES_ENV: grpc_queues()}
"""What a LocalFleet's servers get by default (one gRPC completion queue per CPU, not
TensorFlow's 64): create_local_cluster, cold, and TensorFlow's warm floor get it too, so that
both sides start the same threads."""
FORKED = {SPARES_ENV: "0"}
"""The environment of ``warm_forked``: the same warm child with the pool off (every server and
restart forked when asked, as before the pool), the same run's baseline of the pool's gain."""

# TensorFlow's own floor for a warm start: servers built by create_local_cluster in a process
# that has TensorFlow imported and built one already (its one-time costs paid), all in that one
# process, without a fork or a process per server, timed until every server has answered one
# GetStatus call, as a LocalFleet start() is (the same probe, graphdist._net.probe, in rounds of
# the silent ones). create_local_cluster returns before its servers serve: each still starts its
# gRPC threads, and on 2 CPUs the last answered 120 ms (8 servers) to 150 ms (16) after it
# returned (return_s, printed beside it). No design that runs a process per server can beat it.
WARM_TF = textwrap.dedent(
    """
    import json, os, sys, time
    import tensorflow as tf
    from graphdist._net.probe import probe_many, probers

    def answering(workers):
        with probers([w.target[len("grpc://"):] for w in workers]) as silent:
            while silent:
                silent = [p for p, ok in zip(silent, probe_many(silent, 0.5)) if not ok]

    answering(tf.test.create_local_cluster(1, 0)[0])
    out = {}
    for n in sys.argv[1:]:
        start = time.perf_counter()
        workers, _ = tf.test.create_local_cluster(int(n), 0)
        returned = time.perf_counter()
        answering(workers)
        out[n] = {"start_s": time.perf_counter() - start, "return_s": returned - start}
    print("READY", json.dumps(out), flush=True)
    os._exit(0)  # its servers can never be stopped otherwise
    """
)

WARM_TARGET = 1.25
"""A warm LocalFleet ``start()`` / TensorFlow's warm floor (``WARM_TF``), at each warm size: at
most this (the issue's target, at 8 and 16 servers)."""
RESTART_TARGET_S = 0.25
"""One task's ``restart()`` in a warm fleet, to serving again (its new server answers and listens
on loopback), at each warm size: at most this many seconds (the issue's target)."""


class Timing(TypedDict):
    """One figure of the side-by-side: the median over the rounds, every round's seconds in the
    order measured, and the median as a multiple of the floor its row names."""

    seconds: float
    runs_s: list[float]
    ratio: float


class ColdRow(TypedDict):
    """Cold start-ups at one size: each method's whole process (launch to exit) and its time to
    ready (launch to every server answering); LocalFleet's ratios are against the lean floor,
    create_local_cluster's against the bare one."""

    servers: int
    local_fleet: Timing
    local_fleet_ready: Timing
    create_local_cluster: Timing
    create_local_cluster_ready: Timing


class _WarmFigures(TypedDict):
    servers: int
    start: Timing
    close: Timing
    tf_in_process: Timing


class WarmRow(_WarmFigures, total=False):
    """A warm LocalFleet at one size: ``start()``, one task's ``restart()`` and ``close()`` of a
    fleet in a process whose fork server is already up; with ``--without-pool``, the same with
    the fork server's pool of spares off (``*_forked``: every server forked when asked); and
    TensorFlow's own floor, the same number of servers built in one process that has TensorFlow
    imported (``WARM_TF``). Ratios against that floor. (A figure the warm child did not report,
    as in an older run's JSON, is left out.)"""

    restart: Timing
    tf_returned: Timing
    start_forked: Timing
    restart_forked: Timing


class SideBySide(TypedDict):
    """The side-by-side (:func:`side_by_side`): its rounds, both floors, rows, slopes (seconds
    per server), its targets (text, met) and the warnings of its floors."""

    repeats: int
    floor: Timing
    lean_floor: Timing
    cold: list[ColdRow]
    warm: list[WarmRow]
    slopes: dict[str, float]
    targets: list[tuple[str, bool]]
    warnings: list[str]


def measure_side(key: str, servers: int, warm_sizes: list[int]) -> dict[str, float]:
    """One measurement of the side-by-side (``key``: a floor of ``FLOOR_KEYS``, "warm",
    "warm_forked", "warm_tf" or a method of ``COLD``)."""
    if key in FLOOR_KEYS:
        ready, _ = time_to_ready(CHILDREN[key], then_json=True)
        return {"ready_s": ready}
    if key in ("warm", "warm_forked", "warm_tf"):
        code, env = (WARM_TF, SAME_GRPC) if key == "warm_tf" else (WARM, None)
        if key == "warm_forked":
            env = FORKED
        _, _, out = run_child(code, *map(str, warm_sizes), env=env)
        return {f"{k}[{n}]": v for n, figures in out.items() for k, v in figures.items()}
    env = SAME_GRPC if key == "create_local_cluster" else None
    ready, exited, _ = run_child(COLD[key], str(servers), env=env)
    return {"ready_s": ready, "exit_s": exited}


def _timing(runs: list[float], floor_s: float) -> Timing:
    median = statistics.median(runs)
    return {"seconds": median, "runs_s": runs, "ratio": median / floor_s}


def warm_targets(warm: list[WarmRow]) -> list[tuple[str, bool]]:
    """(text, met) of the warm-start target (:data:`WARM_TARGET`) and the restart target
    (:data:`RESTART_TARGET_S`) at each warm size."""

    def without_pool(w: WarmRow) -> str:
        forked = w.get("restart_forked")
        return "" if forked is None else f", without the pool of spares {forked['seconds']:.3f} s"

    def returned(w: WarmRow) -> str:
        r = w.get("tf_returned")
        ratio = "" if r is None else w["start"]["seconds"] / r["seconds"]
        return "" if r is None else f"; {ratio:.2f}x its return, {r['seconds']:.2f} s"

    restarts = [
        (
            f"warm LocalFleet restart() of one task, {w['servers']} servers: "
            f"{w['restart']['seconds']:.3f} s to serving ({without_pool(w)[2:] or 'absolute'}; "
            f"target <= {RESTART_TARGET_S} s; benchmarks/startup.py --side-by-side)",
            w["restart"]["seconds"] <= RESTART_TARGET_S,
        )
        for w in warm
        if "restart" in w
    ]
    starts = [
        (
            f"warm LocalFleet start(), {w['servers']} servers: {w['start']['ratio']:.2f}x "
            f"TensorFlow's warm floor ({w['start']['seconds']:.2f} s vs "
            f"{w['tf_in_process']['seconds']:.2f} s{returned(w)}; target <= {WARM_TARGET}; "
            "benchmarks/startup.py --side-by-side)",
            w["start"]["ratio"] <= WARM_TARGET,
        )
        for w in warm
    ]
    return starts + restarts


def side_by_side(
    sizes: list[int], warm_sizes: list[int], repeats: int = 3, *, without_pool: bool = False
) -> SideBySide:
    """Cold LocalFleet vs cold ``create_local_cluster`` at each of ``sizes`` and a warm
    LocalFleet at each of ``warm_sizes``, with both floors, in ``repeats`` interleaved rounds
    (``_common.interleaved``); medians over rounds. ``without_pool``: each round also runs the
    warm child with the fork server's pool of spares off (``warm_forked``)."""
    plan = [
        *((k, 0) for k in FLOOR_KEYS),
        *((m, n) for n in sizes for m in COLD),
        ("warm", 0),
        *([("warm_forked", 0)] if without_pool else []),
        ("warm_tf", 0),
    ]
    runs = interleaved(plan, repeats, lambda key: measure_side(*key, warm_sizes))
    floor_runs = {k: [m["ready_s"] for m in runs[(k, 0)]] for k in FLOOR_KEYS}
    floor_s = {k: statistics.median(v) for k, v in floor_runs.items()}

    def timing(key: tuple[str, int], figure: str, floor: float) -> Timing:
        return _timing([m[figure] for m in runs[key]], floor)

    def cold_row(n: int) -> ColdRow:
        lean, bare = floor_s["lean_import"], floor_s["bare_import"]
        return {
            "servers": n,
            "local_fleet": timing(("local_fleet", n), "exit_s", lean),
            "local_fleet_ready": timing(("local_fleet", n), "ready_s", lean),
            "create_local_cluster": timing(("create_local_cluster", n), "exit_s", bare),
            "create_local_cluster_ready": timing(("create_local_cluster", n), "ready_s", bare),
        }

    def warm_row(n: int) -> WarmRow:
        tf_floor = statistics.median(m[f"start_s[{n}]"] for m in runs[("warm_tf", 0)])
        row: WarmRow = {
            "servers": n,
            "start": timing(("warm", 0), f"start_s[{n}]", tf_floor),
            "close": timing(("warm", 0), f"close_s[{n}]", tf_floor),
            "tf_in_process": timing(("warm_tf", 0), f"start_s[{n}]", tf_floor),
        }
        optional = {
            "tf_returned": ("warm_tf", "return_s"),
            "restart": ("warm", "restart_s"),
            "start_forked": ("warm_forked", "start_s"),
            "restart_forked": ("warm_forked", "restart_s"),
        }
        for name, (key, figure) in optional.items():
            if all(f"{figure}[{n}]" in m for m in runs.get((key, 0), [{}])):
                row[name] = timing((key, 0), f"{figure}[{n}]", tf_floor)  # type: ignore[literal-required]
        return row

    cold = [cold_row(n) for n in sizes]
    warm = [warm_row(n) for n in warm_sizes]
    slopes = {
        f"cold_s_per_server[{m}]": slope(sizes, [r[m]["seconds"] for r in cold]) for m in COLD
    }
    slopes["warm_s_per_server[local_fleet]"] = slope(
        warm_sizes, [r["start"]["seconds"] for r in warm]
    )
    floors = {k: _timing(floor_runs[k], floor_s[k]) for k in FLOOR_KEYS}
    warnings = []
    for kind in FLOOR_KEYS:
        figures = [
            (f"{COLD_LABELS[m]}, {r['servers']} servers", r[m]["seconds"])
            for r in cold
            for m in COLD
            if FLOOR_OF[m] == kind
        ]
        warnings += floor_warnings(floors[kind], figures, kind=kind)
    warnings += too_few_floors(repeats)
    return {
        "repeats": repeats,
        "floor": floors["bare_import"],
        "lean_floor": floors["lean_import"],
        "cold": cold,
        "warm": warm,
        "slopes": slopes,
        "targets": warm_targets(warm),
        "warnings": warnings,
    }


def side_by_side_lines(r: SideBySide) -> list[str]:
    """The side-by-side as Markdown: one table, its slopes and how noisy its rounds were."""
    floor, lean = r["floor"], r["lean_floor"]
    sizes = [row["servers"] for row in r["cold"]]

    def cell(t: Timing) -> str:
        return f"{t['seconds']:.2f} s ({t['ratio']:.2f}x)"

    out = [
        f"**Start-up side by side** (`benchmarks/startup.py --side-by-side`, {r['repeats']} "
        f"interleaved rounds, medians; floors: bare `import tensorflow` = "
        f"{floor['seconds']:.2f} s, spread {spread(floor['runs_s']):.0%}; lean import, as a "
        f"LocalFleet server = {lean['seconds']:.2f} s, spread {spread(lean['runs_s']):.0%})",
        "",
        "| | " + " | ".join(f"{n} servers" for n in sizes) + " | s/server |",
        "|---|" + "---:|" * (len(sizes) + 1),
    ]
    against = {"local_fleet": "x the lean floor", "create_local_cluster": "x the bare floor"}
    for m, label in COLD_LABELS.items():
        cells = [cell(row[m]) for row in r["cold"]]
        per = r["slopes"][f"cold_s_per_server[{m}]"]
        out.append(f"| {label}, {against[m]} | " + " | ".join(cells) + f" | {per:.3f} |")
    for m in COLD:
        cells = [cell(row[f"{m}_ready"]) for row in r["cold"]]
        out.append(f"| ... of which to ready: {m} | " + " | ".join(cells) + " | |")
    ratio = [
        f"{row['local_fleet']['seconds'] / row['create_local_cluster']['seconds']:.2f}x"
        for row in r["cold"]
    ]
    out.append("| cold LocalFleet / create_local_cluster | " + " | ".join(ratio) + " | |")
    by_size = {row["servers"]: row for row in r["warm"]}
    columns = sorted({*sizes, *by_size})
    if columns != sizes:  # warm sizes the cold rows lack: the warm rows get their own header
        out += ["", "| | " + " | ".join(f"{n} servers" for n in columns) + " | s/server |"]
        out.append("|---|" + "---:|" * (len(columns) + 1))

    def warm_cells(figure: str, ratio: bool = True) -> str:
        return " | ".join(
            ""
            if n not in by_size
            else cell(by_size[n][figure])
            if ratio
            else f"{by_size[n][figure]['seconds']:.2f} s"
            for n in columns
        )

    per = r["slopes"]["warm_s_per_server[local_fleet]"]
    out.append(
        "| warm LocalFleet `start()` (fork server up), x TensorFlow's warm floor | "
        + warm_cells("start")
        + f" | {per:.3f} |"
    )
    optional = {
        "start_forked": ("| ... without the pool of spares (every server forked when asked)", True),
        "restart": ("| warm LocalFleet `restart()` of one task, to serving", False),
        "restart_forked": ("| ... without the pool of spares", False),
    }
    for figure, (label, with_ratio) in optional.items():
        if all(figure in row for row in r["warm"]):
            out.append(f"{label} | " + warm_cells(figure, ratio=with_ratio) + " | |")
    out.append("| warm LocalFleet `close()` | " + warm_cells("close", ratio=False) + " | |")
    out.append(
        "| TensorFlow's warm floor: `create_local_cluster(n, 0)` in a process that built one "
        "already, until every server answered | " + warm_cells("tf_in_process", ratio=False)
    )
    out[-1] += " | |"
    if all("tf_returned" in row for row in r["warm"]):
        out.append(
            "| ... of which until `create_local_cluster` returned (its servers not answering "
            "yet), x the floor | " + warm_cells("tf_returned") + " | |"
        )
    spreads = ", ".join(
        f"{m} {row['servers']}: {spread(row[m]['runs_s']):.0%}" for row in r["cold"] for m in COLD
    )
    out += ["", f"Spread of the cold figures over the rounds ((max - min) / median): {spreads}."]
    warm_spreads = ", ".join(
        f"{figure} {row['servers']}: {spread(row[figure]['runs_s']):.0%}"
        for row in r["warm"]
        for figure in ("start", "restart", "tf_in_process")
        if figure in row
    )
    out.append(f"Spread of the warm figures: {warm_spreads}.")
    return out


def table_lines(floors: dict[str, Figures], rows: list[dict[str, Any]], methods: Any) -> list[str]:
    """The start-up table of :func:`main` as plain text: seconds against each method's own
    floor, then the memory of every process each method ran."""
    out = [
        f"{FLOOR_LABELS[k]}: {floors[k]['seconds']:.2f} s (median of "
        f"{len(floors[k]['runs_s'])}; floor of {', '.join(m for m in methods if FLOOR_OF[m] == k)})"
        for k in FLOOR_KEYS
    ]
    header = "".join(f"  {m:>22}" for m in methods)
    out.append(f"{'servers':>7}{header}")
    for r in rows:
        ratios = [r[m]["seconds"] / floors[FLOOR_OF[m]]["seconds"] for m in methods]
        cells = "".join(
            f"  {r[m]['seconds']:>8.2f} s = {x:>5.2f}x"
            for m, x in zip(methods, ratios, strict=True)
        )
        out.append(f"{r['servers']:>7}{cells}")
    out.append("memory of every process each method ran, PSS / RSS MiB (processes):")
    out.append(f"{'servers':>7}{header}")
    for r in rows:
        cells = "".join(
            f"  {r[m]['pss_mib']:>6.0f} / {r[m]['rss_mib']:>6.0f} ({r[m]['processes']:>2})"
            for m in methods
        )
        out.append(f"{r['servers']:>7}{cells}")
    if "seed_style" in methods and "local_fleet" in methods:
        last = rows[-1]
        ratio = last["seed_style"]["seconds"] / last["local_fleet"]["seconds"]
        out.append(f"seed-style / LocalFleet at {last['servers']} servers: {ratio:.2f}x")
    return out


def main(argv: list[str] | None = None) -> Any:
    """Run the benchmark ``argv`` asks for, print it and return its figures, with the texts of
    the targets it missed under ``missed`` (the script exits 1 on any)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", help="(default 1 4 8; side by side: 8 16)")
    parser.add_argument(
        "--repeats", type=int, default=FLOOR_REPEATS, help="interleaved rounds (%(default)s)"
    )
    parser.add_argument(
        "--methods", nargs="+", choices=METHODS, default=["local_fleet", "seed_style"]
    )
    parser.add_argument(
        "--side-by-side",
        action="store_true",
        help="cold LocalFleet vs cold create_local_cluster at --sizes (default 8 16) and a warm "
        "LocalFleet at --warm-sizes, in --repeats interleaved rounds",
    )
    parser.add_argument("--warm-sizes", type=int, nargs="+", default=[8, 16])
    parser.add_argument(
        "--without-pool",
        action="store_true",
        help="side by side: also run the warm fleet with its fork server's pool of spares off "
        f"({SPARES_ENV}=0), the same run's figures of every server forked when asked",
    )
    add_json_option(parser)
    args = parser.parse_args(argv)
    if args.side_by_side:
        side = side_by_side(
            args.sizes or [8, 16], args.warm_sizes, args.repeats, without_pool=args.without_pool
        )
        print("\n".join(side_by_side_lines(side)))
        for line in side["warnings"]:
            print(line)
        missed = report_targets(side["targets"])
        write_json(args.json, side)
        return {**side, "missed": missed}

    floors, rows = startup_rounds(args.methods, args.sizes or [1, 4, 8], args.repeats)
    print("\n".join(table_lines(floors, rows, args.methods)))
    warnings = startup_warnings(floors, rows, args.methods)
    for line in warnings:
        print(line)
    result = {**floors, "repeats": args.repeats, "rows": rows, "warnings": warnings}
    write_json(args.json, result)
    return {**result, "missed": []}


if __name__ == "__main__":
    finish(None, None, main()["missed"])
