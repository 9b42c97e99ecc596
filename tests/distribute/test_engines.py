"""Issue 53, point 1: an engine is one module of primitives (:mod:`graphdist._engine`), and both a
fleet and a run are built on it. The engine here is defined in the tests
(``tests/engines/subproc.py``), subclasses nothing of graphdist's, and is found through its
``graphdist.engines`` entry point, in fresh processes as a user's install would find it: it runs
the seeds' split graph (238) on a fleet of its own and a run that restarts after a worker was
SIGKILLed, and leaves no process behind."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from graphdist._distribute.events import Event
from tests.conftest import run_python, wait_gone
from tests.engines import subproc

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def engine_env(tmp_path: Path) -> dict[str, str]:
    """An environment whose Python finds the subproc engine by its entry point alone: a
    distribution's metadata (``entry_points.txt``) on the path, naming ``tests.engines.subproc``."""
    site = tmp_path / "site"
    info = site / "graphdist_subproc_engine-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: graphdist-subproc-engine\nVersion: 1.0\n"
    )
    (info / "entry_points.txt").write_text("[graphdist.engines]\nsubproc = tests.engines.subproc\n")
    path = os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path.rstrip(os.pathsep)}


def _events(stdout: str) -> list[Event]:
    """The events of a ``--output-format jsonl`` run's stdout."""
    return [Event.from_json(line) for line in stdout.splitlines() if line.startswith("{")]


def test_the_engine_subclasses_nothing_of_graphdists():
    assert subproc.SubprocEngine.__mro__ == (subproc.SubprocEngine, object)


