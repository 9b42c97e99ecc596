"""The ``graphdist`` command's own words: the top-level description, each subcommand's
examples, the environment it reads and the ``--version`` line (the parser,
:mod:`graphdist._cli.parser`, puts them in its help)."""

from __future__ import annotations

import sys

from graphdist._tflog import TF_LOGS_ENV
from graphdist._version import __version__

__all__ = [
    "DESCRIPTION",
    "ENVIRONMENT",
    "EXAMPLES",
    "HELP_WIDTH",
    "LOGS",
    "LOGS_LINES",
    "MAX_LOGS_LINES",
    "RESTART",
    "version_line",
]


def version_line() -> str:
    """``graphdist X.Y.Z (Python A.B.C, TensorFlow D.E.F)``, read without importing TensorFlow."""
    from importlib import metadata

    try:
        tf_version = metadata.version("tensorflow")
    except metadata.PackageNotFoundError:
        tf_version = "not installed"
    python = ".".join(map(str, sys.version_info[:3]))
    return f"graphdist {__version__} (Python {python}, TensorFlow {tf_version})"


DESCRIPTION = (
    "Start TensorFlow's distributed runtime (tf.compat.v1 servers, tf.distribute tasks) on "
    "this machine or a Ray cluster: fleets of gRPC servers that stay on loopback, sessions that "
    "never hang, and tf.distribute runs with one process per task."
)
LOGS_LINES = 20  # `graphdist logs`: lines of each log by default
MAX_LOGS_LINES = 100_000  # ...and at most (`tail -f LOG` follows one)
LOGS = (
    "Print the last lines of the detached fleet's logs, each after a `==> PATH <==` line: the "
    "supervisor's and every task's, or one task's. They are read from the state folder, so a "
    "fleet whose supervisor died (cleaned up with its logs kept) still shows them. Exit status 2 "
    "where there are none."
)
RESTART = (
    "Have the detached fleet's supervisor start a task's server again on its address (killing "
    "it first if it runs; a task the restart policy gave up on comes back too) and wait until it "
    "answers. Sessions that used it are broken, new ones work."
)
TF_CONFIG_TEXT = (
    "Print the TF_CONFIG of one task of a cluster, as JSON, for a tf.distribute program "
    "started by other means than `graphdist run` (which sets every task's itself)."
)
REPORT = (
    "Draw a run from its log folder (LOG_DIR/run-N of `graphdist run --log-dir`): one lane "
    "per task with a bar per attempt, coloured by how it ended (done, failed, stopped, "
    "preempted, running), restarts, preemptions and stragglers, and the steps done, "
    "steps/s and loss each task reported (graphdist.step, graphdist.progress). Written as "
    "one self-contained HTML page, or as a PNG when --output ends in .png."
)
CERTS = (
    "Make the TLS credentials of a cluster: a new CA of its own, and for each host of the "
    "cluster's tasks a folder under --out (DIR/hosts/HOST) with ca.pem, cert.pem (for that "
    "host's IP address or DNS name) and key.pem, and one for the client (DIR/client). The "
    "CA's private key is not kept (it is never written): to add a host, make new "
    "credentials for the whole cluster."
)
WARM = (
    "Start, show or stop a warm agent: a process of yours that has imported the preloads "
    "(TensorFlow, tf-keras, NumPy) and waits. `graphdist run` on this machine forks its "
    "tasks from it instead of importing TensorFlow again, so a run starts without waiting "
    "for the import. It serves your user only, exits after --idle-timeout without a run "
    "and is stopped by `graphdist warm stop` (the tasks of runs using it end with it). "
    "Exit status of status: 0 it runs, 2 none runs."
)
STRAGGLERS = (
    "kill a task named a straggler (its steps/s below half the other tasks' median for 30 s) "
    "and restart the run, as for a killed task (needs --max-restarts; by default a straggler "
    "is only named)"
)
HELP_WIDTH = 92  # descriptions are wrapped here: the epilogs' examples keep their own lines
ENVIRONMENT = f"""environment:
  {TF_LOGS_ENV}=1  show TensorFlow's own log lines live (its C++ start-up notices,
                       cuInit, the coordination service...); by default they are only in each
                       task's and server's log file (and in `run --output-format jsonl`)
  GRAPHDIST_STATE_DIR  where detached fleets keep their state (see --state-dir)
  GRAPHDIST_WARM_DIR   where warm agents keep their records (default: graphdist's runtime
                       folder; see `graphdist warm`)"""
