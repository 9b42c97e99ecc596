"""A TLS run's task on a Slurm node: its step starts the node's gateway, then becomes the
task's command (``python -m graphdist._proc.tlsexec``). Process machinery over TLS mode's
pieces (:mod:`graphdist._net.tlsmode`, :mod:`graphdist._net.gateway`), which know nothing of
processes."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence

from graphdist._cluster import Cluster, Task
from graphdist._net.tlsmode import credentials_from_stdin
from graphdist._proc.process import PREEMPT_SIGNAL

__all__ = ["tls_exec_argv"]


def tls_exec_argv(real: Cluster, task: Task, command: Sequence[str]) -> list[str]:
    """The argv that runs ``command`` as ``task`` of a TLS run on its host: ``python -m
    graphdist._proc.tlsexec`` reads the host's credentials on stdin (:meth:`TlsMode.host_json`),
    starts the host's gateway for ``task`` (inbound for it, outbound for the tasks elsewhere),
    removes the credentials, and executes ``command`` in its place with stdin on /dev/null (the
    gateway ends with it). Slurm sends its stop (SIGTERM) and the preemption notice
    (``PREEMPT_SIGNAL``) to every process of the step, and the task then saves its checkpoint
    through the gateway: the gateway ignores both and ends with the task."""
    import sys

    cluster = json.dumps(real.as_dict())
    return [sys.executable, "-m", "graphdist._proc.tlsexec", cluster, task.job, str(task.index),
            "--", *command]  # fmt: skip


def _exec(argv: Sequence[str]) -> int:
    """:func:`tls_exec_argv`'s side; one line and exit status 2 when the gateway cannot start."""
    import signal
    import sys

    from graphdist._exceptions import GraphdistError
    from graphdist._net.gateway import routes, start_gateway

    try:
        cluster, job, index, dashes, *command = argv
        if dashes != "--" or not command:
            raise ValueError(argv)
        real = Cluster.parse(json.loads(cluster))
        task = real.task(job, int(index))
        folder = credentials_from_stdin()
        # ignored in the gateway from its start (inherited through exec; see tls_exec_argv),
        # not in the command this process becomes
        kept = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGTERM, PREEMPT_SIGNAL)}
        try:
            start_gateway(routes(real, [task]), folder)  # it ends with this process's pid
        finally:
            for sig, handler in kept.items():
                signal.signal(sig, handler)
            shutil.rmtree(folder, ignore_errors=True)
    except (GraphdistError, ValueError) as exc:
        print(f"graphdist: the TLS gateway of this task did not start: {exc}", file=sys.stderr)
        return 2
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.execvp(command[0], command)


if __name__ == "__main__":
    import sys

    sys.exit(_exec(sys.argv[1:]))
