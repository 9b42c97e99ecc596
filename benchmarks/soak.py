"""No false restart: a healthy MultiWorkerMirroredStrategy run with long steps on a machine whose
CPUs are saturated, under the launcher's heartbeat (issue 28: "a healthy run with 40 s steps on
a CPU-saturated machine for 10 minutes").

``graphdist run --workers 2 --max-restarts 3 --output-format jsonl -- python _soak_task.py``
(steps of ``--step-s`` seconds of matrix products on every worker, ending in an all-reduce) runs
for ``--minutes`` while ``--burners`` busy-loop processes (default: 2 per CPU, each ending by
itself after the run's time) keep every CPU at 100 %. The heartbeat's timeout is the default
(``HEARTBEAT_TIMEOUT_S``). Read from the launcher's events: restarts and gave-ups (target: 0),
the attempts (target: 1), the steps done and their median time, the run's exit status
(target: 0). A miss prints MISSED and exits 1 (``--no-check``: exit 0); ``--readme FILE`` writes
the block as the section ``soak``.

    python benchmarks/soak.py [--minutes 10] [--step-s 40] [--burners N] [--readme FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

try:
    from ._common import (
        HERE,
        REPO,
        add_report_options,
        command_line,
        finish,
        report_targets_kept,
        update_readme_section,
    )
except ImportError:  # run as a script
    from _common import (
        HERE,
        REPO,
        add_report_options,
        command_line,
        finish,
        report_targets_kept,
        update_readme_section,
    )

sys.path.insert(0, REPO)

TASK = os.path.join(HERE, "_soak_task.py")
_STEP = re.compile(r"step (\d+) took ([\d.]+) s")
BURN = (
    "import sys, time\n"
    "end = time.monotonic() + float(sys.argv[1])\n"
    "while time.monotonic() < end: pass\n"
)


def soak(minutes: float, step_s: float, burners: int) -> dict[str, float]:
    """Run the soak once; its figures."""
    from graphdist._distribute.heartbeat import HEARTBEAT_TIMEOUT_S

    seconds = minutes * 60
    burn = [
        subprocess.Popen([sys.executable, "-c", BURN, str(seconds + 3 * step_s)])
        for _ in range(burners)
    ]
    launcher = [sys.executable, "-m", "graphdist", "run", "--workers", "2"]
    launcher += ["--max-restarts", "3", "--output-format", "jsonl", "--"]
    command = [sys.executable, TASK, "--step-s", str(step_s), "--minutes", str(minutes)]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"}
    began = time.monotonic()
    try:
        run = subprocess.run(
            [*launcher, *command],
            capture_output=True,
            text=True,
            env=env,
            timeout=seconds + 10 * step_s + 120,
        )
    finally:
        for proc in burn:
            proc.kill()
            proc.wait()
    events = []
    for line in run.stdout.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    steps = [
        float(m.group(2))
        for e in events
        if e.get("event") == "line" and e.get("task") == "worker-0"
        for m in [_STEP.fullmatch(e.get("text", ""))]
        if m
    ]
    kinds = [e.get("event") for e in events]
    return {
        "minutes": (time.monotonic() - began) / 60,
        "returncode": run.returncode,
        "restarts": kinds.count("restarting") + kinds.count("gave-up"),
        "attempts": kinds.count("attempt-started"),
        "steps": len(steps),
        "step_median_s": statistics.median(steps) if steps else 0.0,
        "heartbeat_s": HEARTBEAT_TIMEOUT_S,
        "burners": burners,
    }


def report(f: dict[str, float]) -> tuple[list[str], list[str]]:
    lines = [
        f"MWMS, 2 workers, {f['minutes']:.1f} min with {f['burners']:.0f} busy-loop processes on "
        f"{os.cpu_count()} CPUs; heartbeat timeout {f['heartbeat_s']:g} s",
        f"steps done (worker-0):                    {f['steps']:6.0f}",
        f"median step time:                         {f['step_median_s']:6.1f} s",
    ]
    print("\n".join(lines))
    targets, missed = report_targets_kept(
        [
            (f"soak: false restarts: {f['restarts']:.0f} (target 0)", f["restarts"] == 0),
            (f"soak: attempts: {f['attempts']:.0f} (target 1)", f["attempts"] == 1),
            (f"soak: exit status {f['returncode']:.0f} (target 0)", f["returncode"] == 0),
        ]
    )
    return [*lines, *targets], missed


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long (10)")
    parser.add_argument("--step-s", type=float, default=40.0, help="seconds a step (40)")
    parser.add_argument(
        "--burners", type=int, default=2 * (os.cpu_count() or 1), help="busy loops (2 per CPU)"
    )
    add_report_options(parser)
    args = parser.parse_args(argv)
    figures = soak(args.minutes, args.step_s, args.burners)
    printed, missed = report(figures)
    body = "\n".join(["  ```", *(f"  {line}".rstrip() for line in printed), "  ```"])
    update_readme_section(args.readme, "soak", body, command_line("soak.py", argv))
    finish(args.json, figures, [] if args.no_check else missed)
    return figures


if __name__ == "__main__":
    main()
