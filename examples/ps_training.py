"""ParameterServerStrategy on a graphdist cluster: a chief (the coordinator, this script), one ps
task and two workers (plain graphdist servers). Variables live on the ps task.

    graphdist run --chief --ps 1 --workers 2 -- python examples/ps_training.py --mode custom
    graphdist run --chief --ps 1 --workers 2 -- python examples/ps_training.py --mode fit

``custom`` trains with a custom loop whose steps are scheduled on the workers by
``ClusterCoordinator.schedule``; ``fit`` uses tf-keras ``model.fit`` (Keras 3 cannot, see TF_FACTS).
Both print where every variable lives and the held-out accuracy.

With ``--out OUT`` a restarted run (``graphdist run --max-restarts N``: a dead ps task or
coordinator restarts both) resumes instead of starting from zero: ``fit`` from the backup in
OUT/backup taken at the end of every epoch (removed after success), the custom loop from the
checkpoint in OUT/checkpoints taken every ``--save-every`` steps (kept: a rerun resumes at the
end; remove OUT to start over).
"""

import argparse
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np
import tensorflow as tf
from _digits import load_digits_28
from tensorflow import keras

import graphdist

BATCH = 64


def build_model():
    return keras.Sequential(
        [
            keras.layers.Flatten(input_shape=(28, 28, 1)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["custom", "fit"], default="custom")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--out", help="folder to back up to and resume from (default: none)")
    parser.add_argument(
        "--save-every", type=int, default=50, metavar="STEPS",
        help="custom loop: checkpoint every STEPS steps (default 50)",
    )  # fmt: skip
    args = parser.parse_args()

    (x_train, y_train), (x_test, y_test), source = load_digits_28()
    strategy = graphdist.strategy_from_environment()
    print(f"strategy: {type(strategy).__name__}, data: {source}", flush=True)

    def dataset_fn(input_context=None):
        ds = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(2048).repeat()
        return ds.batch(BATCH).prefetch(2)

    with strategy.scope():
        model = build_model()
        optimizer = keras.optimizers.Adam(0.01)

    if args.mode == "custom":
        with strategy.scope():
            optimizer.build(model.trainable_variables)  # its slots exist before a restore
            step_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        manager = None
        if args.out:
            checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, step=step_var)
            manager = graphdist.resume_checkpoint(checkpoint, os.path.join(args.out, "checkpoints"))
        start = int(step_var.numpy())
        coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
        per_worker = coordinator.create_per_worker_dataset(dataset_fn)
        iterator = iter(per_worker)

        @tf.function
        def step(it):
            def replica_step(x, y):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(keras.losses.categorical_crossentropy(y, model(x)))
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
                return loss

            x, y = next(it)
            return strategy.run(replica_step, args=(x, y))

        results = []
        while int(step_var.numpy()) < args.steps:
            chunk = min(args.save_every, args.steps - int(step_var.numpy()))
            results = [coordinator.schedule(step, args=(iterator,)) for _ in range(chunk)]
            coordinator.join()
            step_var.assign_add(chunk)
            if manager is not None:
                manager.save()
            print(f"step {int(step_var.numpy())}/{args.steps} done", flush=True)
        done = f", last loss {float(results[-1].fetch()):.3f}" if results else ""
        since = f" (resumed at step {start})" if start else ""
        print(
            f"custom loop: {args.steps - start} steps scheduled on the workers{since}{done}",
            flush=True,
        )
    else:
        with strategy.scope():
            model.compile(optimizer=optimizer, loss="categorical_crossentropy")

        class Report(keras.callbacks.Callback):
            def on_epoch_end(self, index, logs=None):
                print(f"epoch {index + 1}/3 done", flush=True)

        callbacks = [Report()]
        if args.out:  # the backup first: an epoch reported done is backed up
            callbacks.insert(0, graphdist.backup_and_restore(os.path.join(args.out, "backup")))
        model.fit(
            keras.utils.experimental.DatasetCreator(dataset_fn),
            epochs=3,
            steps_per_epoch=args.steps // 3,
            callbacks=callbacks,
            verbose=0,
        )
        print(f"model.fit: 3 epochs of {args.steps // 3} steps", flush=True)

    for v in model.trainable_variables:
        print(f"variable {v.name} on {v.device}", flush=True)
    accuracy = float(np.mean(model(x_test).numpy().argmax(1) == y_test.argmax(1)))
    print(f"held-out accuracy {accuracy:.3f}", flush=True)


if __name__ == "__main__":
    main()
