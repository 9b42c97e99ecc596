"""`graphdist serve`: one server per process on distinct loopback addresses, and the deploy files
in servers/ that use it."""

from __future__ import annotations

import configparser
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import graphdist
from graphdist._cli.parser import build_parser
from graphdist._graph.graphs import split_graph
from graphdist._ports import pick_free_ports, release_ports
from tests.conftest import QUIET_TF, REPO

SERVERS = os.path.join(REPO, "servers")


def _reachable(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_serve_processes_on_distinct_loopback_addresses_run_the_split_graph():
    ports = pick_free_ports(2)
    release_ports(ports)
    cluster = {"local": [f"127.0.0.2:{ports[0]}", f"127.0.0.3:{ports[1]}"]}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "graphdist",
                "serve",
                "--cluster",
                json.dumps(cluster),
                "--job",
                "local",
                "--task",
                str(i),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={**os.environ, **QUIET_TF},
        )
        for i in range(2)
    ]
    try:
        for i, proc in enumerate(procs):
            assert proc.stderr is not None
            line = ""
            deadline = time.monotonic() + 90
            while "ready at" not in line and time.monotonic() < deadline:
                line = proc.stderr.readline()
                assert line or proc.poll() is None, "serve exited before it was ready"
            assert f"/job:local/task:{i} ready at" in line and f"127.0.0.{i + 2}" in line
        # Each server listens on its own address only.
        assert _reachable("127.0.0.2", ports[0]) and not _reachable("127.0.0.1", ports[0])
        assert _reachable("127.0.0.3", ports[1]) and not _reachable("127.0.0.2", ports[1])
        graph, y = split_graph("/job:local/task:0", "/job:local/task:1")
        for target in (f"grpc://127.0.0.2:{ports[0]}", f"grpc://127.0.0.3:{ports[1]}"):
            with graphdist.session(target, graph=graph) as sess:
                assert sess.run(y) == 238
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        assert [p.wait(30) for p in procs] == [0, 0]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _check_serve_argv(argv: list[str]) -> None:
    assert argv[0] == "graphdist"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "serve"


def test_systemd_unit_runs_a_real_serve_command():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment, method-assign]
    unit.read(os.path.join(SERVERS, "graphdist-server@.service"))
    assert unit["Service"]["EnvironmentFile"] == "/etc/graphdist/%i.env"
    assert unit["Service"]["KillSignal"] == "SIGTERM"
    command = unit["Service"]["ExecStart"].replace("${JOB}", "worker").replace("${TASK}", "1")
    argv = shlex.split(command)
    assert argv[0] == "/usr/bin/env"
    _check_serve_argv(argv[1:])


@pytest.mark.needs("yaml")
def test_kubernetes_manifest_parses_and_matches_its_cluster():
    import yaml

    with open(os.path.join(SERVERS, "kubernetes.yaml")) as f:
        docs = {d["kind"]: d for d in yaml.safe_load_all(f)}
    service, stateful = docs["Service"], docs["StatefulSet"]
    assert service["spec"]["clusterIP"] == "None"  # headless: stable per-pod DNS names
    assert stateful["spec"]["serviceName"] == service["metadata"]["name"]
    cluster = graphdist.Cluster.parse(json.loads(docs["ConfigMap"]["data"]["cluster.json"]))
    replicas = stateful["spec"]["replicas"]
    name = stateful["metadata"]["name"]
    assert cluster.num_tasks("worker") == replicas
    for i in range(replicas):
        assert cluster.address("worker", i).startswith(f"{name}-{i}.{service['metadata']['name']}:")
    container = stateful["spec"]["template"]["spec"]["containers"][0]
    script = container["args"][0].replace('"${HOSTNAME##*-}"', "1")
    argv = shlex.split(script)
    assert argv[0] == "exec"
    _check_serve_argv(argv[1:])
    port = container["ports"][0]["containerPort"]
    assert all(t.port == port for t in cluster)


