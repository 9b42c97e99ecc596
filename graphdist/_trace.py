"""Placement evidence: which device really executed each node of a run.

``op.device`` only says what was *requested*. A traced run (``FULL_TRACE`` with partition graphs)
returns ``RunMetadata`` whose step stats name the device of every executed node. Grappler's
constant folding may collapse a toy graph onto one task, so :func:`no_folding_config` turns it
off when a demo's split must be real (TF_FACTS, "Placement evidence").
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from graphdist._placement import parse_device

if TYPE_CHECKING:
    import tensorflow as tf

__all__ = ["Placement", "no_folding_config", "run_traced"]


def no_folding_config(
    config: tf.compat.v1.ConfigProto | None = None,
) -> tf.compat.v1.ConfigProto:
    """A copy of ``config`` with Grappler's and the graph optimizer's constant folding off."""
    import tensorflow as tf
    from tensorflow.core.protobuf import rewriter_config_pb2

    out = tf.compat.v1.ConfigProto()
    if config is not None:
        out.CopyFrom(config)
    out.graph_options.rewrite_options.constant_folding = rewriter_config_pb2.RewriterConfig.OFF
    out.graph_options.optimizer_options.opt_level = tf.compat.v1.OptimizerOptions.L0
    out.graph_options.optimizer_options.do_constant_folding = False
    return out


@dataclass(frozen=True)
class Placement(Mapping[str, str]):
    """``node name → device`` where each node of the graph actually ran (from step stats).

    ``requested`` maps the same names to ``op.device`` (what the graph asked for).
    """

    executed: Mapping[str, str]
    requested: Mapping[str, str]

    def __getitem__(self, name: str) -> str:
        return self.executed[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.executed)

    def __len__(self) -> int:
        return len(self.executed)

    def task_of(self, name: str) -> str:
        """``job:task`` that executed ``name`` (e.g. ``local:1``)."""
        spec = parse_device(self.executed[name])
        return f"{spec.job}:{spec.task}"

    def table(self) -> str:
        """A plain-text table: op, requested device, executed device."""
        rows = [("op", "requested", "ran on")]
        rows += [(n, self.requested.get(n) or "-", d) for n, d in sorted(self.executed.items())]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        return "\n".join(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in rows
        )


def _device_name(raw: str) -> str:
    """Canonical device of a step-stats entry; GPU stats add parts like ``/stream:all``."""
    keep = [p for p in raw.split("/") if p.split(":")[0] in ("job", "replica", "task", "device")]
    return parse_device("/" + "/".join(keep)).to_string()


def run_traced(
    sess: Any,
    fetches: Any,
    feed_dict: Mapping[Any, Any] | None = None,
) -> tuple[Any, Placement]:
    """Run ``fetches`` with full tracing; return the result and the :class:`Placement` of every
    node of ``sess.graph`` that executed (TensorFlow's own _Send/_Recv nodes are left out)."""
    import tensorflow as tf

    options = tf.compat.v1.RunOptions(
        trace_level=tf.compat.v1.RunOptions.FULL_TRACE, output_partition_graphs=True
    )
    metadata = tf.compat.v1.RunMetadata()
    result = sess.run(fetches, feed_dict=feed_dict, options=options, run_metadata=metadata)
    graph = sess.graph
    names = {op.name for op in graph.get_operations()}
    executed: dict[str, str] = {}
    for dev_stats in metadata.step_stats.dev_stats:
        for node in dev_stats.node_stats:
            if node.node_name in names:
                executed[node.node_name] = _device_name(dev_stats.device)
    requested = {name: graph.get_operation_by_name(name).device for name in executed}
    return result, Placement(executed, requested)
