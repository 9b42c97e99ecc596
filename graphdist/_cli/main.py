"""The ``graphdist`` command: it parses, calls the library and prints, with no logic of its own.

Parsing (:func:`build_parser`) is separate from running (:func:`main`), so both can be tested.
Each option's ``dest`` is the library argument it becomes (``--timeout`` -> ``timeout_s``): values
are checked once, by the library, and its errors, which name API arguments, are printed with the
command's flags instead (:func:`cli_words`). A user mistake prints one line ``Error: ...`` and
exits 2; a failure of the machinery (a server that crashed while starting) exits 1; neither
shows a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import errno
import json
import os
import re
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any, ClassVar, NoReturn, cast

from graphdist._cluster import Cluster
from graphdist._detached.supervisor import RESTART_POLICIES
from graphdist._distribute.heartbeat import HEARTBEAT_TIMEOUT_S, MIN_HEARTBEAT_TIMEOUT_S
from graphdist._distribute.runbackends import describe as describe_run_backend
from graphdist._distribute.runbackends import names as run_backend_names
from graphdist._distribute.runbackends import run_backend
from graphdist._distribute.warmagent import IDLE_TIMEOUT_S
from graphdist._exceptions import (
    ArgumentError,
    ClusterSpecError,
    CredentialsError,
    GraphdistError,
    LoopbackUnavailableError,
    PictureError,
    PlacementError,
    PortInUseError,
    StateError,
    TaskExitError,
    UsageError,
)
from graphdist._fleet.backends import (
    BackendOption,
    backend,
    check_options,
    describe,
    start_timeouts,
)
from graphdist._fleet.backends import names as backend_names
from graphdist._net.members import parse_allow
from graphdist._proc.restarts import (
    BACKOFF,
    DEFAULT_MAX_RESTARTS,
    DEFAULT_MIN_UPTIME_S,
    DEFAULT_RESTART_WINDOW_S,
    STARTUP_FAILURES,
)
from graphdist._proc.signals import STOP_SIGNALS, wait_for_stop
from graphdist._tflog import TF_LOGS_ENV, LossyText, lossy_stream, tf_logs_live
from graphdist._validate import MAX_TIMEOUT_S, timeout_s
from graphdist._validate import ascii_int as _int
from graphdist._version import __version__

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

__all__ = [
    "EXIT_FAILURE",
    "EXIT_USAGE",
    "UsageError",
    "build_parser",
    "cli_words",
    "exit_status",
    "main",
    "task_exit_status",
]

EXIT_FAILURE = 1
EXIT_USAGE = 2
_USER_MISTAKES = (
    ArgumentError,  # UsageError too
    ClusterSpecError,
    PlacementError,
    PortInUseError,
    StateError,
    LoopbackUnavailableError,
    CredentialsError,
)


def version_line() -> str:
    """``graphdist X.Y.Z (Python A.B.C, TensorFlow D.E.F)``, read without importing TensorFlow."""
    from importlib import metadata

    try:
        tf_version = metadata.version("tensorflow")
    except metadata.PackageNotFoundError:
        tf_version = "not installed"
    python = ".".join(map(str, sys.version_info[:3]))
    return f"graphdist {__version__} (Python {python}, TensorFlow {tf_version})"


class _Parser(argparse.ArgumentParser):
    commands: Mapping[str, argparse.ArgumentParser]
    argv: ClassVar[Sequence[str]] = ()  # the command line being parsed (for error())

    def error(self, message: str) -> NoReturn:
        # argparse says a required option is missing before it says another is unknown:
        # `up --clusters local=2` said "--cluster" is required. The unknown one comes first,
        # with the closest of the subcommand's own options.
        parser: argparse.ArgumentParser = self
        unknown = self._unknown_option()
        if unknown is None and message.startswith("unrecognized arguments: "):
            command = next((a for a in _Parser.argv if a in getattr(self, "commands", {})), None)
            parser = self if command is None else self.commands[command]
            unknown = message.removeprefix("unrecognized arguments: ").split()[0]
        if unknown is not None:
            message = f"unrecognized argument {unknown}"
            options = parser._option_string_actions
            close = difflib.get_close_matches(unknown.split("=")[0], options)
            if close:
                message += f" (did you mean {close[0]}?)"
        raise UsageError(f"{message} (see `{parser.prog} --help`)")

    def _unknown_option(self) -> str | None:
        """The first option after this subcommand's name in :attr:`argv` (up to a bare
        ``--``) that is none of its options, nor an abbreviation of one; None for the top
        parser, or where every option is known."""
        argv = list(_Parser.argv)
        argv = argv[: argv.index("--")] if "--" in argv else argv
        name = self.prog.split()[-1]
        if " " not in self.prog or name not in argv:
            return None
        known = self._option_string_actions
        for token in argv[argv.index(name) + 1 :]:
            flag = token.split("=")[0]
            if flag.startswith("--") and not any(k.startswith(flag) for k in known):
                return token
        return None

    def _print_message(self, message: str, file: SupportsWrite[str] | None = None) -> None:
        # argparse's own ignores an OSError: `--help > /dev/full` would say nothing and exit 0
        if message:
            (file or sys.stderr).write(message)


def flags_of(parser: argparse.ArgumentParser) -> dict[str, str]:
    """``{library argument: flag}`` for a (sub)command: each option's ``dest`` is the argument it
    becomes (a backend's option: its name)."""
    flags = {}
    for action in parser._actions:
        long = [o for o in action.option_strings if o.startswith("--")]
        if long and action.dest != "help":
            flags[action.dest.removeprefix("backend_option_")] = long[0]
    return flags


def cli_words(text: str, flags: dict[str, str], name: str | None = None) -> str:
    """A library message, which names API arguments (``max_restarts``, ``expose=True``), in the
    command's words (``--max-restarts``, ``--expose``). Plain words (``workers``) are only taken
    for a flag where the error names that argument (``name``): elsewhere they are prose."""
    for dest in sorted(flags, key=len, reverse=True):
        flag = flags[dest]
        # never inside a path (``/srv/log_dir/x``): a user's own value is shown as given
        text = re.sub(rf"(?<![\w./-]){re.escape(dest)}=True\b", flag, text)
        # ``jobid=`` as a name in prose (no value after it): the flag
        text = re.sub(rf"(?<![\w./-]){re.escape(dest)}=(?![\w'\"\[{{(-])", flag, text)
        if "_" not in dest and dest != name:
            continue
        text = re.sub(rf"(?<![\w./'\"-]){re.escape(dest)}\b(?![=(\[/])", flag, text)
    return text


def _float(text: str) -> float:
    """A number written in ASCII (``float()`` also takes ``"٣"``); nan and inf reach the check
    of the option, which names them."""
    if not text.isascii() or "_" in text:
        raise ValueError(text)
    return float(text)


def _preemption_code(text: str) -> int | None:
    """``none`` (no preemption rule) or an exit code; the library checks its range."""
    return None if text.strip().lower() == "none" else _int(text)


_float.__name__ = "float"
_preemption_code.__name__ = "exit code"


def _seconds_or_off(text: str) -> float | None:
    """``off`` (None) or seconds; the library checks the floor."""
    return None if text.strip().lower() == "off" else _float(text)


_seconds_or_off.__name__ = "seconds"


def _add_state_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--state-dir",
        dest="state_dir",
        metavar="DIR",
        help="folder that holds a detached fleet's state and logs (default: $GRAPHDIST_STATE_DIR, "
        "else ~/.local/state/graphdist); use one per fleet to run several side by side",
    )


