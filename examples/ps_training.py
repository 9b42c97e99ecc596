"""ParameterServerStrategy on a graphdist cluster: a chief (the coordinator, this script), one ps
task and two workers (plain graphdist servers). Variables live on the ps task.

    graphdist run --chief --ps 1 --workers 2 -- python examples/ps_training.py --mode custom
    graphdist run --chief --ps 1 --workers 2 -- python examples/ps_training.py --mode fit

``custom`` trains with a custom loop whose steps are scheduled on the workers by
``ClusterCoordinator.schedule``; ``fit`` uses tf-keras ``model.fit`` (Keras 3 cannot, see TF_FACTS).
Both print where every variable lives and the held-out accuracy.
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

        results = [coordinator.schedule(step, args=(iterator,)) for _ in range(args.steps)]
        coordinator.join()
        print(
            f"custom loop: {args.steps} steps scheduled on the workers, "
            f"last loss {float(results[-1].fetch()):.3f}",
            flush=True,
        )
    else:
        with strategy.scope():
            model.compile(optimizer=optimizer, loss="categorical_crossentropy")
        model.fit(
            keras.utils.experimental.DatasetCreator(dataset_fn),
            epochs=3,
            steps_per_epoch=args.steps // 3,
            verbose=0,
        )
        print(f"model.fit: 3 epochs of {args.steps // 3} steps", flush=True)

    for v in model.trainable_variables:
        print(f"variable {v.name} on {v.device}", flush=True)
    accuracy = float(np.mean(model(x_test).numpy().argmax(1) == y_test.argmax(1)))
    print(f"held-out accuracy {accuracy:.3f}", flush=True)


if __name__ == "__main__":
    main()
