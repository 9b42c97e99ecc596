"""What a dead worker costs a ``graphdist run --max-restarts`` training run: the seconds from
the kill to the first training step after the restart, against a cold start of the same run,
and the training steps done again.

Each repeat runs ``graphdist run --workers 2 --max-restarts 1 -- python _restart_task.py``
(MultiWorkerMirroredStrategy; a small model backed up every ``--save-every`` steps by
``graphdist.backup_and_restore``; one ``step G`` line per step) under graphdist's fault injector
(the ``graphdist_faults`` machinery), which SIGKILLs worker-1 once the chief has printed step
``--kill-at`` of the first attempt. From the output lines' arrival times:

- cold start: the launcher's start to the chief's first step line of attempt 0;
- recovery: the kill to the chief's first step line of attempt 1 (noticing the death,
  stopping the survivor, the back-off, starting every task again, restoring the backup);
  ``stop``, the kill to the launcher's restart line, is the first part of it;
- steps redone: the last step of attempt 0 less the step attempt 1 resumed after.

Figures are medians over ``--repeats``. Targets: recovery at most ``RECOVERY_TARGET`` x the cold
start, and at most ``--save-every`` steps redone per failure (a backup every N steps loses at
most N). A missed target prints MISSED and the script exits 1.

    python benchmarks/restart.py [--steps 300] [--save-every 25] [--kill-at 110] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
from typing import Any, TypedDict

try:
    from ._common import HERE, REPO, add_json_option, quiet_tensorflow, write_json
except ImportError:  # run as a script, or imported with benchmarks/ on sys.path
    from _common import HERE, REPO, add_json_option, quiet_tensorflow, write_json

sys.path.insert(0, REPO)
quiet_tensorflow()

TASK = os.path.join(HERE, "_restart_task.py")
RECOVERY_TARGET = 1.5
"""Recovery (kill to the first step after the restart) / cold start: at most this."""
_STEP = re.compile(r"step (\d+)")


class Restart(TypedDict):
    """One repeat's figures (seconds, and steps)."""

    cold_s: float
    recovery_s: float
    stop_s: float
    ratio: float
    last_step: int
    resumed_after: int
    redone: int


def _steps(outcome: Any, attempt: int) -> list[tuple[float, int]]:
    """(seconds into the run, step) of the chief's step lines in ``attempt``."""
    found = []
    for line in outcome.output:
        if line.task == "worker-0" and line.attempt == attempt:
            step = _STEP.fullmatch(line.text)
            if step is not None:
                found.append((line.at_s, int(step.group(1))))
    return found


def measure_once(steps: int, save_every: int, kill_at: int) -> Restart:
    """One run with one kill (see the module docstring)."""
    from graphdist._distribute.injector import FaultInjector

    injector = FaultInjector()
    try:
        with tempfile.TemporaryDirectory(prefix="graphdist-bench-restart-") as out:
            argv = [sys.executable, TASK, "--out", out, "--steps", str(steps)]
            outcome = injector.run(
                [*argv, "--save-every", str(save_every)],
                workers=2,
                max_restarts=1,
                cwd=HERE,
                env={"TF_CPP_MIN_LOG_LEVEL": "2"},
                faults=[injector.kill("worker-1", after=rf"^step {kill_at}$", of="worker-0")],
            )
    finally:
        left = injector.close()
    if outcome.returncode != 0 or outcome.attempts != 2 or len(outcome.injected) != 1 or left:
        raise RuntimeError(f"the run did not go as planned (survivors: {left}):\n{outcome}")
    first, again = _steps(outcome, 0), _steps(outcome, 1)
    restart_at = next(o.at_s for o in outcome.output if "restarting the run" in o.text)
    killed_at = outcome.injected[0].at_s
    cold, recovery = first[0][0], again[0][0] - killed_at
    last, resumed_after = max(s for _, s in first), again[0][1] - 1
    return {
        "cold_s": cold,
        "recovery_s": recovery,
        "stop_s": restart_at - killed_at,
        "ratio": recovery / cold,
        "last_step": last,
        "resumed_after": resumed_after,
        "redone": last - resumed_after,
    }


def measure(steps: int, save_every: int, kill_at: int, repeats: int) -> dict[str, Any]:
    runs = [measure_once(steps, save_every, kill_at) for _ in range(repeats)]
    median = {
        key: statistics.median(float(r[key]) for r in runs)  # type: ignore[literal-required]
        for key in ("cold_s", "recovery_s", "stop_s", "ratio", "redone")
    }
    return {
        "steps": steps,
        "save_every": save_every,
        "kill_at": kill_at,
        "runs": runs,
        "median": median,
        "worst_redone": max(r["redone"] for r in runs),
    }


def check(figures: dict[str, Any]) -> list[str]:
    """Print the figures against their targets; the lines of the targets missed."""
    m = figures["median"]
    lines = [
        (
            f"recovery / cold start: {m['ratio']:.2f}x (target <= {RECOVERY_TARGET})",
            m["ratio"] <= RECOVERY_TARGET,
        ),
        (
            f"steps redone per failure, worst: {figures['worst_redone']} (target <= "
            f"{figures['save_every']}, the backup interval)",
            figures["worst_redone"] <= figures["save_every"],
        ),
    ]
    for text, met in lines:
        print(("met     " if met else "MISSED  ") + text)
    return [text for text, met in lines if not met]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps in all (300)")
    parser.add_argument("--save-every", type=int, default=25, help="steps between backups (25)")
    parser.add_argument("--kill-at", type=int, default=110, help="kill after this step (110)")
    parser.add_argument("--repeats", type=int, default=3, help="runs, one kill each (3)")
    add_json_option(parser)
    args = parser.parse_args(argv)
    if not 0 < args.kill_at < args.steps:
        parser.error("--kill-at must be between 0 and --steps")
    figures = measure(args.steps, args.save_every, args.kill_at, args.repeats)
    m = figures["median"]
    print(
        f"MWMS, 2 workers, {args.steps} steps, a backup every {args.save_every}, worker-1 "
        f"SIGKILLed after step {args.kill_at}; medians of {args.repeats} run(s)"
    )
    print(f"cold start (launch to first step):        {m['cold_s']:6.2f} s")
    print(f"recovery (kill to first step after it):   {m['recovery_s']:6.2f} s")
    print(f"  of which stop (kill to restart line):   {m['stop_s']:6.2f} s")
    print(f"steps redone per failure:                 {m['redone']:6.0f}")
    missed = check(figures)
    write_json(args.json, figures)
    if missed:
        sys.exit(1)
    return figures


if __name__ == "__main__":
    main()
