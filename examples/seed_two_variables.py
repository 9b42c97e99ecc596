"""The seed's ``var1``/``var2``: one variable per task, both initialized by one call.

Prints each variable's value and the task whose server holds it (from a traced run).
"""

import tensorflow.compat.v1 as tf
from _seed import run_example

from graphdist import run_traced

tf.disable_eager_execution()


def main(fleet):
    with tf.device(fleet.device("local", 0)):
        var1 = tf.Variable(0.0, name="var1")
    with tf.device(fleet.device("local", 1)):
        var2 = tf.Variable(0.0, name="var2")

    with fleet.session("local", 0) as sess1:
        # (This will initialize both variables)
        sess1.run(tf.global_variables_initializer())
        values, placement = run_traced(sess1, [var1, var2])
    with fleet.session("local", 1) as sess2:
        print("var1 =", values[0], "on", placement.task_of(var1.op.name))
        print("var2 =", values[1], "on", placement.task_of(var2.op.name))
        print("seen from task 1:", [float(v) for v in sess2.run([var1, var2])])


if __name__ == "__main__":
    run_example(__doc__, main)
