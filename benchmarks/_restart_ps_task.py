"""The coordinator of ``restart.py``'s ParameterServerStrategy cases (run by ``graphdist run
--chief --ps 1 --workers 2``, on the chief; the ps and worker tasks are plain graphdist servers):
a small model on seeded data, trained by a custom loop whose steps ``ClusterCoordinator.schedule``
puts on the workers, checkpointed every ``--save-every`` steps with
``graphdist.resume_checkpoint`` (modelled on ``examples/ps_training.py --mode custom``).

It prints ``step G`` once step G has finished (G counts from the start of training, across
restarts: the results are fetched in order), ``resumed at step G`` when it resumes, and at the
end ``executions N`` (how many times a step's body ran, counted by a variable on the ps task
that every step increments: more than the steps scheduled when the coordinator ran a step
again after a worker died) and ``training done``.

    python _restart_ps_task.py --out DIR [--steps 300] [--save-every 25]
"""

import argparse
import contextlib
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # before TensorFlow: Keras 3 cannot fit here

import numpy as np
import tensorflow as tf
from tensorflow import keras
from tensorflow.keras import layers

import graphdist

BATCH = 32
FEATURES = 32


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the checkpoints")
    parser.add_argument("--steps", type=int, default=300, help="training steps in all")
    parser.add_argument("--save-every", type=int, default=25, metavar="STEPS")
    args = parser.parse_args()
    keras.utils.set_random_seed(0)
    strategy = graphdist.strategy_from_environment()

    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, FEATURES)).astype(np.float32)
    y = keras.utils.to_categorical((x @ rng.normal(size=(FEATURES, 10))).argmax(1), 10)

    def dataset_fn(input_context=None):
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(BATCH).prefetch(2)

    with strategy.scope():
        model = keras.Sequential(
            [layers.Dense(64, activation="relu", input_shape=(FEATURES,)), layers.Dense(10)]
        )
        optimizer = keras.optimizers.Adam(0.01)
        optimizer.build(model.trainable_variables)  # its slots exist before a restore
        step_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        executions = tf.Variable(0, dtype=tf.int64, trainable=False, name="executions")
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, step=step_var)
    manager = graphdist.resume_checkpoint(checkpoint, os.path.join(args.out, "checkpoints"))
    start = int(step_var.numpy())
    if start:
        print(f"resumed at step {start}", flush=True)
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    @tf.function
    def step(it):
        def replica_step(x, y):
            executions.assign_add(1)
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(
                    keras.losses.categorical_crossentropy(y, model(x), from_logits=True)
                )
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        x, y = next(it)
        return strategy.run(replica_step, args=(x, y))

    done = start
    while done < args.steps:
        chunk = min(args.save_every - done % args.save_every, args.steps - done)
        results = [coordinator.schedule(step, args=(iterator,)) for _ in range(chunk)]
        for result in results:
            # its loss may be on a worker that died since: the step ran, its value is lost
            # (Unavailable while the worker is down, Aborted once its server was restarted:
            # the new server has no such context, "Perhaps the worker was restarted")
            lost = (tf.errors.UnavailableError, tf.errors.CancelledError, tf.errors.AbortedError)
            with contextlib.suppress(*lost):
                result.fetch()
            done += 1
            print(f"step {done}", flush=True)
        coordinator.join()
        step_var.assign(done)
        manager.save()
    print(f"executions {int(executions.numpy())}", flush=True)
    print("training done", flush=True)


if __name__ == "__main__":
    main()
