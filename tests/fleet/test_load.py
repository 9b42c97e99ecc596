"""Load: concurrent updates from many clients lose nothing; concurrent runs all return 238."""

from __future__ import annotations

import json
import textwrap
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import tensorflow as tf

import graphdist
from graphdist._graph.graphs import split_graph
from tests.conftest import start_python

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
CLIENTS, THREADS, ADDS = 8, 4, 250
RUNS = 10_000

# A client of this test only runs graphs: it imports TensorFlow without Keras, as servers do
# (graphdist._proc.lean), which halves the eight clients' imports.
CLIENT = textwrap.dedent(
    """
    import sys, threading
    from graphdist._proc import lean
    lean.install()
    import tensorflow.compat.v1 as tf
    import graphdist
    tf.disable_eager_execution()
    cluster = graphdist.Cluster.parse(sys.argv[1])
    master, threads, adds = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    counter = graphdist.shared_variable("load_counter", 0.0, "/job:local/task:0")
    add = counter.assign_add(1.0)
    sess = graphdist.session(cluster.target("local", master), operation_timeout_ms=60000)
    failed = []
    def work():
        try:
            for _ in range(adds):
                sess.run(add)
        except BaseException as exc:  # a thread's error would not end the process: say it
            failed.append(f"{type(exc).__name__}: {exc}")
    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    sess.close()
    if failed:
        sys.exit("a thread's run failed: " + "; ".join(failed))
    print("done", flush=True)
    """
)


def memory_mib(pids):
    """Total (PSS, RSS) in MiB of the server processes."""
    infos = [psutil.Process(p).memory_full_info() for p in pids]
    return sum(i.pss for i in infos) / 2**20, sum(i.rss for i in infos) / 2**20


def test_many_clients_and_threads_lose_no_update(graphdist_fleet_factory):
    fleet = graphdist_fleet_factory("local=2")
    before = memory_mib(fleet.pids)
    graph = tf.Graph()
    with graph.as_default():
        counter = graphdist.shared_variable("load_counter", 0.0, fleet.device("local", 0))
    with fleet.session("local", 0, graph=graph) as sess:
        assert graphdist.initialize_uninitialized(sess) == ["load_counter"]
    cluster = json.dumps(fleet.cluster.as_dict())
    procs = [
        start_python("-c", CLIENT, cluster, str(i % 2), str(THREADS), str(ADDS))
        for i in range(CLIENTS)
    ]
    outputs = [p.communicate(timeout=240) for p in procs]
    failed = {  # each failed client's own words: its threads' errors, its last line
        i: (e.strip().splitlines() or ["(no output)"])[-1]
        for i, (p, (_, e)) in enumerate(zip(procs, outputs, strict=True))
        if p.returncode != 0
    }
    assert not failed, "\n".join(f"client {i}: {line}" for i, line in failed.items())
    with fleet.session("local", 1, graph=graph) as sess:
        assert sess.run(counter) == CLIENTS * THREADS * ADDS == 8000.0
    after = memory_mib(fleet.pids)
    print(
        f"\nserver memory PSS/RSS MiB before {before[0]:.0f}/{before[1]:.0f}, "
        f"after {CLIENTS * THREADS * ADDS} updates {after[0]:.0f}/{after[1]:.0f}"
    )


def test_ten_thousand_concurrent_runs_all_return_238(graphdist_fleet):
    fleet = graphdist_fleet
    before = memory_mib(fleet.pids)
    graph, y = split_graph(fleet.device("local", 0), fleet.device("local", 1))
    sessions = [fleet.session("local", m, graph=graph) for m in (0, 1)]
    try:
        with ThreadPoolExecutor(max_workers=16) as pool:
            results = list(pool.map(lambda i: sessions[i % 2].run(y), range(RUNS)))
    finally:
        for sess in sessions:
            sess.close()
    assert len(results) == RUNS
    assert all(r == 238 for r in results)
    after = memory_mib(fleet.pids)
    print(
        f"\nserver memory PSS/RSS MiB before {before[0]:.0f}/{before[1]:.0f}, "
        f"after {RUNS} runs {after[0]:.0f}/{after[1]:.0f}"
    )