EXAMPLES = {
    "": """examples:
  graphdist demo                                  the seeds' split graph on a two-task fleet
  graphdist up --cluster worker=2,ps=1            a fleet in the foreground; Ctrl-C stops it
  graphdist up --cluster worker=2 --detach        ...kept by a supervisor: `status`, `logs`,
                                                  `restart`, `down`
  graphdist run --workers 2 -- python train.py    one process per task, each with its TF_CONFIG
  graphdist report logs/run-1                     a run's timeline, steps and loss as a page
  graphdist tf-config --cluster cluster.json --task worker:1
  graphdist serve --cluster cluster.json --job worker --task 0

`graphdist COMMAND --help` describes each command.""",
    "up": """examples:
  graphdist up --cluster local=2                  two servers on free ports; Ctrl-C stops them
  graphdist up --cluster worker=2,ps=1 --json     the tasks as JSON
  graphdist up --cluster '{"worker": ["localhost:2222", "localhost:2223"]}'
  graphdist up --cluster worker=2 --detach --restart on-failure
  graphdist status; graphdist down                the detached fleet's tasks; stop it""",
    "status": """examples:
  graphdist status
  graphdist status --json --state-dir /tmp/fleet-a""",
    "logs": """examples:
  graphdist logs                        # the last lines of the supervisor's and every task's log
  graphdist logs worker-1 -n 100
  tail -f ~/.local/state/graphdist/logs/worker-1.log   # to follow one as it grows

A fleet whose supervisor died is cleaned up with its logs kept: `logs` still reads them, and
`graphdist down` removes them.""",
    "restart": """examples:
  graphdist restart worker-1            # the supervisor starts it again on its address
  graphdist restart ps:0 --state-dir /tmp/fleet-a""",
    "down": """examples:
  graphdist down
  graphdist down --state-dir /tmp/fleet-a""",
    "run": """examples:
  graphdist run --workers 2 -- python train.py
  graphdist run --workers 2 --max-restarts 2 --log-dir /tmp/logs -- python train.py
  graphdist run --chief --ps 1 --workers 2 -- python ps_training.py
  graphdist run --workers 2 --output-format jsonl -- python train.py | jq .event

The command's Python needs TensorFlow and tf-keras (from graphdist's clone: pip install
'.[distribute]').""",
    "serve": """examples (one per host; the same cluster file on every host):
  graphdist serve --cluster cluster.json --job worker --task 0
  srun graphdist serve --slurm worker=2,ps=1      inside a Slurm step
  graphdist serve --cluster cluster.json --job worker --task 0 --tls creds/hosts/10.0.0.1

cluster.json names every task's address, e.g.
  {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"], "ps": ["10.0.0.3:2222"]}""",
    "tf-config": """examples:
  graphdist tf-config --cluster cluster.json --task worker:1
  export TF_CONFIG="$(graphdist tf-config --cluster cluster.json --task chief:0)"

Every task's TF_CONFIG must describe the same cluster, so --cluster names addresses (JSON text
or a file); job=N, which picks new free ports on each call, is refused.""",
    "report": """examples:
  graphdist run --workers 2 --max-restarts 2 --log-dir logs -- python train.py
  graphdist report logs/run-1                      # logs/run-1/report.html
  graphdist report logs/run-1 --output run.png     # the same figure as a PNG

The page is one file (the figure inline, no script, nothing fetched): it opens from disk or as
a CI artifact.""",
    "certs": """examples:
  graphdist certs --cluster cluster.json --out creds
  graphdist certs --cluster cluster.json --out creds --days 30

It prints one folder per host and one for the client; copy each host's folder to that host.
The CA's private key is never written: to add a host, make new credentials for the cluster.""",
    "warm": """examples:
  graphdist warm start                  # runs on this machine now start warm from it
  graphdist run --workers 2 -- python train.py
  graphdist warm status
  graphdist warm stop

A run uses the agent whose preloads are its --preload (default auto) and whose environment
agrees with its own in what the imports read; otherwise it starts its own warm interpreter and
says which variable differs, with the command that starts an agent that matches.""",
    "demo": """examples:
  graphdist demo
  graphdist demo --master 1 --picture placed.svg""",
}
