"""What a failed task costs a ``graphdist run --max-restarts 1`` training run: the seconds from
the fault to the first training step after it, against a cold start of the same run, and the
training steps done again. Four cases (``--case``, repeatable; default ``all``):

- ``mwms-kill``: ``graphdist run --workers 2 -- python _restart_task.py``
  (MultiWorkerMirroredStrategy; a small model backed up every ``--save-every`` steps by
  ``graphdist.backup_and_restore``; one ``step G`` line per step); worker-1 SIGKILLed once the
  chief (worker-0) has printed step ``--kill-at`` of the first attempt. The launcher sees the
  death, stops worker-0 and restarts the run, which resumes from the backup.
- ``mwms-freeze``: the same, worker-1 SIGSTOPped instead (a frozen worker). Nothing exits: the
  launcher's heartbeat (:mod:`graphdist._distribute.heartbeat`) sees the worker stopped for its
  3 s timeout, kills it and restarts the run (TensorFlow's own coordination service would take
  ~12 s). Its recovery target is ``FREEZE_NOTICE_S`` (5 s) + ``RECOVERY_TARGET`` x the cold
  start (printed as a ratio: 1.1 + 5 s / cold start).
- ``mwms-hang``: the same, worker-1 frozen by a cgroup v2 freezer (a hang in native code: its
  processes stay in state S, only the heartbeat's gRPC probes find it); same target. Needs root
  (a writable cgroup v2 hierarchy): skipped with a line saying so elsewhere.
- ``ps-worker-kill``: ``graphdist run --chief --ps 1 --workers 2 -- python _restart_ps_task.py``
  (ParameterServerStrategy; a custom loop of ``ClusterCoordinator.schedule`` steps checkpointed
  every ``--save-every`` steps by ``graphdist.resume_checkpoint``; the chief prints ``step G``
  per finished step); the worker-1 *server* SIGKILLed after step ``--kill-at``. The launcher
  restarts that server in place and the run goes on in the same attempt: reported are the
  seconds from the kill to the launcher's ``... on its address`` line and to the chief's next
  step line, and the steps the coordinator ran again (the closures lost on the dead worker,
  rescheduled on another: ``executions`` counted by a variable on the ps task, less the steps;
  expected about 0-2). No recovery ratio: nothing restarts.
- ``ps-kill``: the same PS run, the ps-0 server SIGKILLed (its variables are lost): the attempt
  fails and the next one resumes from the last checkpoint.
- ``ps-freeze``: the same PS run, the ps-0 server SIGSTOPped: the heartbeat kills it, and the
  run goes on as for ``ps-kill``; the ``mwms-freeze`` target.
- ``ps-worker-freeze``: the worker-1 server SIGSTOPped: the heartbeat kills it and it restarts
  in place, as in ``ps-worker-kill`` (reported: the freeze to the restart line, within
  ``FREEZE_NOTICE_S``, and to the next step).

For the restarting cases (all but ``ps-worker-kill``), from the output lines' arrival times:

- cold start: the launcher's start to the chief's first step line of attempt 0;
- recovery: the fault to the chief's first step line of attempt 1 (noticing the failure,
  stopping the others, the back-off, starting every task again, restoring the backup);
  ``stop``, the fault to the launcher's restart line, is the first part of it;
- steps redone: the last step of attempt 0 less the step attempt 1 resumed after.

Figures are medians over ``--repeats``, one block per case. Targets: recovery at most
``RECOVERY_TARGET`` (1.1) x the cold start (plus ``FREEZE_NOTICE_S`` for a frozen task), and at
most ``--save-every`` steps redone per failure in every case (a backup every N steps loses at
most N). A missed target prints MISSED and the script exits 1 (``--no-check``: exit 0 all the
same). With ``--readme``, every block printed becomes the section ``restart`` of
docs/benchmarks.md (``--case warm`` alone: the section ``warm``), with the plot of recovery by
fault (``--plot``; with ``--readme`` benchmarks/results/restart.png): per case, the cold start,
the recovery split into its stop and the rest, and the target.

The case ``warm`` (issue 40) runs ``mwms-kill`` with cold tasks (``--preload none``: each a fresh
``python``), warm ones (the default: forked from the run's warm interpreter) and warm ones with a
warm agent running (``graphdist warm start``, started once for the case; the run is checked to have
been served by it: a session of the agent's was seen) in turn, ``--repeats`` rounds, and checks the
medians of the rounds' ratios: the start with the agent at most ``WARM_START_TARGET`` x the cold
run's (the run's own warm interpreter's ratio printed beside), each warm side's kill recovery at
most ``WARM_RECOVERY_TARGET`` x the cold run's start, the cold run's steps/s before the kill at most
``WARM_RATE_TARGET`` x each warm side's. The case ``warm-ray`` is the same on ``--backend ray`` (a
Ray instance of each run's own, on this machine: the tasks forked by the node's warm agent,
:mod:`graphdist._distribute.nodewarm`), with the same targets (its start: the run's own agents');
``warm-ray`` also runs Ray Train's ``TensorflowTrainer`` on the same task (``_raytrain_run.py``,
``max_failures=1``, a Ray instance of its own, rank 1's process SIGKILLed after rank 0's step
KILL_AT) and checks graphdist's warm recovery at most ``RAYTRAIN_TARGET`` x Ray Train's; where
Ray Train does not import (``pip install -e '.[raytrain]'``) that target is MISSED, not skipped.
``--case warm --case warm-ray`` writes both into the section ``warm``. The fault injector kills what
the task's guard runs: on Ray a warm task's client, whose end has the agent SIGKILL the task.

    python benchmarks/restart.py [--case CASE ...] [--steps 300] [--save-every 25]
        [--kill-at 110] [--repeats 3] [--json FILE] [--readme docs/benchmarks.md] [--no-check]
        [--plot PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any, TypedDict

import psutil

try:
    from ._common import (
        HERE,
        REPO,
        add_report_options,
        command_line,
        finish,
        quiet_tensorflow,
        report_targets_kept,
        update_readme_section,
    )
except ImportError:  # run as a script, or imported with benchmarks/ on sys.path
    from _common import (
        HERE,
        REPO,
        add_report_options,
        command_line,
        finish,
        quiet_tensorflow,
        report_targets_kept,
        update_readme_section,
    )

sys.path.insert(0, REPO)
quiet_tensorflow()

from graphdist._faults.freezer import freezer_root  # noqa: E402

TASK = os.path.join(HERE, "_restart_task.py")
PS_TASK = os.path.join(HERE, "_restart_ps_task.py")
RECOVERY_TARGET = 1.1
"""Recovery (the fault to the first step after the restart) / cold start: at most this."""
FREEZE_NOTICE_S = 5.0
"""A frozen task only: the seconds allowed on top of ``RECOVERY_TARGET`` x the cold start for
finding it (the launcher's heartbeat, 3 s by default, and its 0.5 s looks)."""
CASES = (
    "warm",
    "warm-ray",
    "mwms-kill",
    "mwms-freeze",
    "mwms-hang",
    "ps-worker-kill",
    "ps-worker-freeze",
    "ps-kill",
    "ps-freeze",
)
WARM_START_TARGET = 0.75
"""``warm``: a warm run's cold start / a cold-task run's cold start (issue 40): at most this."""
WARM_RECOVERY_TARGET = 0.6
"""``warm``: a warm run's kill recovery / a cold-task run's cold start: at most this."""
RAYTRAIN_TARGET = 0.5
"""``warm-ray``: graphdist's warm kill recovery on Ray / Ray Train's (issue 40): at most this."""
WARM_RATE_TARGET = 1.05
"""``warm``: a cold-task run's steps/s in attempt 0 / a warm run's: at most this (the warm
path must not slow training)."""
FROZEN = ("mwms-freeze", "mwms-hang", "ps-freeze", "ps-worker-freeze")
IN_PLACE = ("ps-worker-kill", "ps-worker-freeze")
"""The cases where nothing restarts but the one server: the run goes on in its attempt."""
_STEP = re.compile(r"step (\d+)")
_EXECUTIONS = re.compile(r"executions (\d+)")


class Restart(TypedDict, total=False):
    """One repeat's figures (seconds, and steps)."""

    cold_s: float
    recovery_s: float
    stop_s: float
    ratio: float
    last_step: int
    resumed_after: int
    redone: int
    restart_line_s: float
    next_step_s: float
    rate: float


def _steps(outcome: Any, attempt: int, task: str) -> list[tuple[float, int]]:
    """(seconds into the run, step) of ``task``'s step lines in ``attempt``."""
    found = []
    for line in outcome.output:
        if line.task == task and line.attempt == attempt:
            step = _STEP.fullmatch(line.text)
            if step is not None:
                found.append((line.at_s, int(step.group(1))))
    return found


def _run(
    case: str,
    steps: int,
    save_every: int,
    kill_at: int,
    preload: str = "auto",
    ray: bool = False,
    warm_dir: str | None = None,
) -> Any:
    """Run ``case`` once under the fault injector (``ray``: with ``--backend ray`` on a Ray
    instance of the run's own; ``warm_dir``: where it looks for a warm agent, by default a
    folder with none); its :class:`RunOutcome`."""
    sessions: set[int] = set()
    done = threading.Event()
    if warm_dir is not None:  # what shows that the agent served the run: its session
        agent = psutil.Process(_agents[warm_dir])
        threading.Thread(target=_sessions, args=(agent, sessions, done), daemon=True).start()
    try:
        outcome = _run_once(case, steps, save_every, kill_at, preload, ray, warm_dir)
    finally:
        done.set()
    if warm_dir is not None and not sessions:
        raise RuntimeError(f"{case}: the run's tasks did not come from the warm agent:\n{outcome}")
    return outcome


def _run_once(
    case: str,
    steps: int,
    save_every: int,
    kill_at: int,
    preload: str,
    ray: bool,
    warm_dir: str | None,
) -> Any:
    from graphdist._faults.injector import FaultInjector

    ps = case.startswith("ps-")
    runner = "chief-0" if ps else "worker-0"
    after = rf"^step {kill_at}$"
    task = "ps-0" if case in ("ps-kill", "ps-freeze") else "worker-1"
    make = {"freeze": FaultInjector.freeze, "hang": FaultInjector.hang}.get(
        case.rsplit("-", 1)[1], FaultInjector.kill
    )
    fault = make(task, after=after, of=runner)
    injector = FaultInjector()
    try:
        with tempfile.TemporaryDirectory(prefix="graphdist-bench-restart-") as out:
            argv = [sys.executable, PS_TASK if ps else TASK, "--out", out, "--steps", str(steps)]
            outcome = injector.run(
                [*argv, "--save-every", str(save_every)],
                workers=2,
                ps=1 if ps else 0,
                chief=ps,
                max_restarts=1,
                cwd=HERE,
                env={**_run_env(warm_dir), **({"RAY_ADDRESS": "local"} if ray else {})},
                faults=[fault],
                launcher_args=["--preload", preload, *(["--backend", "ray"] if ray else [])],
            )
    finally:
        left = injector.close()
    attempts = 1 if case in IN_PLACE else 2
    if (
        outcome.returncode != 0
        or outcome.attempts != attempts
        or len(outcome.injected) != 1
        or left
    ):
        raise RuntimeError(f"{case}: the run did not go as planned (survivors: {left}):\n{outcome}")
    return outcome


def _run_env(warm_dir: str | None) -> dict[str, str]:
    """A measured run's environment (and its warm agent's): where it looks for an agent."""
    none = os.path.join(tempfile.gettempdir(), f"graphdist-bench-no-agent-{os.getpid()}")
    return {"TF_CPP_MIN_LOG_LEVEL": "2", "GRAPHDIST_WARM_DIR": warm_dir or none}


@contextlib.contextmanager
def warm_agent() -> Iterator[str]:
    """A warm agent (``graphdist warm start``, the default preloads) in a folder of its own,
    for the runs of the ``warm`` case's third side; stopped, and checked gone, at the end."""
    with tempfile.TemporaryDirectory(prefix="graphdist-bench-agent-") as folder:
        # PYTHONUNBUFFERED: as the fault injector sets it for its runs (read at import)
        env = {**os.environ, **_run_env(folder), "PYTHONUNBUFFERED": "1"}
        warm = [sys.executable, "-m", "graphdist", "warm"]
        subprocess.run([*warm, "start"], env=env, check=True, capture_output=True, timeout=300)
        try:
            [name] = [n for n in os.listdir(folder) if n.endswith(".json")]
            with open(os.path.join(folder, name)) as f:
                _agents[folder] = json.load(f)["pid"]
            yield folder
        finally:
            stopped = subprocess.run([*warm, "stop"], env=env, capture_output=True, text=True)
            if stopped.returncode != 0 or "stopped" not in stopped.stdout:
                raise RuntimeError(f"the warm agent did not stop: {stopped}")


_agents: dict[str, int] = {}  # a warm agent's folder -> its pid


def _sessions(agent: psutil.Process, seen: set[int], done: threading.Event) -> None:
    """Note every session (child) of ``agent`` until ``done``."""
    while not done.wait(0.1):
        with contextlib.suppress(psutil.Error):
            seen.update(c.pid for c in agent.children())


def measure_once(case: str, steps: int, save_every: int, kill_at: int, **how: Any) -> Restart:
    """One run of ``case`` with one fault (see the module docstring); ``how``: ``_run``'s
    ``preload``, ``ray`` and ``warm_dir``."""
    outcome = _run(case, steps, save_every, kill_at, **how)
    runner = "chief-0" if case.startswith("ps-") else "worker-0"
    first = _steps(outcome, 0, runner)
    killed_at = outcome.injected[0].at_s
    if case in IN_PLACE:
        restart_at = next(o.at_s for o in outcome.output if "on its address" in o.text)
        executions = [
            int(m.group(1))
            for o in outcome.output
            if o.task == runner
            for m in [_EXECUTIONS.fullmatch(o.text)]
            if m
        ]
        return {
            "cold_s": first[0][0],
            "restart_line_s": restart_at - killed_at,
            "next_step_s": next(at for at, _ in first if at > killed_at) - killed_at,
            "last_step": max(s for _, s in first),
            "redone": executions[-1] - steps,
        }
    again = _steps(outcome, 1, runner)
    restart_at = next(o.at_s for o in outcome.output if "restarting the run" in o.text)
    cold, recovery = first[0][0], again[0][0] - killed_at
    last, resumed_after = max(s for _, s in first), again[0][1] - 1
    (t0, s0), (t1, s1) = first[0], first[-1]
    return {
        "cold_s": cold,
        "recovery_s": recovery,
        "stop_s": restart_at - killed_at,
        "ratio": recovery / cold,
        "rate": (s1 - s0) / (t1 - t0) if t1 > t0 else float("nan"),
        "last_step": last,
        "resumed_after": resumed_after,
        "redone": last - resumed_after,
    }


def measure(case: str, steps: int, save_every: int, kill_at: int, repeats: int) -> dict[str, Any]:
    runs = [measure_once(case, steps, save_every, kill_at) for _ in range(repeats)]
    keys = [
        k
        for k in (
            "cold_s",
            "recovery_s",
            "stop_s",
            "ratio",
            "restart_line_s",
            "next_step_s",
            "redone",
        )
        if k in runs[0]
    ]
    median = {key: statistics.median(float(r[key]) for r in runs) for key in keys}  # type: ignore[literal-required]
    return {
        "case": case,
        "steps": steps,
        "save_every": save_every,
        "kill_at": kill_at,
        "runs": runs,
        "median": median,
        "worst_redone": max(r["redone"] for r in runs),
    }


RAYTRAIN = os.path.join(HERE, "_raytrain_run.py")
# Ray's prefix of a worker's line, in colour where it thinks a terminal reads it
_WORKER_LINE = re.compile(r"\(RayTrainWorker pid=(\d+)[^)]*\)(?:\x1b\[[0-9;]*m)?\s*(.*)")


def measure_raytrain(steps: int, save_every: int, kill_at: int) -> dict[str, float]:
    """Ray Train's side of ``warm-ray`` (``_raytrain_run.py``): the same task under
    ``TensorflowTrainer`` on a Ray instance of its own, rank 1's process SIGKILLed once rank 0
    said ``step KILL_AT``; its cold start (launch to rank 0's first step) and recovery (the
    kill to rank 0's first step in a new process). Everything the run started (its session) is
    killed at the end and checked gone."""
    with tempfile.TemporaryDirectory(prefix="graphdist-bench-raytrain-") as out:
        argv = [sys.executable, RAYTRAIN, "--out", out, "--steps", str(steps)]
        argv += ["--save-every", str(save_every)]
        # RAY_DEDUP_LOGS=0: Ray would fold the two workers' equal "step N" lines into one
        env = {**os.environ, "RAY_ADDRESS": "local", "TF_CPP_MIN_LOG_LEVEL": "2"}
        env["RAY_DEDUP_LOGS"] = "0"
        started = time.monotonic()
        proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, cwd=HERE,
        )  # fmt: skip
        ranks: dict[int, int] = {}
        first = killed = recovered = None
        tail: list[str] = []
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                now = time.monotonic() - started
                tail = [*tail[-40:], line]
                found = _WORKER_LINE.search(line)
                if found is None:
                    continue
                pid, text = int(found.group(1)), found.group(2).strip()
                if text.startswith("rank "):
                    ranks[pid] = int(text.split()[1])
                if ranks.get(pid) != 0 or _STEP.fullmatch(text) is None:
                    continue
                if first is None:
                    first = now
                if killed is None and text == f"step {kill_at}":
                    [victim] = [p for p, r in ranks.items() if r == 1]
                    os.kill(victim, signal.SIGKILL)
                    killed, old = now, set(ranks)
                elif killed is not None and recovered is None and pid not in old:
                    recovered = now
            code = proc.wait(600)
        finally:
            group = [p.pid for p in psutil.process_iter() if _in_session(p, proc.pid)]
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            left = [p for p in group if psutil.pid_exists(p) and _alive(p)]
        if code != 0 or first is None or killed is None or recovered is None or left:
            raise RuntimeError(
                f"Ray Train's run did not go as planned (exit {code}, left {left}):\n"
                + "".join(tail)
            )
        return {"cold_s": first, "recovery_s": recovered - killed}


