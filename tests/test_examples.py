"""Every example of the legacy seed runs through graphdist and prints the seed's results."""

from __future__ import annotations

import os
import socket

import pytest

from tests.conftest import REPO, run_python, seed_ports_free

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
EXAMPLES = os.path.join(REPO, "examples")
# An example imports TensorFlow twice (itself and its fleet's fork server) and runs real work:
# 10-30 s here, several times that on a loaded machine. The tests claim results, not speed.
EXAMPLE_TIMEOUT_S = 200


def run_example(name: str, *args: str):
    path = os.path.join(EXAMPLES, name)
    result = run_python([path, *args], cwd=EXAMPLES, timeout=EXAMPLE_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines()


def test_unlinked_local_sessions():
    assert run_example("seed_unlinked_sessions.py") == [
        "Value of var (Session 1): 0.0",
        "Value of var (Session 2): 0.0",
        "Increment var in Session 1",
        "Value of var (Session 1): 1.0",
        "Value of var (Session 2): 0.0",
    ]


def test_variable_shared_by_two_sessions_on_two_servers():
    assert run_example("seed_shared_variable.py") == [
        "Value of var (Session 1): 0.0",
        "Value of var (Session 2): 0.0",
        "Increment var in Session 1",
        "Value of var (Session 1): 1.0",
        "Value of var (Session 2): 1.0",
    ]


def test_two_variables_on_two_tasks_initialized_by_one_call():
    assert run_example("seed_two_variables.py") == [
        "var1 = 0.0 on local-0",
        "var2 = 0.0 on local-1",
        "seen from task 1: [0.0, 0.0]",
    ]


def test_split_graph_prints_238_locally_and_split():
    lines = run_example("seed_split_graph.py")
    assert lines[:2] == ["local result: 238", "split result: 238"]
    table = {ln.split()[0]: ln.split()[-1] for ln in lines[3:]}
    assert table["sub"].startswith("/job:local/replica:0/task:0")
    assert table["add"].startswith("/job:local/replica:0/task:1")


@pytest.mark.xdist_group("seed_ports")  # one at a time: they all listen on 2020
def test_seed_ports_work_when_free_and_fail_clearly_when_taken():
    if not seed_ports_free():
        pytest.skip("ports 2020/2021 are taken on this machine")
    lines = run_example("seed_split_graph.py", "--seed-ports")
    assert lines[:2] == ["local result: 238", "split result: 238"]
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # 2020 may be in TIME_WAIT
        holder.bind(("127.0.0.1", 2020))
        holder.listen()
        result = run_python(
            [os.path.join(EXAMPLES, "seed_split_graph.py"), "--seed-ports"], cwd=EXAMPLES
        )
    assert result.returncode == 2
    assert "Error: Port 2020" in result.stderr and "already in use" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("mode", [[], ["--ref"]], ids=["resource", "ref"])
def test_two_client_processes_share_a_variable(mode):
    out = run_example("shared_variable_clients.py", *mode)
    lines = [ln for ln in out if ln.startswith("client")]
    assert lines == [
        "client 1: initialized ['counter'], incremented counter to 1.0",
        "client 2: read counter = 1.0 without initializing",
    ]


def test_matrix_products_split_over_four_tasks_match_local():
    lines = run_example("split_matmul.py")
    assert lines[-1] == "match within a relative tolerance of 1e-05"
    assert "tasks used: worker-0, worker-1, worker-2, worker-3" in lines


def test_between_graph_replication_learns_the_known_weights():
    lines = run_example("between_graph_replication.py")
    assert lines[-1] == "w = 3.000 (true 3.0), b = 2.000 (true 2.0)"
    assert sum(ln.startswith("worker ") and " done" in ln for ln in lines) == 2


def test_gpu_placement_example_runs_or_explains_why_not():
    lines = run_example("gpu_placement.py")
    assert lines[0].startswith("GPUs on this machine:")
    if lines[0].endswith("none"):
        assert any("no GPU placement possible here" in ln and "has 0 GPU" in ln for ln in lines)
    else:
        assert lines[-1].endswith("/device:GPU:0") and "task:1" in lines[-1]
