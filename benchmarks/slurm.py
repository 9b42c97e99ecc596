"""On Slurm: a two-node training run's cold start and recovery under ``graphdist run --backend
slurm`` against the same script under plain ``srun`` with TensorFlow's ``SlurmClusterResolver``
(what HPC users write today), and a ``SlurmFleet``'s start against a ``RayFleet``'s on the same
two nodes (issue 37, point 7).

The Slurm cluster is the test bed's (tests/slurmbed.py: a slurmctld on a login host and a slurmd
on each of two node hosts, network namespaces of this machine), so this needs root and Slurm
(``tests/slurm/install-slurm.sh``). One allocation of the two nodes (``salloc --no-shell -N 2``)
serves every measurement; every command is started on the login host with its ``--jobid``.

- **cold start**, the seeds' MWMS script (``examples/seed_mwms_training.py --epochs E``), one
  worker per node, launch to worker 0's first ``epoch 1/E`` line, both sides in interleaved
  rounds (the order alternating):

  - graphdist: ``graphdist run --backend slurm --jobid J --workers 2 --max-restarts 1
    --output-format jsonl -- python seed_mwms_training.py ...``;
  - plain: ``srun --jobid J -N 2 --ntasks-per-node 1 --label python -c WRAPPER
    seed_mwms_training.py ...``, the wrapper an HPC user writes today: ``SlurmClusterResolver``
    -> ``TF_CONFIG``, then the script in the same process (``runpy``: one TensorFlow import, as
    if the resolver were in the script; ``exec`` of a second Python would import it twice and
    make this side slower). The wrapper sets ``TF_USE_LEGACY_KERAS=1`` before its import, as
    the script does before its own (else the script's Keras is half Keras 3). On a node
    without GPUs the resolver needs ``gpus_per_node=1, gpus_per_task=1, auto_set_gpu=False``:
    its default asks ``nvidia-smi`` (and fails when it is missing), and ``gpus_per_node=0``
    divides a range by zero.

- **recovery**, the same graphdist run: worker 1's command SIGKILLed on its node at its
  ``epoch K/E`` line (``--kill-after K``, default 1); the kill to worker 0's first epoch line of
  the second attempt (noticing, stopping the other step, placing the attempt again, a port step,
  starting both steps, TensorFlow's import, restoring the backup, the epoch). ``stop`` is the
  kill to the launcher's restarting event. Plain ``srun`` has no recovery: nothing starts a
  killed task again (the job must be submitted again, from its last backup).

- **fleet start**, ``local=2`` (one server per node) on the same two nodes, the driver on node 1
  with TensorFlow and graphdist imported: ``SlurmFleet("local=2", jobid=J).start()`` (the
  allocation read, a port step, a ``graphdist serve`` step per node, each ready line and gRPC
  answer) against ``RayFleet("local=2", address=HEAD, strategy="STRICT_SPREAD",
  expose=True).start()`` on a Ray cluster of the same two hosts (the head on node 1, a Ray node
  on node 2, started once before these rounds and idle during the Slurm rounds too; its start
  includes ``import ray`` and ``ray.init``, as a user's does), from the constructor to
  ``start()`` returning, in interleaved rounds; each fleet then runs the split graph once (238)
  and closes.

Targets (met / MISSED, exit 1 on a miss; ``--no-check``: exit 0 all the same):

- graphdist's cold start <= ``COLD_TARGET`` (1.25) x plain srun's: graphdist's run adds the
  allocation's read, a port step on the nodes and a guard per task, not a second import;
- recovery <= ``RECOVERY_TARGET`` (1.1) x graphdist's own cold start (``benchmarks/restart.py``'s
  target for a killed worker on one machine): the same work, one epoch from a fresh import;
- SlurmFleet start <= ``FLEET_TARGET`` (1.5) x RayFleet start (``benchmarks/hosts.py``'s bound
  for a start across nodes): both start one process per node that imports TensorFlow and
  serves; Slurm's step launch may cost what Ray's actor placement does, not more than half again.

Figures are medians over ``--rounds``; a measure whose rounds spread over more than 25 % of its
median says so in a warning. ``--readme docs/benchmarks.md`` writes the printed block into the
section ``slurm``. The whole run takes 5-8 minutes here; ``--smoke`` (one round, targets not
checked) about 2 (45 s for ``--part run``, 55 s for ``--part fleet``): beyond what
tests/test_bench_smoke.py gives a benchmark, which runs none that needs root, Slurm and Ray.

    sudo python benchmarks/slurm.py [--rounds 3] [--epochs 2] [--kill-after 1]
        [--part all|run|fleet] [--smoke] [--json FILE] [--readme docs/benchmarks.md]
        [--no-check]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

try:
    from . import _common
except ImportError:  # run as a script, or imported with benchmarks/ on sys.path
    import _common

sys.path.insert(0, _common.REPO)

NAME = "slurm"
COLD_TARGET = 1.25
RECOVERY_TARGET = 1.1
FLEET_TARGET = 1.5
SPREAD_LIMIT = _common.FLOOR_SPREAD_LIMIT
SCRIPT = os.path.join(_common.REPO, "examples", "seed_mwms_training.py")
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2"}
RUN_TIMEOUT_S = 600.0
FLEET_TIMEOUT_S = 300.0
RAY = os.path.join(os.path.dirname(sys.executable), "ray")

# What an HPC user's srun step runs today: TensorFlow's resolver writes TF_CONFIG, then the script.
WRAPPER = r"""
import json, os, runpy, sys
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # the script's own setting, before TF's import
import tensorflow as tf
r = tf.distribute.cluster_resolver.SlurmClusterResolver(
    gpus_per_node=1, gpus_per_task=1, auto_set_gpu=False)  # CPU nodes: see benchmarks/slurm.py
