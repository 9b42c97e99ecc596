"""TLS mode against plain members-only serving, side by side in one run: what the mutual-TLS
gateways (graphdist/_net/gateway.py) cost a step, a transfer between hosts and a start.

The hosts are network namespaces on one bridge (tests/hostbed.py), so this needs root. A veth
pair on one machine is not a network: no wire, the same kernel, memory and cores on every side.
Here every process of the three hosts (two TensorFlow servers and two gateways per cluster, the
client and its gateway) shares this machine's cores, so the gateways' encryption competes with
the servers it relays for, which on real hosts it would not; the figures show the cost of
going through the gateways, not that of a real network.

Two clusters are served at once, on ports of their own, in every round: PLAIN, ``graphdist
serve`` of local:0 on host 1 and local:1 on host 2 with ``--allow`` host 3; TLS, the same with
``--tls`` (credentials from ``graphdist certs``, made once). A client on host 3 (no member by
address) holds a session on each. Each round launches both pairs anew, one side after the other,
the side first alternating, and the client measures, alternating the sides within the round:

- step: the seeds' split graph (constant folding off), ``--steps`` runs after 20 of warm-up, in
  blocks of 10 per side; the median step of each side over every round;
- transfer: a ``--mb`` MB float32 variable on task 1 (initialised once a round), read on task 0
  by a ``reduce_sum`` placed there, so the tensor crosses host 2 -> host 1 and the client gets a
  scalar (as benchmarks/transfer.py); ``--transfers`` reads per side, one side then the other;
  the median MB/s (MB = 2^20 bytes); and the CPU the side's servers and gateways used during
  its reads (cores: CPU seconds / the reads' seconds), to show where the time goes;
- start: launch of the side's two ``serve`` processes to both printing "ready at"; and
  ``graphdist.connect`` on the client (TensorFlow and the TLS modules imported already);
  medians over the rounds.

Targets (met / MISSED, exit 1 on a miss): step TLS <= 1.3x plain, transfer TLS >= 0.5x plain,
serve start TLS <= 1.5x plain (loose: TLS adds a gateway, a Python process without TensorFlow,
to a start that TensorFlow's import dominates). ``graphdist.connect`` has no target: plain is a
probe of each server, TLS starts a gateway process first; its seconds are shown.

    python benchmarks/tls.py [--steps 50] [--rounds 3] [--mb 64] [--transfers 5] [--smoke]
        [--json FILE] [--readme docs/benchmarks.md] [--plot PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

try:
    from . import _common
except ImportError:  # run as a script
    import _common

sys.path.insert(0, _common.REPO)
from tests.net.test_hosts import SPLIT_GRAPH

NAME = "tls"
STEP_TARGET = 1.3
BANDWIDTH_TARGET = 0.5
SERVE_TARGET = 1.5
SIDES = ("plain", "tls")
READY_S = 180.0
PLOT = os.path.join(_common.HERE, "results", "tls.png")
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2"}

# The client on host 3: one JSON command a line on stdin ("do": connect, steps, transfer, close;
# "order": the sides, first one first), one JSON answer a line on stdout.
CLIENT = (
    SPLIT_GRAPH
    + r"""
