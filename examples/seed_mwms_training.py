"""The second seed's training, for real: its CNN under MultiWorkerMirroredStrategy on 2 workers.

Run it through the launcher, which gives every worker its TF_CONFIG:

    graphdist run --workers 2 --max-restarts 2 -- \
        python examples/seed_mwms_training.py --out /tmp/mwms

Each worker prints the seed's lines, trains on real digit images (offline), saves its final
weights to OUT/weights-worker-N.npz and prints its held-out accuracy. Training is backed up to
OUT/backup at the end of every epoch (or every ``--save-every`` steps) by the chief (worker 0)
only; a restarted run (``--max-restarts``, or running it again after a failure) resumes from the
last backup instead of from zero, and the backup is removed once training finished.

The same ``--seed`` gives the same run: the initial weights come from it, and each epoch's data
order is a function of the seed and the epoch alone, so a resumed run sees the batches the
uninterrupted run would have seen and ends with the same weights (on CPU).
"""

import argparse
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # before TensorFlow: Keras 3 cannot fit here

import numpy as np
import tensorflow as tf
from _digits import load_digits_28
from tensorflow import keras
from tensorflow.keras import layers

import graphdist

BATCH_SIZE_PER_REPLICA = 64


def epoch_batches(x, y, global_batch, seed, first_epoch, epochs, skip_steps):
    """Batches of epochs ``first_epoch`` .. ``epochs - 1``, less the first ``skip_steps``.

    Each epoch is a full shuffle of the data (the seed's ``shuffle(BUFFER_SIZE)`` with a buffer
    larger than the data set), but its order depends on the seed and the epoch only, not on how
    many times this process went through the data: a run resumed at epoch 2 gets the order the
    uninterrupted run had in epoch 2 (a reshuffling ``Dataset.shuffle`` would start again at
    its first order in the new process).
    """
    orders = [np.random.default_rng([seed, e]).permutation(len(x)) for e in range(epochs)]
    orders = np.array(orders[first_epoch:], dtype=np.int64).reshape(-1, len(x))  # maybe none
    x, y = tf.constant(x), tf.constant(y)
    ds = tf.data.Dataset.from_tensor_slices(orders)
    ds = ds.flat_map(lambda order: tf.data.Dataset.from_tensor_slices(order).batch(global_batch))
    return ds.skip(skip_steps).map(lambda i: (tf.gather(x, i), tf.gather(y, i)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", required=True, help="folder for weights and the backup")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and data order")
    parser.add_argument(
        "--save-every", type=int, default=None, metavar="STEPS",
        help="back up every STEPS steps (default: at the end of every epoch)",
    )  # fmt: skip
    args = parser.parse_args()
    task = os.environ.get("GRAPHDIST_TASK", "local")
    print(f"task {task} pid {os.getpid()}", flush=True)
    keras.utils.set_random_seed(args.seed)

    strategy = graphdist.strategy_from_environment()
    print(f"Number of devices: {strategy.num_replicas_in_sync}", flush=True)
    global_batch = graphdist.global_batch_size(BATCH_SIZE_PER_REPLICA, strategy)

    (x_train, y_train), (x_test, y_test), source = load_digits_28()
    print(f"data: {source}, {len(x_train)} training images", flush=True)

    with strategy.scope():
        model = keras.Sequential(
            [
                layers.Conv2D(32, kernel_size=(3, 3), activation="relu", input_shape=(28, 28, 1)),
                layers.MaxPooling2D(pool_size=(2, 2)),
                layers.Flatten(),
                layers.Dense(10, activation="softmax"),
            ]
        )
        model.compile(optimizer="adam", loss="categorical_crossentropy", metrics=["accuracy"])
    print("Model created and compiled within strategy scope.", flush=True)

    # Every worker backs up (the save is collective); only the chief keeps the backup.
    backup = graphdist.backup_and_restore(
        os.path.join(args.out, "backup"), save_freq=args.save_every or "epoch"
    )
    start, done_steps = backup.resume_at
    if start or done_steps:
        steps = f" + {done_steps} steps" if done_steps else ""  # epochs and steps done
        print(f"resuming from epoch {start}{steps}", flush=True)
    else:
        print("starting from scratch", flush=True)
    steps_per_epoch = -(-len(x_train) // global_batch)
    train_dataset = epoch_batches(
        x_train, y_train, global_batch, args.seed, start, args.epochs, done_steps
    )
    train_dataset = graphdist.shard(train_dataset, "DATA")

    class Report(keras.callbacks.Callback):
        def on_epoch_end(self, index, logs=None):
            print(f"epoch {index + 1}/{args.epochs} done, loss {logs['loss']:.4f}", flush=True)

    print(f"\nStarting training on {strategy.num_replicas_in_sync} replicas...", flush=True)
    model.fit(
        train_dataset,
        epochs=args.epochs,
        steps_per_epoch=steps_per_epoch,
        # the backup first: an epoch reported done is backed up; graphdist.progress(): each
        # worker's steps, loss and wait to the launcher (nothing outside graphdist run)
        callbacks=[backup, Report(), graphdist.progress()],
        verbose=0,
    )
    print("Training complete.", flush=True)

    predictions = model(x_test, training=False).numpy()
    accuracy = float(np.mean(predictions.argmax(1) == y_test.argmax(1)))
    print(f"held-out accuracy {accuracy:.3f}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    np.savez(os.path.join(args.out, f"weights-{task}.npz"), *model.get_weights())


if __name__ == "__main__":
    main()
