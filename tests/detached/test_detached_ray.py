"""``graphdist up --detach --backend ray``: the supervisor looks its backend up by name and owns a
RayFleet (on a Ray instance of its own, on loopback only); ``attach`` runs the seeds' split graph
on it, ``status`` shows it, ``down`` stops it and every process of it, Ray's included."""

from __future__ import annotations

import json
import os

import pytest

import graphdist
from graphdist._graph.graphs import split_graph
from tests.conftest import EVENTUALLY_S, read_json, run_python, wait_gone

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(420),
    pytest.mark.needs("ray", extra="ray"),
]


def gd(*args: str, timeout: float = 300) -> object:
    return run_python(["-m", "graphdist", *args], timeout=timeout)


def test_up_detach_with_the_ray_backend_serves_the_split_graph_and_down_stops_all(
    ray_env, state_dir
):
    up = gd(
        "up",
        "--cluster",
        "local=2",
        "--backend",
        "ray",
        "--detach",
        "--json",
        "--state-dir",
        state_dir,
    )
    assert up.returncode == 0, up.stderr
    rows = json.loads(up.stdout)
    assert [(r["job"], r["task"], r["alive"]) for r in rows] == [
        ("local", 0, True),
        ("local", 1, True),
    ]
    record = read_json(os.path.join(state_dir, "fleet.json"))
    pids = [record["supervisor"]["pid"], *(t["pid"] for t in record["tasks"])]
    try:
        assert all(r["address"].startswith("127.0.0.1:") for r in rows)  # Ray on loopback
        with graphdist.attach(state_dir) as fleet:  # leaving it detaches
            graph, y = split_graph(fleet.device("local", 0), fleet.device("local", 1))
            with fleet.session("local", 0, graph=graph) as sess:
                assert sess.run(y) == 238
        status = gd("status", "--json", "--state-dir", state_dir)
        assert status.returncode == 0, status.stderr
        assert [r["alive"] for r in json.loads(status.stdout)] == [True, True]
    finally:
        down = gd("down", "--state-dir", state_dir)
    assert down.returncode == 0, down.stderr
    assert wait_gone(pids, EVENTUALLY_S) == []
    assert not os.path.exists(state_dir)
