"""The deploy files of ``servers/`` run on the host bed (tests/hostbed.py), as far as they can
without Slurm and systemd: their own command lines, read from the files, start real servers on
two hosts, each with an address of its own, and a client on a member host runs the split graph
across them.

- ``servers/slurm.sbatch``: its ``srun`` line's ``graphdist serve --slurm ...`` with a job spec
  of two tasks, each host given the variables ``srun`` sets for its task, and node names that
  resolve to the hosts' addresses (``ip netns exec`` mounts ``/etc/netns/NS/hosts`` over
  ``/etc/hosts``).
- ``servers/graphdist-server@.service``: its ``ExecStart`` line, with ``EnvironmentFile``'s
  variables expanded as systemd expands them, run for two instances in a clean environment, and
  stopped with the unit's ``KillSignal`` within its ``TimeoutStopSec``.
"""

from __future__ import annotations

import configparser
import contextlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest

from tests.conftest import QUIET_TF, REPO

pytestmark = [pytest.mark.promise]

SERVERS = os.path.join(REPO, "servers")
READY_S = 90.0  # a server's TensorFlow import on a busy 2-core machine
NETNS_ETC = "/etc/netns"
# What systemd gives a system service as PATH (systemd.exec(5), "Environment variables").
SYSTEMD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# A client of the served cluster, run on a host. argv: the cluster file, the job. Prints one
# JSON line: the split graph's result, task 0 the master, task 1 computing x - 66.
CLIENT = r"""
import json, sys
import graphdist
import tensorflow as tf

path, job = sys.argv[1], sys.argv[2]
tf.compat.v1.disable_eager_execution()
graph = tf.Graph()
with graph.as_default():
    x = tf.constant(2)
    with tf.device(f"/job:{job}/task:1"):
        y2 = x - 66
    with tf.device(f"/job:{job}/task:0"):
        y = x + 300 + y2
with graphdist.connect(path, timeout_s=30) as fleet:
    with fleet.session(job, 0, graph, config=graphdist.no_folding_config()) as sess:
        print(json.dumps({"result": int(sess.run(y))}), flush=True)
"""


def _client(host: Any, cluster_file: str, job: str) -> int:
    result = host.run(
        [sys.executable, "-c", CLIENT, cluster_file, job],
        env={**os.environ, **QUIET_TF},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("{")]
    return int(json.loads(line)["result"])


class Server:
    """One ``argv`` started on ``host``, its stdout and stderr in a log file."""

    def __init__(self, host: Any, argv: Sequence[str], env: Mapping[str, str], log: str) -> None:
        self.host, self.log_path = host, log
        with open(log, "wb") as f:
            self.proc: subprocess.Popen[Any] = host.popen(
                list(argv), stdout=f, stderr=subprocess.STDOUT, env=dict(env)
            )

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def ready_line(self) -> str:
        return next((ln for ln in self.log().splitlines() if "ready at" in ln), "")

    def stop(self, timeout_s: float) -> tuple[int | None, float]:
        """SIGTERM, then the exit status and how long it took (None: killed after
        ``timeout_s``); the process is gone either way."""
        t = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            code = None
            self.proc.kill()
            self.proc.wait(10)
        took = time.monotonic() - t
        with pytest.raises(ProcessLookupError):  # reaped: no such pid left
            os.kill(self.proc.pid, 0)
        assert (
            str(self.proc.pid)
            not in self.host.run(
                ["ip", "netns", "pids", self.host.netns], capture_output=True, text=True
            ).stdout.split()
        )
        return code, took


def _wait_ready(servers: Sequence[Server]) -> float:
    t = time.monotonic()
    while not all(s.ready_line() for s in servers):
        for i, s in enumerate(servers):
            assert s.proc.poll() is None, f"server {i} exited {s.proc.returncode}: {s.log()}"
        assert time.monotonic() - t < READY_S, [s.log()[-2000:] for s in servers]
        time.sleep(0.2)
    return time.monotonic() - t


def _listeners(host: Any, port: int) -> list[str]:
    """Where anything on ``host`` listens on TCP ``port``, as ``ss`` in its namespace reads it:
    an oracle of the tests' own, independent of the server's word. gRPC listens on an IPv6
    socket: an IPv4-mapped address ``[::ffff:A]`` is written as ``A``."""
    out = host.run(["ss", "-Hltn"], capture_output=True, text=True, check=True).stdout
    found = [line.split()[3] for line in out.splitlines() if len(line.split()) > 4]
    found = [re.sub(r"^\[::ffff:([0-9.]+)\]:", r"\1:", a) for a in found]
    return sorted(a for a in found if a.rsplit(":", 1)[1] == str(port))