def _raytrain_missing() -> str | None:
    """Why Ray Train cannot run here (its dependencies are not graphdist's), or None."""
    check = [sys.executable, "-c", "import ray.train.tensorflow"]
    done = subprocess.run(check, capture_output=True, text=True, timeout=300)
    if done.returncode == 0:
        return None
    last = (done.stderr.strip().splitlines() or ["it does not import"])[-1]
    return f"{last} (pip install -e '.[raytrain]')"


def _in_session(proc: psutil.Process, sid: int) -> bool:
    with contextlib.suppress(psutil.Error, OSError):
        return os.getsid(proc.pid) == sid
    return False


def _alive(pid: int) -> bool:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return False
        except psutil.Error:
            return False
        time.sleep(0.1)
    return True


def measure_warm(
    steps: int,
    save_every: int,
    kill_at: int,
    repeats: int,
    ray: bool = False,
    raytrain: bool = False,
) -> dict[str, Any]:
    """``warm``: ``mwms-kill`` with cold tasks (``--preload none``, the baseline), with warm
    ones (the default: the run's own warm interpreter) and, on this machine, with a warm agent
    running (``graphdist warm start``), in turn, ``repeats`` rounds; each ratio's median over
    the rounds. ``ray`` (``warm-ray``): cold and warm on a Ray instance of each run's own."""
    pairs = []
    agent = contextlib.nullcontext(None) if ray else warm_agent()
    with agent as folder:
        for _ in range(repeats):
            cold = measure_once("mwms-kill", steps, save_every, kill_at, preload="none", ray=ray)
            warm = measure_once("mwms-kill", steps, save_every, kill_at, ray=ray)
            pair: dict[str, Any] = {
                "cold": cold,
                "warm": warm,
                "start": warm["cold_s"] / cold["cold_s"],
                "recovery": warm["recovery_s"] / cold["cold_s"],
                "rate": cold["rate"] / warm["rate"],
            }
            if ray and raytrain:
                pair["raytrain"] = measure_raytrain(steps, save_every, kill_at)
                pair["vs_raytrain"] = warm["recovery_s"] / pair["raytrain"]["recovery_s"]
            if folder is not None:
                pair["agent"] = measure_once(
                    "mwms-kill", steps, save_every, kill_at, warm_dir=folder
                )
                pair["agent_start"] = pair["agent"]["cold_s"] / cold["cold_s"]
                pair["agent_recovery"] = pair["agent"]["recovery_s"] / cold["cold_s"]
                pair["agent_slower"] = cold["rate"] / pair["agent"]["rate"]
            pairs.append(pair)
    keys = [k for k in pairs[0] if k not in ("cold", "warm", "agent", "raytrain")]
    median = {k: statistics.median(float(p[k]) for p in pairs) for k in keys}
    for side in ("cold", "warm", "agent", "raytrain"):
        if side not in pairs[0]:
            continue
        for key in ("cold_s", "recovery_s", "rate"):
            if key in pairs[0][side]:
                median[f"{side}_{key}"] = statistics.median(float(p[side][key]) for p in pairs)
    return {"case": "warm-ray" if ray else "warm", "steps": steps, "save_every": save_every,
            "kill_at": kill_at, "runs": pairs, "median": median}  # fmt: skip


