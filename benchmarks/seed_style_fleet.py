"""The seed's way of starting a fleet: one ``spawn``ed ``multiprocessing.Process`` per server, each
importing TensorFlow and building its server. Prints READY once every server answers over gRPC,
then (JSON, on the next line) the memory of every process it ran: itself, its spawned servers and
multiprocessing's resource tracker (``_common.tree_memory``).

    python benchmarks/seed_style_fleet.py N
"""

import multiprocessing
import sys
import time

from graphdist import Cluster
from graphdist._net.probe import Prober

DEADLINE_S = 120.0


def create_server(cluster, index):
    import tensorflow.compat.v1 as tf

    server = tf.train.Server(tf.train.ClusterSpec(cluster), job_name="local", task_index=index)
    server.join()


def main(n):
    cluster = Cluster.parse(f"local={n}").as_dict()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=create_server, args=(cluster, i)) for i in range(n)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + DEADLINE_S
    try:
        for address in cluster["local"]:
            with Prober(address) as prober:
                while not prober.probe(0.5):
                    if time.monotonic() > deadline or not all(p.is_alive() for p in procs):
                        sys.exit(f"seed-style fleet of {n} did not come up")
                    time.sleep(0.02)
        print("READY", flush=True)  # the memory is read after it, never counted in the time
        import json

        from _common import tree_memory

        print(json.dumps(tree_memory()), flush=True)
    finally:
        for p in procs:
            p.kill()
            p.join()


if __name__ == "__main__":
    main(int(sys.argv[1]))
