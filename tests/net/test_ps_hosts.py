"""The parameter-server example across hosts, for real: examples/ps_training.py's tasks spread
over three hosts of a bed of network namespaces (tests/hostbed.py), each task's server started
by hand with ``graphdist serve`` as an operator would on real machines, and the chief given its
TF_CONFIG by ``graphdist tf-config``: no ``graphdist run`` anywhere.

chief:0 and ps:0 on host 0, worker:0 on host 1, worker:1 on host 2. The example must train to
the accuracy its ``graphdist run`` test expects (tests/distribute/test_training.py: above 0.5),
with every variable on the ps task served at host 0's address, and the work must cross hosts:
each worker host's own network interface carries at least ten training steps' worth of the
model's variables in each direction (a worker reads the variables from the ps task and sends
its gradients back at every step; a worker that only held its dataset would move a few KB).
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.conftest import QUIET_TF, REPO, run_python, wait_gone

pytestmark = [pytest.mark.promise]

READY_S = 90.0  # three servers importing TensorFlow at once on a busy 2-core machine
CHIEF_S = 270.0  # the chief's TensorFlow, tf-keras and 150 steps, on the same 2 cores
STOP_S = 30.0
THRESHOLD = 0.5  # tests/distribute/test_training.py: the same example under `graphdist run`
# examples/ps_training.py's model: Dense(64) on 28*28 inputs, then Dense(10), float32.
VARIABLE_BYTES = 4 * (28 * 28 * 64 + 64 + 64 * 10 + 10)
MIN_STEPS_OF_TRAFFIC = 10
PS_DEVICE = "/job:ps/replica:0/task:0/device:CPU:0"


def _eth0_bytes(pid: int) -> tuple[int, int]:
    """(received, sent) bytes of eth0 in the network namespace of process ``pid``."""
    with open(f"/proc/{pid}/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == "eth0":
                fields = counters.split()
                return int(fields[0]), int(fields[8])
    raise AssertionError(f"no eth0 in the network namespace of pid {pid}")


def _listening(pid: int) -> list[tuple[str, int]]:
    """Where process ``pid`` listens (a v4-mapped IPv6 address as its IPv4 one), read from its
    own network namespace's /proc/PID/net/tcp and tcp6: psutil reads the caller's namespace,
    and finds nothing on a host."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed since
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: TCP_LISTEN
                    continue
                hex_ip, hex_port = fields[1].split(":")
                # 32-bit words, each in the host's (little-endian) byte order
                raw = b"".join(
                    bytes.fromhex(hex_ip[i : i + 8])[::-1] for i in range(0, len(hex_ip), 8)
                )
                ip = ipaddress.ip_address(raw)
                if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
                    ip = ip.ipv4_mapped
                found.append((str(ip), int(hex_port, 16)))
    return sorted(found)


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _stop(procs: list[subprocess.Popen[Any]]) -> list[int | None]:
    """SIGTERM to every server still running, then their exit statuses (killed if deaf)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    codes: list[int | None] = []
    for p in procs:
        try:
            codes.append(p.wait(STOP_S))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
            codes.append(None)
    return codes


@pytest.mark.timeout(400)
def test_the_ps_example_trains_with_its_tasks_on_three_hosts(hosts: Any, tmp_path: Any) -> None:
    """ps:0 on host 0, worker:0 on host 1 and worker:1 on host 2 served by ``graphdist serve``;
    the chief on host 0 runs ``ps_training.py --mode custom`` with the TF_CONFIG ``graphdist
    tf-config`` prints: it exits 0, its variables live on the ps task, its accuracy is above
    the example's threshold, and both worker hosts carried training traffic. SIGTERM stops
    every server with status 0, and no process is left on any host."""
    chief_port, ps_port, w0_port, w1_port = random.sample(range(20000, 40001), 4)
    # the namespaces are the test's own: every port is free
    cluster = {
        "chief": [f"{hosts[0].address}:{chief_port}"],
        "ps": [f"{hosts[0].address}:{ps_port}"],
        "worker": [f"{hosts[1].address}:{w0_port}", f"{hosts[2].address}:{w1_port}"],
    }
    path = str(tmp_path / "cluster.json")
    with open(path, "w") as f:
        json.dump(cluster, f)

    served = [(hosts[0], "ps", 0), (hosts[1], "worker", 0), (hosts[2], "worker", 1)]
    logs = [str(tmp_path / f"serve-{job}-{index}.log") for _, job, index in served]
    procs: list[subprocess.Popen[Any]] = []
    codes: list[int | None] = []
    try:
        for (host, job, index), log_path in zip(served, logs, strict=True):
            argv = [sys.executable, "-m", "graphdist", "serve", "--cluster", path]
            argv += ["--job", job, "--task", str(index)]
            with open(log_path, "wb") as out:
                procs.append(
                    host.popen(
                        argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **QUIET_TF}
                    )
                )
        deadline = time.monotonic() + READY_S
        while not all("ready at" in _read(lp) for lp in logs):
            for (_, job, index), p, lp in zip(served, procs, logs, strict=True):
                assert p.poll() is None, f"serve {job}:{index} exited {p.returncode}: {_read(lp)}"
            assert time.monotonic() < deadline, [_read(lp)[-2000:] for lp in logs]
            time.sleep(0.2)
        # ps:0 is served on host 0, at host 0's address only
        ps_address = cluster["ps"][0]
        assert f"/job:ps/task:0 ready at grpc://{ps_address} " in _read(logs[0])
        assert _listening(procs[0].pid) == [(hosts[0].address, ps_port)]

        config = run_python(
            ["-m", "graphdist", "tf-config", "--cluster", path, "--task", "chief:0"]
        )
        assert config.returncode == 0, config.stderr
        tf_config = json.loads(config.stdout)
        assert tf_config["task"] == {"type": "chief", "index": 0}
        assert tf_config["cluster"] == cluster

        before = [_eth0_bytes(p.pid) for p in procs[1:]]
        started = time.monotonic()
        chief = hosts[0].run(
            [sys.executable, os.path.join("examples", "ps_training.py"), "--mode", "custom"],
            cwd=REPO,
            env={**os.environ, **QUIET_TF, "TF_CONFIG": config.stdout.strip()},
            capture_output=True,
            text=True,
            timeout=CHIEF_S,
        )
        seconds = time.monotonic() - started
        after = [_eth0_bytes(p.pid) for p in procs[1:]]
        lines = chief.stdout.splitlines()
        assert chief.returncode == 0, (chief.stdout[-3000:], chief.stderr[-3000:])
        for (_, job, index), p, lp in zip(served, procs, logs, strict=True):
            assert p.poll() is None, f"serve {job}:{index} exited {p.returncode}: {_read(lp)}"

        assert any(ln.startswith("strategy: ParameterServerStrategy") for ln in lines), lines
        assert "custom loop: 150 steps scheduled on the workers" in chief.stdout, lines
        devices = [ln.split(" on ")[-1] for ln in lines if ln.startswith("variable ")]
        assert len(devices) == 4, lines  # two Dense layers: a kernel and a bias each
        assert all(d == PS_DEVICE for d in devices), devices
        [accuracy] = [float(ln.split()[-1]) for ln in lines if ln.startswith("held-out accuracy")]
        assert accuracy > THRESHOLD, lines

        # Each worker's host received the variables and sent gradients, step after step.
        minimum = MIN_STEPS_OF_TRAFFIC * VARIABLE_BYTES
        traffic = {
            f"worker:{i} on {hosts[i + 1].address}": (rx1 - rx0, tx1 - tx0)
            for i, ((rx0, tx0), (rx1, tx1)) in enumerate(zip(before, after, strict=True))
        }
        assert all(rx >= minimum and tx >= minimum for rx, tx in traffic.values()), (
            f"(received, sent) bytes during the run: {traffic}; at least {minimum} each expected"
        )
        print(f"\nchief ran {seconds:.1f} s, accuracy {accuracy:.3f}, worker traffic {traffic}")
    finally:
        codes = _stop(procs)
    assert codes == [0, 0, 0], [_read(lp)[-2000:] for lp in logs]
    assert wait_gone([p.pid for p in procs], STOP_S) == []
    for p in procs:  # gone: reaped, and no such pid left
        with pytest.raises(ProcessLookupError):
            os.kill(p.pid, 0)
    assert [h.pids() for h in hosts] == [[], [], []]