def report_warm(figures: dict[str, Any], repeats: int) -> tuple[list[str], list[str]]:
    """Print the ``warm`` block; its lines and the texts of its targets missed."""
    m = figures["median"]
    case = figures["case"]
    where = " on Ray (--backend ray, a Ray instance of each run's own)" if case != "warm" else ""
    agent = "agent_start" in m
    compared = "warm tasks (--preload auto)" + (
        ", and warm tasks with a warm agent running" if agent else ""
    )
    lines = [
        f"[{case}] MWMS, 2 workers{where}, worker-1 SIGKILLed after step {figures['kill_at']}: "
        f"{compared} against cold ones (--preload none) in the same run; medians of {repeats} "
        f"round(s)",
    ]
    sides = [("cold", "cold tasks"), ("warm", "warm tasks"), ("agent", "warm agent")]
    for side, words in [*sides, ("raytrain", "Ray Train")]:
        if f"{side}_cold_s" in m:
            rate = f", {m[f'{side}_rate']:6.1f} steps/s" if f"{side}_rate" in m else ""
            lines.append(
                f"{words + ':':12s}start {m[f'{side}_cold_s']:6.2f} s, recovery "
                f"{m[f'{side}_recovery_s']:6.2f} s{rate}"
            )
    print("\n".join(lines))
    first = "agent_start" if agent else "start"
    with_agent = " with a warm agent running" if agent else ""
    checked = [
        (
            f"{case}: start{with_agent} / cold tasks' start: {m[first]:.2f}x (target <= "
            f"{WARM_START_TARGET:g}; the run's own warm interpreter: {m['start']:.2f}x)",
            m[first] <= WARM_START_TARGET,
        )
    ]
    for prefix, who in [("", "warm tasks'"), *([("agent_", "a warm agent's tasks'")] * agent)]:
        recovery, rate = m[f"{prefix}recovery"], m["agent_slower" if prefix else "rate"]
        checked += [
            (
                f"{case}: kill recovery{' with a warm agent' if prefix else ''} / cold tasks' "
                f"start: {recovery:.2f}x (target <= {WARM_RECOVERY_TARGET:g})",
                recovery <= WARM_RECOVERY_TARGET,
            ),
            (
                f"{case}: cold tasks' steps/s / {who}: {rate:.2f}x (target <= "
                f"{WARM_RATE_TARGET:g}: warm trains no slower)",
                rate <= WARM_RATE_TARGET,
            ),
        ]
    if "vs_raytrain" in m:
        checked.append(
            (
                f"{case}: kill recovery / Ray Train's (TensorflowTrainer, max_failures=1, same "
                f"task and Ray instance kind): {m['vs_raytrain']:.2f}x (target <= "
                f"{RAYTRAIN_TARGET:g})",
                m["vs_raytrain"] <= RAYTRAIN_TARGET,
            )
        )
    targets, missed = report_targets_kept(checked)
    print()
    return [*lines, *targets, ""], missed


