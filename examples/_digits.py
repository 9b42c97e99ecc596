"""Real digit images available offline, as 28x28x1 floats in [0, 1] with one-hot labels.

Keras' cached MNIST (``~/.keras/datasets/mnist.npz``) when it is there (a subset, to keep the
examples quick on two cores), otherwise scikit-learn's bundled 8x8 digits scaled up to 28x28.
"""

import os

import numpy as np

MNIST = os.path.expanduser("~/.keras/datasets/mnist.npz")


def _one_hot(labels):
    return np.eye(10, dtype=np.float32)[labels]


def load_digits_28(max_train=4096, max_test=1024, seed=0):
    """``((x_train, y_train), (x_test, y_test), source)``; ``source`` names the data set."""
    if os.path.exists(MNIST):
        with np.load(MNIST) as data:
            x_train, y_train = data["x_train"][:max_train], data["y_train"][:max_train]
            x_test, y_test = data["x_test"][:max_test], data["y_test"][:max_test]
        scale, source = 255.0, "keras mnist"
    else:
        from sklearn.datasets import load_digits

        digits = load_digits()
        # 8x8 -> 32x32 by pixel repetition, then a 2-pixel crop on each side -> 28x28.
        images = np.kron(digits.images, np.ones((4, 4)))[:, 2:30, 2:30]
        order = np.random.default_rng(seed).permutation(len(images))
        images, labels = images[order], digits.target[order]
        split = int(len(images) * 0.8)
        x_train, y_train = images[:split], labels[:split]
        x_test, y_test = images[split:], labels[split:]
        scale, source = 16.0, "scikit-learn digits"
    prep = lambda x: np.expand_dims(x.astype(np.float32) / scale, -1)  # noqa: E731
    return (prep(x_train), _one_hot(y_train)), (prep(x_test), _one_hot(y_test)), source