spec = r.cluster_spec().as_dict()
os.environ["TF_CONFIG"] = json.dumps(
    {"cluster": spec, "task": {"type": r.task_type, "index": r.task_id}})
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
"""

FLEET = r"""
import json, sys, time
import graphdist
import tensorflow as tf

tf.compat.v1.disable_eager_execution()
graph = tf.Graph()
with graph.as_default():
    x = tf.constant(2)
    with tf.device("/job:local/task:1"):
        y2 = x - 66
    with tf.device("/job:local/task:0"):
        y = x + 300 + y2

kind, where = sys.argv[1], sys.argv[2]
t = time.perf_counter()
if kind == "slurm":
    fleet = graphdist.SlurmFleet("local=2", jobid=where)
else:
    fleet = graphdist.RayFleet("local=2", address=where, strategy="STRICT_SPREAD", expose=True)
fleet.start()
took = time.perf_counter() - t
with fleet.session("local", 0, graph, config=graphdist.no_folding_config()) as sess:
    result = int(sess.run(y))
hosts = len({task.host for task in fleet.cluster})
t = time.perf_counter()
fleet.close()
print(json.dumps({"seconds": took, "result": result, "hosts": hosts,
                  "close_s": time.perf_counter() - t}), flush=True)
"""


def _stream(
    proc: subprocess.Popen[str], timeout_s: float, on_line: Callable[[float, str], None]
) -> tuple[int, list[str]]:
    """Hand each line of ``proc``'s stdout to ``on_line`` with its arrival time until it ends
    (killed after ``timeout_s``); its exit status and every line."""
    assert proc.stdout is not None
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    lines: list[str] = []
    try:
        for raw in proc.stdout:
            lines.append(raw.rstrip("\n"))
            on_line(time.monotonic(), lines[-1])
        code = proc.wait(60)
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    return code, lines


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [part.decode() for part in f.read().split(b"\0") if part]
    except OSError:
        return []


def _steps_left(bed: Any, jobid: int) -> list[str]:
    out = bed.run(None, ["squeue", "-h", "-s", "-j", str(jobid), "-o", "%i %j"]).stdout
    return [line for line in out.splitlines() if not line.split()[0].endswith((".extern",))]


def _check_clean(bed: Any, jobid: int, what: str) -> None:
    """No step of the allocation left after a run (the next round starts on idle nodes)."""
    deadline = time.monotonic() + 20
    while (left := _steps_left(bed, jobid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        raise RuntimeError(f"{what} left Slurm steps behind: {left}")


def _failed(what: str, code: int, lines: list[str]) -> RuntimeError:
    tail = "\n".join(lines[-40:])
    return RuntimeError(f"{what} did not go as planned (exit {code}):\n{tail}")


def measure_graphdist(
    bed: Any, jobid: int, epochs: int, kill_after: int, out: str
) -> dict[str, float]:
    """One ``graphdist run --backend slurm`` with worker 1 killed at its ``kill_after`` epoch
    line: cold start, recovery, stop (seconds)."""
    argv = [sys.executable, "-m", "graphdist", "run", "--backend", "slurm", "--jobid", str(jobid)]
    argv += ["--workers", "2", "--max-restarts", "1", "--output-format", "jsonl", "--"]
    argv += [sys.executable, SCRIPT, "--epochs", str(epochs), "--out", out]
    nodes: dict[str, str] = {}
    at: dict[str, float] = {}

    def on_line(now: float, raw: str) -> None:
        if not raw.startswith("{"):
            return
        event = json.loads(raw)
        kind, attempt = event.get("event"), event.get("attempt")
        if kind == "attempt-started" and not nodes:
            nodes.update(event["nodes"])
        if kind == "task-exited" and attempt == 1:
            at["exited"] = now  # the last of the attempt's tasks told ended
        if kind == "restarting" and "restarting" not in at:
            at["restarting"] = now
        if kind != "line":
            return
        task, text = event.get("task"), event["text"]
        if task == "worker-0" and text.startswith("task ") and f"first{attempt}" not in at:
            at[f"first{attempt}"] = now  # the script's first line: TensorFlow imported
        if not text.startswith("epoch "):
            return
        if task == "worker-0" and attempt == 1 and "cold" not in at:
            at["cold"] = now
        if task == "worker-0" and attempt == 2 and "again" not in at:
            at["again"] = now
        kill = task == "worker-1" and attempt == 1 and "kill" not in at
        if kill and text.startswith(f"epoch {kill_after}/"):
            node = bed.node(nodes["worker-1"])
            pids = [p for p in node.pids() if _cmdline(p)[1:2] == [SCRIPT]]
            if len(pids) != 1:
                raise RuntimeError(f"worker-1's command on {node.name}: {pids}")
            os.kill(pids[0], signal.SIGKILL)
            at["kill"] = time.monotonic()

    start = time.monotonic()
    proc = bed.popen(
        None, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=QUIET
    )
    code, lines = _stream(proc, RUN_TIMEOUT_S, on_line)
    attempts = sum('"event": "attempt-started"' in ln for ln in lines)
    if (
        code != 0
        or attempts != 2
        or not {"cold", "kill", "again", "exited", "restarting", "first1", "first2"} <= set(at)
    ):
        raise _failed("graphdist run --backend slurm", code, lines)
    _check_clean(bed, jobid, "graphdist run")
    return {
        "cold_s": at["cold"] - start,
        "recovery_s": at["again"] - at["kill"],
        "stop_s": at["restarting"] - at["kill"],
        "ended_s": at["exited"] - at["kill"],
        "gone_s": at["restarting"] - at["exited"],
        "first_s": at["first1"] - start,
        "again_first_s": at["first2"] - at["restarting"],
        "again_epoch_s": at["again"] - at["first2"],
    }


def measure_plain(bed: Any, jobid: int, epochs: int, out: str) -> dict[str, float]:
    """One plain ``srun`` of the wrapper and the script: cold start (seconds)."""
    argv = ["srun", f"--jobid={jobid}", "-N", "2", "--ntasks-per-node=1", "--label"]
    argv += [sys.executable, "-c", WRAPPER, SCRIPT, "--epochs", str(epochs), "--out", out]
    at: dict[str, float] = {}

    def on_line(now: float, raw: str) -> None:
        if raw.startswith("0: epoch ") and "cold" not in at:
            at["cold"] = now
        if raw.startswith("0: task ") and "first" not in at:
            at["first"] = now  # the script's first line: TensorFlow imported (by the wrapper)

    start = time.monotonic()
    proc = bed.popen(
        None, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=QUIET
    )
    code, lines = _stream(proc, RUN_TIMEOUT_S, on_line)
    last = f"epoch {epochs}/{epochs} done"
    if (
        code != 0
        or not {"cold", "first"} <= set(at)
        or not any(ln.startswith(f"0: {last}") for ln in lines)
    ):
        raise _failed("plain srun + SlurmClusterResolver", code, lines)
    _check_clean(bed, jobid, "plain srun")
    return {"cold_s": at["cold"] - start, "first_s": at["first"] - start}


class RayOnNodes:
    """A Ray head on node 1's host and a Ray node on node 2's, with a token of their own; stopped
    by killing the processes that carry that token (never ``ray stop``, which stops every Ray
    of this machine, nor the node hosts' Slurm daemons)."""

    def __init__(self, nodes: list[Any]) -> None:
        self.hosts = [node.host for node in nodes]
        self.tmp = tempfile.mkdtemp(prefix="gdbsr-")  # short: Ray's AF_UNIX paths are below it
        self.token = secrets.token_hex(16)
        self.env = {
            **os.environ, **QUIET, "RAY_TMPDIR": self.tmp, "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token, "RAY_USAGE_STATS_ENABLED": "0",
        }  # fmt: skip
        self.env.pop("RAY_ADDRESS", None)
        port = random.randint(20000, 40000)
        self.address = f"{self.hosts[0].address}:{port}"
        try:
            for host in self.hosts:  # Ray finds a node's address from its route to the internet
                host.run(["ip", "route", "replace", "default", "dev", "eth0"], check=True)
            common = ["--num-cpus", "2", "--disable-usage-stats"]
            head = ["--head", "--port", str(port), "--include-dashboard=false"]
            for host, role in ((self.hosts[0], head), (self.hosts[1], ["--address", self.address])):
                done = host.run(
                    [RAY, "start", *role, "--node-ip-address", host.address, *common],
                    env=self.env, capture_output=True, text=True, timeout=180,
                )  # fmt: skip
                if done.returncode != 0:
                    raise RuntimeError(f"ray start failed: {done.stdout[-2000:]}{done.stderr}")
        except BaseException:
            self.stop()
            raise

    def _pids(self) -> list[int]:
        import psutil

        found = []
        for host in self.hosts:
            for pid in host.pids():
                with contextlib.suppress(psutil.Error):
                    if psutil.Process(pid).environ().get("RAY_AUTH_TOKEN") == self.token:
                        found.append(pid)
        return found

    def stop(self) -> None:
        from tests.conftest import wait_gone

        seen: set[int] = set()
        for _ in range(20):  # a dying raylet may still start a worker: until none is left
            pids = self._pids()
            if not pids:
                break
            seen.update(pids)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        left = wait_gone(seen, 30)
        shutil.rmtree(self.tmp, ignore_errors=True)
        if left:
            raise RuntimeError(f"Ray's processes {left} outlived SIGKILL")


def measure_fleet(bed: Any, kind: str, where: str, env: dict[str, str] | None) -> dict[str, Any]:
    """One fleet start of ``kind`` (slurm / ray), its driver on node 1."""
    argv = [sys.executable, "-c", FLEET, kind, where]
    node = bed.nodes[0]
    if kind == "slurm":  # on the node as Slurm sees it (its name, the bed's names)
        done = bed.run(node, argv, env=QUIET, timeout=FLEET_TIMEOUT_S)
    else:  # on the node's host, as the Ray daemons there
        done = node.host.run(
            argv, env=env, cwd=bed.jobs_dir, capture_output=True, text=True,
            timeout=FLEET_TIMEOUT_S,
        )  # fmt: skip
    rows = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    result = json.loads(rows[-1]) if rows else {}
    if done.returncode != 0 or result.get("result") != 238 or result.get("hosts") != 2:
        raise RuntimeError(
            f"{kind} fleet start failed (exit {done.returncode}): {result}\n"
            f"{done.stdout[-2000:]}{done.stderr[-3000:]}"
        )
    return result


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(float(r[key]) for r in runs)


def _spread_warnings(series: dict[str, list[float]]) -> list[str]:
    out = []
    for label, values in series.items():
        if _common.spread(values) > SPREAD_LIMIT:
            out.append(
                f"{_common.WARNING}noisy run: {label} varied {_common.spread(values):.0%} between "
                f"its {len(values)} rounds ({min(values):.2f} s to {max(values):.2f} s; limit "
                f"{SPREAD_LIMIT:.0%} of their median): the machine's load moved"
            )
    return out


def _runs(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


def report(figures: dict[str, Any]) -> tuple[list[str], list[tuple[str, bool]]]:
    """The printed block's lines and the targets."""
    lines: list[str] = []
    targets: list[tuple[str, bool]] = []
    series: dict[str, list[float]] = {}
    if "run" in figures:
        run = figures["run"]
        g, p = run["graphdist"], run["plain"]
        cold_g, cold_p = _median(g, "cold_s"), _median(p, "cold_s")
        recovery, stop = _median(g, "recovery_s"), _median(g, "stop_s")
        rounds = len(g)
        lines += [
            f"[run] the seeds' MWMS script ({os.path.relpath(SCRIPT, _common.REPO)} --epochs "
            f"{run['epochs']}), 2 workers on 2 Slurm nodes, launched on the login host; medians "
            f"of {rounds} interleaved round(s)",
            "cold start (launch to worker 0's first epoch line):",
            f"  plain srun + SlurmClusterResolver:         {cold_p:6.2f} s  ({_runs(_col(p))})",
            f"    of which to the script's first line:     {_median(p, 'first_s'):6.2f} s  "
            "(TensorFlow imported)",
            f"  graphdist run --backend slurm:             {cold_g:6.2f} s  ({_runs(_col(g))})",
            f"    of which to the script's first line:     {_median(g, 'first_s'):6.2f} s",
            f"recovery (worker 1 SIGKILLed at its epoch {run['kill_after']} line, to worker 0's "
            "first epoch line after):",
            f"  graphdist run --backend slurm:             {recovery:6.2f} s  "
            f"({_runs(_col(g, 'recovery_s'))})",
            f"    stop (kill to restarting):               {stop:6.2f} s",
            f"      every task ended (kill to task-exited):{_median(g, 'ended_s'):6.2f} s",
            f"      their steps gone (then to restarting): {_median(g, 'gone_s'):6.2f} s",
            f"    restarting to the script's first line:   {_median(g, 'again_first_s'):6.2f} s",
            f"    then to the first epoch line:            {_median(g, 'again_epoch_s'):6.2f} s",
            "  plain srun + SlurmClusterResolver:         none (nothing starts a killed task "
            "again)",
        ]
        series["plain srun's cold start"] = _col(p)
        series["graphdist's cold start"] = _col(g)
        series["graphdist's recovery"] = _col(g, "recovery_s")
        targets += [
            (
                f"cold start, graphdist run --backend slurm / plain srun + SlurmClusterResolver: "
                f"{cold_g / cold_p:.2f}x (target <= {COLD_TARGET:.2f}; same script, epochs and "
                "nodes)",
                cold_g / cold_p <= COLD_TARGET,
            ),
            (
                f"recovery / graphdist's cold start: {recovery / cold_g:.2f}x (target <= "
                f"{RECOVERY_TARGET:.2f}; kill to the first epoch after, against launch to the "
                "first epoch)",
                recovery / cold_g <= RECOVERY_TARGET,
            ),
        ]
    if "fleet" in figures:
        fleet = figures["fleet"]
        s, r = fleet["slurm"], fleet["ray"]
        start_s, start_r = _median(s, "seconds"), _median(r, "seconds")
        if lines:
            lines.append("")
        lines += [
            f"[fleet] local=2, one server per node of the same 2 hosts, the driver on node 1 "
            f"(TensorFlow imported), RayFleet STRICT_SPREAD, expose=True; medians of {len(s)} "
            "interleaved round(s)",
            "start (constructor to start() returning):",
            f"  SlurmFleet(jobid=J), a step per server:    {start_s:6.2f} s  "
            f"({_runs(_col(s, 'seconds'))})",
            f"  RayFleet, head on node 1, node 2 joined:   {start_r:6.2f} s  "
            f"({_runs(_col(r, 'seconds'))})",
            f"close(): SlurmFleet {_median(s, 'close_s'):.2f} s, RayFleet "
            f"{_median(r, 'close_s'):.2f} s",
        ]  # fmt: skip
        series["SlurmFleet's start"] = _col(s, "seconds")
        series["RayFleet's start"] = _col(r, "seconds")
        targets.append(
            (
                f"SlurmFleet start / RayFleet start, local=2 on the same 2 nodes: "
                f"{start_s / start_r:.2f}x (target <= {FLEET_TARGET:.2f})",
                start_s / start_r <= FLEET_TARGET,
            )
        )
    return [*_spread_warnings(series), *lines], targets


def _col(runs: list[dict[str, Any]], key: str = "cold_s") -> list[float]:
    return [float(r[key]) for r in runs]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from tests.slurmbed import SlurmBed

    figures: dict[str, Any] = {}
    t0 = time.monotonic()
    with SlurmBed(2) as bed:
        jobid = bed.salloc(2)
        try:
            if args.part in ("all", "run"):
                count = iter(range(10**6))

                def one(side: str) -> dict[str, float]:
                    out = os.path.join(bed.jobs_dir, f"{side}-{next(count)}")
                    if side == "graphdist":
                        return measure_graphdist(bed, jobid, args.epochs, args.kill_after, out)
                    return measure_plain(bed, jobid, args.epochs, out)

                runs = _common.interleaved(["plain", "graphdist"], args.rounds, one)
                figures["run"] = {
                    "epochs": args.epochs,
                    "kill_after": args.kill_after,
                    **runs,
                }
            if args.part in ("all", "fleet"):
                ray = RayOnNodes(bed.nodes[:2])
                try:

                    def start(kind: str) -> dict[str, Any]:
                        if kind == "slurm":
                            return measure_fleet(bed, "slurm", str(jobid), None)
                        return measure_fleet(bed, "ray", ray.address, ray.env)

                    figures["fleet"] = _common.interleaved(["slurm", "ray"], args.rounds, start)
                finally:
                    ray.stop()
        finally:
            bed.scancel(jobid)
    figures["elapsed_s"] = time.monotonic() - t0
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (3)")
    parser.add_argument("--epochs", type=int, default=2, help="the script's epochs (2)")
    parser.add_argument(
        "--kill-after", type=int, default=1, help="kill worker 1 at this epoch's line (1)"
    )
    parser.add_argument(
        "--part",
        choices=("all", "run", "fleet"),
        default="all",
        help="the training runs, the fleet starts, or both (all)",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="one round, targets not checked (--no-check)"
    )
    _common.add_report_options(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.no_check = 1, True
    if args.rounds < 1 or not 0 < args.kill_after < args.epochs:
        parser.error("--rounds must be >= 1 and 0 < --kill-after < --epochs")
    if os.geteuid() != 0:
        print(
            "benchmarks/slurm.py needs root (the Slurm bed's network namespaces)", file=sys.stderr
        )
        return 2
    import pytest

    from tests.slurmbed import require_slurmbed

    try:
        require_slurmbed()
    except pytest.skip.Exception as exc:
        print(f"benchmarks/slurm.py cannot make a Slurm bed: {exc}", file=sys.stderr)
        return 2
    if args.part != "run" and not os.path.exists(RAY):
        print("benchmarks/slurm.py --part fleet needs Ray ('graphdist[ray]')", file=sys.stderr)
        return 2
    figures = measure(args)
    lines, targets = report(figures)
    lines.append(f"(the whole benchmark took {figures['elapsed_s']:.0f} s)")
    print("\n".join(lines))
    printed, missed = _common.report_targets_kept(targets)
    body = "\n".join(["  ```", *(f"  {ln}".rstrip() for ln in [*lines, *printed]), "  ```"])
    _common.update_readme_section(args.readme, NAME, body, _common.command_line("slurm.py", argv))
    _common.write_json(args.json, figures)
    return 1 if missed and not args.no_check else 0


if __name__ == "__main__":
    sys.exit(main())
