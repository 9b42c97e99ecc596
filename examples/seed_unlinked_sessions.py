"""The seed's first example: two plain sessions are unlinked execution engines.

Each ``tf.Session()`` here is in-process (no server), so incrementing ``var`` in one leaves the
other at 0.0. Prints the seed's lines: 0.0 / 0.0, then 1.0 / 0.0.
"""

import tensorflow.compat.v1 as tf

import graphdist

tf.disable_eager_execution()

var = tf.Variable(initial_value=0.0)

# graphdist.session() is tf.Session with a bounded operation timeout; no target = in-process.
sess1 = graphdist.session()
sess1.run(tf.global_variables_initializer())
sess2 = graphdist.session()
sess2.run(tf.global_variables_initializer())

print("Value of var (Session 1):", sess1.run(var))
print("Value of var (Session 2):", sess2.run(var))

sess1.run(var.assign_add(1.0))
print("Increment var in Session 1")

print("Value of var (Session 1):", sess1.run(var))
print("Value of var (Session 2):", sess2.run(var))
sess1.close()
sess2.close()