def _add_restart_window(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--restart-window",
        dest="restart_window_s",
        type=_float,
        metavar="S",
        help="the sliding window --max-restarts counts in, in seconds (default "
        f"{DEFAULT_RESTART_WINDOW_S:g})",
    )


def _add_allow(p: argparse.ArgumentParser, needs: str) -> None:
    p.add_argument(
        "--allow",
        action="append",
        metavar="ADDR|CIDR[,...]",
        help=f"{needs}other machines let in besides the cluster's own hosts (repeatable); every "
        "other machine's connection is closed and logged",
    )


def _allow(args: argparse.Namespace) -> str | None:
    return None if args.allow is None else ",".join(args.allow)


def _add_backend_options(p: argparse.ArgumentParser) -> None:
    """A flag for every fleet backend's own options (``--address`` for ray); the chosen backend
    gets only its own (:func:`_backend_options`)."""
    _add_options(p, {n: backend(n, check=False).options for n in backend_names()})


def _add_options(
    p: argparse.ArgumentParser, options: Mapping[str, Sequence[BackendOption]]
) -> None:
    """A flag for each option of ``{backend: its options}``, saying whose it is."""
    owners: dict[str, tuple[BackendOption, list[str]]] = {}
    for name, own in options.items():
        for option in own:
            owners.setdefault(option.name, (option, []))[1].append(name)
    for option, names in owners.values():
        p.add_argument(
            option.flag,
            dest=f"backend_option_{option.name}",
            type=option.parse,
            metavar=option.metavar,
            help=f"with --backend {' or '.join(names)}: {option.help}",
        )