@pytest.mark.timeout(180)
def test_an_engine_from_an_entry_point_runs_a_fleet_of_the_split_graph(engine_env, tmp_path):
    script = textwrap.dedent(
        """
        import json
        from graphdist._fleet.backends import backend, names
        from graphdist._fleet.command import CommandFleet
        from graphdist._graph.graphs import split_graph
        from graphdist._graph.trace import no_folding_config, run_traced

        Fleet = backend("subproc")
        assert "subproc" in names() and issubclass(Fleet, CommandFleet), (names(), Fleet)
        with Fleet("local=2", node="box") as fleet:
            graph, y = split_graph(fleet.device("local", 0), fleet.device("local", 1))
            with fleet.session("local", 0, graph=graph, config=no_folding_config()) as sess:
                result, placement = run_traced(sess, y)
            print(json.dumps({
                "result": int(result),
                "devices": sorted(set(placement.values())),
                "pids": [t.pid for t in fleet.tasks],
                "nodes": [t.node for t in fleet.tasks],
                "repr": repr(fleet),
            }))
        """
    )
    done = run_python(["-c", script], env=engine_env, timeout=150, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["result"] == 238
    assert any("/task:0" in d for d in said["devices"]), said
    assert any("/task:1" in d for d in said["devices"]), said
    assert said["nodes"] == ["box", "box"] and "subproc node box" in said["repr"]
    assert wait_gone(said["pids"], 10.0) == []


@pytest.mark.timeout(180)
def test_an_engine_from_an_entry_point_runs_a_run_that_restarts(engine_env, tmp_path):
    """worker-1 SIGKILLs itself in the first attempt: the run restarts once, the cause is
    worker-1 killed by SIGKILL (through the engine's two guards), and the second attempt ends
    with both workers' exit 0."""
    command = (
        "import os, signal\n"
        "print('pid', os.getpid(), flush=True)\n"
        "first = os.environ['GRAPHDIST_RESTART'] == '0'\n"
        "if first and os.environ['GRAPHDIST_TASK'] == 'worker-1':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    argv = [
        "-m", "graphdist", "run", "--backend", "subproc", "--node", "box",
        "--ntasks-per-node", "2", "--preload", "none", "--max-restarts", "1",
        "--output-format", "jsonl", "--", sys.executable, "-c", command,
    ]  # fmt: skip
    done = run_python(argv, env=engine_env, timeout=150, cwd=str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    events = _events(done.stdout)
    started = [e.payload for e in events if e.kind == "attempt-started"]
    assert [s.backend for s in started] == ["subproc", "subproc"]
    assert all(set(s.nodes.values()) == {"box"} for s in started), started
    restarting = [e.payload for e in events if e.kind == "restarting"]
    assert len(restarting) == 1
    cause = restarting[0].cause
    assert (cause.task, cause.exitcode) == ("worker-1", -9), cause
    assert "killed by SIGKILL" in cause.how, cause
    lines = [
        (e.attempt, e.task, int(e.data["text"].split()[1])) for e in events if e.kind == "line"
    ]
    first, second = sorted({e.attempt for e in events if e.kind == "attempt-started"})
    # worker-1's line of the first attempt (it prints, then dies) and both of the second; worker-0
    # may print none in the first: that attempt is stopped as soon as worker-1 is dead
    said = {(a, t) for a, t, _ in lines}
    assert said >= {(first, "worker-1"), (second, "worker-0"), (second, "worker-1")}, lines
    assert wait_gone([pid for _, _, pid in lines], 10.0) == []


def test_an_engines_own_option_is_checked_before_anything_starts(engine_env, tmp_path):
    argv = ["-m", "graphdist", "run", "--backend", "subproc", "--node", "a b"]
    done = run_python(
        [*argv, "--", sys.executable, "-c", "pass"], env=engine_env, timeout=60, cwd=str(tmp_path)
    )
    assert done.returncode == 2 and "node must be a word, not 'a b'" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.timeout(240)
def test_a_parameter_server_run_on_an_engine_serves_its_servers_as_the_engines_fleet(
    engine_env, tmp_path
):
    """A ps run's worker and ps tasks are the engine's fleet (``graphdist serve`` steps through
    its primitives), started for each attempt: the chief reaches both servers' ports in each,
    SIGKILLs itself in the first, and after the run no port of either attempt is listening."""
    command = (
        "import json, os, signal, socket\n"
        "cluster = json.loads(os.environ['TF_CONFIG'])['cluster']\n"
        "for job in ('worker', 'ps'):\n"
        "    host, port = cluster[job][0].rsplit(':', 1)\n"
        "    socket.create_connection((host, int(port)), timeout=5).close()\n"
        "print('reached', flush=True)\n"
        "if os.environ['GRAPHDIST_RESTART'] == '0':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    argv = [
        "-m", "graphdist", "run", "--backend", "subproc", "--workers", "1",
        "--ps", "1", "--chief", "--ntasks-per-node", "3", "--preload", "none",
        "--max-restarts", "1", "--output-format", "jsonl", "--", sys.executable, "-c", command,
    ]  # fmt: skip
    done = run_python(argv, env=engine_env, timeout=200, cwd=str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    events = _events(done.stdout)
    started = [e.payload for e in events if e.kind == "attempt-started"]
    assert [(s.tasks, sorted(s.servers)) for s in started] == [
        (["chief-0"], ["ps-0", "worker-0"]),
        (["chief-0"], ["ps-0", "worker-0"]),
    ]
    assert [e.data["text"] for e in events if e.kind == "line"] == ["reached", "reached"]
    cause = next(e.payload for e in events if e.kind == "restarting").cause
    assert (cause.task, cause.exitcode) == ("chief-0", -9), cause
    for s in started:
        for address in (s.cluster["worker"][0], s.cluster["ps"][0]):
            host, port = address.rsplit(":", 1)
            with pytest.raises(OSError):
                socket.create_connection((host, int(port)), timeout=2).close()


ATTACHED = """
import sys
import graphdist
from graphdist._graph.graphs import split_graph

fleet = graphdist.attach(sys.argv[1])
graph, y = split_graph(fleet.device("local", 0), fleet.device("local", 1))
with fleet.session("local", 0, graph=graph) as sess:
    print(sess.run(y))
fleet.detach()
"""


@pytest.mark.timeout(240)
def test_an_engine_from_an_entry_point_serves_a_detached_fleet_its_supervisor_finds(
    engine_env, tmp_path
):
    """``graphdist up --backend subproc --detach``: the supervisor, another process, finds the
    engine by its entry point too; a client attached to the fleet runs the split graph (238),
    and ``down`` leaves neither the supervisor nor a server, nor the state folder."""
    state = str(tmp_path / "state")

    def gd(*args: str) -> subprocess.CompletedProcess[str]:
        return run_python(
            ["-m", "graphdist", *args], env=engine_env, timeout=180, cwd=str(tmp_path)
        )

    pids: list[int] = []
    try:
        up = gd(
            "up", "--backend", "subproc", "--node", "box", "--cluster", "local=2", "--detach",
            "--json", "--state-dir", state,
        )  # fmt: skip
        assert up.returncode == 0, up.stderr
        rows = json.loads(up.stdout)
        assert [(r["job"], r["task"], r["alive"]) for r in rows] == [
            ("local", 0, True),
            ("local", 1, True),
        ], rows
        record = json.loads(Path(state, "fleet.json").read_text())
        pids = [record["supervisor"]["pid"], *(t["pid"] for t in record["tasks"])]
        client = run_python(["-c", ATTACHED, state], env=engine_env, timeout=120, cwd=str(tmp_path))
        assert client.stdout.split() == ["238"], client.stderr[-2000:]
    finally:
        down = gd("down", "--state-dir", state)
    assert down.returncode == 0, down.stderr
    assert len(pids) == 3 and wait_gone(pids, 30.0) == []
    assert not os.path.exists(state)
