"""GPU pinning per server process, checked on a CPU machine by what each process receives."""

from __future__ import annotations

import pytest

import graphdist
from graphdist._proc.gpus import plan_gpus

CLUSTER = graphdist.Cluster({"worker": ["h:1", "h:2", "h:3"]})


def test_round_robin_deals_gpus_in_task_order():
    plan = plan_gpus("round-robin", CLUSTER, gpus=[0, 1])
    assert plan == {("worker", 0): [0], ("worker", 1): [1], ("worker", 2): [0]}
    assert plan_gpus("round-robin", CLUSTER, gpus=[]) == {
        ("worker", 0): [],
        ("worker", 1): [],
        ("worker", 2): [],
    }
    assert plan_gpus(None, CLUSTER) is None


def test_explicit_plan_and_its_errors():
    plan = plan_gpus({"worker:1": [2, 3], ("worker", 2): [0]}, CLUSTER)
    assert plan == {("worker", 0): [], ("worker", 1): [2, 3], ("worker", 2): [0]}
    with pytest.raises(graphdist.ClusterSpecError, match="No task with index 9"):
        plan_gpus({"worker:9": [0]}, CLUSTER)
    with pytest.raises(graphdist.ClusterSpecError, match="'worker'"):
        plan_gpus({"worker": [0]}, CLUSTER)
    with pytest.raises(graphdist.ClusterSpecError, match=">= 0"):
        plan_gpus({"worker:0": [-1]}, CLUSTER)
    with pytest.raises(graphdist.ClusterSpecError, match="round-robin"):
        plan_gpus("spread", CLUSTER)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_each_server_process_receives_its_gpus_and_devices_are_checked(graphdist_fleet_factory):
    plan = {"worker:0": [0], "worker:1": [1, 2], "worker:2": []}
    fleet = graphdist_fleet_factory("worker=3", gpus=plan)
    received = {}
    for task in fleet.tasks:
        line = next(ln for ln in task.log_tail(50) if "CUDA_VISIBLE_DEVICES=" in ln)
        received[task.index] = line.split("CUDA_VISIBLE_DEVICES=")[1].strip()
    assert received == {0: "0", 1: "1,2", 2: ""}
    assert fleet.device("worker", 1, gpu=1) == "/job:worker/replica:0/task:1/device:GPU:1"
    with pytest.raises(graphdist.PlacementError, match="has 2 GPU"):
        fleet.device("worker", 1, gpu=2)
    with pytest.raises(graphdist.PlacementError, match="has 0 GPU"):
        fleet.check("/job:worker/task:2/gpu:0")
