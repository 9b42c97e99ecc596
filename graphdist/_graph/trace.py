"""Placement evidence: which device really executed each node of a run.

``op.device`` only says what was *requested*. A traced run (``FULL_TRACE`` with partition graphs)
returns ``RunMetadata`` whose step stats name the device of every executed node. Grappler's
constant folding may collapse a toy graph onto one task, so :func:`no_folding_config` turns it
off when a demo's split must be real (TF_FACTS, "Placement evidence").
"""

from __future__ import annotations

import html
import os
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from graphdist._exceptions import PictureError
from graphdist._failures import task_name
from graphdist._graph.placement import parse_device

if TYPE_CHECKING:
    import tensorflow as tf

__all__ = ["Placement", "check_log_dir", "check_picture_path", "no_folding_config", "run_traced"]


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
        """The task that executed ``name``, named as graphdist names tasks (``local-1``)."""
        spec = parse_device(self.executed[name])
        return task_name(spec.job or "localhost", spec.task or 0)

    def table(self) -> str:
        """A plain-text table: op, requested device, executed device."""
        rows = [("op", "requested", "ran on")]
        rows += [(n, self.requested.get(n) or "-", d) for n, d in sorted(self.executed.items())]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        return "\n".join(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in rows
        )

    def _repr_html_(self) -> str:
        """Jupyter's view: the table, each row in its task's colour (and a dark text colour, for
        dark themes), and the placed graph as an inline SVG picture (drawn here: no Graphviz
        needed)."""
        tasks = self.tasks()
        colour = {t: _PALETTE[i % len(_PALETTE)] for i, t in enumerate(tasks)}
        rows = "".join(
            f'<tr style="background:{colour[self.task_of(n)]};color:#1a1a1a">'
            f"<td>{html.escape(n)}</td>"
            f"<td>{html.escape(self.requested.get(n) or '-')}</td><td>{html.escape(d)}</td></tr>"
            for n, d in sorted(self.executed.items())
        )
        return (
            "<table><thead><tr><th>op</th><th>requested</th><th>ran on</th></tr></thead>"
            f"<tbody>{rows}</tbody></table>{self.to_svg()}"
        )

    def to_svg(self) -> str:
        """An SVG picture of the executed nodes: one box per node in its task's colour, laid
        out left to right by data dependencies, with a legend of the tasks."""
        tasks = self.tasks()
        colour = {t: _PALETTE[i % len(_PALETTE)] for i, t in enumerate(tasks)}
        inputs: dict[str, list[str]] = {name: [] for name in self.executed}
        if self.graph is not None:
            for name in self.executed:
                op = self.graph.get_operation_by_name(name)
                inputs[name] = [t.op.name for t in op.inputs if t.op.name in self.executed]
        depth: dict[str, int] = {}

        def depth_of(name: str, seen: frozenset[str] = frozenset()) -> int:
            if name not in depth:
                parents = [p for p in inputs[name] if p not in seen]
                depth[name] = 1 + max((depth_of(p, seen | {name}) for p in parents), default=-1)
            return depth[name]

        layers: dict[int, list[str]] = {}
        for name in sorted(self.executed):
            layers.setdefault(depth_of(name), []).append(name)
        box_w, box_h, gap_x, gap_y, top = 150, 44, 50, 16, 34
        where: dict[str, tuple[int, int]] = {}
        for level, names in sorted(layers.items()):
            for row, name in enumerate(names):
                where[name] = (10 + level * (box_w + gap_x), top + row * (box_h + gap_y))
        width = 20 + (max(layers, default=0) + 1) * (box_w + gap_x)
        height = top + max((len(v) for v in layers.values()), default=1) * (box_h + gap_y)
        parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            'font-family="sans-serif" font-size="11">',
            '<defs><marker id="arrow" markerWidth="8" markerHeight="8" refX="8" refY="4" '
            'orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#555"/></marker></defs>',
        ]
        for i, task in enumerate(tasks):
            x = 10 + i * 110
            parts.append(
                f'<rect x="{x}" y="6" width="100" height="18" rx="4" fill="{colour[task]}"/>'
                f'<text x="{x + 50}" y="19" text-anchor="middle" fill="#1a1a1a">'
                f"{html.escape(task)}</text>"
            )
        for name, parents in inputs.items():
            x2, y2 = where[name]
            for parent in parents:
                x1, y1 = where[parent]
                parts.append(
                    f'<line x1="{x1 + box_w}" y1="{y1 + box_h // 2}" x2="{x2}" '
                    f'y2="{y2 + box_h // 2}" stroke="#555" marker-end="url(#arrow)"/>'
                )
        for name, (x, y) in where.items():
            task = self.task_of(name)
            kind = self.graph.get_operation_by_name(name).type if self.graph is not None else ""
            parts.append(
                f'<rect x="{x}" y="{y}" width="{box_w}" height="{box_h}" rx="6" '
                f'fill="{colour[task]}" stroke="#333"/>'
                f'<text x="{x + 6}" y="{y + 16}" fill="#1a1a1a">{html.escape(name[:22])}</text>'
                f'<text x="{x + 6}" y="{y + 32}" fill="#333">{html.escape(kind)} @ '
                f"{html.escape(task)}</text>"
            )
        parts.append("</svg>")
        return "".join(parts)

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
        rendered by Graphviz ``dot``. Raises :class:`PictureError` (one line) for another
        format, a folder that does not exist or cannot be written, ``dot`` needed but missing,
        or a failed write; :func:`check_picture_path` makes the same checks up front."""
        path = check_picture_path(path)
        fmt = _picture_format(path)
        dot_text = self.to_dot()
        try:
            if fmt in _DOT_FORMATS:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(dot_text)
                return path
            exe = shutil.which("dot")
            assert exe is not None  # checked above
            done = subprocess.run(
                [exe, f"-T{fmt}", "-o", path], input=dot_text.encode(), capture_output=True
            )
        except OSError as exc:
            raise PictureError(
                f"Cannot write the picture {path!r}: {exc.strerror or exc}", path
            ) from None
        if done.returncode != 0:
            last = (done.stderr.decode(errors="replace").strip().splitlines() or [""])[-1]
            raise PictureError(
                f"Graphviz `dot` could not write {path!r} (exit {done.returncode}): {last}", path
            )
        return path

    def write_tensorboard(self, logdir: str | os.PathLike[str]) -> str:
        """Write the graph and this run's metadata as a TensorBoard log in ``logdir``; the graph
        view's "colour by device" then shows the split. Returns the folder."""
        import tensorflow as tf

        if self.graph is None or self.metadata is None:
            raise PictureError(
                "This placement has no graph or run metadata to write", os.fspath(logdir)
            )
        logdir = check_log_dir(logdir)
        with self.graph.as_default():  # FileWriter refuses to run eagerly
            writer = tf.compat.v1.summary.FileWriter(logdir, graph=self.graph)
            try:
                writer.add_run_metadata(self.metadata, "traced_run")
            finally:
                writer.close()
        return logdir


