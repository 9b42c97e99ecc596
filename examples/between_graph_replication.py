"""Between-graph replication in the classic tutorials' style: one ps task holds the weights of a
linear model, and two worker *client processes* each build their own graph and update them.

Data follow y = 3x + 2. Each worker runs plain SGD against the shared ``w`` and ``b`` on the ps
task (its own session's master is its own worker task). At the end the weights, read from the
ps, are the known answer.

    python examples/between_graph_replication.py
"""

import argparse
import json
import subprocess
import sys

import graphdist

TRUE_W, TRUE_B = 3.0, 2.0
STEPS = 300


def worker(index, cluster_json):
    import numpy as np
    import tensorflow.compat.v1 as tf

    tf.disable_eager_execution()
    cluster = graphdist.Cluster.parse(cluster_json)
    w = graphdist.shared_variable("w", 0.0, "/job:ps/task:0")
    b = graphdist.shared_variable("b", 0.0, "/job:ps/task:0")
    with tf.device(f"/job:worker/task:{index}"):
        x = tf.placeholder(tf.float32, [None])
        y = tf.placeholder(tf.float32, [None])
        loss = tf.reduce_mean(tf.square(w * x + b - y))
        train = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    rng = np.random.default_rng(index)
    with graphdist.session(cluster.target("worker", index)) as sess:
        graphdist.initialize_uninitialized(sess)
        for _ in range(STEPS):
            xs = rng.uniform(-1, 1, 32).astype(np.float32)
            sess.run(train, {x: xs, y: TRUE_W * xs + TRUE_B})
        print(f"worker {index} done, loss {sess.run(loss, {x: xs, y: TRUE_W * xs + TRUE_B}):.2e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cluster", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.cluster)
        return
    import tensorflow.compat.v1 as tf

    tf.disable_eager_execution()
    with graphdist.LocalFleet("ps=1,worker=2") as fleet:
        cluster_json = json.dumps(fleet.cluster.as_dict())
        argv = [sys.executable, __file__, "--cluster", cluster_json, "--worker"]
        clients = [subprocess.Popen([*argv, str(i)]) for i in range(2)]
        codes = [c.wait(timeout=300) for c in clients]
        if any(codes):
            sys.exit(f"a worker client failed: exit codes {codes}")
        w = graphdist.shared_variable("w", 0.0, "/job:ps/task:0")
        b = graphdist.shared_variable("b", 0.0, "/job:ps/task:0")
        with fleet.session("ps", 0) as sess:
            w_value, b_value = sess.run([w, b])
    print(f"w = {w_value:.3f} (true {TRUE_W}), b = {b_value:.3f} (true {TRUE_B})")


if __name__ == "__main__":
    main()
