"""TF_CONFIG: the environment variable that tells each tf.distribute task who it is.

:func:`tf_config` builds a task's TF_CONFIG from any graphdist cluster, with TensorFlow's rules:
task types ``chief``, ``worker``, ``ps`` and ``evaluator`` (plus any other job of the cluster, as
TensorFlow allows); at most one chief; the evaluator is not part of the cluster map.
:func:`parse_tf_config` reads and checks an incoming one (environment, text or mapping), naming
exactly what is wrong.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from graphdist._cluster import Cluster, ClusterLike
from graphdist._exceptions import ClusterSpecError, TFConfigError
from graphdist._spectext import load_json
from graphdist._validate import is_ascii_digits, show

__all__ = ["TFConfig", "cluster_resolver", "parse_tf_config", "tf_config"]

EVALUATOR = "evaluator"
KNOWN_TYPES = ("chief", "worker", "ps", EVALUATOR)


@dataclass(frozen=True)
class TFConfig:
    """A checked TF_CONFIG: the ``cluster`` (evaluator excluded), this task's ``task_type`` and
    ``task_index``, and the optional ``rpc_layer`` and ``environment``."""

    cluster: Cluster
    task_type: str
    task_index: int
    rpc_layer: str | None = None
    environment: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "cluster": self.cluster.as_dict(),
            "task": {"type": self.task_type, "index": self.task_index},
        }
        if self.rpc_layer:
            out["rpc_layer"] = self.rpc_layer
        if self.environment:
            out["environment"] = self.environment
        return out

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=True)

    @property
    def is_chief(self) -> bool:
        """True for the task that writes checkpoints: the chief, or worker 0 without a chief."""
        if "chief" in self.cluster:
            return self.task_type == "chief"
        return self.task_type == "worker" and self.task_index == 0


def _parse_task(value: str) -> tuple[str, int]:
    if not isinstance(value, str):
        raise TFConfigError(f"Task {show(value)} is not TYPE:INDEX (e.g. worker:1)", value)
    kind, sep, index = value.partition(":")
    if sep and is_ascii_digits(index) and len(index) > 10:
        raise TFConfigError(
            f"Task {show(value)} has an index too large for a task (at most 10 digits)", value
        )
    if not sep or not is_ascii_digits(index):
        raise TFConfigError(
            f"Task {show(value)} is not TYPE:INDEX with an index of ASCII digits (e.g. worker:1)",
            value,
        )
    return kind, int(index)


def tf_config(
    cluster: ClusterLike, task_type: str, task_index: int | None = None, *, evaluator: bool = False
) -> TFConfig:
    """The TF_CONFIG of ``task_type:task_index`` (``task_type`` may be ``"worker:1"``).

    Raises :class:`TFConfigError` for an unknown type, an index out of range, or a cluster with
    more than one chief or with an ``evaluator`` job inside the cluster map, and
    :class:`ClusterSpecError` for ``job=N`` text (each call would pick other ports: every task's
    TF_CONFIG must name the same addresses).
    """
    if task_index is None:
        task_type, task_index = _parse_task(task_type)
    checked = _check_cluster(Cluster.parse_addresses(cluster, what="A TF_CONFIG's cluster"))
    _check_task(checked, task_type, task_index)
    return TFConfig(checked, task_type, task_index)


def _check_cluster(cluster: Cluster) -> Cluster:
    if EVALUATOR in cluster:
        raise TFConfigError(
            "The cluster map must not contain the 'evaluator' job; TensorFlow keeps the evaluator "
            "outside the cluster (give it task type 'evaluator' only)",
            EVALUATOR,
        )
    if "chief" in cluster and cluster.num_tasks("chief") != 1:
        raise TFConfigError(
            f"The cluster has {cluster.num_tasks('chief')} chiefs; TensorFlow allows at most one",
            "chief",
        )
    return cluster


def _check_task(cluster: Cluster, task_type: object, task_index: object) -> None:
    if not isinstance(task_type, str) or not task_type:
        raise TFConfigError(f"Task type {show(task_type)} is not a job name", task_type)
    if not isinstance(task_index, int) or isinstance(task_index, bool) or task_index < 0:
        raise TFConfigError(f"Task index {show(task_index)} is not a whole number >= 0", task_index)
    if task_type == EVALUATOR:
        if task_index != 0:
            raise TFConfigError(
                f"There is one evaluator; index {task_index} is invalid", task_index
            )
        return
    if task_type not in cluster:
        known = ", ".join(sorted(set(KNOWN_TYPES) | set(cluster.jobs)))
        raise TFConfigError(
            f"Task type {show(task_type)} is neither a job of the cluster "
            f"({', '.join(cluster.jobs)}) nor 'evaluator'; known types: {known}",
            task_type,
        )
    if task_index not in cluster.task_indices(task_type):
        raise TFConfigError(
            f"Task index {task_index} is out of range for job {task_type!r}, which has "
            f"{cluster.num_tasks(task_type)} task(s)",
            task_index,
        )


def parse_tf_config(source: str | Mapping[str, Any] | None = None) -> TFConfig:
    """Read and check a TF_CONFIG: ``None`` reads the environment variable, a string is JSON
    text, a mapping is taken as is. Raises :class:`TFConfigError` naming what is wrong."""
    if source is None:
        source = os.environ.get("TF_CONFIG")
        if not source:
            raise TFConfigError("TF_CONFIG is not set (or empty) in the environment")
    data = load_json(source, "TF_CONFIG", TFConfigError) if isinstance(source, str) else source
    if not isinstance(data, Mapping):
        raise TFConfigError(f"TF_CONFIG must be a JSON object, not {type(data).__name__}", data)
    unknown = set(data) - {"cluster", "task", "rpc_layer", "environment"}
    if unknown:
        names = ", ".join(sorted(show(k) for k in unknown)[:5])
        raise TFConfigError(f"TF_CONFIG has unknown key(s): {names}", data)
    if "cluster" not in data:
        raise TFConfigError("TF_CONFIG has no 'cluster'", data)
    if "task" not in data:
        raise TFConfigError("TF_CONFIG has no 'task' (e.g. {'type': 'worker', 'index': 0})", data)
    task = data["task"]
    if not isinstance(task, Mapping):
        raise TFConfigError(f"TF_CONFIG 'task' must be an object, not {show(task)}", task)
    if "type" not in task or "index" not in task:
        missing = [k for k in ("type", "index") if k not in task]
        raise TFConfigError(f"TF_CONFIG 'task' lacks {' and '.join(missing)}", task)
    try:
        cluster = Cluster.parse(data["cluster"]) if isinstance(data["cluster"], Mapping) else None
    except TFConfigError:
        raise
    except ClusterSpecError as exc:
        raise TFConfigError(f"TF_CONFIG 'cluster' is invalid: {exc}", data["cluster"]) from None
    if cluster is None:
        raise TFConfigError(f"TF_CONFIG 'cluster' must be an object, not {show(data['cluster'])}")
    _check_cluster(cluster)
    _check_task(cluster, task["type"], task["index"])
    for key in ("rpc_layer", "environment"):
        if key in data and not isinstance(data[key], str):
            raise TFConfigError(f"TF_CONFIG {key!r} must be a string, not {show(data[key])}")
    return TFConfig(
        cluster, task["type"], task["index"], data.get("rpc_layer"), data.get("environment")
    )


def cluster_resolver(config: TFConfig | str | Mapping[str, Any] | None = None) -> Any:
    """A TensorFlow cluster resolver for ``config`` (default: the TF_CONFIG environment
    variable), checked first: a ``SimpleClusterResolver`` with the cluster, task type, index and
    RPC layer that ``TFConfigClusterResolver`` would read. Imports TensorFlow."""
    import tensorflow as tf

    checked = config if isinstance(config, TFConfig) else parse_tf_config(config)
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        checked.cluster.to_cluster_spec(),
        task_type=checked.task_type,
        task_id=checked.task_index,
        rpc_layer=checked.rpc_layer or "grpc",
    )
