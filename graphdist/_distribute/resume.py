"""Resume after a restart instead of starting from zero: one line in the training script.

``graphdist run --max-restarts N`` starts a failed run again with the same tasks; these helpers
make the script carry on from its last backup:

- :func:`backup_and_restore` for ``model.fit``: a tf-keras ``BackupAndRestore`` callback.
  tf-keras' own callback already restores every task from ``BASE/chief``, lets only the task
  that should checkpoint (the chief, or worker 0 without one; the coordinator under
  ParameterServerStrategy) write there, has every other worker save a throw-away copy in
  ``BASE/workertemp_N`` (deleted right after each save; all must save, the save reads
  variables across workers) and deletes ``BASE/chief`` after a successful ``fit`` (with
  ``delete_checkpoint``). graphdist adds what it does not: ``BASE`` itself is removed after
  success (tf-keras leaves it, with an empty ``workertemp_N`` from each worker), a
  ``save_freq`` tf-keras would silently ignore (every N steps under ParameterServerStrategy,
  where it skips its step hooks: no backup at all) is refused, the resume point is readable
  before ``fit`` (``resume_at``, to build the data a resumed run must see), bad arguments get
  graphdist's errors, and a resume is announced.
- :func:`resume_checkpoint` for custom loops: restores the latest ``tf.train.Checkpoint`` from
  ``BASE`` and returns a ``tf.train.CheckpointManager`` that writes to
  :func:`graphdist.checkpoint_dir` (``BASE`` on the chief, a throw-away folder elsewhere).

Both print one line when they resume, starting with :data:`RESUMED_PREFIX`
(``graphdist: resumed from /x/backup (after epoch 2)``), and nothing when they start fresh; the
launcher's run summary repeats that line for each restart.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
from typing import Any

from graphdist._exceptions import ArgumentError, UnsupportedVersionError
from graphdist._validate import count, show

__all__ = ["RESUMED_PREFIX", "backup_and_restore", "preemption_handler", "resume_checkpoint"]

RESUMED_PREFIX = "graphdist: resumed from "
"""How a resume is announced in the task's output (the launcher's summary looks for it)."""

_SAVED_EPOCH = "ckpt_saved_epoch/.ATTRIBUTES/VARIABLE_VALUE"
_SAVED_BATCH = "ckpt_saved_batch/.ATTRIBUTES/VARIABLE_VALUE"


def _folder(base_dir: object, name: str = "base_dir") -> str:
    if isinstance(base_dir, bytes) or not isinstance(base_dir, str | os.PathLike):
        raise ArgumentError(
            f"{name} must be a folder path (str or os.PathLike), not {show(base_dir)}",
            name=name,
            value=base_dir,
        )
    path = os.fspath(base_dir)
    if not isinstance(path, str) or not path:
        raise ArgumentError(f"{name} must be a non-empty folder path", name=name, value=base_dir)
    return path if "://" in path else os.path.abspath(path)  # gs://... stays as it is


def _check_save_freq(save_freq: object) -> str | int:
    if save_freq == "epoch" and isinstance(save_freq, str):
        return "epoch"
    if isinstance(save_freq, int) and not isinstance(save_freq, bool) and save_freq >= 1:
        return save_freq
    raise ArgumentError(
        f"save_freq must be 'epoch' or a whole number of steps >= 1, not {show(save_freq)}",
        name="save_freq",
        value=save_freq,
    )


def _announce(what: str) -> None:
    print(f"{RESUMED_PREFIX}{what}", file=sys.stdout, flush=True)


def _resume_point(latest: str | None, save_freq: str | int) -> tuple[int, int]:
    """``(epoch, step)`` to continue at, read from the backup ``latest`` (tf-keras' own rule:
    after an epoch-end backup, the next epoch; after a step backup, the next step of its
    epoch, which may be the whole epoch)."""
    if latest is None:
        return (0, 0)
    import tensorflow as tf

    reader = tf.train.load_checkpoint(latest)
    epoch, batch = int(reader.get_tensor(_SAVED_EPOCH)), int(reader.get_tensor(_SAVED_BATCH))
    if isinstance(save_freq, int) and batch >= 0:
        return (max(epoch, 0), batch + 1)
    return (epoch + 1, 0) if epoch >= 0 else (0, 0)


def _describe(point: tuple[int, int]) -> str:
    epoch, step = point
    return f"after step {step} of epoch {epoch + 1}" if step else f"after epoch {epoch}"


def _tf_keras_backup() -> Any:
    """tf-keras' BackupAndRestore, or UnsupportedVersionError when ``tf.keras`` is Keras 3."""
    import tensorflow as tf

    try:
        cls = tf.keras.callbacks.BackupAndRestore
    except ImportError as exc:  # TF_USE_LEGACY_KERAS=1 without tf-keras installed
        cls, why = None, f" ({exc})"
    else:
        why = ""
    if cls is None or not cls.__module__.startswith("tf_keras."):
        raise UnsupportedVersionError(
            "graphdist.backup_and_restore needs tf-keras (Keras 2) as tf.keras"
            f"{why or ' (this is Keras 3)'}: pip install '{tf_keras_requirement()}' and set "
            "TF_USE_LEGACY_KERAS=1 before TensorFlow is imported (`graphdist run` sets it for "
            "its tasks); Keras 3 cannot model.fit under the multi-worker strategies"
        )
    return cls


