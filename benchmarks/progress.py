"""What reporting progress costs a training loop: steps per second of a 1 ms step with and
without ``graphdist.step`` after each step, in one real task of ``graphdist run``.

The task (one worker, warm, under its guard, its records relayed to the launcher as in any run)
runs ``--rounds`` rounds, each ``--steps`` steps of ``--step-ms`` of CPU work (a spin on the
thread's CPU clock: a sleep's jitter would hide the figure, and a preemption does not shorten a
step) without the call and as many with it (``graphdist.step(n, total=..., loss=..., ready=...)``,
its costliest form: a synchronous run's wait with it), back to
back, the order swapped every round. The ratio is the median of the rounds' own ratios of steps
per second without the call over those with it, on the wall clock (each round's two blocks saw
the same load) and on the task's CPU clock (which other load does not move). The launcher's
``progress`` events are counted: a run that received none measured nothing, and says so.

Target (issue 56): the ratio at most ``TARGET_RATIO`` (1.02). A missed target prints MISSED and
the script exits 1 (``--no-check``: exit 0 all the same).

    python benchmarks/progress.py [--rounds 20] [--steps 500] [--step-ms 1.0] [--smoke]
        [--json FILE] [--readme docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap
from typing import Any

try:
    from . import _common
except ImportError:  # run as a script
    import _common

NAME = "progress"
"""This benchmark's section of docs/benchmarks.md (``<!-- bench:progress:start -->``)."""
TARGET_RATIO = 1.02
"""Steps per second without ``graphdist.step`` over those with it, at most."""

TASK = textwrap.dedent(
    """
    import json, sys, time
    import graphdist

    rounds, steps, step_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])

    def loop(report, start):
        began, cpu = time.perf_counter(), time.thread_time()
        for n in range(start, start + steps):
            until = time.thread_time() + step_s  # CPU work: a preemption does not shorten it
            while time.thread_time() < until:
                pass
            if report:
                graphdist.step(
                    n + 1, total=2 * rounds * steps, loss=1.0 / (n + 1), ready=time.time()
                )
        return time.perf_counter() - began, time.thread_time() - cpu

    done = 0
    for r in range(rounds):
        row = {}
        for report in ((False, True) if r % 2 == 0 else (True, False)):
            wall, cpu = loop(report, done)
            done += steps
            row["with" if report else "without"] = (steps / wall, steps / cpu)
        print(json.dumps(row), flush=True)
    """
)


def measure(rounds: int, steps: int, step_ms: float) -> dict[str, Any]:
    """One run: each round's steps/s with and without the call (on the wall clock and on the
    task's CPU clock) and the launcher's ``progress`` events counted."""
    argv = [sys.executable, "-m", "graphdist", "run", "--workers", "1"]
    argv += ["--output-format", "jsonl", "--", sys.executable, "-c", TASK]
    argv += [str(rounds), str(steps), str(step_ms / 1000)]
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=600, cwd=_common.REPO, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"the run failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    rows = [
        json.loads(e["text"]) for e in events if e["event"] == "line" and e["text"].startswith("{")
    ]
    warm = [e["warm"] for e in events if e["event"] == "task-started"]

    def median(side: str, clock: int) -> float:
        return statistics.median(row[side][clock] for row in rows)

    return {
        "rounds": rounds,
        "steps": steps,
        "step_ms": step_ms,
        "warm": all(warm),
        "without_steps_per_s": median("without", 0),
        "with_steps_per_s": median("with", 0),
        # each round's two blocks ran back to back: their ratio saw the same load
        "ratio": statistics.median(row["without"][0] / row["with"][0] for row in rows),
        "cpu_ratio": statistics.median(row["without"][1] / row["with"][1] for row in rows),
        "records": sum(e["event"] == "progress" for e in events),
        "rows": rows,
    }


def report(figures: dict[str, Any]) -> tuple[str, list[tuple[str, bool]]]:
    """The section's text and the targets: ``(text, met)``."""
    text = (
        "| step | without `graphdist.step` (steps/s) | with it (steps/s) | ratio | CPU-time "
        "ratio | records |\n|---|---:|---:|---:|---:|---:|\n"
        f"| {figures['step_ms']:g} ms of CPU work | {figures['without_steps_per_s']:.1f} | "
        f"{figures['with_steps_per_s']:.1f} | {figures['ratio']:.4f}x | "
        f"{figures['cpu_ratio']:.4f}x | {figures['records']} |\n\n"
        f"Medians of {figures['rounds']} rounds, each {figures['steps']} steps without the call "
        "and as many with it, back to back in turns (the ratio is the median of the rounds' "
        f"own), in one {'warm' if figures['warm'] else 'cold'} task of `graphdist run --workers "
        "1`; the CPU-time ratio counts the task's own CPU only, which the machine's other load "
        "does not move; records: the `progress` events the launcher received (at most one per "
        "0.5 s)."
    )
    targets = [
        (
            f"steps/s without over with graphdist.step {figures['ratio']:.4f}x <= {TARGET_RATIO}x",
            figures["ratio"] <= TARGET_RATIO,
        ),
        (
            f"the launcher received {figures['records']} progress records > 0",
            figures["records"] > 0,
        ),
    ]
    return text, targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--step-ms", type=float, default=1.0)
    parser.add_argument("--smoke", action="store_true", help="2 rounds of 100 steps")
    _common.add_report_options(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.steps = 2, 100
    figures = measure(args.rounds, args.steps, args.step_ms)
    _common.publish(args, NAME, "progress.py", argv, report(figures), figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