@contextlib.contextmanager
def _etc_hosts(hosts: Sequence[Any], names: Mapping[str, str]) -> Iterator[None]:
    """``/etc/netns/NS/hosts`` for each of ``hosts``: ``ip netns exec NS`` mounts it over
    ``/etc/hosts``, so the ``names`` (name: address) resolve there; removed on the way out,
    and checked to be gone."""
    made_root = not os.path.exists(NETNS_ETC)
    folders = [os.path.join(NETNS_ETC, h.netns) for h in hosts]
    try:
        for folder in folders:
            os.makedirs(folder)
            with open(os.path.join(folder, "hosts"), "w") as f:
                f.write("127.0.0.1 localhost\n")
                f.writelines(f"{addr} {name}\n" for name, addr in names.items())
        yield
    finally:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        if made_root:
            with contextlib.suppress(OSError):  # another bed may use it meanwhile: kept then
                os.rmdir(NETNS_ETC)
        assert not any(os.path.exists(folder) for folder in folders), folders


def _slurm_serve_argv(job_spec: str, port_base: int) -> list[str]:
    """servers/slurm.sbatch's ``srun`` line without srun, its job spec and port base replaced,
    every other word kept; ``graphdist`` as this interpreter's ``-m graphdist``."""
    with open(os.path.join(SERVERS, "slurm.sbatch")) as f:
        (srun,) = [line for line in f if line.startswith("srun ")]
    argv = shlex.split(srun)
    serve = argv[argv.index("graphdist") :]
    assert serve[1] == "serve", serve
    for flag, value in (("--slurm", job_spec), ("--port-base", str(port_base))):
        assert serve.count(flag) == 1, f"{flag} not once in the sbatch's srun line: {srun}"
        serve[serve.index(flag) + 1] = value
    return [sys.executable, "-m", "graphdist", *serve[1:]]


@pytest.mark.timeout(240)
def test_the_slurm_script_serves_on_two_hosts(hosts: Any, tmp_path: Any) -> None:
    """The sbatch's ``graphdist serve --slurm`` on hosts 1 and 2 as Slurm tasks 0 and 1 of a
    step on node[1-2]: each server takes its task from TensorFlow's SlurmClusterResolver, says
    it is ready at its node's name and listens on that node's address only; a client on host 1
    runs the split graph across both (238); SIGTERM stops both with exit 0."""
    port = random.randint(20000, 40000)  # the namespaces are the test's own: all ports free
    members = hosts[0], hosts[1]
    names = {f"node{i + 1}": h.address for i, h in enumerate(members)}
    argv = _slurm_serve_argv("local=2", port)
    # What srun sets for each task and SlurmClusterResolver reads (PROCID, STEP_NUM_TASKS,
    # STEP_NODELIST, STEP_TASKS_PER_NODE; nothing else of Slurm's); none of ours leaks in.
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    step = {
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": "node[1-2]",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    }
    cluster_file = str(tmp_path / "cluster.json")
    with open(cluster_file, "w") as f:
        json.dump({"local": [f"{h.address}:{port}" for h in members]}, f)
    servers: list[Server] = []
    with _etc_hosts(members, names):
        try:
            for i, host in enumerate(members):
                env = {**base, **step, "SLURM_PROCID": str(i)}
                servers.append(Server(host, argv, env, str(tmp_path / f"slurm-{i}.log")))
            ready_s = _wait_ready(servers)
            for i, (s, host) in enumerate(zip(servers, members, strict=True)):
                line = s.ready_line()
                assert f"/job:local/task:{i} ready at grpc://node{i + 1}:{port}" in line, line
                assert f"listening on {host.address}," in line, line
                assert _listeners(host, port) == [f"{host.address}:{port}"]
            t = time.monotonic()
            assert _client(hosts[0], cluster_file, "local") == 238
            client_s = time.monotonic() - t
        finally:
            stopped = [s.stop(15.0) for s in servers]
    assert [code for code, _ in stopped] == [0, 0], [s.log()[-2000:] for s in servers]
    print(
        f"slurm: ready {ready_s:.1f} s, client {client_s:.1f} s, "
        f"stop {', '.join(f'{took:.2f}' for _, took in stopped)} s"
    )


def _unit() -> configparser.SectionProxy:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment, method-assign]
    unit.read(os.path.join(SERVERS, "graphdist-server@.service"))
    return unit["Service"]


def _environment_file(path: str) -> dict[str, str]:
    """KEY=VALUE lines, as systemd reads an EnvironmentFile (comments and blanks skipped)."""
    env = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith(("#", ";")):
                key, _, value = line.partition("=")
                env[key.strip()] = value.strip()
    return env


def _specifiers(text: str, instance: str, cache: str) -> str:
    """systemd's specifiers of ``text`` that the unit uses: %i the instance, %C the cache root
    (/var/cache for a system unit; ``cache`` here), %% a percent sign."""
    known = {"i": instance, "C": cache, "%": "%"}
    return re.sub(r"%(.)", lambda m: known[m.group(1)], text)


