"""Across hosts: the split graph's step latency with its two tasks on two hosts against both on
one, and a two-node RayFleet's start-up with one server per node against both on one node.

The hosts are network namespaces on one bridge (tests/hostbed.py), each with its own address, so
this needs root. A veth pair on one machine is not a network: no wire, no switch, the same
kernel and memory on both sides; what these figures show is the cost of going through a
network stack between hosts and of graphdist's members-only check, not that of a real network.

- latency: ``graphdist serve`` of ``local:0`` and ``local:1`` on hosts 1 and 2 (across), and
  again both on host 1 (one host, two ports); a client on host 1 runs the seeds' split graph
  (constant folding off, so task 1 really computes) ``--steps`` times against each, in
  alternating rounds; the figure is each side's median step.
- startup: a Ray head on host 1 and a node on host 2 (token auth); ``RayFleet("local=2",
  expose=True)`` with ``STRICT_SPREAD`` (a server per node) against ``STRICT_PACK`` (both on one
  node), alternately, launch to every server answering; each side's median.

Targets (met / MISSED, exit 1 on a miss): latency across <= 2.0x one host, start-up two nodes
<= 1.5x one node.

    python benchmarks/hosts.py [--steps 200] [--rounds 3] [--json FILE]
        [--readme docs/benchmarks.md]
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
import time
from typing import Any

try:
    from . import _common
except ImportError:  # run as a script
    import _common

sys.path.insert(0, _common.REPO)
from tests.net.test_hosts import SPLIT_GRAPH

NAME = "hosts"
LATENCY_TARGET = 2.0
STARTUP_TARGET = 1.5
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2"}

LATENCY = (
    SPLIT_GRAPH
    + r"""
steps = int(sys.argv[1])
fleets = [graphdist.connect(path, timeout_s=120) for path in sys.argv[2:]]
sessions = [f.session("local", 0, graph, config=graphdist.no_folding_config()) for f in fleets]
for sess in sessions:
    assert sess.run(y) == 238
    for _ in range(20):
        sess.run(y)
for line in sys.stdin:  # one round per line: each side in turn, the order alternating
    order = list(range(len(sessions)))
    if int(line) % 2:
        order.reverse()
    times = {}
    for i in order:
        t = time.perf_counter()
        for _ in range(steps):
            sessions[i].run(y)
        times[i] = (time.perf_counter() - t) / steps
    print(json.dumps([times[i] for i in range(len(sessions))]), flush=True)
"""
)

STARTUP = (
    SPLIT_GRAPH
    + r"""
address, strategy = sys.argv[1], sys.argv[2]
t = time.perf_counter()
fleet = graphdist.RayFleet("local=2", address=address, strategy=strategy, expose=True).start()
took = time.perf_counter() - t
with fleet.session("local", 0, graph, config=graphdist.no_folding_config()) as sess:
    assert sess.run(y) == 238
