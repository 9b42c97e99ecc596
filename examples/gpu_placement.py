"""Place ops on ``/job:local/task:1/gpu:0`` and prove from the run metadata that they ran on it.

Each task of the fleet is pinned to its own GPU (round-robin over this machine's GPUs). On a
machine without a GPU, graphdist refuses the placement before TensorFlow sees it, and the example
says so and exits 0.

    python examples/gpu_placement.py
"""

import tensorflow.compat.v1 as tf

import graphdist

tf.disable_eager_execution()


def main():
    print(f"GPUs on this machine: {graphdist.available_gpus() or 'none'}")
    with graphdist.LocalFleet("local=2", gpus="round-robin") as fleet:
        print(f"pinned: {dict((f'{j}:{i}', g) for (j, i), g in fleet.gpus.items())}")
        try:
            gpu = fleet.device("local", 1, gpu=0)
        except graphdist.PlacementError as exc:
            print(f"no GPU placement possible here: {exc}")
            return
        with tf.device(gpu):
            a = tf.random.normal([1024, 1024], seed=1)
            product = tf.matmul(a, a, name="product")
        with tf.device(fleet.device("local", 0, cpu=0)):
            total = tf.reduce_sum(product, name="total")
        with fleet.session("local", 0) as sess:
            _, placement = graphdist.run_traced(sess, total)
        print(placement.table())
        print(f"product ran on {placement['product']}")


if __name__ == "__main__":
    main()
