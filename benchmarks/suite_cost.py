"""Where the test suite's time goes: every process it starts, its CPU, by kind and by test file.

Run it in place of ``pytest`` (arguments after ``--`` go to pytest as they are)::

    python benchmarks/suite_cost.py [--interval 0.3] [--top 20] [--json FILE] [--readme FILE]
        -- [PYTEST ARGS]

While pytest runs, this samples ``/proc`` every ``--interval`` seconds: each process's CPU time
(user + system), its parent, and its command line (again once it has used some CPU: a fleet
server or a warm task takes its title after it starts). pytest-xdist titles each worker with
the test it runs (``[pytest-xdist running] NODEID``), so a process is charged to the test its
worker ran when the process was first seen, through its chain of parents (a process re-parented
before it was seen, a daemon's, is charged to no test). It prints the pytest run's CPU use of the
machine, a table of CPU by kind of process and one by test file, each row a share of the CPU
the machine was busy with: the suite's own figures, so no baseline. A process that lived less
than one interval is missed (the last row says how much CPU that leaves out, with the kernel's).

It sets no target and fails nothing (its exit status is pytest's): the suite's time is CI's
clock's to judge; this says which part to cut. It samples the whole machine: run it on a quiet
one. ``--readme FILE`` writes the tables into FILE's ``suite-cost`` section.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

try:
    from ._common import command_line, update_readme_section
except ImportError:  # run as a script
    from _common import command_line, update_readme_section  # type: ignore[no-redef]

XDIST_TITLE = "[pytest-xdist running] "
WORKER_CMD = "import sys;exec(eval(sys.stdin.readline()))"  # an xdist worker before its title
HZ = os.sysconf("SC_CLK_TCK")


@dataclass
class Proc:
    """One process as the sampler saw it."""

    pid: int
    ppid: int
    comm: str
    cmd: str
    first_s: float  # when first seen (time.monotonic)
    cpu_s: float = 0.0  # user + system, last seen
    cpu_at_first_s: float = 0.0  # already used when first seen (before the run: not its cost)


@dataclass
class Samples:
    procs: dict[str, Proc] = field(default_factory=dict)  # "pid:starttime" -> Proc
    titles: dict[int, list[tuple[float, str]]] = field(default_factory=dict)  # worker -> tests
    busy_s: float = 0.0  # the machine's CPU busy time over the run (all cores)
    idle_s: float = 0.0
    wall_s: float = 0.0


def _stat(pid: str) -> tuple[str, int, float, int] | None:
    """(comm, ppid, CPU seconds, start time in ticks) of ``/proc/PID/stat``; None once gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    end = text.rfind(")")
    fields = text[end + 2 :].split()
    return (
        text[text.find("(") + 1 : end],
        int(fields[1]),
        (int(fields[11]) + int(fields[12])) / HZ,
        int(fields[19]),
    )


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()[:400]
    except OSError:
        return ""


