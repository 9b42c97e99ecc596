"""The training task of ``soak.py`` (run by ``graphdist run``, one per worker): steps of
``--step-s`` seconds of real work under MultiWorkerMirroredStrategy, each a loop of matrix
products on every worker (TensorFlow's compute threads busy the whole step) ending in an
all-reduce across the workers, until ``--minutes`` have passed. Prints ``step K took S s``.

    python _soak_task.py [--step-s 40] [--minutes 10]
"""

import argparse
import os
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import tensorflow as tf

import graphdist


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-s", type=float, default=40.0)
    parser.add_argument("--minutes", type=float, default=10.0)
    args = parser.parse_args()
    strategy = graphdist.strategy_from_environment()

    @tf.function
    def work():
        start = tf.timestamp()
        x = tf.random.stateless_normal((256, 256), seed=(1, 2))

        def busy(x):
            return [tf.linalg.normalize(tf.matmul(x, x))[0]]

        [x] = tf.while_loop(lambda x: tf.timestamp() - start < args.step_s, busy, [x])
        return tf.reduce_sum(x)

    def step():
        value = strategy.run(work)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)

    step = tf.function(step)
    end = time.monotonic() + args.minutes * 60
    k = 0
    while time.monotonic() < end:
        began = time.monotonic()
        step()
        k += 1
        print(f"step {k} took {time.monotonic() - began:.1f} s", flush=True)
    print("soak done", flush=True)


if __name__ == "__main__":
    main()