DESCRIPTION = (
    "Start TensorFlow's distributed runtime (tf.compat.v1 servers, tf.distribute tasks) on "
    "this machine or a Ray cluster: fleets of gRPC servers that stay on loopback, sessions that "
    "never hang, and tf.distribute runs with one process per task."
)
_HELP_WIDTH = 92  # descriptions are wrapped here: the epilogs' examples keep their own lines
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
  graphdist up --cluster worker=2 --detach        ...kept by a supervisor: `status`, `down`
  graphdist run --workers 2 -- python train.py    one process per task, each with its TF_CONFIG
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
agrees with its own in what the imports read; otherwise it starts its own warm interpreter.""",
    "demo": """examples:
  graphdist demo
  graphdist demo --master 1 --picture placed.svg""",
}


def _command(
    sub: Any, name: str, help: str, description: str | None = None
) -> argparse.ArgumentParser:
    """A subcommand with its one-line ``help``, a ``description`` (default: the help as a
    sentence), its examples and the environment it reads."""
    text = description or help[0].upper() + help[1:] + "."
    parser: argparse.ArgumentParser = sub.add_parser(
        name,
        help=help,
        description=textwrap.fill(text, _HELP_WIDTH),
        epilog=f"{EXAMPLES[name]}\n\n{ENVIRONMENT}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return parser


def build_parser() -> _Parser:
    parser = _Parser(
        prog="graphdist",
        description=textwrap.fill(DESCRIPTION, _HELP_WIDTH),
        epilog=f"{EXAMPLES['']}\n\n{ENVIRONMENT}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    parser.commands = sub.choices

    up = _command(
        sub,
        "up",
        "start a fleet of TensorFlow servers on this machine",
        "Start a fleet of TensorFlow servers (one process each) and print its tasks once every "
        "server answers. In the foreground it runs until Ctrl-C, SIGTERM or SIGHUP; with "
        "--detach a supervisor keeps it and the command returns. Ctrl-C at any moment stops "
        "everything it started and exits 130 (SIGTERM or SIGHUP once it runs: 0), until a "
        "fleet is detached: that one keeps running, and the command exits 0.",
    )
    up.add_argument(
        "--cluster",
        required=True,
        metavar="SPEC",
        help="JSON text, a JSON file path, or job=N[,job=N...] (free ports are chosen)",
    )
    up.add_argument(
        "--detach", action="store_true", help="return once ready; a supervisor keeps it running"
    )
    up.add_argument(
        "--start-timeout",
        dest="start_timeout_s",
        type=_float,
        metavar="S",
        help=f"seconds to wait for every server (default: the backend's: {start_timeouts()})",
    )
    up.add_argument("--json", action="store_true", help="print the tasks as JSON")
    up.add_argument(
        "--expose",
        action="store_true",
        help="let servers be reached from the network (default: loopback only): every "
        "interface, or with --backend ray each node's own address (needed when Ray places "
        "servers on other hosts); they let in only the cluster's hosts and --allow (TensorFlow's "
        "servers have no authentication: whoever gets in can run code)",
    )
    up.add_argument(
        "--backend",
        choices=backend_names(),
        default="local",
        help="; ".join(describe(n) for n in backend_names()),
    )
    _add_allow(up, "with --expose: ")
    up.add_argument(
        "--tls",
        action="store_true",
        help="TLS mode (local: a cluster on this host's address; ray, slurm: every node): "
        "servers stay on loopback, mutual-TLS gateways on the tasks' addresses let in holders "
        "of this fleet's own credentials only (the client's folder is printed)",
    )
    _add_backend_options(up)
    up.add_argument(
        "--restart",
        choices=RESTART_POLICIES,
        default="no",
        help="with --detach: restart a task whose server dies (default: no)",
    )
    up.add_argument(
        "--max-restarts",
        dest="max_restarts",
        type=_int,
        metavar="N",
        help="with --restart on-failure: restarts of a task within any --restart-window; one "
        "more death within it and the supervisor gives up on the task (default "
        f"{DEFAULT_MAX_RESTARTS}). Restarts back off: {BACKOFF.describe()}",
    )
    _add_restart_window(up)
    _add_state_dir(up)

    status = _command(
        sub,
        "status",
        "show the detached fleet's tasks",
        "Show the detached fleet's tasks. Exit status: 0 the fleet runs (a task may "
        "be waiting for its scheduled restart); 1 a task is dead for good (the supervisor gave "
        "up on it, or --restart is no); 2 no fleet, a stale one (cleaned up) or an unreadable "
        "state file (`graphdist down` still stops its processes).",
    )
    status.add_argument("--json", action="store_true", help="print a JSON list of tasks")
    _add_state_dir(status)

    down = _command(
        sub,
        "down",
        "stop the detached fleet and remove its state",
        "Stop the detached fleet (every process its supervisor started: they are found by a "
        "marker too, so an unreadable state file still stops everything), check they are gone "
        "and remove its state folder, also the leftovers of an interrupted `up --detach`.",
    )
    _add_state_dir(down)

    run = _command(
        sub,
        "run",
        "run a multi-worker command: one process per task, each with its TF_CONFIG",
        "Start a local cluster and run COMMAND once per chief/worker task with its "
        "TF_CONFIG and TF_USE_LEGACY_KERAS=1; with --ps, the chief runs COMMAND as coordinator "
        "while workers and ps tasks are plain servers. Exits 0 only if every task does. On "
        "Ctrl-C, SIGTERM or SIGHUP every process the tasks started is stopped first (exit "
        "130, 143, 129); if it is SIGKILLed, each task's guard stops them. The console shows "
        "the tasks' own lines, prefixed [worker-1], without TensorFlow's log lines "
        f"({TF_LOGS_ENV}=1 shows them; --log-dir and --output-format jsonl keep every line).",
    )
    run.add_argument("--workers", type=_int, default=2, metavar="N", help="worker tasks (2)")
    run.add_argument("--ps", type=_int, default=0, metavar="M", help="parameter servers (0)")
    run.add_argument("--chief", action="store_true", help="add a chief task (needed with --ps)")
    run.add_argument(
        "--timeout",
        dest="timeout_s",
        type=_float,
        metavar="S",
        help="stop everything after S seconds",
    )
    run.add_argument("--expose", action="store_true", help="do not keep servers on loopback")
    run.add_argument(
        "--tls",
        action="store_true",
        help="TLS mode: the tasks' servers on loopback, mutual-TLS gateways between the "
        "hosts (local: in front of this machine's address, the client's folder printed), "
        "credentials made for each attempt; instead of --expose",
    )
    run.add_argument(
        "--max-restarts",
        dest="max_restarts",
        type=_int,
        metavar="N",
        help="when a task fails, stop every task and start the run again, at most N times "
        "within any --restart-window (default 0: fail at once); each attempt's tasks get "
        "GRAPHDIST_RESTART=K (K restarts before it) and should resume from their last backup. "
        f"Restarts back off: {BACKOFF.describe()}; a run that fails {STARTUP_FAILURES} times "
        "in a row within --min-uptime of starting gives up early",
    )
    _add_restart_window(run)
    run.add_argument(
        "--min-uptime",
        dest="min_uptime_s",
        type=_float,
        metavar="S",
        help="with --max-restarts: an attempt that fails sooner after its start is a start-up "
        f"failure (default {DEFAULT_MIN_UPTIME_S:g}; 0: no start-up rule)",
    )
    run.add_argument(
        "--preemption-exit-code",
        dest="preemption_exit_code",
        type=_preemption_code,
        default=argparse.SUPPRESS,
        metavar="CODE",
        help="an attempt whose every task exits with CODE was preempted (TensorFlow's "
        "PreemptionCheckpointHandler saved and exited): it restarts at once and spends no "
        "restart (default 42; none: off)",
    )
    run.add_argument(
        "--heartbeat-timeout",
        dest="heartbeat_timeout_s",
        type=_seconds_or_off,
        default=argparse.SUPPRESS,
        metavar="S",
        help="a task stopped (SIGSTOP) for S seconds, or whose server (every MWMS worker and PS "
        "task serves one) has not answered for S seconds, is frozen: it is killed and fails "
        f"or restarts the run as a killed task does (default {HEARTBEAT_TIMEOUT_S:g}, at least "
        f"{MIN_HEARTBEAT_TIMEOUT_S:g}; off: no heartbeat)",
    )
    run.add_argument(
        "--log-dir",
        dest="log_dir",
        metavar="DIR",
        help="keep each task's whole output, the run's events, exit statuses and summary in a "
        "private folder of the run's own, DIR/run-N (attempt-K/TASK.log, events.jsonl, "
        "exits.json, summary.txt)",
    )
    run.add_argument(
        "--output-format",
        dest="output_format",
        choices=("text", "jsonl"),
        default="text",
        help="text (default): task lines prefixed [worker-1] and the run's own lines; jsonl: "
        "one JSON object a line, every task line and event of the run (for tools)",
    )
    run.add_argument(
        "--backend",
        choices=run_backend_names(),
        default="local",
        help="; ".join(describe_run_backend(n) for n in run_backend_names()),
    )
    _add_options(run, {n: run_backend(n, check=False).options for n in run_backend_names()})
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")

    srv = _command(
        sub,
        "serve",
        "run one server of a cluster in the foreground (for systemd, Kubernetes, Slurm)",
        "Run one TensorFlow server of a cluster in the foreground, on a real host: it binds only "
        "its own task's address (--bind-all: every interface), lets in only the cluster's hosts "
        "and --allow, logs one line when ready and exits 0 on SIGTERM or SIGINT.",
    )
    srv.add_argument(
        "--cluster",
        metavar="SPEC",
        help="every task's address: JSON text or a JSON file path (the same on every host)",
    )
    srv.add_argument("--job", help="this server's job name")
    srv.add_argument("--task", type=_int, metavar="INDEX", help="this server's task index")
    srv.add_argument(
        "--slurm",
        metavar="JOB=N[,JOB=N]",
        help="take the cluster and this task from Slurm's environment (SlurmClusterResolver)",
    )
    srv.add_argument("--port-base", type=_int, metavar="PORT", help="with --slurm (8888)")
    srv.add_argument(
        "--bind-all",
        action="store_true",
        help="listen on every interface as TensorFlow does (default: only the task's address)",
    )
    _add_allow(srv, "")
    srv.add_argument(
        "--tls",
        metavar="DIR",
        help="TLS mode: this host's folder from `graphdist certs` (or the whole folder, on a "
        "shared file system; - reads it from stdin as JSON); the server stays on loopback "
        "and a mutual-TLS gateway on the task's address lets in holders of the cluster's "
        "certificates only",
    )

    tfc = _command(
        sub,
        "tf-config",
        "print a task's TF_CONFIG for a cluster, as JSON",
        "Print the TF_CONFIG of one task of a cluster, as JSON, for a tf.distribute program "
        "started by other means than `graphdist run` (which sets every task's itself).",
    )
    tfc.add_argument(
        "--cluster",
        required=True,
        metavar="SPEC",
        help="every task's address: JSON text or a JSON file path",
    )
    tfc.add_argument(
        "--task", required=True, metavar="TYPE:INDEX", help="chief:0, worker:1, ps:0, evaluator:0"
    )

    certs = _command(
        sub,
        "certs",
        "make a cluster's TLS credentials: a new CA, a key and certificate per host",
        "Make the TLS credentials of a cluster: a new CA of its own, and for each host of the "
        "cluster's tasks a folder under --out (DIR/hosts/HOST) with ca.pem, cert.pem (for that "
        "host's IP address or DNS name) and key.pem, and one for the client (DIR/client). The "
        "CA's private key is not kept (it is never written): to add a host, make new "
        "credentials for the whole cluster.",
    )
    certs.add_argument(
        "--cluster",
        required=True,
        metavar="SPEC",
        help="every task's address: JSON text or a JSON file path (the hosts get certificates)",
    )
    certs.add_argument(
        "--out", required=True, metavar="DIR", help="a new or empty folder for the credentials"
    )
    certs.add_argument(
        "--days", type=_int, default=365, metavar="N", help="days the certificates are valid (365)"
    )

    warm = _command(
        sub,
        "warm",
        "keep a warm agent: TensorFlow imported once, for every run on this machine",
        "Start, show or stop a warm agent: a process of yours that has imported the preloads "
        "(TensorFlow, tf-keras, NumPy) and waits. `graphdist run` on this machine forks its "
        "tasks from it instead of importing TensorFlow again, so a run starts without waiting "
        "for the import. It serves your user only, exits after --idle-timeout without a run "
        "and is stopped by `graphdist warm stop` (the tasks of runs using it end with it). "
        "Exit status of status: 0 it runs, 2 none runs.",
    )
    warm.add_argument("action", choices=("start", "status", "stop"), help="what to do")
    warm.add_argument(
        "--preload",
        default="auto",
        metavar="MODULES",
        help="comma-separated modules the agent imports, or auto (NumPy, TensorFlow, tf-keras; "
        "default): a run uses the agent of its own --preload",
    )
    warm.add_argument(
        "--idle-timeout",
        dest="idle_timeout_s",
        type=_float,
        default=None,
        metavar="S",
        help=f"with start: exit after S seconds without a run (default {IDLE_TIMEOUT_S:g}; "
        "0: never)",
    )

    demo = _command(
        sub,
        "demo",
        "run the seeds' split graph (238) on a two-task fleet",
        "Start a two-task fleet, run the seeds' split graph (x=2; x-66 on task 0, x+300 and the "
        "sum on task 1) through one task's session, print the result (238) and where each op "
        "ran, and stop the fleet.",
    )
    demo.add_argument(
        "--seed-ports",
        action="store_true",
        help="use the seed's localhost:2020 and localhost:2021 instead of free ports",
    )
    demo.add_argument(
        "--master", type=_int, default=0, metavar="TASK", help="task the session talks to (0)"
    )
    demo.add_argument(
        "--picture",
        metavar="FILE",
        help="write the placed graph coloured by task (.svg, .png, .pdf need Graphviz; or .dot)",
    )
    demo.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="write a TensorBoard log (graph + run metadata; colour the graph view by device)",
    )
    return parser


# -- output -------------------------------------------------------------------------------------


def _rows_table(rows: list[dict[str, Any]]) -> str:
    header = ["JOB", "TASK", "ADDRESS", "PID", "ALIVE", "TARGET"]
    table = [header] + [
        [
            r["job"],
            str(r["task"]),
            r["address"],
            str(r["pid"]),
            "yes" if r["alive"] else "NO",
            f"grpc://{r['address']}",
        ]
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table
    )


def _print_rows(rows: list[dict[str, Any]], as_json: bool) -> None:
    # flushed: a foreground `up` goes on running, and its reader waits for the rows
    if as_json:
        print(json.dumps(rows, indent=2), flush=True)
    else:
        print(_rows_table(rows), flush=True)


# -- commands -----------------------------------------------------------------------------------


def _state_dir(args: argparse.Namespace) -> str:
    from graphdist._detached.fleet import resolve_state_dir

    return resolve_state_dir(args.state_dir)


def _backend(name: str) -> Any:

    try:
        return backend(name)
    except ArgumentError as exc:
        raise UsageError(f"--backend {name}: {exc}") from None


def _given_options(args: argparse.Namespace) -> dict[str, Any]:
    """The backend options given on the command line (each flag's dest is backend_option_NAME)."""
    return {
        key.removeprefix("backend_option_"): value
        for key, value in vars(args).items()
        if key.startswith("backend_option_") and value is not None
    }


def _backend_options(args: argparse.Namespace) -> dict[str, Any]:
    """The backend options given on the command line, refused unless the chosen backend's own."""
    return check_options(args.backend, _given_options(args))


def _refuse_unused(args: argparse.Namespace, needs: str, *dests: str) -> None:
    """An option that would do nothing is a mistake to say, not to ignore."""
    for dest in dests:
        if getattr(args, dest) is not None:
            raise UsageError(f"{dest} does nothing without {needs}; drop it or add {needs}")


def _cmd_up(args: argparse.Namespace) -> int:
    if args.restart != "no" and not args.detach:
        raise UsageError("--restart needs --detach (a foreground fleet stops on any failure)")
    if args.restart != "on-failure":
        _refuse_unused(args, "--detach --restart on-failure", "max_restarts", "restart_window_s")
    kind = _backend(args.backend)
    options = _backend_options(args)
    cluster = kind.parse_cluster(args.cluster)  # parsed once here; the fleet checks it
    if args.detach:
        return _up_detached(args, cluster, options)
    fleet = kind.for_command(
        cluster,
        start_timeout_s=args.start_timeout_s,
        expose=args.expose,
        allow=parse_allow(_allow(args)) or None,
        **({"tls": True} if args.tls else {}),
        **options,
    )
    stop, received = _start_noting_signals(fleet, keep=True)
    with fleet:
        if args.tls:
            _say_tls_client(fleet.tls_client, fleet.real_cluster)
        real = getattr(fleet, "real_cluster", None) or fleet.cluster  # TLS: not the aliases
        rows = [
            {
                "job": t.job,
                "task": t.index,
                "address": real.task(t.job, t.index).address,
                "pid": t.pid,
                "alive": t.alive,
            }
            for t in fleet.tasks
        ]
        _print_rows(rows, args.json)
        print("graphdist: fleet running; press Ctrl-C to stop it", file=sys.stderr, flush=True)
        fleet.watch(_report_death)
        wait_for_stop(stop)
        print("graphdist: stopping the fleet", file=sys.stderr, flush=True)
    # Ctrl-C ends it as a shell expects of an interrupted command (a loop of them stops);
    # SIGTERM and SIGHUP, a service manager's stop, are a normal end
    return 128 + signal.SIGINT if received[0] == signal.SIGINT else 0


def _start_noting_signals(fleet: Any, *, keep: bool) -> tuple[threading.Event, list[int]]:
    """``fleet.start()`` with stop signals only noted meanwhile (a KeyboardInterrupt in the
    middle of starting processes could leave one unrecorded, or fail its cleanup): the start
    ends, or fails because the same SIGINT killed a fork server still importing TensorFlow;
    then the fleet is closed and :class:`_Interrupted` raised (exit 130 for Ctrl-C, 128 + N for
    another signal). Returns the event a later stop signal sets and the signals received, with
    the handlers kept (``keep``) or given back (a later Ctrl-C is a KeyboardInterrupt again)."""
    stop = threading.Event()
    received: list[int] = []

    def note(signum: int, frame: Any) -> None:
        received.append(signum)
        stop.set()

    previous = {sig: signal.signal(sig, note) for sig in STOP_SIGNALS}
    try:
        fleet.start()
    except GraphdistError:
        if received:
            raise _Interrupted(received[0]) from None
        raise
    finally:
        if not keep:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    if received:
        fleet.close()
        raise _Interrupted(received[0])
    return stop, received


class _Interrupted(Exception):
    """A stop signal ended a command before it was done (:func:`main`: one line, 128 + N)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _say_tls_client(folder: str, cluster: Any) -> None:
    """The line that tells where a TLS fleet's client credentials are, and how to use them."""
    print(
        f"graphdist: TLS mode; the client's credentials are in {folder} (copy that folder to "
        f"the machine that connects: graphdist.connect(CLUSTER, tls=FOLDER), CLUSTER being "
        f"{json.dumps(cluster.as_dict())})",
        file=sys.stderr,
        flush=True,
    )


def _report_death(task: Any) -> None:
    """A foreground fleet's watcher callback: one line per death of a task."""
    from graphdist._failures import exited

    log = f" (log: {task.log_path})" if task.log_path else ""
    name = f"{task.name}"
    print(f"graphdist: task {exited(name, task.exitcode)}{log}", file=sys.stderr, flush=True)


def _up_detached(args: argparse.Namespace, cluster: Any, options: dict[str, Any]) -> int:
    from graphdist._detached.fleet import SupervisorSpec, start_detached, status_rows

    restarts = {
        key: getattr(args, key)
        for key in ("max_restarts", "restart_window_s")
        if getattr(args, key) is not None
    }
    spec = SupervisorSpec(
        state_dir=_state_dir(args),
        cluster=cluster,
        start_timeout_s=args.start_timeout_s,
        restart=args.restart,
        expose=args.expose,
        allow=parse_allow(_allow(args)),
        backend=args.backend,
        options=options,
        tls=args.tls,
        **restarts,
    )

    def note(text: str) -> None:
        print(f"graphdist: {text}", file=sys.stderr, flush=True)

    ready = []

    def detached() -> None:
        # the fleet runs and is the supervisor's now: a stop signal from here on (while the
        # rows are printed, or as Python exits) would kill this command with the fleet left
        # running while saying "interrupted"; it is ignored, and the command ends with 0 as it
        # says
        ready.append(True)
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    def interrupted(signum: int, frame: Any) -> None:
        raise _Interrupted(signum)  # start_detached stops what it started, as for a Ctrl-C

    # SIGTERM and SIGHUP (a closed terminal) as Ctrl-C: by default they would end this command
    # at once, and the supervisor, in a session of its own, would bring the fleet up anyway
    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:  # nohup's SIGHUP stays ignored
            previous[sig] = signal.signal(sig, interrupted)
    try:
        record = start_detached(spec, note=note, on_ready=detached)
    finally:
        if not ready:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    _print_rows(status_rows(record), args.json)
    if spec.tls_client is not None:  # the real cluster: a Ray or Slurm fleet's nodes' addresses
        from graphdist._cluster import Cluster

        _say_tls_client(spec.tls_client, Cluster.parse(record.real_cluster or cluster))
    print(
        f"graphdist: fleet detached (supervisor pid {record.supervisor.pid}, state "
        f"{spec.state_dir}); stop it with `graphdist down`",
        file=sys.stderr,
    )
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    """Exit 0: the fleet runs (a task may be waiting for its scheduled restart); 1: a task is
    dead for good (the restart policy gave up on it, or there is none); 2: no fleet, a stale
    one (cleaned up) or an unreadable state file."""
    from graphdist._detached.fleet import fleet_problem, live_record, no_fleet, status_rows
    from graphdist._exceptions import FleetError

    state_dir = _state_dir(args)
    record = live_record(state_dir, cleanup=False)
    if record is None:
        error = no_fleet(state_dir)
        ups = _foreground_ups()
        if ups:  # "no fleet" while one runs in another terminal reads as a bug
            error = StateError(
                f"{error}; a foreground `graphdist up` runs as pid {', '.join(map(str, ups))}: "
                "its own terminal shows its tasks (status sees detached fleets only)",
                state_dir,
            )
        raise error
    _print_rows(status_rows(record), args.json)
    problem = fleet_problem(record)
    if problem is not None:
        raise FleetError(problem)
    return 0


def _foreground_ups() -> list[int]:
    """The pids of this user's ``graphdist up`` commands without ``--detach``."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "uids", "cmdline"]):
        with contextlib.suppress(psutil.Error, TypeError):
            argv = proc.info["cmdline"] or []
            if proc.info["pid"] == os.getpid() or proc.info["uids"].real != os.getuid():
                continue
            at = [i for i, a in enumerate(argv) if os.path.basename(a) == "graphdist"]
            if at and argv[at[0] + 1 : at[0] + 2] == ["up"] and "--detach" not in argv:
                found.append(proc.info["pid"])
    return found


def _cmd_down(args: argparse.Namespace) -> int:
    from graphdist._detached.fleet import stop_detached

    state_dir = _state_dir(args)

    def waiting(holder: str) -> None:
        print(
            f"graphdist: waiting for {holder}, which is changing {state_dir}",
            file=sys.stderr,
            flush=True,
        )

    print(f"graphdist: {stop_detached(state_dir, note=waiting)}; removed {state_dir}")
    return 0


def _cmd_warm(args: argparse.Namespace) -> int:
    from graphdist._distribute.localrun import zygote_env
    from graphdist._distribute.warm import check_preload
    from graphdist._distribute.warmagent import live_agent, start_agent, stop_agent

    preload = check_preload(args.preload)
    if not preload:
        raise UsageError("--preload none: a warm agent imports at least one module; name them")
    if args.idle_timeout_s is not None and args.action != "start":
        raise UsageError(f"--idle-timeout goes with start only, not with {args.action}")
    what = ",".join(preload)
    if args.action == "start":
        idle = IDLE_TIMEOUT_S if args.idle_timeout_s is None else args.idle_timeout_s
        if idle != 0:  # 0: never; else a finite, bounded number of seconds (not nan or inf)
            try:
                idle = timeout_s(idle, "--idle-timeout", IDLE_TIMEOUT_S)
            except ArgumentError:
                raise UsageError(
                    f"--idle-timeout must be 0 or more seconds (0: never), finite and at most "
                    f"{MAX_TIMEOUT_S:g}, not {idle:g}"
                ) from None
        env = zygote_env({**os.environ, "TF_USE_LEGACY_KERAS": "1"})
        record, started = start_agent(preload, env, idle)
        said = "started" if started else "already running"
        print(f"graphdist: warm agent {said}: pid {record.pid}, preloads {what}")
        return 0
    if args.action == "stop":
        stopped = stop_agent(preload)
        if stopped is None:
            print(f"graphdist: no warm agent runs (preloads {what})")
        else:
            print(f"graphdist: warm agent pid {stopped.pid} stopped (preloads {what})")
        return 0
    found = live_agent(preload)
    if found is None:
        print(f"graphdist: no warm agent runs (preloads {what})")
        return 2
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(found.started))
    idle = "never" if not found.idle_timeout_s else f"after {found.idle_timeout_s:g} s idle"
    print(
        f"graphdist: warm agent pid {found.pid}, preloads {what}, since {since}, "
        f"served {found.served} run{'' if found.served == 1 else 's'}, exits {idle}; "
        f"log {found.log}"
    )
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from graphdist._graph.trace import check_log_dir, check_picture_path

    # Every argument is checked before the fleet starts, not after the demo ran.
    if args.master not in (0, 1):
        raise UsageError(f"--master {args.master}: the demo fleet has tasks 0 and 1")
    for flag, given in (("--picture", args.picture), ("--tensorboard", args.tensorboard)):
        if given is not None and not given.strip():
            raise UsageError(f"{flag} needs a file or folder, not {given!r}")
    try:
        if args.picture:
            check_picture_path(args.picture)
        if args.tensorboard:
            check_log_dir(args.tensorboard)
    except PictureError as exc:
        option = "--picture" if args.picture and exc.path == args.picture else "--tensorboard"
        raise UsageError(f"{option}: {exc}") from None

    from graphdist._fleet.local import LocalFleet
    from graphdist._graph.graphs import split_graph
    from graphdist._graph.trace import no_folding_config, run_traced
    from graphdist._proc import lean
    from graphdist._tflog import import_tensorflow_quietly

    lean.install()  # this client only builds and runs a graph: TensorFlow without Keras
    # The client's TensorFlow import (seconds) overlaps the fleet's start, which is mostly the
    # fork server's own import; the graph below waits for it (the import lock).
    # TensorFlow's own log lines stay out of the demo's output (GRAPHDIST_TF_LOGS=1 shows them).
    threading.Thread(target=import_tensorflow_quietly, name="import-tf", daemon=True).start()
    spec: Any = {"local": ["localhost:2020", "localhost:2021"]} if args.seed_ports else "local=2"
    fleet = LocalFleet(spec)
    _start_noting_signals(fleet, keep=False)
    with fleet:
        print(
            "graphdist demo: "
            + ", ".join(f"{t.name} at {t.address} (pid {t.pid})" for t in fleet.tasks),
            file=sys.stderr,
        )
        graph, y = split_graph(fleet.device("local", 0), fleet.device("local", 1))
        with fleet.session("local", args.master, graph=graph, config=no_folding_config()) as sess:
            result, placement = run_traced(sess, y)
        print(result)
        print(f"\nwhere each op ran (master: {fleet.target('local', args.master)}):")
        print(placement.table())
        if args.picture:
            print(f"\npicture: {placement.write_picture(args.picture)}")
        if args.tensorboard:
            logdir = placement.write_tensorboard(args.tensorboard)
            print(f"TensorBoard log: {logdir} (tensorboard --logdir {logdir})")
    return 0


def _say(line: str) -> None:
    """The run's last line on stdout. Lost output never changes a run's status (its tasks' lines
    are dropped the same way, :class:`graphdist._distribute.taskproc.Output`): a reader gone away
    (``| head``) got what it wanted; on another failure (a full disk) the line goes to stderr."""
    try:
        print(line, flush=True)
    except OSError as exc:
        if not _is_output_error(exc):
            raise
        if exc.errno != errno.EPIPE:
            print(f"{line} [stdout: {exc.strerror}]", file=sys.stderr)


def _cmd_run(args: argparse.Namespace) -> int:
    from graphdist._distribute.launcher import run_command

    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        raise UsageError("No command to run; put it after `--`, e.g. -- python train.py")
    if not args.max_restarts:
        _refuse_unused(args, "--max-restarts N", "restart_window_s", "min_uptime_s")
    given = {  # what was given: the library's defaults for the rest
        key: getattr(args, key)
        for key in ("max_restarts", "restart_window_s", "min_uptime_s")
        if getattr(args, key) is not None
    }
    if "preemption_exit_code" in vars(args):  # "none" is given too: None turns it off
        given["preemption_exit_code"] = args.preemption_exit_code
    if "heartbeat_timeout_s" in vars(args):  # "off" is given too: None turns it off
        given["heartbeat_timeout_s"] = args.heartbeat_timeout_s
    results = run_command(
        command,
        workers=args.workers,
        ps=args.ps,
        chief=args.chief,
        timeout_s=args.timeout_s,
        expose=args.expose,
        log_dir=args.log_dir,
        output_format=args.output_format,
        backend=args.backend,
        tls=args.tls,
        **given,
        **_given_options(args),
    )
    if args.output_format == "text":
        ran = ", ".join(r.name for r in results)
        servers = [f"worker-{i}" for i in range(args.workers)] if args.ps else []
        servers += [f"ps-{i}" for i in range(args.ps)]
        served = (
            f"; {len(servers)} server task(s) served it ({', '.join(servers)})" if servers else ""
        )
        _say(f"graphdist: the run succeeded: {len(results)} task(s) exited 0 ({ran}){served}")
    return 0


def _cmd_serve(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from graphdist._proc import lean
    from graphdist._proc.serve import SLURM_PORT_BASE, serve, slurm_task

    lean.install()  # this process only serves: TensorFlow without Keras and SciPy

    for flag, given in (("--slurm", args.slurm), ("--cluster", args.cluster), ("--job", args.job)):
        if given is not None and not given.strip():
            raise UsageError(f"{flag} needs a value, not {given!r}")
    if args.slurm:
        if args.cluster or args.job or args.task is not None:
            raise UsageError("--slurm takes the cluster, job and task from Slurm; drop the others")
        counts = {job: int(n) for job, n in Cluster.parse_counts(args.slurm).items()}
        port_base = SLURM_PORT_BASE if args.port_base is None else args.port_base
        cluster, job, index = slurm_task(counts, port_base=port_base)
    else:
        if args.port_base is not None:
            raise UsageError("--port-base goes with --slurm only; a --cluster names every port")
        if not args.cluster or not args.job or args.task is None:
            raise UsageError("serve needs --cluster, --job and --task (or --slurm)")
        cluster = Cluster.parse_addresses(args.cluster, what="A served cluster")
        job, index = args.job, args.task
    return serve(
        cluster, job, index, bind_all=args.bind_all, argv=argv, allow=_allow(args), tls=args.tls
    )


def _cmd_tf_config(args: argparse.Namespace) -> int:
    from graphdist._distribute.tfconfig import tf_config

    print(tf_config(args.cluster, args.task).to_json())
    return 0


def _cmd_certs(args: argparse.Namespace) -> int:
    from graphdist._net.tlscerts import CLIENT, make_credentials

    cluster = Cluster.parse_addresses(args.cluster, what="A cluster to make credentials for")
    hosts = [task.host.removeprefix("[").removesuffix("]") for task in cluster.tasks]
    try:
        folders = make_credentials(list(dict.fromkeys(hosts)), args.out, days=args.days)
    except CredentialsError as exc:  # --days is the flag's name here, not the argument's
        raise UsageError(str(exc), name=None if exc.path else "days") from None
    for host, folder in folders.items():
        if host == CLIENT:
            print(f"client: {folder}  (for graphdist.connect(cluster, tls=...))")
        else:
            print(f"{host}: {folder}  (copy to {host}; graphdist serve --tls {folder})")
    return 0


_COMMANDS = {
    "tf-config": _cmd_tf_config,
    "run": _cmd_run,
    "up": _cmd_up,
    "status": _cmd_status,
    "down": _cmd_down,
    "demo": _cmd_demo,
    "certs": _cmd_certs,
    "warm": _cmd_warm,
}


def task_exit_status(exitcode: int | None) -> int:
    """``graphdist run``'s status when a task failed: the task's own exit code (as torchrun
    and TensorFlow's multi_process_runner give it), 128 + N for a task killed by signal N (as a
    shell reports it), 1 when it is unknown."""
    if exitcode is None or exitcode == 0:
        return EXIT_FAILURE
    if exitcode < 0:
        return min(128 - exitcode, 255)
    return min(exitcode, 255)


def exit_status(exc: GraphdistError) -> int:
    """The command's exit status for ``exc``, decided by its class wherever it was raised (in
    this process or, carried whole, in a supervisor): 2 for a user mistake (a bad value, a taken
    port, a state folder in use), the task's own status for a :class:`TaskExitError` (see
    :func:`task_exit_status`), 1 for any other failure."""
    if isinstance(exc, TaskExitError):
        return task_exit_status(exc.failed.exitcode)
    if isinstance(exc, _USER_MISTAKES):
        return EXIT_USAGE
    return EXIT_FAILURE


EXIT_PIPE = 128 + signal.SIGPIPE
"""A reader that went away (``graphdist status | head -1``): 141, what a shell shows for
``yes | head -1``, whose ``yes`` SIGPIPE killed (coreutils, git)."""
_OUTPUT_ERROR = "_graphdist_output_error"  # set on an OSError of a write to stdout


class _Stdout:
    """``sys.stdout`` while a command runs: a write or flush that fails raises as it would, marked
    as the command's output (:func:`main` tells it from any other OSError), and fd 1 becomes
    /dev/null, so that what is still buffered, another thread's line and Python's flush at exit
    cannot fail again (no "Exception ignored ... BrokenPipeError"). ``None``: fd 1 was closed
    when the command started, and every write fails as a closed file descriptor's does."""

    def __init__(self, stream: IO[str] | None) -> None:
        self._stream = stream
        self._failed_once = False

    def write(self, text: str) -> int:
        try:
            if self._stream is None:
                if self._failed_once:  # said once; the rest is lost as on /dev/null
                    return len(text)
                raise OSError(errno.EBADF, os.strerror(errno.EBADF))
            return self._stream.write(text)
        except OSError as exc:
            raise self._failed(exc) from None

    def flush(self) -> None:
        try:
            if self._stream is not None:
                self._stream.flush()
        except OSError as exc:
            raise self._failed(exc) from None

    def _failed(self, exc: OSError) -> OSError:
        setattr(exc, _OUTPUT_ERROR, True)
        self._failed_once = True
        with contextlib.suppress(AttributeError, OSError, ValueError):
            if self._stream is not None and self._stream.fileno() == 1:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)
                os.close(devnull)
        return exc

    def __getattr__(self, name: str) -> Any:
        if self._stream is None:
            raise AttributeError(name)
        return getattr(self._stream, name)


