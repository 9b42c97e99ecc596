"""How fast a fleet's session reports a failed task, against a raw TensorFlow session meeting the
same failure in the same run, and against the session's own operation timeout.

For each case, a fresh ``LocalFleet("local=2")`` with default settings (so a fleet session's
timeout is ``graphdist.FLEET_OPERATION_TIMEOUT_MS``, ten minutes) and a step that blocks on
``local:1`` and sends its result to ``local:0`` (a dequeue from an empty queue there), so a
failure hits it mid-transfer. Each figure is the median, over ``--repeats``, of the seconds from
the failure (the kill, the SIGSTOP) to the error in the caller.

The baseline is the same failure met by a raw ``tf.compat.v1.Session`` on a fresh fleet of its
own, with the best plain-TensorFlow setting there is: ``ConfigProto(operation_timeout_in_ms=N)``,
``--raw-timeout-s`` (default: ``graphdist.DEFAULT_OPERATION_TIMEOUT_MS``, the bound graphdist
itself sets where nothing watches the peers); ``RunOptions(timeout_in_ms=...)`` would add nothing,
as it does not even cover a session's creation. Without any timeout, raw TensorFlow waits for
ever in the cases where it waits the whole timeout here (printed as ``timeout``). ``vs raw`` is
graphdist's seconds over raw TensorFlow's; ``of timeout`` is graphdist's seconds as a fraction
of the ten minutes TensorFlow alone would wait under the fleet's own timeout.

Targets (docs/fleets.md, "Failures in a second"): a dead or killed task, transfers and the master
included, is reported within ``DEAD_TARGET_S``; a frozen task within ``frozen_target_s()``
(three missed gRPC probes); closing the session then takes at most ``CLOSE_TARGET_S``. A missed
target prints MISSED and the script exits 1 (``--no-check``: exit 0 all the same).

    python benchmarks/fast_failure.py [--repeats 3] [--case NAME ...] [--raw-timeout-s 30]
        [--json out.json] [--readme docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

try:
    from . import _common
except ImportError:  # run as a script
    import _common

sys.path.insert(0, _common.REPO)

NAME = "fast_failure"
"""This benchmark's section of docs/benchmarks.md (``<!-- bench:fast_failure:start -->``)."""
DEAD_TARGET_S = 1.0
"""A dead or killed task (worker or master) is reported within this many seconds."""
CLOSE_TARGET_S = 1.0
"""Closing a session after any failure returns within this many seconds ("at once")."""
SETTLE_S = 1.0
"""Seconds a run is given to reach its blocking dequeue before the failure is injected."""
GRAPHDIST_WAIT_S = 120.0
"""The most a graphdist run is waited for after the failure (a bound, never reached)."""
RAW_MARGIN_S = 10.0
"""Seconds a raw run (and its close) is waited for beyond its operation timeout."""


def frozen_target_s() -> float:
    """A frozen task is reported within this many seconds: ``MISSES_BEFORE_FROZEN`` probes,
    ``PROBE_INTERVAL_S`` apart, the last one waiting ``RUN_PROBE_TIMEOUT_S``."""
    from graphdist._fleet import guard
    from graphdist._net.probe import RUN_PROBE_TIMEOUT_S

    return guard.MISSES_BEFORE_FROZEN * guard.PROBE_INTERVAL_S + RUN_PROBE_TIMEOUT_S


def _label(error: BaseException | None) -> str:
    """How a run ended: graphdist's ``task status``, or TensorFlow's error class."""
    if error is None:
        return "no error"
    if hasattr(error, "task") and hasattr(error, "status"):
        return f"{error.task} {error.status}"
    name = type(error).__name__
    return "timeout" if name == "DeadlineExceededError" else name


