"""Training throughput of the seed's CNN under MultiWorkerMirroredStrategy: 1 vs 2 workers.

Both runs go through ``graphdist.run_function`` in this one run, on this machine; each worker
times epochs 2..N of ``model.fit`` (the first epoch includes tracing) and the figure is global
samples per second. On a 2-core machine two workers share the same cores, so the ratio shows
the collective overhead more than any speed-up. README states no figure or target of it.

    python benchmarks/mwms_throughput.py [--epochs 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import io
import os

try:
    from ._common import REPO, add_json_option, write_json
except ImportError:  # run as a script, or imported with benchmarks/ on sys.path
    from _common import REPO, add_json_option, write_json

import graphdist

EXAMPLES = os.path.join(REPO, "examples")


def train(examples_dir: str, epochs: int) -> float:
    import sys
    import time

    sys.path.insert(0, examples_dir)
    import tensorflow as tf
    from _digits import load_digits_28
    from tensorflow import keras

    import graphdist

    strategy = graphdist.strategy_from_environment()
    (x, y), _, _ = load_digits_28()
    batch = graphdist.global_batch_size(64, strategy)
    ds = graphdist.shard(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch), "DATA")
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.layers.Conv2D(32, 3, activation="relu", input_shape=(28, 28, 1)),
                keras.layers.MaxPooling2D(2),
                keras.layers.Flatten(),
                keras.layers.Dense(10, activation="softmax"),
            ]
        )
        model.compile(optimizer="adam", loss="categorical_crossentropy")
    times: list[float] = []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times.append(time.perf_counter() - self.start)

    model.fit(ds, epochs=epochs, callbacks=[Timer()], verbose=0)
    return len(x) * (epochs - 1) / sum(times[1:])


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4, help="epochs, the first untimed (4)")
    add_json_option(parser)
    args = parser.parse_args(argv)
    if args.epochs < 2:
        parser.error(f"--epochs must be at least 2 (the first is not timed), not {args.epochs}")
    figures = {}
    for workers in (1, 2):
        values = graphdist.run_function(
            train, EXAMPLES, args.epochs, workers=workers, timeout_s=600, output=io.StringIO()
        )
        figures[f"{workers} worker(s)"] = min(values.values())  # replicas run in lockstep
    one, two = figures.values()
    print(f"{'workers':<12} {'samples/s':>10}")
    for name, value in figures.items():
        print(f"{name:<12} {value:>10.0f}")
    print(f"2 workers / 1 worker: {two / one:.2f}x on {os.cpu_count()} CPU cores")
    write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()