def _is_output_error(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and getattr(exc, _OUTPUT_ERROR, False)


def _standard_fds_open() -> None:
    """/dev/null on fd 0, 1 or 2 where the command started with it closed (``graphdist status
    >&-``): otherwise the next file or socket opened takes its number, and a child's output or
    TensorFlow's C++ logging (which writes to fd 2) would land in it."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            devnull = os.open(os.devnull, os.O_RDWR)
            if devnull != fd:
                os.dup2(devnull, fd)
                os.close(devnull)
            os.set_inheritable(fd, True)


def _exit_code(code: object) -> int:
    """A SystemExit's code as an exit status (argparse's: 0 after --help or --version)."""
    if code is None:
        return 0
    return code if isinstance(code, int) else EXIT_FAILURE


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``graphdist`` command; returns the exit status.

    Output that cannot be written never shows a traceback: a reader that went away (EPIPE) ends
    the command quietly with :data:`EXIT_PIPE`; any other failure to write stdout (a full disk,
    stdout closed) with one line ``Error: cannot write output: ...`` and status 1; stderr that
    cannot be written loses its lines (there is nowhere to say so) and changes nothing. `run`
    goes on when its output is lost and keeps the run's status (see :func:`_say`)."""
    _standard_fds_open()
    streams = sys.stdout, sys.stderr
    sys.stdout = cast(IO[str], _Stdout(sys.stdout))
    sys.stderr = _lossy_stderr(sys.stderr)
    try:
        try:
            status = _main(argv)
        except SystemExit as exc:  # argparse's, after --help or --version
            status = _exit_code(exc.code)
        sys.stdout.flush()  # what is still buffered fails here, not in Python's exit
        return status
    except OSError as exc:
        if not _is_output_error(exc):
            raise
        if exc.errno == errno.EPIPE:
            return EXIT_PIPE
        print(f"Error: cannot write output: {exc.strerror}", file=sys.stderr)
        return EXIT_FAILURE
    finally:
        sys.stderr.flush()
        sys.stdout, sys.stderr = streams


