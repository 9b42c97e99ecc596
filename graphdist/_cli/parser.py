"""The ``graphdist`` command's parser: every subcommand and flag (:func:`build_parser`), the
value types of its options, and the words that turn a library message into the command's own
(:func:`cli_words`).

Each option's ``dest`` is the library argument it becomes (``--timeout`` -> ``timeout_s``):
values are checked once, by the library, and its errors, which name API arguments, are printed
with the command's flags instead. A parse error is a :class:`UsageError` (one line, exit 2), not
argparse's usage text and ``SystemExit``.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import textwrap
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

from graphdist._cli import helptext
from graphdist._cli.helptext import DESCRIPTION, ENVIRONMENT, EXAMPLES, HELP_WIDTH, version_line
from graphdist._detached.supervisor import RESTART_POLICIES
from graphdist._distribute.heartbeat import HEARTBEAT_TIMEOUT_S, MIN_HEARTBEAT_TIMEOUT_S
from graphdist._distribute.runbackends import describe as describe_run_backend
from graphdist._distribute.runbackends import names as run_backend_names
from graphdist._distribute.runbackends import run_backend
from graphdist._distribute.warmagent import IDLE_TIMEOUT_S
from graphdist._exceptions import UsageError
from graphdist._fleet.backends import BackendOption, backend, describe, start_timeouts
from graphdist._fleet.backends import names as backend_names
from graphdist._proc.restarts import (
    BACKOFF,
    DEFAULT_MAX_RESTARTS,
    DEFAULT_MIN_UPTIME_S,
    DEFAULT_RESTART_WINDOW_S,
    STARTUP_FAILURES,
)
from graphdist._tflog import TF_LOGS_ENV
from graphdist._validate import ascii_int as _int

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

__all__ = [
    "allow_text",
    "build_parser",
    "cli_words",
    "flags_of",
    "given_backend_options",
    "refuse_unused",
]


class _Parser(argparse.ArgumentParser):
    commands: Mapping[str, argparse.ArgumentParser]
    argv: ClassVar[Sequence[str]] = ()  # the command line being parsed (for error())

    def parse_command(self, argv: Sequence[str]) -> argparse.Namespace:
        """Parse a whole command line, whose words are kept for :meth:`error` (which the
        subcommands' parsers call too)."""
        _Parser.argv = list(argv)
        return self.parse_args(_Parser.argv)

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


def allow_text(args: argparse.Namespace) -> str | None:
    """The ``--allow`` values as one comma-separated text; None where none was given."""
    return None if args.allow is None else ",".join(args.allow)


def given_backend_options(args: argparse.Namespace) -> dict[str, Any]:
    """The backend options given on the command line (each flag's dest is backend_option_NAME)."""
    return {
        key.removeprefix("backend_option_"): value
        for key, value in vars(args).items()
        if key.startswith("backend_option_") and value is not None
    }


def refuse_unused(args: argparse.Namespace, needs: str, *dests: str) -> None:
    """An option that would do nothing is a mistake to say, not to ignore."""
    for dest in dests:
        if getattr(args, dest) is not None:
            raise UsageError(f"{dest} does nothing without {needs}; drop it or add {needs}")


def _add_backend_options(p: argparse.ArgumentParser) -> None:
    """A flag for every fleet backend's own options (``--address`` for ray); the chosen backend
    gets only its own (:func:`given_backend_options`, checked by the command)."""
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


def _command(
    sub: Any, name: str, help: str, description: str | None = None
) -> argparse.ArgumentParser:
    """A subcommand with its one-line ``help``, a ``description`` (default: the help as a
    sentence), its examples and the environment it reads."""
    text = description or help[0].upper() + help[1:] + "."
    parser: argparse.ArgumentParser = sub.add_parser(
        name,
        help=help,
        description=textwrap.fill(text, HELP_WIDTH),
        epilog=f"{EXAMPLES[name]}\n\n{ENVIRONMENT}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return parser


def build_parser() -> _Parser:
    parser = _Parser(
        prog="graphdist",
        description=textwrap.fill(DESCRIPTION, HELP_WIDTH),
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

    logs = _command(sub, "logs", "print the last lines of the detached fleet's logs", helptext.LOGS)
    logs.add_argument("task", nargs="?", metavar="TASK", help="one task's log (worker-1)")
    lines, most = helptext.LOGS_LINES, helptext.MAX_LOGS_LINES
    logs.add_argument(
        "-n", "--lines", type=_int, default=lines, metavar="N",
        help=f"lines of each log, at most {most} (default {lines})",
    )  # fmt: skip
    _add_state_dir(logs)
    restart = _command(sub, "restart", "restart a task of the detached fleet", helptext.RESTART)
    restart.add_argument("task", metavar="TASK", help="the task, as status names it (worker-1)")
    _add_state_dir(restart)

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
        "private folder of the run's own, DIR/run-N (in /tmp: DIR/graphdist-run-TIME-PID; "
        "attempt-K/TASK.log, events.jsonl, exits.json, summary.txt)",
    )
    run.add_argument(
        "--metrics-file",
        dest="metrics_file",
        metavar="PATH",
        help="keep the run's metrics (attempts, restarts, recoveries) in PATH, a .prom file "
        "for node_exporter's textfile collector, in a folder that is yours alone",
    )
    stragglers = "--restart-stragglers"
    run.add_argument(stragglers, action="store_true", default=None, help=helptext.STRAGGLERS)
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
        sub, "tf-config", "print a task's TF_CONFIG for a cluster, as JSON", helptext.TF_CONFIG_TEXT
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

    report = _command(
        sub, "report", "draw a run's timeline, steps and loss from its log folder", helptext.REPORT
    )
    report.add_argument("run_dir", metavar="RUN_DIR", help="a run's log folder (LOG_DIR/run-N)")
    report.add_argument(
        "--output",
        "-o",
        metavar="PATH",
        help="the file to write, .html or .png (default RUN_DIR/report.html); replaced whole",
    )

    certs = _command(
        sub,
        "certs",
        "make a cluster's TLS credentials: a new CA, a key and certificate per host",
        helptext.CERTS,
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
        helptext.WARM,
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
