"""The seeds' graphs, built once here for the demo, the examples, the tests and the benchmarks,
and a blocking step for fault drills."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import tensorflow as tf

__all__ = ["SPLIT_GRAPH_RESULT", "blocking_step", "split_graph"]

SPLIT_GRAPH_RESULT = 238
"""What the seed's split graph returns: (2 + 300) + (2 - 66)."""


def split_graph(
    sub_device: str | None = "/job:local/task:0",
    add_device: str | None = "/job:local/task:1",
    graph: tf.Graph | None = None,
) -> tuple[tf.Graph, Any]:
    """The legacy seed's example: ``x = 2``; ``y2 = x - 66`` on ``sub_device``; ``y1 = x + 300``
    and ``y = y1 + y2`` on ``add_device``. Returns ``(graph, y)``; ``y`` evaluates to 238.

    Ops are named ``x``, ``y2``, ``y1`` and ``y``. ``None`` devices leave placement to TensorFlow.
    """
    import tensorflow as tf

    graph = graph if graph is not None else tf.Graph()
    with graph.as_default():
        x = tf.constant(2, name="x")
        with tf.device(sub_device):
            y2 = tf.subtract(x, 66, name="y2")
        with tf.device(add_device):
            y1 = tf.add(x, 300, name="y1")
            y = tf.add(y1, y2, name="y")
    return graph, y


def blocking_step(block_device: str, out_device: str) -> tuple[tf.Graph, Any, Any]:
    """A step for fault drills: it blocks on ``block_device`` (a dequeue from an empty queue
    there) and sends the item to ``out_device``, so a failure can hit it mid-transfer. Returns
    ``(graph, out, release)``: running ``release`` (from another session) ends the step, and
    ``out`` then evaluates to 42.0."""
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        with tf.device(block_device):
            queue = tf.queue.FIFOQueue(1, tf.float32, shapes=[], shared_name="q", name="q")
            item = queue.dequeue()
        with tf.device(out_device):
            out = item + 1.0
        release = queue.enqueue(41.0)
    return graph, out, release
