"""Ray's memory monitor, read from Ray's own record (graphdist/_ray/nodes.py
``ray_out_of_memory``): the error Ray 2.60 raised on every call to an actor its monitor killed
(``ray.exceptions.OutOfMemoryError``, captured from a real kill on this machine: a local Ray
with ``RAY_memory_usage_threshold`` 10 points above the machine's use, an actor allocating 8
GB), said as ``out of memory (Ray's memory monitor ...)`` by a run's task and a RayFleet's
server; any other error of a dead actor says nothing of memory. An actor that Ray starts again
(a RayFleet's server: ``max_restarts=-1``) raises no such error, only ``ActorUnavailableError``
("The actor was restarted"): its worker's record in Ray's GCS worker table
(``ray_worker_out_of_memory``: exit type ``NODE_OUT_OF_MEMORY``, the same words as detail) is
then Ray's only word, and the restart a session's guard reports says it.

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

    from graphdist._ray.nodes import ray_out_of_memory

    assert ray_out_of_memory(ray.exceptions.OutOfMemoryError(CAPTURED)) == WORDS
    # a record worded otherwise (another Ray): still Ray's word, without what it did not say
    bare = ray.exceptions.OutOfMemoryError("killed")
    assert ray_out_of_memory(bare) == "out of memory (Ray's memory monitor killed its worker)"


def test_a_death_ray_does_not_call_out_of_memory_says_nothing_of_memory() -> None:
    import ray.exceptions

    from graphdist._ray.nodes import ray_out_of_memory

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
    from graphdist._ray.fleet import RayTask

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


NODE = "ba9dc4e422cccad1cffbc062d759e5d45f54d15e47298fc73c786bf0"
# The exit detail of the GCS worker record of a restarting actor's worker that Ray 2.60's monitor
# killed (captured on this machine as above; its call failed with ActorUnavailableError "The
# actor was restarted", no OutOfMemoryError), cut as CAPTURED is; graphdist's own lookup said
# RECORD_WORDS of it against that live Ray.
RECORD = (
    "1 worker(s) were killed due to the node running low on memory. Memory on the node (IP: "
    f"192.0.2.2, ID: {NODE}) was 3.09GB used / 23.54GB limit (0.131100)\nOOM kill reason: "
    "Memory usage 3198136320B exceeded threshold of 3184800512B (12.6% of 25276194816B limit)\n"
    "Ray killed 1 worker(s) based on the killing policy\n"
)
RECORD_WORDS = (
    "out of memory (Ray's memory monitor killed its worker: node 192.0.2.2 at 3.09GB used / "
    "23.54GB, over its threshold of 12.6%)"
)


def _worker(pid: int, node: str, exit_type: str, detail: str = "", end_ms: int = 1) -> bytes:
    """A record of Ray's GCS worker table, as Ray's own message type writes it."""
    from ray.core.generated import common_pb2, gcs_pb2

    record = gcs_pb2.WorkerTableData(
        is_alive=False,
        pid=pid,
        exit_type=common_pb2.WorkerExitType.Value(exit_type),
        exit_detail=detail,
        end_time_ms=end_ms,
    )
    record.worker_address.node_id = bytes.fromhex(node)
    return bytes(record.SerializeToString())


@pytest.fixture
def worker_table(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Ray's GCS worker table as graphdist reads it, with the records a test puts in it."""
    from ray._private.state import state

    table: list[bytes] = []

    class Accessor:
        def get_worker_table(self) -> list[bytes]:
            return table

    monkeypatch.setattr(state, "_connect_and_get_accessor", Accessor)
    return table


def test_rays_record_of_a_worker_its_monitor_killed_is_said_as_its_error_is(worker_table):
    """The worker table's record (exit type NODE_OUT_OF_MEMORY, its detail as Ray's error
    words it): the words of that pid on that node, and of no other pid, node or exit."""
    from graphdist._ray.nodes import ray_worker_out_of_memory

    other = "00" * 28
    worker_table += [
        _worker(16920, NODE, "NODE_OUT_OF_MEMORY", RECORD, end_ms=5),
        _worker(16920, other, "SYSTEM_ERROR", end_ms=9),  # the same pid on another node
        _worker(777, NODE, "SYSTEM_ERROR"),
    ]
    assert ray_worker_out_of_memory(16920, NODE) == RECORD_WORDS
    assert ray_worker_out_of_memory(16920, other) is None
    assert ray_worker_out_of_memory(777, NODE) is None
    assert ray_worker_out_of_memory(4242, NODE) is None  # no record (yet)
    worker_table.append(_worker(16920, NODE, "USER_ERROR", end_ms=7))  # the pid again, later
    assert ray_worker_out_of_memory(16920, NODE) is None
    assert ray_worker_out_of_memory(16920, "not hex") is None


def test_a_server_ray_restarted_after_its_monitor_killed_it_says_so(worker_table, monkeypatch):
    """A RayFleet server's actor is started again by Ray (max_restarts=-1): its calls fail as
    it restarts, with no OutOfMemoryError, so the record is Ray's only word. A session's guard
    then reads the restart with how the old process ended; a restart for another cause says
    nothing of memory."""
    from concurrent.futures import Future

    import ray

    from graphdist._cluster import Cluster
    from graphdist._failures import RESTARTED
    from graphdist._fleet.health import problem_of
    from graphdist._ray.fleet import RayTask

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    task = RayTask(Cluster({"worker": ["127.0.0.1:1"]}).task("worker", 0), None, NODE, 0, "")
    for pid in (100, 200, 300):
        answered: Future[int] = Future()
        answered.set_result(pid)
        task._ping = answered
        assert task.alive and task.pid == pid
    worker_table += [
        _worker(100, NODE, "NODE_OUT_OF_MEMORY", RECORD),
        _worker(200, NODE, "SYSTEM_ERROR"),
    ]
    assert problem_of(task, 100, 0) == (
        RESTARTED,
        f"pid 100 before ran {RECORD_WORDS}, now pid 300",
    )
    assert problem_of(task, 200, 0) == (RESTARTED, "pid 200 before, now pid 300")
    assert task.ended_why(300) is None  # it runs: no record, none kept
