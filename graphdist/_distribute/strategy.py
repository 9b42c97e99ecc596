"""tf.distribute helpers: what the seed does by hand, done once and checked.

- :func:`strategy_from_environment`: TF_CONFIG present → MultiWorkerMirroredStrategy (or, on the
  chief of a cluster with ``ps`` tasks, ParameterServerStrategy); absent → MirroredStrategy when
  GPUs are visible, else the default strategy. TF_CONFIG is parsed and checked first, so a
  malformed one fails with a :class:`TFConfigError` instead of a hang.
- :func:`global_batch_size`: per-replica size times replicas in sync.
- :func:`shard`: sets the dataset's auto-shard policy explicitly (``DATA`` by default: datasets
  built from memory cannot be sharded by file).
- :func:`checkpoint_dir`: chief-only checkpoints; other workers get throw-away folders, as
  TensorFlow recommends for multi-worker saving (every worker must save, only one may write).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import Any

from graphdist._distribute.tfconfig import TFConfig, cluster_resolver, parse_tf_config
from graphdist._exceptions import ArgumentError, StrategyError
from graphdist._validate import count

__all__ = ["checkpoint_dir", "global_batch_size", "is_chief", "shard", "strategy_from_environment"]

SHARD_POLICIES = ("AUTO", "DATA", "FILE", "OFF", "HINT")


def _env_config() -> TFConfig | None:
    return parse_tf_config() if os.environ.get("TF_CONFIG") else None


def strategy_from_environment() -> Any:
    """The strategy the environment calls for (see the module docstring). Imports TensorFlow.

    Raises :class:`StrategyError` when a cluster with ps tasks is read on a worker or ps task
    (those run plain servers; only the chief coordinates), and :class:`TFConfigError` for a
    malformed TF_CONFIG.
    """
    import tensorflow as tf

    config = _env_config()
    if config is None:
        if tf.config.list_physical_devices("GPU"):
            return tf.distribute.MirroredStrategy()
        return tf.distribute.get_strategy()
    resolver = cluster_resolver(config)
    if "ps" in config.cluster:
        if config.task_type != "chief":
            raise StrategyError(
                f"TF_CONFIG makes this task {config.task_type}:{config.task_index} of a "
                "parameter-server cluster; only the chief builds the strategy (workers and ps "
                "tasks run servers: `graphdist run --ps N --chief` starts them for you)",
                task=f"{config.task_type}:{config.task_index}",
            )
        return tf.distribute.experimental.ParameterServerStrategy(resolver)
    return tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver)


def global_batch_size(per_replica: int, strategy: Any) -> int:
    """``per_replica`` times the strategy's replicas in sync (the size to ``batch()`` with)."""
    return count(per_replica, "per_replica") * int(strategy.num_replicas_in_sync)


def shard(dataset: Any, policy: str = "DATA") -> Any:
    """``dataset`` with its auto-shard policy set explicitly to ``policy`` (AUTO, DATA, FILE,
    OFF or HINT), instead of TensorFlow's silent AUTO → FILE → DATA fallback."""
    import tensorflow as tf

    if policy.upper() not in SHARD_POLICIES:
        raise ArgumentError(
            f"Shard policy {policy!r} is not one of {', '.join(SHARD_POLICIES)}",
            name="policy",
            value=policy,
        )
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = getattr(
        tf.data.experimental.AutoShardPolicy, policy.upper()
    )
    return dataset.with_options(options)


def is_chief(config: TFConfig | None = None) -> bool:
    """True on the task that writes checkpoints: the chief, or worker 0 when there is no chief,
    or the only process when TF_CONFIG is unset."""
    config = config if config is not None else _env_config()
    return True if config is None else config.is_chief


def checkpoint_dir(base: str | os.PathLike[str], config: TFConfig | None = None) -> str:
    """Where this task should save checkpoints: ``base`` on the chief, a fresh throw-away temporary
    folder on every other task (all tasks must call save, but only one may write the real one),
    removed when the process exits. Restore from ``base`` on every task."""
    base = os.fspath(base)
    if is_chief(config):
        os.makedirs(base, exist_ok=True)
        return base
    path = tempfile.mkdtemp(prefix="graphdist-ckpt-throwaway-")
    atexit.register(shutil.rmtree, path, True)
    return path
