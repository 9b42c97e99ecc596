"""The seed's split graph: ``x - 66`` on task 0, ``x + 300`` and the sum on task 1: 238.

First the seed's plain local version, then the same graph split over a two-task fleet, run
through the seed's master (``grpc://`` of task 0). Constant folding is switched off so the split
is real, and a traced run shows where each op ran. It prints ``local result: 238``, ``split
result: 238`` and the table of where each op ran.
"""

import tensorflow.compat.v1 as tf
from _seed import run_example

from graphdist import no_folding_config, run_traced

tf.disable_eager_execution()


def main(fleet):
    x = tf.constant(2)
    y1 = x + 300
    y2 = x - 66
    y = y1 + y2
    with tf.Session() as sess:
        result = sess.run(y)
        print(f"local result: {result}")

    tf.reset_default_graph()
    x = tf.constant(2)
    # define the device to use. FORMAT: /job:JOB_NAME/task:TASK_NUMBER
    with tf.device(fleet.device("local", 0)):
        y2 = x - 66
    with tf.device(fleet.device("local", 1)):
        y1 = x + 300
        y = y1 + y2

    # Run session on one of the workers (the seed's grpc://localhost:2020 is task 0)
    with fleet.session("local", 0, config=no_folding_config()) as sess:
        result, placement = run_traced(sess, y)
        print(f"split result: {result}")
    print(placement.table())


if __name__ == "__main__":
    run_example(__doc__, main)