def _lossy_stderr(stream: IO[str] | None) -> IO[str]:
    """``sys.stderr`` while a command runs: a :class:`LossyText` on fd 2, unless it is another
    stream than fd 2 (pytest's capture, a notebook's)."""
    if isinstance(stream, LossyText):
        return stream
    if stream is not None:
        try:
            if stream.fileno() != 2:
                return stream
        except (AttributeError, OSError, ValueError):
            return stream
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    return lossy_stream(2, stream)


def _main(argv: Sequence[str] | None) -> int:
    command = None
    try:
        parser = build_parser()  # it imports the backends: Ctrl-C may come meanwhile
        argv = list(sys.argv[1:] if argv is None else argv)
        _Parser.argv = argv
        args = parser.parse_args(argv)
        tf_logs_live()  # a bad value is one line here, before anything starts
        command = args.command
        if args.command == "serve":
            return _cmd_serve(args, argv)
        return _COMMANDS[args.command](args)
    except GraphdistError as exc:
        text = str(exc)
        if command is not None:
            text = cli_words(text, flags_of(parser.commands[command]), getattr(exc, "name", None))
        print(f"Error: {text}", file=sys.stderr)
        return exit_status(exc)
    except KeyboardInterrupt:
        print("Error: interrupted", file=sys.stderr)
        return 130
    except _Interrupted as exc:
        by = "" if exc.signum == signal.SIGINT else f" by {exc}"
        print(f"Error: interrupted{by}", file=sys.stderr)
        return 128 + exc.signum


if __name__ == "__main__":
    sys.exit(main())
