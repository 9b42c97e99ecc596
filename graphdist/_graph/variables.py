"""Variables that live on one task and are shared by every session and client that names them.

A variable placed on a task lives in that task's server, not in a session: any session of the
cluster, and any separate client process that builds a variable of the same name on the same
device, sees the same value (TF_FACTS, "Variables"). Two traps make this fragile by hand:

- TensorFlow silently renames a second ``tf.Variable(name="var")`` in one graph to ``var_1``, or
  prefixes it with the current name scope, and a different name is a different variable on the
  server. :func:`shared_variable` uses the exact name given and returns the existing variable
  when the graph already declares it.
- ``global_variables_initializer()`` resets values that another client already set.
  :func:`initialize_uninitialized` initializes only what the servers report as uninitialized.

Both work with ref variables (``disable_v2_behavior``) and resource variables
(``disable_eager_execution`` only).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from graphdist._exceptions import VariableError
from graphdist._graph.placement import DeviceSpec, parse_device

if TYPE_CHECKING:
    import tensorflow as tf

__all__ = ["initialize_uninitialized", "shared_variable"]


def _variables_of(graph: Any) -> list[Any]:
    import tensorflow as tf

    return list(
        graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
        + graph.get_collection(tf.compat.v1.GraphKeys.LOCAL_VARIABLES)
    )


def shared_variable(
    name: str,
    initial_value: Any,
    device: str | DeviceSpec,
    *,
    dtype: Any = None,
    trainable: bool = True,
    graph: tf.Graph | None = None,
) -> Any:
    """Declare (or return the already declared) variable ``name`` that lives on ``device``.

    The variable is created at the top-level name scope with exactly ``name``, so every client
    that declares the same name and device shares one value on the server. Nothing is
    initialized here: call :func:`initialize_uninitialized` (it never resets a shared value).
    Raises :class:`VariableError` if ``name`` is already used in the graph by another op, or by
    a variable on another device. ``graph`` defaults to the default graph.
    """
    import tensorflow as tf

    graph = graph if graph is not None else tf.compat.v1.get_default_graph()
    placed = parse_device(device).to_string()
    for var in _variables_of(graph):
        if var.op.name == name:
            if parse_device(var.device).to_string() != placed:
                raise VariableError(
                    f"Variable {name!r} is already declared on {var.device!r}, not {placed!r}",
                    name=name,
                    device=var.device,
                )
            return var
    try:
        graph.get_operation_by_name(name)
    except KeyError:
        pass
    else:
        raise VariableError(
            f"The name {name!r} is already taken by a non-variable op in this graph; a shared "
            "variable needs its exact name",
            name=name,
        )
    with graph.as_default(), graph.name_scope(None), tf.device(placed):
        var = tf.compat.v1.Variable(initial_value, name=name, dtype=dtype, trainable=trainable)
    if var.op.name != name:  # pragma: no cover - guarded above
        raise VariableError(
            f"TensorFlow renamed shared variable {name!r} to {var.op.name!r}", name=name
        )
    return var


def initialize_uninitialized(sess: Any, var_list: Sequence[Any] | None = None) -> list[str]:
    """Initialize only those variables (of ``var_list``, default every global and local variable
    of ``sess.graph``) that are not initialized yet on their servers; return their names.

    A value that another session or client already set is never reset. Two clients racing to
    initialize the same variable both write its initial value, which is harmless.
    """
    import tensorflow as tf

    graph = sess.graph
    variables = list(var_list) if var_list is not None else _variables_of(graph)
    if not variables:
        return []
    with graph.as_default():
        report = tf.compat.v1.report_uninitialized_variables(variables)
    names = {n.decode() if isinstance(n, bytes) else str(n) for n in sess.run(report)}
    todo = [v for v in variables if v.op.name in names]
    if todo:
        with graph.as_default():
            init = tf.compat.v1.variables_initializer(todo)
        sess.run(init)
    return sorted(v.op.name for v in todo)