nodes = len(set(fleet.node_ids.values()))
fleet.close()
print(json.dumps({"seconds": took, "nodes": nodes}), flush=True)
"""
)


def _serve(host: Any, path: str, index: int, log: str) -> subprocess.Popen[Any]:
    argv = [sys.executable, "-m", "graphdist", "serve", "--cluster", path, "--job", "local"]
    with open(log, "wb") as f:
        return host.popen(
            [*argv, "--task", str(index)], stdout=f, stderr=subprocess.STDOUT,
            env={**os.environ, **QUIET},
        )  # fmt: skip


def _wait_ready(logs: list[str], procs: list[subprocess.Popen[Any]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        texts = []
        for log in logs:
            with open(log, errors="replace") as f:
                texts.append(f.read())
        if all("ready at" in t for t in texts):
            return
        dead = [p.args for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"servers did not start: {dead or 'timeout'}: {texts}")
        time.sleep(0.2)


def measure_latency(bed: Any, folder: str, steps: int, rounds: int) -> dict[str, float]:
    h1, h2 = bed[0], bed[1]
    p1, p2, p3 = random.sample(range(20000, 40000), 3)
    setups = {
        "across": {"local": [f"{h1.address}:{p1}", f"{h2.address}:{p1}"]},
        "one_host": {"local": [f"{h1.address}:{p2}", f"{h1.address}:{p3}"]},
    }
    paths, procs, logs = [], [], []
    for name, cluster in setups.items():
        path = os.path.join(folder, f"{name}.json")
        with open(path, "w") as f:
            json.dump(cluster, f)
        paths.append(path)
        for i, host in enumerate((h1, h2) if name == "across" else (h1, h1)):
            logs.append(os.path.join(folder, f"{name}-{i}.log"))
            procs.append(_serve(host, path, i, logs[-1]))
    try:
        _wait_ready(logs, procs, 180)
        client = h1.popen(
            [sys.executable, "-c", LATENCY, str(steps), *paths],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, **QUIET},
        )  # fmt: skip
        assert client.stdin is not None and client.stdout is not None
        samples: list[list[float]] = []
        for r in range(rounds):
            client.stdin.write(f"{r}\n")
            client.stdin.flush()
            samples.append(json.loads(client.stdout.readline()))
        client.stdin.close()
        client.wait(60)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(30)
    across = statistics.median(s[0] for s in samples) * 1e3
    one = statistics.median(s[1] for s in samples) * 1e3
    return {"across_ms": across, "one_host_ms": one, "ratio": across / one}


def measure_startup(bed: Any, rounds: int) -> dict[str, float]:
    h1, h2 = bed[0], bed[1]
    tmp = tempfile.mkdtemp(prefix="gdbh-")
    env = {
        **os.environ, **QUIET, "RAY_TMPDIR": tmp, "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(16), "RAY_USAGE_STATS_ENABLED": "0",
    }  # fmt: skip
    env.pop("RAY_ADDRESS", None)
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    port = random.randint(20000, 40000)
    address = f"{h1.address}:{port}"
    try:
        for host in (h1, h2):
            host.run(["ip", "route", "replace", "default", "dev", "eth0"], check=True)
        common = ["--num-cpus", "2", "--disable-usage-stats"]
        h1.run(
            [
                ray,
                "start",
                "--head",
                "--port",
                str(port),
                "--node-ip-address",
                h1.address,
                "--include-dashboard=false",
                *common,
            ],
            env=env,
            check=True,
            capture_output=True,
        )
        h2.run([ray, "start", "--address", address, "--node-ip-address", h2.address, *common],
               env=env, check=True, capture_output=True)  # fmt: skip
        runs: dict[str, list[float]] = {"STRICT_SPREAD": [], "STRICT_PACK": []}
        for r in range(rounds):
            order = ["STRICT_SPREAD", "STRICT_PACK"]
            for strategy in order if r % 2 == 0 else order[::-1]:
                out = h1.run(
                    [sys.executable, "-c", STARTUP, address, strategy],
                    env=env, capture_output=True, text=True, timeout=600,
                )  # fmt: skip
                if out.returncode != 0:
                    raise RuntimeError(out.stderr[-3000:])
                result = json.loads(out.stdout.strip().splitlines()[-1])
                assert result["nodes"] == (2 if strategy == "STRICT_SPREAD" else 1), result
                runs[strategy].append(result["seconds"])
    finally:
        pids = [p for host in (h1, h2) for p in host.pids()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)
    two = statistics.median(runs["STRICT_SPREAD"])
    one = statistics.median(runs["STRICT_PACK"])
    return {"two_nodes_s": two, "one_node_s": one, "ratio": two / one}


def report(
    latency: dict[str, float], startup: dict[str, float]
) -> tuple[str, list[tuple[str, bool]]]:
    """README's table (with the note that a veth pair is no network) and the targets."""
    lines = [
        "| measure | across hosts | on one host / node | ratio | target |",
        "|---|---:|---:|---:|---|",
        f"| split graph step (ms) | {latency['across_ms']:.2f} | {latency['one_host_ms']:.2f} "
        f"| {latency['ratio']:.2f}x | <= {LATENCY_TARGET:.1f}x |",
        f"| RayFleet local=2 start (s) | {startup['two_nodes_s']:.1f} | "
        f"{startup['one_node_s']:.1f} | {startup['ratio']:.2f}x | <= {STARTUP_TARGET:.1f}x |",
    ]
    targets = [
        (f"latency across hosts {latency['ratio']:.2f}x <= {LATENCY_TARGET}x",
         latency["ratio"] <= LATENCY_TARGET),
        (f"RayFleet start on two nodes {startup['ratio']:.2f}x <= {STARTUP_TARGET}x",
         startup["ratio"] <= STARTUP_TARGET),
    ]  # fmt: skip
    table = "\n".join(lines) + (
        "\n\nHosts are network namespaces on one bridge: a veth pair is not a network (no wire, "
        "one kernel), so these show the network stack's and the members-only check's cost, not "
        "a real network's."
    )
    return table, targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    _common.add_report_options(parser)
    args = parser.parse_args(argv)
    from tests.hostbed import HostBed, HostBedError

    if os.geteuid() != 0:
        print("benchmarks/hosts.py needs root (network namespaces)", file=sys.stderr)
        return 2
    try:
        bed = HostBed(3)
    except HostBedError as exc:
        print(f"cannot make the hosts: {exc}", file=sys.stderr)
        return 2
    folder = tempfile.mkdtemp(prefix="gdbench-hosts-")
    try:
        latency = measure_latency(bed, folder, args.steps, args.rounds)
        startup = measure_startup(bed, args.rounds)
    finally:
        bed.close()
        shutil.rmtree(folder, ignore_errors=True)
    table, targets = report(latency, startup)
    print(table)
    missed = _common.report_targets(targets)
    _common.update_readme_section(args.readme, NAME, table, _common.command_line("hosts.py", argv))
    _common.write_json(args.json, {"latency": latency, "startup": startup})
    return 1 if missed and not args.no_check else 0


if __name__ == "__main__":
    sys.exit(main())
