"""Placement evidence: which device really executed each node of a run.

``op.device`` only says what was *requested*. A traced run (``FULL_TRACE`` with partition graphs)
returns ``RunMetadata`` whose step stats name the device of every executed node. Grappler's
constant folding may collapse a toy graph onto one task, so :func:`no_folding_config` turns it
off when a demo's split must be real (TF_FACTS, "Placement evidence").
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from graphdist._exceptions import PictureError
from graphdist._graph.placement import parse_device

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


_PALETTE = ["#8dd3c7", "#fdb462", "#bebada", "#fb8072", "#80b1d3", "#b3de69", "#fccde5", "#d9d9d9"]


@dataclass(frozen=True)
class Placement(Mapping[str, str]):
    """``node name → device`` where each node of the graph actually ran (from step stats).

    ``requested`` maps the same names to ``op.device`` (what the graph asked for); ``metadata`` is
    the run's ``RunMetadata`` and ``graph`` the graph it ran, for the picture and TensorBoard.
    """

    executed: Mapping[str, str]
    requested: Mapping[str, str]
    metadata: Any = field(default=None, compare=False, repr=False)
    graph: Any = field(default=None, compare=False, repr=False)

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

    def tasks(self) -> list[str]:
        """The ``job:task`` names that executed at least one node, sorted."""
        return sorted({self.task_of(n) for n in self.executed})

    def to_dot(self) -> str:
        """Graphviz DOT text of the executed nodes, each filled with its task's colour and
        labelled with name, op type and task; edges follow the graph's data inputs."""
        tasks = self.tasks()
        colour = {t: _PALETTE[i % len(_PALETTE)] for i, t in enumerate(tasks)}
        lines = [
            "digraph placement {",
            '  rankdir="LR";',
            '  node [shape=box, style="rounded,filled"];',
        ]
        for task in tasks:
            lines.append(
                f'  "legend {task}" [label="{task}", fillcolor="{colour[task]}", shape=note];'
            )
        for name in sorted(self.executed):
            task = self.task_of(name)
            kind = self.graph.get_operation_by_name(name).type if self.graph is not None else ""
            label = f"{name}\\n{kind}\\n{task}" if kind else f"{name}\\n{task}"
            lines.append(f'  "{name}" [label="{label}", fillcolor="{colour[task]}"];')
        if self.graph is not None:
            for name in sorted(self.executed):
                for tensor in self.graph.get_operation_by_name(name).inputs:
                    if tensor.op.name in self.executed:
                        lines.append(f'  "{tensor.op.name}" -> "{name}";')
        lines.append("}")
        return "\n".join(lines) + "\n"

    def write_picture(self, path: str | os.PathLike[str]) -> str:
        """Write the placed graph to ``path``: ``.dot`` as text, ``.svg``/``.png``/``.pdf``
        rendered by Graphviz ``dot``. Raises :class:`PictureError` if ``dot`` is needed but
        missing."""
        path = os.fspath(path)
        fmt = os.path.splitext(path)[1].lstrip(".").lower()
        dot_text = self.to_dot()
        if fmt in ("dot", "gv"):
            with open(path, "w", encoding="utf-8") as f:
                f.write(dot_text)
            return path
        if fmt not in ("svg", "png", "pdf"):
            raise PictureError(
                f"Cannot write a picture as {path!r}: use .dot, .svg, .png or .pdf", path
            )
        exe = shutil.which("dot")
        if exe is None:
            raise PictureError(
                f"Graphviz `dot` is not installed, so {path!r} cannot be rendered; install "
                "graphviz (apt-get install graphviz) or write a .dot file",
                path,
            )
        subprocess.run([exe, f"-T{fmt}", "-o", path], input=dot_text.encode(), check=True)
        return path

    def write_tensorboard(self, logdir: str | os.PathLike[str]) -> str:
        """Write the graph and this run's metadata as a TensorBoard log in ``logdir``; the graph
        view's "colour by device" then shows the split. Returns the folder."""
        import tensorflow as tf

        if self.graph is None or self.metadata is None:
            raise PictureError(
                "This placement has no graph or run metadata to write", os.fspath(logdir)
            )
        logdir = os.fspath(logdir)
        with self.graph.as_default():  # FileWriter refuses to run eagerly
            writer = tf.compat.v1.summary.FileWriter(logdir, graph=self.graph)
            try:
                writer.add_run_metadata(self.metadata, "traced_run")
            finally:
                writer.close()
        return logdir


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
    return result, Placement(executed, requested, metadata, graph)