def _bounded_close(sess: Any, wait_s: float) -> float:
    """Seconds ``sess.close()`` took, from a thread of its own, whether it returned or raised
    (a raw session's close after a task died waits out its timeout, then raises
    ``DeadlineExceededError``); ``nan`` when it had not ended after ``wait_s``."""
    done = threading.Event()
    start = time.monotonic()

    def close() -> None:
        try:
            sess.close()
        except Exception:  # the time it took is the figure; how it ended is TensorFlow's
            pass
        finally:
            done.set()

    threading.Thread(target=close, daemon=True).start()
    return time.monotonic() - start if done.wait(wait_s) else float("nan")


def timed_failure(
    fleet: Any, fail: Callable[[Any], None], *, during: bool, raw_timeout_s: float | None = None
) -> dict[str, Any]:
    """``seconds`` from ``fail(fleet)`` to the error of a run (started before it when
    ``during``; ``nan`` if none came within the wait), the error's ``label`` and ``close_s``.
    The session is the fleet's own, or a raw ``tf.compat.v1.Session`` with
    ``operation_timeout_in_ms`` when ``raw_timeout_s`` is given."""
    import tensorflow as tf

    from graphdist._graph.graphs import blocking_step

    graph, out, _ = blocking_step(fleet.device("local", 1), fleet.device("local", 0))
    if raw_timeout_s is None:
        sess = fleet.session("local", 0, graph=graph)
        wait_s = GRAPHDIST_WAIT_S
    else:
        config = tf.compat.v1.ConfigProto(operation_timeout_in_ms=int(raw_timeout_s * 1000))
        sess = tf.compat.v1.Session(fleet.target("local", 0), graph=graph, config=config)
        wait_s = raw_timeout_s + RAW_MARGIN_S
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            sess.run(out)
        except Exception as exc:  # what ended the run: graphdist's or TensorFlow's error
            box["error"] = exc
        box["at"] = time.monotonic()
        done.set()

    if during:
        threading.Thread(target=run, daemon=True).start()
        time.sleep(SETTLE_S)
    start = time.monotonic()
    fail(fleet)
    if not during:
        threading.Thread(target=run, daemon=True).start()
    if not done.wait(wait_s):
        return {"seconds": float("nan"), "label": f"still waiting after {wait_s:.0f} s"}
    return {
        "seconds": box["at"] - start,
        "label": _label(box.get("error")),
        "close_s": _bounded_close(sess, wait_s),
    }


def freeze_worker(fleet: Any) -> None:
    os.kill(fleet.task("local", 1).pid, signal.SIGSTOP)


CASES: dict[str, tuple[Callable[[Any], None], bool]] = {
    "worker dead before a new session's run": (lambda f: f.kill("local", 1), False),
    "worker killed during a transfer": (lambda f: f.kill("local", 1), True),
    "worker frozen (SIGSTOP) during a run": (freeze_worker, True),
    "master killed during a run": (lambda f: f.kill("local", 0), True),
}
FROZEN = "worker frozen (SIGSTOP) during a run"


def one_fleet(fail: Callable[[Any], None], during: bool, raw_timeout_s: float | None) -> Any:
    """One failure on a fresh two-task fleet (see :func:`timed_failure`)."""
    import graphdist

    with graphdist.LocalFleet("local=2") as fleet:
        try:
            return timed_failure(fleet, fail, during=during, raw_timeout_s=raw_timeout_s)
        finally:
            for task in fleet.tasks:  # thaw a frozen task so that close() is quick
                if task.alive:
                    os.kill(task.pid, signal.SIGCONT)