def _cpu_times() -> tuple[float, float]:
    """(busy, idle) CPU seconds of the whole machine since boot."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq = map(int, f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / HZ, (idle + iowait) / HZ


def _uptime_ticks() -> int:
    with open("/proc/uptime") as f:
        return int(float(f.read().split()[0]) * HZ)


def sample(samples: Samples, me: int, now: float, since_ticks: int) -> None:
    """One look at every process: new ones noted, CPU brought up to date, worker titles read.
    A process started before ``since_ticks`` (the run's start, in ticks since boot) is charged
    only what it uses from its first sighting on."""
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        stat = _stat(name)
        if stat is None:
            continue
        comm, ppid, cpu, start = stat
        key = f"{name}:{start}"
        proc = samples.procs.get(key)
        if proc is None:
            before = cpu if start < since_ticks else 0.0
            proc = Proc(int(name), ppid, comm, _cmdline(int(name)), now, cpu, before)
            samples.procs[key] = proc
        elif cpu >= 0.5 and proc.cpu_s < 0.5:  # its title now (a server, a warm task)
            proc.cmd = _cmdline(proc.pid) or proc.cmd
        proc.cpu_s = cpu
        if WORKER_CMD in proc.cmd or "[pytest-xdist" in proc.cmd:  # a worker: its test now
            title = _cmdline(proc.pid)
            proc.cmd = title or proc.cmd
            test = title.removeprefix(XDIST_TITLE) if title.startswith(XDIST_TITLE) else ""
            seen = samples.titles.setdefault(proc.pid, [])
            if test and (not seen or seen[-1][1] != test):
                seen.append((now, test))


def kind(cmd: str, comm: str) -> str:
    """The kind of process a command line says (the first rule that matches)."""
    rules = (
        ("-m pytest", "pytest (the run itself, its workers)"),
        ("bin/pytest", "pytest (the run itself, its workers)"),
        ("import sys;exec(eval", "pytest (the run itself, its workers)"),
        ("[pytest-xdist", "pytest (the run itself, its workers)"),
        ("forkserver", "fleet fork servers (one per process that owns a fleet)"),
        ("nodewarm", "warm node agents (Ray, Slurm runs)"),
        ("zygote", "warm interpreters of runs (each imports TensorFlow)"),
        ("warmagent", "warm agents"),
        ("graphdist-warm", "warm agents"),
    )
    for needle, name in rules:
        if needle in cmd:
            return name
    if "site-packages/ray/" in cmd or cmd.startswith("ray::") or comm in ("gcs_server", "raylet"):
        return "Ray (its daemons, workers, graphdist's actors)"
    slurm = ("munged", "srun", "sbatch", "salloc", "sinfo", "squeue", "scontrol", "scancel")
    if comm.startswith("slurm") or comm in slurm:
        return "Slurm daemons and commands"
    if re.search(r"graphdist serve|graphdist\._net\.gateway", cmd):
        return "graphdist serve, TLS gateways"
    if cmd.startswith("graphdist ") or "graphdist-guard" in cmd:
        return "fleet servers, spares, guards (forked: no import)"
    if re.search(r"(-m graphdist|bin/graphdist)\b|graphdist\._detached", cmd):
        return "graphdist commands, launchers, supervisors"
    if " -c " in cmd:
        return "tests' helper scripts (python -c)"
    if "python" in cmd or comm.startswith("python"):
        return "scripts: tasks, examples, benchmarks"
    return "other"


def test_of(
    proc: Proc, procs: Mapping[int, Proc], titles: Mapping[int, list[tuple[float, str]]]
) -> str | None:
    """The test file ``proc`` was started for: its nearest ancestor that is an xdist worker,
    and the test that worker ran when ``proc`` was first seen; None where none is found (and
    for a worker itself)."""
    if proc.pid in titles:
        return None  # a worker itself: its own CPU spans its tests
    seen: set[int] = set()
    pid = proc.pid
    while pid not in titles:
        parent = procs.get(pid)
        if parent is None or pid in seen or parent.ppid <= 1:
            return None
        seen.add(pid)
        pid = parent.ppid
    tests = [test for at, test in titles[pid] if at <= proc.first_s + 0.5]
    return tests[-1].split("::")[0] if tests else None


def report(samples: Samples, top: int) -> dict[str, Any]:
    """The tables (module docstring) as data."""
    procs = list(samples.procs.values())
    by_pid = {p.pid: p for p in sorted(procs, key=lambda p: p.first_s)}
    kinds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    sampled = 0.0
    for proc in procs:
        used = proc.cpu_s - proc.cpu_at_first_s
        if used <= 0:
            continue
        sampled += used
        row = kinds[kind(proc.cmd, proc.comm)]
        row[0] += used
        row[1] += 1
        test = test_of(proc, by_pid, samples.titles)
        row = files[test or "(no test: the pytest run itself, daemons, re-parented processes)"]
        row[0] += used
        row[1] += 1
    busy = samples.busy_s or 1.0
    return {
        "wall_s": samples.wall_s,
        "busy_cpu_s": samples.busy_s,
        "busy_share": samples.busy_s / max(samples.busy_s + samples.idle_s, 1e-9),
        "kinds": sorted(
            ([k, c, int(n), c / busy] for k, (c, n) in kinds.items()), key=lambda r: -r[1]
        ),
        "files": sorted(
            ([k, c, int(n), c / busy] for k, (c, n) in files.items()), key=lambda r: -r[1]
        )[:top],
        "unsampled_cpu_s": max(samples.busy_s - sampled, 0.0),
        "cores": os.cpu_count() or 1,
    }


def _table(title: str, rows: Iterable[list[Any]]) -> list[str]:
    lines = [f"| {title} | CPU s | processes | share of busy CPU |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {cpu:.0f} | {n} | {share:.0%} |" for name, cpu, n, share in rows]
    return lines


def render(result: Mapping[str, Any]) -> str:
    cores = result.get("cores") or os.cpu_count() or 1
    floor = result["busy_cpu_s"] / cores
    lines = [
        f"pytest ran {result['wall_s']:.0f} s; the machine's CPU was busy "
        f"{result['busy_share']:.0%} of that ({result['busy_cpu_s']:.0f} CPU s on "
        f"{cores} cores). The floor, the same work with every core busy throughout: "
        f"{floor:.0f} s ({floor / 60:.1f} min); the rest, {result['wall_s'] - floor:.0f} s, is "
        "time when a core had nothing to run (tests waiting on timeouts, restarts, Slurm).",
        "",
        *_table("kind of process", result["kinds"]),
        f"| not seen (lived under one interval), the kernel's | {result['unsampled_cpu_s']:.0f} |"
        f" | {result['unsampled_cpu_s'] / max(result['busy_cpu_s'], 1e-9):.0%} |",
    ]
    if result["files"]:
        lines += ["", *_table("test file (processes it started)", result["files"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=0.3, help="seconds between samples (0.3)")
    parser.add_argument("--top", type=int, default=20, help="test files to list (20)")
    parser.add_argument("--json", help="write the result here too")
    parser.add_argument("--readme", metavar="PATH", help="write the tables into its section")
    parser.add_argument(
        "--from-json", metavar="PATH", help="print (and --readme) a saved --json result; no run"
    )
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments")
    args = parser.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        saved["files"] = saved["files"][: args.top]
        print(render(saved))
        update_readme_section(
            args.readme, "suite-cost", render(saved), command_line("suite_cost.py", argv)
        )
        return 0
    if args.interval <= 0:
        parser.error(f"--interval must be more than 0 seconds, not {args.interval:g}")
    samples = Samples()
    done = threading.Event()

    since = _uptime_ticks()

    def sampler() -> None:
        me = os.getpid()
        while not done.is_set():
            sample(samples, me, time.monotonic(), since)
            done.wait(args.interval)

    busy0, idle0 = _cpu_times()
    t0 = time.monotonic()
    thread = threading.Thread(target=sampler, name="suite-cost-sampler", daemon=True)
    thread.start()
    try:
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        code = subprocess.call([sys.executable, "-m", "pytest", *args.pytest_args], cwd=repo)
    finally:
        done.set()
        thread.join()
    busy1, idle1 = _cpu_times()
    samples.wall_s = time.monotonic() - t0
    samples.busy_s, samples.idle_s = busy1 - busy0, idle1 - idle0
    result = report(samples, args.top)
    print(render(result))
    update_readme_section(
        args.readme, "suite-cost", render(result), command_line("suite_cost.py", argv)
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    **result,
                    "pytest_exit": code,
                    "procs": [asdict(p) for p in samples.procs.values()],
                },
                f,
            )
    return code


if __name__ == "__main__":
    sys.exit(main())