@functools.cache
def _backup_class() -> Any:
    import tensorflow as tf

    base = _tf_keras_backup()
    files = importlib.import_module("tf_keras.src.distribute.distributed_file_utils")

    class GraphdistBackupAndRestore(base):  # type: ignore[misc,valid-type]
        """tf-keras' BackupAndRestore with graphdist's additions (see
        :func:`graphdist.backup_and_restore`)."""

        def __init__(self, backup_dir: str, save_freq: str | int) -> None:
            super().__init__(backup_dir, save_freq=save_freq, delete_checkpoint=True)
            self._keeper = True
            self._leaf = ""

        @property
        def resume_at(self) -> tuple[int, int]:
            """``(epoch, step)`` a ``fit`` with this callback continues at, read from the
            backup on disk: the 0-based epoch and how many of its steps are done; ``(0, 0)``
            without a backup."""
            return _resume_point(tf.train.latest_checkpoint(self._chief_dir()), self.save_freq)

        def _chief_dir(self) -> str:
            return os.path.join(self.backup_dir, "chief")  # where tf-keras keeps the backup

        def on_train_begin(self, logs: Any = None) -> None:
            strategy = self.model.distribute_strategy
            if self.save_freq != "epoch" and isinstance(
                strategy, tf.distribute.ParameterServerStrategy
            ):
                raise ArgumentError(
                    f"save_freq={self.save_freq} would never back up under "
                    "ParameterServerStrategy (tf-keras skips its step hooks there); use "
                    "save_freq='epoch' with a smaller steps_per_epoch",
                    name="save_freq",
                    value=self.save_freq,
                )
            super().on_train_begin(logs)
            state = self._training_state
            self._keeper = state.write_checkpoint_manager is state.read_checkpoint_manager
            if not self._keeper:  # tf-keras' folder for this task's throw-away copies
                temp = files._get_base_dirpath(strategy)
                self._leaf = os.path.join(self.backup_dir, temp)
            latest = state.read_checkpoint_manager.latest_checkpoint
            if latest is not None:
                point = _resume_point(latest, self.save_freq)
                _announce(f"{self.backup_dir} ({_describe(point)})")

        def on_train_end(self, logs: Any = None) -> None:
            super().on_train_end(logs)  # the keeper deletes BASE/chief
            # Every task tries, after removing its own part: the last one to try finds BASE
            # empty, whatever order the tasks finish in (the others' rmdir fails harmlessly).
            # A folder holding anything else stays.
            for folder in ([] if self._keeper else [self._leaf]) + [self.backup_dir]:
                with contextlib.suppress(OSError):  # not empty, gone, or not a local folder
                    os.rmdir(folder)

    return GraphdistBackupAndRestore


def backup_and_restore(base_dir: str | os.PathLike[str], *, save_freq: str | int = "epoch") -> Any:
    """A tf-keras ``BackupAndRestore`` callback for ``model.fit`` that resumes a restarted run
    from its last backup, in ``base_dir`` (used only for the backup; tf-keras keeps it in
    ``base_dir/chief``).

    ``save_freq``: ``"epoch"`` (default: back up at the end of every epoch) or a whole number
    of steps (every N steps; not under ParameterServerStrategy, where tf-keras backs up only at
    epoch ends: ``fit`` raises :class:`ArgumentError` there). Only the chief (worker 0 without a
    chief; the coordinator under ParameterServerStrategy) writes the backup; every other worker
    saves a throw-away copy (all must save: the save reads variables across workers) that
    tf-keras deletes right after each save. Every task restores from ``base_dir``, which must
    therefore be the same folder for all of them (one machine, or a shared file system).

    When ``fit`` resumes, each task prints one line ``graphdist: resumed from BASE (after epoch
    N)`` (or ``(after step S of epoch N)``); nothing when it starts fresh. After a successful
    ``fit`` (early stopping counts) the backup is deleted (tf-keras' ``delete_checkpoint``) and
    ``base_dir`` with it unless it holds other files, so the next run starts from zero; a
    ``fit`` that raised, or a task that was killed, leaves it for the restart.

    The callback's ``resume_at`` is the ``(epoch, step)`` the next ``fit`` continues at (the
    0-based epoch, and how many of its steps are done), read from the backup before ``fit``: a
    script whose data order depends on the epoch uses it to give a resumed run the batches an
    uninterrupted one would have seen (``fit`` itself only skips the epochs and steps, it does
    not move the data on).

    Raises :class:`ArgumentError` for a ``base_dir`` that is not a path or a bad ``save_freq``,
    and :class:`UnsupportedVersionError` when ``tf.keras`` is Keras 3 (set
    ``TF_USE_LEGACY_KERAS=1`` before TensorFlow is imported; ``graphdist run`` does).
    Imports TensorFlow.
    """
    path = _folder(base_dir)
    freq = _check_save_freq(save_freq)
    return _backup_class()(path, freq)