def measure_case(name: str, repeats: int, raw_timeout_s: float) -> dict[str, Any]:
    """Both sessions' figures of case ``name``; graphdist and raw TensorFlow alternate."""
    import graphdist

    fail, during = CASES[name]
    ours, raw = [], []
    for _ in range(repeats):
        ours.append(one_fleet(fail, during, None))
        raw.append(one_fleet(fail, during, raw_timeout_s))
    seconds = statistics.median(r["seconds"] for r in ours)
    raw_s = statistics.median(r["seconds"] for r in raw)
    timeout_s = graphdist.FLEET_OPERATION_TIMEOUT_MS / 1000
    return {
        "case": name,
        "seconds": seconds,
        "runs_s": [r["seconds"] for r in ours],
        "error": ours[-1]["label"],
        "close_s": max(r.get("close_s", float("nan")) for r in ours),
        "raw_s": raw_s,
        "raw_runs_s": [r["seconds"] for r in raw],
        "raw_error": raw[-1]["label"],
        "raw_close_s": max(r.get("close_s", float("nan")) for r in raw),
        "raw_timeout_s": raw_timeout_s,
        "vs_raw": seconds / raw_s,
        "timeout_s": timeout_s,
        "fraction_of_timeout": seconds / timeout_s,
    }


def table(rows: list[dict[str, Any]]) -> str:
    """The figures as a fixed-width table (what is printed, and what README shows)."""
    lines = [
        f"{'case':40} {'graphdist':>9} {'raw TF':>8} {'vs raw':>7} {'of timeout':>10}  "
        "graphdist's error; raw TF's"
    ]
    for r in rows:
        lines.append(
            f"{r['case']:40} {r['seconds']:8.2f}s {r['raw_s']:7.2f}s {r['vs_raw']:7.3f} "
            f"{r['fraction_of_timeout']:10.4f}  {r['error']}, close {r['close_s']:.2f} s; "
            f"{r['raw_error']}, close {r['raw_close_s']:.2f} s"
        )
    return "\n".join(lines)


def check(rows: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """Print each case's figures against its targets; the lines printed and the texts of the
    targets missed."""
    lines = []
    for r in rows:
        goal = frozen_target_s() if r["case"] == FROZEN else DEAD_TARGET_S
        # a nan (no error within the wait) fails every comparison: a miss, as it should be
        lines.append(
            (f"{r['case']}: {r['seconds']:.2f} s (target <= {goal:.1f} s)", r["seconds"] <= goal)
        )
        lines.append(
            (
                f"{r['case']}: close {r['close_s']:.2f} s (target <= {CLOSE_TARGET_S:.1f} s)",
                r["close_s"] <= CLOSE_TARGET_S,
            )
        )
    return _common.report_targets_kept(lines)


def markdown(rows: list[dict[str, Any]], raw_timeout_s: float, report: list[str]) -> str:
    """README's section: the table and the target lines, as printed, in a code block."""
    head = (
        f"  Raw TF: a `tf.compat.v1.Session` with `operation_timeout_in_ms` = {raw_timeout_s:g} s "
        "(`timeout`: it waited all of it; without a timeout it waits for ever)."
    )
    body = "\n".join("  " + line for line in [*table(rows).splitlines(), *report])
    return f"{head}\n\n  ```\n{body}\n  ```"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each case (3)")
    parser.add_argument(
        "--case", action="append", choices=list(CASES), help="a case to run (repeatable; all)"
    )
    parser.add_argument(
        "--raw-timeout-s",
        type=float,
        default=None,
        help="the raw session's operation timeout (default: DEFAULT_OPERATION_TIMEOUT_MS, 30 s)",
    )
    _common.add_report_options(parser)
    args = parser.parse_args(argv)
    _common.quiet_tensorflow()
    import graphdist

    raw_timeout_s = args.raw_timeout_s or graphdist.DEFAULT_OPERATION_TIMEOUT_MS / 1000
    names = args.case or list(CASES)
    rows = [measure_case(name, args.repeats, raw_timeout_s) for name in names]
    print(table(rows))
    report, missed = check(rows)
    command = _common.command_line("fast_failure.py", argv)
    _common.update_readme_section(args.readme, NAME, markdown(rows, raw_timeout_s, report), command)
    _common.finish(args.json, rows, [] if args.no_check else missed)
    return rows


if __name__ == "__main__":
    main()