def _service_run(
    service: configparser.SectionProxy, instance: str, etc: str, cache: str
) -> tuple[list[str], dict[str, str]]:
    """The unit's ExecStart for ``instance`` as systemd would run it, and its environment, with
    /etc/graphdist/ moved to ``etc`` and the cache root to ``cache``. The environment is
    systemd's clean one: its PATH, the Environment= assignments and the EnvironmentFile's
    variables. In ExecStart, ${VAR} is VAR's value (one word each) and ``/usr/bin/env
    graphdist`` the venv's entry point; every other word is kept."""
    env_file = _specifiers(service["EnvironmentFile"], instance, cache)
    assert env_file.startswith("/etc/graphdist/"), env_file
    env = {"PATH": SYSTEMD_PATH}
    for assignment in shlex.split(_specifiers(service.get("Environment", ""), instance, cache)):
        key, _, value = assignment.partition("=")
        env[key] = value
    env.update(_environment_file(env_file.replace("/etc/graphdist/", etc, 1)))
    argv = shlex.split(_specifiers(service["ExecStart"], instance, cache))
    assert argv[:2] == ["/usr/bin/env", "graphdist"], argv
    argv = [os.path.join(os.path.dirname(sys.executable), "graphdist"), *argv[2:]]
    argv = [re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], word) for word in argv]
    return [word.replace("/etc/graphdist/", etc) for word in argv], env


@pytest.mark.timeout(240)
def test_the_systemd_unit_serves_on_two_hosts(hosts: Any, tmp_path: Any) -> None:
    """The unit's ExecStart for instances worker-0 (host 1) and worker-1 (host 2), with their
    EnvironmentFile and cluster.json in a folder of the test's own instead of /etc/graphdist
    and the unit's cache folder in another: both ready, each having built its bind shim in its
    own CacheDirectory, a client on host 2 runs the split graph (238), and the unit's
    KillSignal stops each with exit 0 within its TimeoutStopSec.

    Not reproduced: ``DynamicUser=yes`` (a user made up at start, whose home is /, and what it
    implies: ProtectSystem=strict, ProtectHome=read-only, PrivateTmp), which needs systemd; the
    servers run as the test's user, root, without HOME (a dynamic user's would be /), and the
    unit's own cache folder is checked to be the one used, so that a unit without it
    (which a dynamic user could not start: no writable home) fails here. ``Restart=`` is
    systemd's too, and not exercised."""
    service = _unit()
    assert service["KillSignal"] == "SIGTERM"
    assert "CacheDirectory" in service, "no cache folder: a dynamic user's home is / (read-only)"
    stop_s = float(service["TimeoutStopSec"].removesuffix("s"))
    port = random.randint(20000, 40000)
    members = hosts[0], hosts[1]
    etc = str(tmp_path / "etc-graphdist") + "/"
    cache = str(tmp_path / "var-cache")  # %C
    os.makedirs(etc)
    cluster = {"worker": [f"{h.address}:{port}" for h in members]}
    with open(os.path.join(etc, "cluster.json"), "w") as f:
        json.dump(cluster, f)
    servers: list[Server] = []
    try:
        for i, host in enumerate(members):
            instance = f"worker-{i}"
            with open(os.path.join(etc, f"{instance}.env"), "w") as f:
                f.write(f"JOB=worker\nTASK={i}\n")
            # made by systemd before the service starts (mode 0755, the service's user's)
            os.makedirs(os.path.join(cache, _specifiers(service["CacheDirectory"], instance, "")))
            argv, env = _service_run(service, instance, etc, cache)
            assert argv[1:] == shlex.split(
                f"serve --cluster {etc}cluster.json --job worker --task {i}"
            ), argv
            assert (env["JOB"], env["TASK"]) == ("worker", str(i))
            servers.append(Server(host, argv, env, str(tmp_path / f"{instance}.log")))
        ready_s = _wait_ready(servers)
        for i, (s, host) in enumerate(zip(servers, members, strict=True)):
            assert f"/job:worker/task:{i} ready at" in s.ready_line(), s.log()
            assert f"listening on {host.address}," in s.ready_line(), s.log()
            assert _listeners(host, port) == [f"{host.address}:{port}"]
            own_cache = os.path.join(
                cache, _specifiers(service["CacheDirectory"], f"worker-{i}", ""), "graphdist"
            )
            assert [n for n in os.listdir(own_cache) if n.startswith("loopback-bind-")], own_cache
        t = time.monotonic()
        assert _client(hosts[1], os.path.join(etc, "cluster.json"), "worker") == 238
        client_s = time.monotonic() - t
    finally:
        stopped = [s.stop(stop_s) for s in servers]
    assert [code for code, _ in stopped] == [0, 0], [s.log()[-2000:] for s in servers]
    print(
        f"systemd: ready {ready_s:.1f} s, client {client_s:.1f} s, "
        f"stop {', '.join(f'{took:.2f}' for _, took in stopped)} s (limit {stop_s:g} s)"
    )
