"""How fast a fleet's session reports a failed task, against the session's own operation timeout.

For each case, a fresh ``LocalFleet("local=2")`` with default settings (so the timeout is
``graphdist.FLEET_OPERATION_TIMEOUT_MS``, ten minutes) and a step that blocks on ``local:1`` and
sends its result to ``local:0`` (a dequeue from an empty queue there), so a failure hits it
mid-transfer. Each figure is the median, over ``--repeats``, of the seconds from the failure
(the kill, the SIGSTOP) to the ``TaskFailedError`` in the caller; the last column is that figure
as a fraction of the timeout that TensorFlow alone would have waited.

    python benchmarks/fast_failure.py [--repeats 3] [--json out.json]
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
    from ._common import REPO, add_json_option, quiet_tensorflow, write_json
except ImportError:  # run as a script
    from _common import REPO, add_json_option, quiet_tensorflow, write_json

sys.path.insert(0, REPO)


def timed_failure(fleet: Any, fail: Callable[[Any], None], *, during: bool) -> tuple[float, str]:
    """Seconds from ``fail(fleet)`` to the error of a run (started before it when ``during``),
    and the error's ``task status``."""
    import graphdist
    from graphdist._graph.graphs import blocking_step

    graph, out, _ = blocking_step(fleet.device("local", 1), fleet.device("local", 0))
    sess = fleet.session("local", 0, graph=graph)
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            sess.run(out)
        except graphdist.TaskFailedError as exc:
            box["error"] = exc
        box["at"] = time.monotonic()
        done.set()

    if during:
        threading.Thread(target=run, daemon=True).start()
        time.sleep(1.0)
    start = time.monotonic()
    fail(fleet)
    if not during:
        run()
    done.wait(120)
    error = box.get("error")
    close_start = time.monotonic()
    sess.close()
    box["close_s"] = time.monotonic() - close_start
    label = f"{error.task} {error.status}" if error is not None else "no error"
    return box.get("at", float("nan")) - start, f"{label}; close {box['close_s']:.2f} s"


def freeze_worker(fleet: Any) -> None:
    os.kill(fleet.task("local", 1).pid, signal.SIGSTOP)


CASES: dict[str, tuple[Callable[[Any], None], bool]] = {
    "worker dead before a new session's run": (lambda f: f.kill("local", 1), False),
    "worker killed during a transfer": (lambda f: f.kill("local", 1), True),
    "worker frozen (SIGSTOP) during a run": (freeze_worker, True),
    "master killed during a run": (lambda f: f.kill("local", 0), True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    add_json_option(parser)
    args = parser.parse_args()
    quiet_tensorflow()
    import graphdist

    timeout_s = graphdist.FLEET_OPERATION_TIMEOUT_MS / 1000
    rows = []
    for name, (fail, during) in CASES.items():
        seconds = []
        notes = []
        for _ in range(args.repeats):
            with graphdist.LocalFleet("local=2") as fleet:
                try:
                    elapsed, note = timed_failure(fleet, fail, during=during)
                finally:
                    for task in fleet.tasks:  # thaw a frozen task so that close() is quick
                        if task.alive:
                            os.kill(task.pid, signal.SIGCONT)
            seconds.append(elapsed)
            notes.append(note)
        median = statistics.median(seconds)
        rows.append(
            {
                "case": name,
                "seconds": median,
                "runs_s": seconds,
                "timeout_s": timeout_s,
                "fraction_of_timeout": median / timeout_s,
                "error": notes[-1],
            }
        )
    print(f"{'case':42} {'detected':>9} {'timeout':>8} {'fraction':>9}  error")
    for row in rows:
        print(
            f"{row['case']:42} {row['seconds']:8.2f}s {row['timeout_s']:7.0f}s "
            f"{row['fraction_of_timeout']:9.4f}  {row['error']}"
        )
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
