"""A real computation split over 4 tasks by graphdist's automatic plan, checked against one
local session.

The graph sums eight independent products of 384x384 matrices (a tree of adds). ``AutoPlan``
balances the estimated cost of each product over the tasks while keeping transfers low; a traced
run shows which task computed which product, and the result matches the local run within
``RTOL`` (float32 sums in another order differ in their last digits).

    python examples/split_matmul.py
"""

import numpy as np
import tensorflow.compat.v1 as tf

import graphdist

tf.disable_eager_execution()
N, SIZE = 8, 384
RTOL = 1e-5  # relative: the split and the local run add the products in different orders


def build():
    rng = np.random.default_rng(0)
    products = []
    for i in range(N):
        with tf.name_scope(f"product{i}"):
            a = tf.constant(rng.standard_normal((SIZE, SIZE)), dtype=tf.float32, name="a")
            b = tf.constant(rng.standard_normal((SIZE, SIZE)), dtype=tf.float32, name="b")
            products.append(tf.matmul(a, b, name="ab"))
    while len(products) > 1:
        products = [tf.add(products[i], products[i + 1]) for i in range(0, len(products), 2)]
    return tf.reduce_sum(products[0], name="total")


def main():
    local_graph = tf.Graph()
    with local_graph.as_default():
        local_total = build()
    with graphdist.session(graph=local_graph) as sess:
        expected = sess.run(local_total)

    with graphdist.LocalFleet("worker=4") as fleet:
        placed = graphdist.split(build, graphdist.AutoPlan(), fleet.cluster)
        config = graphdist.no_folding_config()
        with fleet.session_for(placed.outputs, graph=placed.graph, config=config) as sess:
            result, placement = graphdist.run_traced(sess, placed.outputs)
    for i in range(N):
        print(f"product{i} ran on {placement.task_of(f'product{i}/ab')}")
    print(f"tasks used: {', '.join(placement.tasks())}")
    print(f"split result {result:.4f}, local result {expected:.4f}")
    close = np.isclose(result, expected, rtol=RTOL)
    print(f"{'match' if close else 'MISMATCH'} within a relative tolerance of {RTOL:g}")


if __name__ == "__main__":
    main()