_DOT_FORMATS = ("dot", "gv")
_RENDERED_FORMATS = ("svg", "png", "pdf")


def _picture_format(path: str) -> str:
    return os.path.splitext(path)[1].lstrip(".").lower()


def check_picture_path(path: str | os.PathLike[str]) -> str:
    """``path`` as a string if a placement picture can be written there: a ``.dot``/``.gv``,
    ``.svg``, ``.png`` or ``.pdf`` name (the last three need Graphviz ``dot`` on ``PATH``) in an
    existing folder this user can write, and not a folder itself. Raises :class:`PictureError`
    naming the path; the CLI calls it before a demo starts anything."""
    path = os.fspath(path)
    fmt = _picture_format(path)
    if fmt not in _DOT_FORMATS + _RENDERED_FORMATS:
        raise PictureError(
            f"Cannot write a picture as {path!r}: use .dot, .svg, .png or .pdf", path
        )
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise PictureError(
            f"Cannot write the picture {path!r}: folder {folder!r} does not exist", path
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PictureError(
            f"Cannot write the picture {path!r}: folder {folder!r} is not writable", path
        )
    if os.path.isdir(path):
        raise PictureError(f"Cannot write the picture {path!r}: it is a folder", path)
    if fmt in _RENDERED_FORMATS and shutil.which("dot") is None:
        raise PictureError(
            f"Graphviz `dot` is not installed, so {path!r} cannot be rendered; install "
            "graphviz (apt-get install graphviz) or write a .dot file",
            path,
        )
    return path


def check_log_dir(logdir: str | os.PathLike[str]) -> str:
    """``logdir`` as a string if a TensorBoard log can be written there: a folder, or a path
    whose nearest existing parent is a folder this user can write. Raises
    :class:`PictureError`."""
    logdir = os.fspath(logdir)
    probe = os.path.abspath(logdir)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise PictureError(
            f"Cannot write a TensorBoard log in {logdir!r}: {probe!r} is a file", logdir
        )
    if not os.access(probe, os.W_OK | os.X_OK):
        raise PictureError(
            f"Cannot write a TensorBoard log in {logdir!r}: {probe!r} is not writable", logdir
        )
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
