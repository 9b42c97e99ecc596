"""A custom training loop under MultiWorkerMirroredStrategy that survives preemption with zero
steps lost: TensorFlow's ``PreemptionCheckpointHandler`` saves at a step every worker agrees on
when one of them gets SIGTERM, and every worker exits with code 42; the next start restores that
checkpoint and goes on from the step after it.

Run it through the launcher, which gives each worker its TF_CONFIG and restarts a preempted
attempt at once (a preemption spends no restart):

    graphdist run --workers 2 -- python examples/preemptible_training.py --out /tmp/pre

On Slurm, ``examples/slurm_preemptible.sbatch`` runs it with ``--requeue``: Slurm's warning
signal (``--signal=B:USR1@60``) makes graphdist send SIGTERM to every task, which saves and
exits 42, and the run goes on in the same allocation; a requeued job (``scontrol requeue``,
a preempting job) starts the script again in the next allocation, from the same checkpoint.

Every worker prints ``step K`` as it finishes step K (from 1); the data of step K depends on K
alone, so a resumed run computes exactly the steps the uninterrupted one would have. At the
end the chief writes its weights to OUT/weights.npz.
"""

import argparse
import os
import time

import numpy as np
import tensorflow as tf

import graphdist

BATCH = 32


def batch_of(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(step)
    x = rng.normal(size=(BATCH, 8)).astype("float32")
    y = (x.sum(axis=1, keepdims=True) > 0).astype("float32")
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the checkpoints and the final weights")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--step-time", type=float, default=0.2, help="seconds a step sleeps")
    args = parser.parse_args()

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        tf.random.set_seed(0)
        dense = tf.keras.layers.Dense(1, kernel_initializer="zeros")
        dense.build((None, 8))
        optimizer = tf.keras.optimizers.SGD(0.1)
    checkpoint = tf.train.Checkpoint(dense=dense, optimizer=optimizer)
    # TensorFlow's PreemptionCheckpointHandler, passed only the first SIGTERM (a second one,
    # which a cluster may send while it saves, kills TensorFlow's)
    handler = graphdist.preemption_handler(
        strategy, checkpoint, os.path.join(args.out, "checkpoints")
    )

    @tf.function
    def train_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        def replica(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.keras.losses.binary_crossentropy(y, dense(x), True))
            grads = tape.gradient(loss, dense.trainable_variables)
            optimizer.apply_gradients(zip(grads, dense.trainable_variables, strict=True))
            return loss

        return strategy.reduce("MEAN", strategy.run(replica, (x, y)), axis=None)

    first = handler.total_run_calls + 1
    for step in range(first, args.steps + 1):
        x, y = batch_of(step)
        loss = handler.run(train_step, x, y)
        print(f"step {step} loss {float(loss):.6f}", flush=True)
        if args.step_time:  # a step of real work takes time: a preemption finds it mid-run
            time.sleep(args.step_time)
    task = strategy.cluster_resolver.task_id
    if strategy.cluster_resolver.task_type in ("chief", None) or task == 0:
        np.savez(os.path.join(args.out, "weights.npz"), *[v.numpy() for v in dense.weights])
    print("training done", flush=True)


if __name__ == "__main__":
    main()
