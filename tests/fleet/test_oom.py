"""A fleet's server killed by the kernel's OOM killer is `dead` of memory, in every word a user
reads (issue 55, point 3): the session's TaskFailedError and health() say it ran out of memory,
with the limit of its cgroup, not only `killed by SIGKILL`."""

from __future__ import annotations

import os

import pytest

import graphdist
from tests.proc.test_oom import memory_cgroup

pytestmark = [pytest.mark.integration, pytest.mark.promise, pytest.mark.timeout(120)]


def test_a_server_the_oom_killer_ended_is_dead_of_memory_with_its_limit():
    import tensorflow.compat.v1 as tf

    tf.disable_eager_execution()
    with memory_cgroup(200 << 20) as (folder, path), graphdist.LocalFleet("local=2") as fleet:
        server = fleet.task("local", 1)
        with open(os.path.join(folder, "cgroup.procs"), "w") as f:
            f.write(str(server.pid))  # what it allocates from now on counts against 200 MiB
        graph = tf.Graph()
        with graph.as_default(), tf.device(fleet.device("local", 1)):
            big = tf.reduce_sum(tf.random.uniform([400_000_000]))  # 1.6 GB on local-1
        with (
            fleet.session("local", 0, graph) as sess,
            pytest.raises(graphdist.TaskFailedError) as e,
        ):
            sess.run(big)
        text = str(e.value)
        assert e.value.task == "local-1" and e.value.status == "dead", text
        assert (
            f"ran out of memory (the kernel's OOM killer; limit 200 MiB of memory cgroup {path})"
            in text
        )
        assert "killed by SIGKILL (exit status 137)" in text, text
        (row,) = [r for r in fleet.health() if (r.job, r.index) == ("local", 1)]
        assert "out of memory" in row.detail, row
