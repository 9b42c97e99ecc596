"""The seed's shared variable: ``var`` lives on task 0; sessions on task 0 and task 1 see one value.

Prints the seed's lines: 0.0 / 0.0, then 1.0 / 1.0 after an increment through session 1.
Run with ``--seed-ports`` to use the seed's localhost:2020/2021.
"""

import tensorflow.compat.v1 as tf
from _seed import run_example

tf.disable_eager_execution()


def main(fleet):
    with tf.device(fleet.device("local", 0)):
        var = tf.Variable(initial_value=0.0, name="var")
    sess1 = fleet.session("local", 0)
    sess2 = fleet.session("local", 1)

    sess1.run(tf.global_variables_initializer())
    sess2.run(tf.global_variables_initializer())

    print("Value of var (Session 1):", sess1.run(var))
    print("Value of var (Session 2):", sess2.run(var))

    sess1.run(var.assign_add(1.0))
    print("Increment var in Session 1")

    print("Value of var (Session 1):", sess1.run(var))
    print("Value of var (Session 2):", sess2.run(var))
    sess1.close()
    sess2.close()


if __name__ == "__main__":
    run_example(__doc__, main)