def test_slurm_script_builds_the_right_cluster_from_slurm_variables(monkeypatch):
    with open(os.path.join(SERVERS, "slurm.sbatch")) as f:
        srun = next(line for line in f if line.startswith("srun "))
    argv = shlex.split(srun)
    serve = argv[argv.index("graphdist") :]
    _check_serve_argv(serve)
    args = build_parser().parse_args(serve[1:])
    counts = graphdist.Cluster.parse_counts(args.slurm)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "3")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "node[01-03]")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "1(x3)")
    from graphdist._proc.serve import slurm_task

    # TensorFlow deals the Slurm tasks to jobs in the order of the job names: ps, then worker.
    expected = {"ps": ["node01:8888"], "worker": ["node02:8888", "node03:8888"]}
    for procid, task in enumerate([("ps", 0), ("worker", 0), ("worker", 1)]):
        monkeypatch.setenv("SLURM_PROCID", str(procid))
        cluster, job, index = slurm_task(counts, port_base=args.port_base)
        assert cluster.as_dict() == expected
        assert (job, index) == task


def test_serve_argument_errors_are_one_line(tmp_path, run_cli):
    for argv, fragment in [
        (["serve", "--job", "local", "--task", "0"], "needs --cluster"),
        (["serve", "--slurm", "worker=2", "--job", "x"], "drop the others"),
        (
            ["serve", "--cluster", '{"local": ["127.0.0.1:1"]}', "--job", "local", "--task", "4"],
            "No task with index 4",
        ),
    ]:
        result = run_cli(*argv)
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("Error: ") and fragment in result.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("extra", [[], ["--bind-all"]])
def test_a_preset_shimmed_marker_never_serves_without_the_shim(extra):
    """issue 38: GRAPHDIST_SERVE_SHIMMED=1 from outside (graphdist's own marker that it has
    re-executed serve with the shim) skipped the shim: with --bind-all the server listened on
    every interface and claimed "let in: none". serve now asks the shim itself, and refuses."""
    (port,) = pick_free_ports(1)
    try:
        cluster = json.dumps({"local": [f"localhost:{port}"]})
        argv = ["serve", "--cluster", cluster, "--job", "local", "--task", "0", *extra]
        result = subprocess.run(
            [sys.executable, "-m", "graphdist", *argv],
            env={**os.environ, **QUIET_TF, "GRAPHDIST_SERVE_SHIMMED": "1"},
            capture_output=True,
            text=True,
            timeout=50,
        )
        assert result.returncode == 2, result.stderr
        (line,) = result.stderr.splitlines()
        assert line.startswith("Error: graphdist's bind shim is not loaded"), line
        with socket.socket() as probe:  # nothing ever listened there
            assert probe.connect_ex(("127.0.0.1", port)) != 0
    finally:
        release_ports([port])


# `serve --tls -` with its gateway's start replaced by a stand-in that is stopped by SIGTERM
# half-way (as a failed SlurmFleet start's SIGTERM finds a step): the received credentials are
# on disk then, and must not stay there.
STOPPED_WHILE_ITS_GATEWAY_STARTS = """
import os, signal, sys, time
from graphdist import Cluster
from graphdist._proc import serve
def stand_in(*args):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)  # the signal ends it first
serve._start_tls_gateway = stand_in
serve.serve(Cluster.parse({"local": ["10.254.0.1:2222"]}), "local", 0, bind_all=False,
            argv=[], allow=None, tls="-")
"""


@pytest.mark.timeout(60)
def test_serve_tls_stopped_before_its_server_runs_leaves_no_received_key(tmp_path):
    import fnmatch

    from graphdist._net.tlscerts import make_credentials
    from graphdist._net.tlsmode import RECEIVED_GLOB

    folders = make_credentials(["10.254.0.1"], str(tmp_path / "creds"))
    own = folders["10.254.0.1"]
    files = {n: (Path(own) / n).read_text() for n in ("ca.pem", "cert.pem", "key.pem")}
    temp = tmp_path / "tmp"
    temp.mkdir()
    result = subprocess.run(
        [sys.executable, "-c", STOPPED_WHILE_ITS_GATEWAY_STARTS],
        input=json.dumps(files), capture_output=True, text=True, timeout=50,
        env={**os.environ, **QUIET_TF, "TMPDIR": str(temp)},
    )  # fmt: skip
    assert result.returncode == 128 + signal.SIGTERM, result.stderr[-2000:]
    assert not fnmatch.filter(os.listdir(temp), RECEIVED_GLOB), os.listdir(temp)
