"""The second seed's training, for real: its CNN under MultiWorkerMirroredStrategy on 2 workers.

Run it through the launcher, which gives every worker its TF_CONFIG:

    graphdist run --workers 2 -- python examples/seed_mwms_training.py --out /tmp/mwms

Each worker prints the seed's lines, trains on real digit images (offline), saves its final
weights to OUT/weights-worker-N.npz and prints its held-out accuracy. Checkpoints go to
OUT/checkpoints on the chief (worker 0) only; a rerun resumes from the last one.
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

BUFFER_SIZE = 10000
BATCH_SIZE_PER_REPLICA = 64


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", required=True, help="folder for weights and checkpoints")
    args = parser.parse_args()
    task = os.environ.get("GRAPHDIST_TASK", "local")
    print(f"task {task} pid {os.getpid()}", flush=True)

    strategy = graphdist.strategy_from_environment()
    print(f"Number of devices: {strategy.num_replicas_in_sync}", flush=True)
    global_batch = graphdist.global_batch_size(BATCH_SIZE_PER_REPLICA, strategy)

    (x_train, y_train), (x_test, y_test), source = load_digits_28()
    print(f"data: {source}, {len(x_train)} training images", flush=True)
    train_dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train))
    train_dataset = train_dataset.shuffle(BUFFER_SIZE, seed=0).batch(global_batch)
    train_dataset = graphdist.shard(train_dataset, "DATA")

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
        epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
    print("Model created and compiled within strategy scope.", flush=True)

    real_dir = os.path.join(args.out, "checkpoints")
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer, epoch=epoch)
    latest = tf.train.latest_checkpoint(real_dir) if os.path.isdir(real_dir) else None
    if latest:
        checkpoint.restore(latest)
        print(f"resuming from epoch {int(epoch.numpy())} ({os.path.basename(latest)})", flush=True)
    else:
        print("starting from scratch", flush=True)
    # Every worker saves (the save is collective); only the chief writes the real folder.
    save_dir = graphdist.checkpoint_dir(real_dir)
    print(f"saving checkpoints to {save_dir}", flush=True)
    manager = tf.train.CheckpointManager(checkpoint, save_dir, max_to_keep=2)

    class SaveEachEpoch(keras.callbacks.Callback):
        def on_epoch_end(self, index, logs=None):
            epoch.assign(index + 1)
            manager.save()
            print(f"epoch {index + 1}/{args.epochs} done, loss {logs['loss']:.4f}", flush=True)

    start = int(epoch.numpy())
    print(f"\nStarting training on {strategy.num_replicas_in_sync} replicas...", flush=True)
    model.fit(
        train_dataset,
        epochs=args.epochs,
        initial_epoch=start,
        callbacks=[SaveEachEpoch()],
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
