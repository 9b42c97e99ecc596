"""Ray's memory monitor, read from Ray's own record (graphdist/_fleet/raynodes.py
``ray_out_of_memory``): the error Ray 2.60 raised on every call to an actor its monitor killed
(``ray.exceptions.OutOfMemoryError``, captured from a real kill on this machine: a local Ray
with ``RAY_memory_usage_threshold`` 10 points above the machine's use, an actor allocating 8
GB), said as ``out of memory (Ray's memory monitor ...)`` by a run's task and a RayFleet's
server; any other error of a dead actor says nothing of memory.

Not triggered end to end here: the threshold is a fraction of the whole machine's memory (24
GiB), which the other tests running beside these move by gigabytes, so no kill of a chosen
worker is reliable on it."""

from __future__ import annotations

import pytest

from graphdist._verdicts import ProcessFacts, ended_detail

pytestmark = [pytest.mark.needs("ray", extra="ray")]

# The start and the policy's part of the record, as Ray wrote them (the object store's counts
# and the node's top 10 processes between and after them left out).
CAPTURED = (
    "1 worker(s) were killed due to the node running low on memory. Memory on the node (IP: "
    "192.0.2.2, ID: 7ea9a4648b654c7eca13433373010b1c06bb304f01c64eb0e2efc879) was 6.70GB used"
    " / 23.54GB limit (0.284443)\nOOM kill reason: Memory usage 6335672320B exceeded threshold"
    " of 6310144512B (25.0% of 25276194816B limit)\n"
    "Ray killed 1 worker(s) based on the killing policy\nConsidered workers: [\nSelected to "
    "kill: (Actor(6f29a8dd618e4decb1a7a41e01000000): job ID=01000000, lease ID=000000001ff9d09f"
    "f057ea9d06e06061ba8efb8d6ca337b45ca8e1324ca32e8f, task name=Hog.__init__, required "
    "resources={}, pid=16920, actual memory used=2.96GB, worker ID=6b8936e04918c645cfa824908c"
    "a202fb2d410fdb69f60b4d452683ba)\n]\n"
)
WORDS = (
    "out of memory (Ray's memory monitor killed its worker: node 192.0.2.2 at 6.70GB used / "
    "23.54GB, over its threshold of 25.0%)"
)


def test_rays_out_of_memory_error_is_said_with_its_node_use_and_threshold() -> None:
    import ray.exceptions

    from graphdist._fleet.raynodes import ray_out_of_memory

    assert ray_out_of_memory(ray.exceptions.OutOfMemoryError(CAPTURED)) == WORDS
    # a record worded otherwise (another Ray): still Ray's word, without what it did not say
    bare = ray.exceptions.OutOfMemoryError("killed")
    assert ray_out_of_memory(bare) == "out of memory (Ray's memory monitor killed its worker)"


def test_a_death_ray_does_not_call_out_of_memory_says_nothing_of_memory() -> None:
    import ray.exceptions

    from graphdist._fleet.raynodes import ray_out_of_memory

    assert ray_out_of_memory(ray.exceptions.ActorDiedError()) is None
    assert ray_out_of_memory(RuntimeError(CAPTURED)) is None  # the words alone are no record


def test_a_server_ray_killed_for_memory_is_dead_out_of_memory_with_no_exit_status() -> None:
    """Ray gives no exit status: the words say what Ray said, and no made-up way it ended."""
    assert ended_detail(ProcessFacts(ended=True, oom=WORDS)) == f"ran {WORDS}"
    killed = ProcessFacts(ended=True, exitcode=-9, oom="out of memory (x)")
    assert (
        ended_detail(killed) == "ran out of memory (x) and was killed by SIGKILL (exit status 137)"
    )


def test_a_ping_that_ray_fails_for_memory_marks_the_server_out_of_memory_until_it_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A RayFleet server's ping (Ray's future) failing with Ray's record: dead, and out of
    memory in Ray's words; the restarted actor's answer clears it."""
    from concurrent.futures import Future

    import ray
    import ray.exceptions

    from graphdist._cluster import Cluster
    from graphdist._fleet.ray import RayTask

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    task = RayTask(Cluster({"worker": ["127.0.0.1:1"]}).task("worker", 0), None, "n" * 8, 0, "")
    failed: Future[int] = Future()
    failed.set_exception(ray.exceptions.OutOfMemoryError(CAPTURED))
    task._ping = failed
    assert not task.alive and task.oom == WORDS
    answered: Future[int] = Future()
    answered.set_result(4242)
    task._ping = answered
    assert task.alive and task.pid == 4242 and task.oom is None