import cryptography.x509, graphdist._fleet.remote, graphdist._net.gateway  # not timed
steps, mb = int(sys.argv[1]), int(sys.argv[2])
with graph.as_default():
    with tf.device("/job:local/task:1"):
        blob = tf.compat.v1.Variable(tf.zeros([mb * 2**20 // 4], tf.float32), name="blob")
    with tf.device("/job:local/task:0"):
        total = tf.reduce_sum(tf.identity(blob) + 1.0)
fleets, sessions = {}, {}

def timed(fetch, side):
    t = time.perf_counter()
    sessions[side].run(fetch)
    return time.perf_counter() - t

for line in sys.stdin:
    cmd = json.loads(line)
    order, out = cmd["order"], {side: [] for side in cmd["order"]}
    if cmd["do"] == "connect":
        for side in order:
            path, creds = cmd["sides"][side]
            t = time.perf_counter()
            fleets[side] = graphdist.connect(path, timeout_s=120, tls=creds or None)
            out[side] = time.perf_counter() - t
        for side in order:
            config = graphdist.no_folding_config()
            sessions[side] = fleets[side].session("local", 0, graph, config=config)
            assert sessions[side].run(y) == 238
            sessions[side].run(blob.initializer)
            sessions[side].run(total)
            for _ in range(20):
                sessions[side].run(y)
    elif cmd["do"] == "steps":
        for block in range(0, steps, 10):
            for side in order if block % 20 == 0 else order[::-1]:
                out[side] += [timed(y, side) for _ in range(min(10, steps - block))]
    elif cmd["do"] == "transfer":
        for side in order:
            out[side] = [timed(total, side) for _ in range(cmd["n"])]
    else:
        for side in order:
            sessions.pop(side).close()
            fleets.pop(side).close()
    print(json.dumps(out), flush=True)
"""
)


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` so far (a process gone counts nothing)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


class Pair:
    """One side's ``graphdist serve`` of local:0 on host 1 and local:1 on host 2 on ``port``,
    launched at once; ``seconds``: the launch to both logs saying "ready at"."""

    def __init__(self, bed: Any, folder: str, side: str, port: int, creds: str) -> None:
        h1, h2 = bed[0], bed[1]
        self.path = os.path.join(folder, f"{side}-{port}.json")
        with open(self.path, "w") as f:
            json.dump({"local": [f"{h1.address}:{port}", f"{h2.address}:{port}"]}, f)
        self.logs = [os.path.join(folder, f"{side}-{port}-{i}.log") for i in range(2)]
        self.procs: list[subprocess.Popen[Any]] = []
        start = time.perf_counter()
        for i, host in enumerate((h1, h2)):
            argv = [sys.executable, "-m", "graphdist", "serve", "--cluster", self.path]
            argv += ["--job", "local", "--task", str(i)]
            if side == "tls":
                argv += ["--tls", os.path.join(creds, "hosts", host.address)]
            else:
                argv += ["--allow", bed[2].address]
            with open(self.logs[i], "wb") as log:
                env = {**os.environ, **QUIET}
                self.procs.append(host.popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env))
        while not all("ready at" in self.log(i) for i in range(2)):
            dead = [p.args for p in self.procs if p.poll() is not None]
            if dead or time.perf_counter() - start > READY_S:
                raise RuntimeError(f"{side} servers did not start: {dead or 'timeout'}: "
                                   f"{[self.log(i)[-2000:] for i in range(2)]}")  # fmt: skip
            time.sleep(0.05)
        self.seconds = time.perf_counter() - start
        self.gateways = []  # in TLS mode, each serve process's child
        for p in self.procs:
            with open(f"/proc/{p.pid}/task/{p.pid}/children") as f:
                self.gateways += [int(c) for c in f.read().split()]

    def log(self, i: int) -> str:
        with open(self.logs[i], errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            p.wait(30)


def measure(bed: Any, folder: str, steps: int, rounds: int, mb: int, transfers: int) -> Any:
    """Every figure of both sides, interleaved: see the module docstring."""
    made = subprocess.run(
        [sys.executable, "-m", "graphdist", "certs", "--out", os.path.join(folder, "creds"),
         "--cluster", json.dumps({"local": [f"{bed[0].address}:1", f"{bed[1].address}:1"]})],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if made.returncode != 0:
        raise RuntimeError(made.stderr)
    creds = os.path.join(folder, "creds")
    client = bed[2].popen(
        [sys.executable, "-c", CLIENT, str(steps), str(mb)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **QUIET},
    )  # fmt: skip
    assert client.stdin is not None and client.stdout is not None

    def ask(**cmd: Any) -> Any:
        client.stdin.write(json.dumps(cmd) + "\n")  # type: ignore[union-attr]
        client.stdin.flush()  # type: ignore[union-attr]
        line = client.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"the client on host 3 exited {client.wait(30)}")
        return json.loads(line)

    keys = ("serve_s", "connect_s", "step_s", "read_s", "server_cpu_s", "gateway_cpu_s")
    got: dict[str, dict[str, list[float]]] = {k: {s: [] for s in SIDES} for k in keys}
    ports = random.sample(range(20000, 40000), 2 * rounds)  # the namespaces' own: all free
    for r in range(rounds):
        order = list(SIDES if r % 2 == 0 else SIDES[::-1])
        pairs: dict[str, Pair] = {}
        try:
            for side in order:
                pairs[side] = Pair(bed, folder, side, ports.pop(), creds)
                got["serve_s"][side].append(pairs[side].seconds)
            sides = {s: [pairs[s].path, os.path.join(creds, "client") if s == "tls" else ""]
                     for s in SIDES}  # fmt: skip
            for side, seconds in ask(do="connect", order=order, sides=sides).items():
                got["connect_s"][side].append(seconds)
            for side, times in ask(do="steps", order=order).items():
                got["step_s"][side] += times
            for side in order:  # one side at a time, so that its CPU is its reads'
                servers, gateways = [p.pid for p in pairs[side].procs], pairs[side].gateways
                before = _cpu_s(servers), _cpu_s(gateways)
                (times,) = ask(do="transfer", order=[side], n=transfers).values()
                got["read_s"][side] += times
                got["server_cpu_s"][side].append((_cpu_s(servers) - before[0]) / sum(times))
                got["gateway_cpu_s"][side].append((_cpu_s(gateways) - before[1]) / sum(times))
            ask(do="close", order=order)
        finally:
            for pair in pairs.values():
                pair.stop()
    client.stdin.close()
    client.wait(60)
    med = {k: {s: statistics.median(v[s]) for s in SIDES} for k, v in got.items()}

    def side_by_side(plain: float, tls: float) -> dict[str, float]:
        return {"plain": plain, "tls": tls, "ratio": tls / plain}

    step, read = med["step_s"], med["read_s"]
    return {
        "step_ms": side_by_side(step["plain"] * 1e3, step["tls"] * 1e3),
        "mb_per_s": side_by_side(mb / read["plain"], mb / read["tls"]),
        "serve_s": side_by_side(med["serve_s"]["plain"], med["serve_s"]["tls"]),
        "connect_s": side_by_side(med["connect_s"]["plain"], med["connect_s"]["tls"]),
        "cpu_cores": {"servers": med["server_cpu_s"], "gateways": med["gateway_cpu_s"]},
        "runs": {k: got[k] for k in ("serve_s", "connect_s")},
        "mb": mb, "steps": steps, "rounds": rounds, "transfers": transfers,
        "cores": os.cpu_count(),
    }  # fmt: skip


def report(f: dict[str, Any]) -> tuple[str, list[tuple[str, bool]]]:
    """The record's table (with the note that a veth pair is no network) and the targets."""
    step, bw, serve, conn = f["step_ms"], f["mb_per_s"], f["serve_s"], f["connect_s"]
    cpu = f["cpu_cores"]
    lines = [
        "| measure | plain (members only) | TLS | TLS / plain | target |",
        "|---|---:|---:|---:|---|",
        f"| split graph step, host 3 client (ms) | {step['plain']:.2f} | {step['tls']:.2f} "
        f"| {step['ratio']:.2f}x | <= {STEP_TARGET:.1f}x |",
        f"| {f['mb']} MB task 1 -> task 0, host 2 -> host 1 (MB/s) | {bw['plain']:.0f} | "
        f"{bw['tls']:.0f} | {bw['ratio']:.2f}x | >= {BANDWIDTH_TARGET:.1f}x |",
        f"| `serve` pair launch to both ready (s) | {serve['plain']:.2f} | {serve['tls']:.2f} "
        f"| {serve['ratio']:.2f}x | <= {SERVE_TARGET:.1f}x |",
        f"| `graphdist.connect` on host 3 (s) | {conn['plain']:.3f} | {conn['tls']:.3f} "
        f"| {conn['ratio']:.1f}x | none |",
    ]
    targets = [
        (f"TLS step {step['ratio']:.2f}x plain <= {STEP_TARGET}x", step["ratio"] <= STEP_TARGET),
        (f"TLS transfer {bw['ratio']:.2f}x plain >= {BANDWIDTH_TARGET}x",
         bw["ratio"] >= BANDWIDTH_TARGET),
        (f"TLS serve start {serve['ratio']:.2f}x plain <= {SERVE_TARGET}x",
         serve["ratio"] <= SERVE_TARGET),
    ]  # fmt: skip
    table = "\n".join(lines) + (
        f"\n\nMedians of {f['rounds']} interleaved rounds ({f['steps']} steps, {f['transfers']} "
        f"reads of {f['mb']} MB a side a round). CPU during the reads, in cores: TensorFlow's "
        f"servers {cpu['servers']['plain']:.2f} plain, {cpu['servers']['tls']:.2f} TLS; TLS "
        f"gateways {cpu['gateways']['tls']:.2f}, of this machine's {f['cores']}.\n\n"
        "Hosts are network namespaces on one bridge: a veth pair is not a network (no wire, "
        "one kernel), and every process of the three hosts shares this machine's cores, the "
        "gateways' encryption those of the servers it relays for; so these show the cost of "
        "the TLS gateways on one machine, not a real network's."
    )
    return table, targets


def plot(f: dict[str, Any], path: str) -> None:
    """Two bars per measure, plain and TLS, as ratios to plain (bandwidth: higher is better),
    and each target; a log scale, on which 2x and 0.5x are as far from plain."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["step", f"{f['mb']} MB transfer\n(MB/s)", "serve start", "connect"]
    ratios = [f[k]["ratio"] for k in ("step_ms", "mb_per_s", "serve_s", "connect_s")]
    xs = range(len(names))
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.bar([x - 0.2 for x in xs], [1.0] * len(xs), 0.4, label="plain (members only)")
    bars = ax.bar([x + 0.2 for x in xs], ratios, 0.4, label="TLS")
    ax.bar_label(bars, [f"{r:.2f}x" for r in ratios], fontsize=8)
    for x, target in zip(xs, (STEP_TARGET, BANDWIDTH_TARGET, SERVE_TARGET), strict=False):
        ax.hlines(target, x, x + 0.4, colors="red", lw=2, label="target" if x == 0 else None)
    ax.set_xticks(list(xs), names, fontsize=8)
    ax.set(yscale="log", ylabel="x plain (log)", title="TLS mode against plain (namespace hosts)")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%gx"))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--transfers", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="1 round, 10 steps, 2 reads of 4 MB")
    parser.add_argument("--plot", metavar="PATH", help="the plot (with --readme: the record's)")
    _common.add_report_options(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.steps, args.transfers, args.mb = 1, 10, 2, 4
    from tests.hostbed import HostBed, HostBedError

    if os.geteuid() != 0:
        print("benchmarks/tls.py needs root (network namespaces)", file=sys.stderr)
        return 2
    folder = tempfile.mkdtemp(prefix="gdbench-tls-")
    try:
        with HostBed(3) as bed:
            figures = measure(bed, folder, args.steps, args.rounds, args.mb, args.transfers)
    except HostBedError as exc:
        print(f"cannot make the hosts: {exc}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    table, targets = report(figures)
    print(table)
    missed = _common.report_targets(targets)
    path = args.plot or (PLOT if args.readme else None)
    if path:
        plot(figures, path)
    if args.readme and path:
        shown = os.path.relpath(path, os.path.dirname(os.path.abspath(args.readme)))
        table += f"\n\n![TLS against plain, as ratios to plain]({shown})"
    _common.update_readme_section(args.readme, NAME, table, _common.command_line("tls.py", argv))
    _common.write_json(args.json, figures)
    return 1 if missed and not args.no_check else 0


if __name__ == "__main__":
    sys.exit(main())
