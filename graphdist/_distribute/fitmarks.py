"""What ``model.fit``'s steps tell of their waits under MultiWorkerMirroredStrategy, for
:func:`graphdist.progress` (:mod:`graphdist._distribute.progress`), and :func:`ready_time`, the
same mark for a custom loop's :func:`graphdist.step`. Imported only where TensorFlow is."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

__all__ = ["CLOCK_SLACK_S", "FitMarks", "ready_time"]

#: Seconds a fit step's marks (``tf.timestamp()``) may read before its batch's begin hook
#: (``time.time()``): one clock, so only its rounding.
CLOCK_SLACK_S = 0.005


def ready_time(gradients: Any) -> Any:
    """A ``tf.timestamp()`` taken once every gradient in ``gradients`` (a structure of tensors,
    IndexedSlices or None) is computed, for :func:`graphdist.step`'s ``ready``: call it in the step
    function, before the gradients are all-reduced. It depends on their values (one element of
    each, brought to this host's CPU), not only on their ops, so that on a GPU the kernels'
    run counts, not their launch."""
    import tensorflow as tf

    firsts = []
    for grad in tf.nest.flatten(gradients):
        if grad is not None:
            values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
            firsts.append(tf.cast(tf.reshape(values, [-1])[:1], tf.float64))
    probe = [tf.reduce_sum(tf.concat(firsts, 0))] if firsts else []  # on the gradients' device
    with tf.device("CPU:0"):
        copied = [tf.identity(p) for p in probe]  # one copy to the host
    with tf.device("CPU:0"), tf.control_dependencies(copied):
        return tf.timestamp()


class FitMarks:
    """Under MultiWorkerMirroredStrategy, what ``fit``'s steps tell of their waits: two
    variables of this worker's own (one copy a worker, never reduced), set in each step when it
    had its batch (after the distributed iterator's own all-reduce, which agrees whether every
    worker has data) and when it had its gradients (:func:`ready_time`, before their
    all-reduce in the tf-keras optimizer's ``aggregate_gradients``). :meth:`wrap` puts them into
    the model's ``train_step`` and that method for one ``fit`` (traced anew where the step was
    traced without them), :meth:`unwrap` takes them out again. Kept beside the model, never on
    it: as its attribute they would join its weights and its checkpoints."""

    def __init__(self, strategy: Any) -> None:
        import tensorflow as tf

        with strategy.scope():
            self.had_batch, self.had_grads = (
                tf.Variable(
                    0.0,
                    dtype=tf.float64,
                    trainable=False,
                    synchronization=tf.VariableSynchronization.ON_READ,
                    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                    name=name,
                )
                for name in ("graphdist_had_batch", "graphdist_had_grads")
            )
        # the train function traced with the marks (weakly: it holds the model), and how many
        # times it had traced when the last fit ended (a fit without the marks may trace again)
        self.traced: weakref.ref[Any] | None = None
        self.tracings = -1
        self.saved: list[tuple[Any, str, Any]] = []  # what wrap replaced: unwrap puts it back

    @staticmethod
    def of(model: Any) -> FitMarks | None:
        """The model's marks, where they tell a wait: None under another strategy, with an
        optimizer that aggregates otherwise (a legacy one), under XLA (``jit_compile``: no
        timestamp there) or several steps per execution (the batch hooks see only the last)."""
        import tensorflow as tf

        strategy = tf.distribute.get_strategy()
        optimizer = getattr(model, "optimizer", None)
        inner = getattr(optimizer, "inner_optimizer", optimizer)  # mixed precision's is inside
        if (
            not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
            or getattr(inner, "aggregate_gradients", None) is None
            or getattr(model, "jit_compile", False)
            or _steps_per_execution(model) != 1
            or getattr(model, "autotune_steps_per_execution", False)
        ):
            return None
        marks = _MARKS.get(model)
        if marks is None:
            _MARKS[model] = marks = FitMarks(strategy)
        return marks

    def wrap(self, model: Any) -> None:
        import tensorflow as tf

        self.unwrap()  # what a fit that raised left (it never reached its on_train_end)
        inner = getattr(model.optimizer, "inner_optimizer", model.optimizer)
        train_step, aggregate = model.train_step, inner.aggregate_gradients
        had_batch, had_grads = self.had_batch, self.had_grads

        def marked_train_step(data: Any) -> Any:
            if not getattr(model, "jit_compile", False):  # read as it traces
                with tf.control_dependencies(tf.nest.flatten(data, expand_composites=True)):
                    had_batch.assign(tf.timestamp())
            return train_step(data)

        def marked_aggregate(grads_and_vars: Any) -> Any:
            pairs = list(grads_and_vars)
            if not getattr(model, "jit_compile", False):
                had_grads.assign(ready_time([g for g, _ in pairs]))
            return aggregate(pairs)

        for owner, name, wrapper in (
            (model, "train_step", marked_train_step),
            (inner, "aggregate_gradients", marked_aggregate),
        ):
            self.saved.append((owner, name, vars(owner).get(name, _NONE)))
            setattr(owner, name, wrapper)
        function = model.train_function
        if function is not getattr(model, "train_tf_function", None):
            return  # the user's own (fit keeps it): not traced anew, no wait said
        if (
            self.traced is None
            or self.traced() is not function
            or _tracings(function) != self.tracings
        ):
            function = model.train_function = model.make_train_function(force=True)
            self.traced = weakref.ref(function)

    def unwrap(self, model: Any = None) -> None:
        if model is not None:
            self.tracings = _tracings(model.train_function)
        while self.saved:
            owner, name, before = self.saved.pop()
            if before is _NONE:
                with contextlib.suppress(AttributeError):
                    delattr(owner, name)
            else:
                setattr(owner, name, before)

    def wait(self, began: float, ended: float) -> float | None:
        """What a step waited for the other workers: from its start (``began``, the batch's
        begin) to its batch, and from its gradients to its end (``ended``, the batch's end);
        None where the marks are not this step's (a step that aggregates by itself, a step
        traced without them): the marks and the batch's hooks read the same clock."""
        had_batch, had_grads = (
            float(mark.read_value()) for mark in (self.had_batch, self.had_grads)
        )
        if not began - CLOCK_SLACK_S <= had_batch <= had_grads <= ended + CLOCK_SLACK_S:
            return None
        return max(0.0, had_batch - began) + max(0.0, ended - had_grads)


def _tracings(function: Any) -> int:
    """How many times a train function traced (-1: not known)."""
    try:
        return int(function.experimental_get_tracing_count())
    except Exception:  # not a tf.function
        return -1


def _steps_per_execution(model: Any) -> int | None:
    """The model's steps per execution of its train function (1 unless compiled with more);
    None where it cannot be read."""
    steps = getattr(model, "_steps_per_execution", None)
    if steps is None:
        return 1
    try:
        return int(steps.numpy() if hasattr(steps, "numpy") else steps)
    except Exception:  # whatever a strategy's variable raises
        return None


_NONE = object()
#: Each model's marks (:class:`FitMarks`), as long as the model lives.
_MARKS: weakref.WeakKeyDictionary[Any, FitMarks] = weakref.WeakKeyDictionary()
