"""A task that is busy, not frozen: every thread of its TensorFlow compute pool held by a kernel.

TensorFlow's server answers ``WorkerService/GetStatus`` on its compute pool (one thread per
CPU), so a task whose pool threads all sit in long kernels leaves it unanswered for as long as
they run; gRPC itself still answers, and the process runs. :func:`pool_held` makes that state
without burning CPU: a step of a session whose ``WriteFile`` kernels (one more than the CPUs)
each block in ``open()`` of a FIFO that nobody reads, until the test opens it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["pool_held"]


def _cpus() -> int:
    return max(len(os.sched_getaffinity(0)), os.cpu_count() or 1)


@contextlib.contextmanager
def pool_held(fleet: Any, job: str, index: int, folder: str) -> Iterator[dict[str, Any]]:
    """Hold every compute-pool thread of task ``job:index`` of ``fleet`` (a session on the same
    task runs the step) while the body runs; yields the step's box (``error``, ``elapsed`` once
    it ended). On the way out the kernels are let go and the step is joined (it must have
    succeeded: the caller asserts ``"error" not in box``)."""
    import tensorflow as tf

    fifo = os.path.join(folder, "held.fifo")
    os.mkfifo(fifo)
    graph = tf.Graph()
    with graph.as_default():
        path = tf.compat.v1.placeholder(tf.string, [])  # fed: nothing is folded ahead of time
        with tf.device(fleet.device(job, index)):
            writes = [tf.io.write_file(path, "x") for _ in range(_cpus() + 1)]
    box: dict[str, Any] = {}
    sess = fleet.session(job, index, graph=graph)

    def step() -> None:
        start = time.monotonic()
        try:
            sess.run(writes, {path: fifo})
        except BaseException as exc:  # the test reads it from the box
            box["error"] = exc
        box["elapsed"] = time.monotonic() - start

    thread = threading.Thread(target=step, daemon=True, name="pool-held")
    thread.start()
    try:
        time.sleep(1.0)  # every kernel is in open() by now
        assert thread.is_alive(), box
        yield box
    finally:
        # read and write ends both: every open() of the kernels returns, and none sees EOF
        reader = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
        thread.join(30)
        os.close(reader)
        sess.close()
        os.unlink(fifo)
    assert not thread.is_alive(), "the held step did not end once its kernels were let go"