def target(case: str, cold_s: float) -> float | None:
    """The recovery / cold start target of ``case`` (None: it does not restart the run)."""
    if case in IN_PLACE:
        return None
    if case in FROZEN:
        return RECOVERY_TARGET + FREEZE_NOTICE_S / cold_s
    return RECOVERY_TARGET


def check(figures: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Print the figures against their targets; the lines printed and the texts of the targets
    missed."""
    m, case = figures["median"], figures.get("case", "mwms-kill")
    lines = []
    goal = target(case, m["cold_s"])
    if goal is not None:
        lines.append(
            (
                f"{case}: recovery / cold start: {m['ratio']:.2f}x (target <= {goal:.2f})",
                m["ratio"] <= goal,
            )
        )
    if case == "ps-worker-freeze":
        lines.append(
            (
                f"{case}: freeze to the restart line: {m['restart_line_s']:.2f} s (target <= "
                f"{FREEZE_NOTICE_S:g} s)",
                m["restart_line_s"] <= FREEZE_NOTICE_S,
            )
        )
    lines.append(
        (
            f"{case}: steps redone per failure, worst: {figures['worst_redone']} (target <= "
            f"{figures['save_every']}, the backup interval)",
            figures["worst_redone"] <= figures["save_every"],
        )
    )
    return report_targets_kept(lines)


_WHAT = {
    "mwms-kill": "MWMS, 2 workers, worker-1 SIGKILLed",
    "mwms-freeze": "MWMS, 2 workers, worker-1 SIGSTOPped (frozen)",
    "ps-worker-kill": "PS (chief, 1 ps, 2 workers), the worker-1 server SIGKILLed",
    "ps-kill": "PS (chief, 1 ps, 2 workers), the ps-0 server SIGKILLed",
    "mwms-hang": "MWMS, 2 workers, worker-1 hung (a cgroup v2 freezer: state S, not T)",
    "ps-worker-freeze": "PS (chief, 1 ps, 2 workers), the worker-1 server SIGSTOPped",
    "ps-freeze": "PS (chief, 1 ps, 2 workers), the ps-0 server SIGSTOPped",
}


def report(figures: dict[str, Any], repeats: int) -> tuple[list[str], list[str]]:
    """Print one case's block; its lines and the texts of its targets missed."""
    m, case = figures["median"], figures["case"]
    lines = [
        f"[{case}] {_WHAT[case]} after step {figures['kill_at']}; {figures['steps']} steps, a "
        f"checkpoint every {figures['save_every']}; medians of {repeats} run(s)",
        f"cold start (launch to first step):        {m['cold_s']:6.2f} s",
    ]
    if case in IN_PLACE:
        lines += [
            f"fault to the launcher's restart line:     {m['restart_line_s']:6.2f} s",
            f"fault to the next step line:              {m['next_step_s']:6.2f} s",
            f"steps run again by the coordinator:       {m['redone']:6.0f}",
        ]
    else:
        lines += [
            f"recovery (fault to first step after it):  {m['recovery_s']:6.2f} s",
            f"  of which stop (fault to restart line):  {m['stop_s']:6.2f} s",
            f"steps redone per failure:                 {m['redone']:6.0f}",
        ]
    print("\n".join(lines))
    targets, missed = check(figures)
    print()
    return [*lines, *targets, ""], missed


PLOT = os.path.join(HERE, "results", "restart.png")


def plot(results: dict[str, dict[str, Any]], path: str) -> None:
    """Recovery by fault: one row per case, the cold start's bar beside the recovery's (its stop,
    the fault to the launcher's restart line, then the rest; for a server restarted in place,
    the fault to its restart line and to the next step), and the target's mark."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(results)
    fig, ax = plt.subplots(figsize=(8.5, 0.55 * len(cases) + 1.4))
    for y, case in enumerate(cases):
        m = results[case]["median"]
        cold_label = "cold start" if y == 0 else None
        ax.barh(y + 0.2, m["cold_s"], 0.4, color="#9aa5b1", label=cold_label)
        if case in IN_PLACE:
            stop, total = m["restart_line_s"], m["next_step_s"]
        else:
            stop, total = m["stop_s"], m["recovery_s"]
        stop_label = "fault to restart line" if y == 0 else None
        ax.barh(y - 0.2, stop, 0.4, color="#c0392b", label=stop_label)
        rest_label = "restart line to next step" if y == 0 else None
        ax.barh(y - 0.2, total - stop, 0.4, left=stop, color="#2e86c1", label=rest_label)
        ax.text(total, y - 0.2, f" {total:.1f} s", va="center", fontsize=7)
        goal = target(case, m["cold_s"])
        if goal is not None:
            ax.vlines(goal * m["cold_s"], y - 0.4, y, colors="black", lw=2,
                      label="recovery target" if case == cases[0] else None)  # fmt: skip
    ax.set_yticks(range(len(cases)), cases, fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="seconds (medians)", title="graphdist run: recovery by fault vs cold start")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps in all (300)")
    parser.add_argument("--save-every", type=int, default=25, help="steps between backups (25)")
    parser.add_argument("--kill-at", type=int, default=110, help="kill after this step (110)")
    parser.add_argument("--repeats", type=int, default=3, help="runs, one kill each (3)")
    parser.add_argument(
        "--case",
        action="append",
        choices=[*CASES, "all"],
        help="a case to run (repeatable; default: all)",
    )
    parser.add_argument("--plot", metavar="PATH", help="the plot (with --readme: the record's)")
    add_report_options(parser)
    args = parser.parse_args(argv)
    if not 0 < args.kill_at < args.steps:
        parser.error("--kill-at must be between 0 and --steps")
    chosen = args.case or ["all"]
    cases = [c for c in CASES if c in chosen or "all" in chosen]
    results, printed, missed = {}, [], []
    figures_warm: dict[str, Any] | None = None
    for case in cases:
        if case == "mwms-hang" and freezer_root() is None:
            line = f"[{case}] not run: it needs a writable cgroup v2 hierarchy (root)"
            print(line, end="\n\n")
            printed += [line, ""]
            if "mwms-hang" in chosen:
                missed.append(line)
            continue
        if case in ("warm", "warm-ray"):
            ray = case == "warm-ray"
            why = _raytrain_missing() if ray else None
            if why is not None:
                line = f"[{case}] Ray Train not measured: {why}"
                print(line, end="\n\n")
                printed, missed = [*printed, line, ""], [*missed, line]
            warm = measure_warm(
                args.steps, args.save_every, args.kill_at, args.repeats, ray, why is None and ray
            )
            lines, case_missed = report_warm(warm, args.repeats)
            printed, missed = printed + lines, missed + case_missed
            figures_warm = warm if figures_warm is None else {**figures_warm, "ray": warm}
            continue
        results[case] = measure(case, args.steps, args.save_every, args.kill_at, args.repeats)
        lines, case_missed = report(results[case], args.repeats)
        printed, missed = printed + lines, missed + case_missed
    figures = {"cases": results, "warm": figures_warm}
    command = command_line("restart.py", argv)
    body = "\n".join(["  ```", *(f"  {line}".rstrip() for line in printed[:-1]), "  ```"])
    path = args.plot or (PLOT if args.readme else None)
    if path and results:
        plot(results, path)
        if args.readme:
            shown = os.path.relpath(path, os.path.dirname(os.path.abspath(args.readme)))
            body += f"\n\n![Recovery by fault against the cold start]({shown})"
    # the warm case alone is a section of its own (the faults' record stays as it was)
    warm_only = set(cases) <= {"warm", "warm-ray"}
    update_readme_section(args.readme, "warm" if warm_only else "restart", body, command)
    finish(args.json, figures, [] if args.no_check else missed)
    return figures


if __name__ == "__main__":
    main()