def resume_checkpoint(
    checkpoint: Any, base_dir: str | os.PathLike[str], *, max_to_keep: int = 2
) -> Any:
    """Restore ``checkpoint`` (a ``tf.train.Checkpoint``) from the latest checkpoint in
    ``base_dir``, if there is one, and return a ``tf.train.CheckpointManager`` for it that
    writes to :func:`graphdist.checkpoint_dir` of ``base_dir``: ``base_dir`` on the chief, a
    throw-away folder (removed at exit) on every other task, which must still call ``save``
    with the others. It keeps the ``max_to_keep`` (default 2) most recent checkpoints.

    Prints one line ``graphdist: resumed from PATH`` (the checkpoint's path prefix) when it
    restores, nothing when ``base_dir`` holds no checkpoint. The restore is TensorFlow's
    deferred one: variables made later (optimizer slots) get their values when created. Unlike
    :func:`backup_and_restore`, the checkpoints stay after the run (they are the model: a
    rerun resumes at the end, with nothing left to train); delete ``base_dir`` to start over.
    Put a step or epoch counter (a ``tf.Variable``) in the checkpoint to know where to go on.

    Raises :class:`ArgumentError` for a ``checkpoint`` that is not a ``tf.train.Checkpoint``,
    a ``base_dir`` that is not a path or a ``max_to_keep`` below 1. Imports TensorFlow.
    """
    path = _folder(base_dir)
    count(max_to_keep, "max_to_keep")
    import tensorflow as tf

    from graphdist._distribute.strategy import checkpoint_dir

    if not isinstance(checkpoint, tf.train.Checkpoint):
        raise ArgumentError(
            f"checkpoint must be a tf.train.Checkpoint, not {type(checkpoint).__name__}: wrap "
            "what to save, e.g. tf.train.Checkpoint(model=model, optimizer=optimizer, step=step)",
            name="checkpoint",
            value=checkpoint,
        )
    latest = tf.train.latest_checkpoint(path)
    if latest is not None:
        checkpoint.restore(latest)
        _announce(latest)
    return tf.train.CheckpointManager(checkpoint, checkpoint_dir(path), max_to_keep=max_to_keep)


def preemption_handler(strategy: Any, checkpoint: Any, base_dir: str | os.PathLike[str]) -> Any:
    """TensorFlow's ``PreemptionCheckpointHandler`` for a custom loop under ``strategy``,
    saving ``checkpoint`` in ``base_dir``, made safe for the signals a cluster sends: on the
    first SIGTERM every worker saves at one step they agree on and exits with code 42 (a
    preemption to ``graphdist run``, restarted at once), and the next start restores that
    checkpoint (``handler.total_run_calls`` steps done). Run each step through
    ``handler.run(step_fn, ...)``.

    What graphdist adds: only the first SIGTERM reaches TensorFlow's handler, and the process
    ignores every later one. A process dies of a second one while it saves or exits (measured:
    two SIGTERMs 0.1 s apart killed both MWMS workers, exit status 143, nothing saved), and
    Slurm's end of a job (``scancel``, a requeue, a preempting job) signals every process of
    every step, while ``srun`` forwards the SIGTERM it gets too. SIGKILL still ends it. Prints
    one line ``graphdist: resumed from BASE (step N)`` when it restores. Imports TensorFlow.
    """
    import signal

    import tensorflow as tf

    path = _folder(base_dir)
    handler = tf.distribute.experimental.PreemptionCheckpointHandler(
        strategy.cluster_resolver, checkpoint, path
    )
    theirs = signal.getsignal(signal.SIGTERM)
    if callable(theirs):
        seen: list[int] = []

        def first_only(signum: int, frame: Any) -> None:
            if not seen:
                seen.append(signum)
                # ignored from now on, by the kernel: a later one may come while the process
                # exits, when Python's handlers are gone
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                theirs(signum, frame)

        signal.signal(signal.SIGTERM, first_only)
    done = int(handler.total_run_calls)
    if done:
        _announce(f"{path} (step {done})")
    return handler


def tf_keras_requirement() -> str:
    """``tf-keras==2.21.*`` for this environment's TensorFlow 2.21 (tf-keras follows
    TensorFlow's minor versions), or plain ``tf-keras`` where TensorFlow's version is unknown.
    graphdist itself is on no package index: ``graphdist[distribute]`` is nothing pip finds."""
    from importlib import metadata

    try:
        major, minor = metadata.version("tensorflow").split(".")[:2]
    except (metadata.PackageNotFoundError, ValueError):
        return "tf-keras"
    return f"tf-keras=={major}.{minor}.*"
