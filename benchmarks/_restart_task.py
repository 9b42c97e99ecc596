"""The training task of ``restart.py`` (run by ``graphdist run``, one per worker): a small model
under MultiWorkerMirroredStrategy on seeded data, backed up every ``--save-every`` steps with
``graphdist.backup_and_restore``, printing ``step G`` after every training step (G counts from
the start of training, across restarts) and ``resumed at step G`` when it resumes.

    python _restart_task.py --out DIR [--steps 300] [--save-every 25]
"""

import argparse
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # before TensorFlow: Keras 3 cannot fit here

import numpy as np
import tensorflow as tf
from tensorflow import keras
from tensorflow.keras import layers

import graphdist

BATCH_SIZE_PER_REPLICA = 32
FEATURES = 32


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the backup")
    parser.add_argument("--steps", type=int, default=300, help="training steps in all")
    parser.add_argument("--save-every", type=int, default=25, metavar="STEPS")
    args = parser.parse_args()
    keras.utils.set_random_seed(0)
    strategy = graphdist.strategy_from_environment()
    global_batch = graphdist.global_batch_size(BATCH_SIZE_PER_REPLICA, strategy)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.steps * global_batch, FEATURES)).astype(np.float32)
    y = keras.utils.to_categorical((x @ rng.normal(size=(FEATURES, 10))).argmax(1), 10)
    with strategy.scope():
        model = keras.Sequential(
            [layers.Dense(64, activation="relu", input_shape=(FEATURES,)), layers.Dense(10)]
        )
        model.compile(optimizer="adam", loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    backup = graphdist.backup_and_restore(
        os.path.join(args.out, "backup"), save_freq=args.save_every
    )
    _, done = backup.resume_at
    if done:
        print(f"resumed at step {done}", flush=True)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch).skip(done)
    data = graphdist.shard(data, "DATA")

    class Steps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            print(f"step {batch + 1}", flush=True)

    model.fit(data, epochs=1, steps_per_epoch=args.steps, callbacks=[backup, Steps()], verbose=0)
    print("training done", flush=True)


if __name__ == "__main__":
    main()
