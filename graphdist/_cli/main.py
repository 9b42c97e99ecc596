"""The ``graphdist`` command: it parses, calls the library and prints, with no logic of its own.

Parsing (:func:`graphdist._cli.parser.build_parser`) is separate from running (:func:`main`), so
both can be tested; the commands are :mod:`graphdist._cli.fleetcmds` and
:mod:`graphdist._cli.runcmds`. Library errors, which name API arguments, are printed with the
command's flags instead (:func:`graphdist._cli.parser.cli_words`). A user mistake prints one line
``Error: ...`` and exits 2; a failure of the machinery (a server that crashed while starting)
exits 1; neither shows a traceback.
"""

from __future__ import annotations

import argparse
import errno
import re
import shlex
import signal
import sys
from collections.abc import Callable, Sequence
from typing import IO, cast

from graphdist._cli.fleetcmds import (
    cmd_demo,
    cmd_down,
    cmd_logs,
    cmd_restart,
    cmd_status,
    cmd_up,
)
from graphdist._cli.parser import build_parser, cli_words, flags_of
from graphdist._cli.runcmds import (
    cmd_certs,
    cmd_report,
    cmd_run,
    cmd_serve,
    cmd_tf_config,
    cmd_warm,
)
from graphdist._cli.streams import (
    CommandStdout,
    is_output_error,
    lossy_stderr,
    standard_fds_open,
)
from graphdist._exceptions import (
    ArgumentError,
    ClusterSpecError,
    CredentialsError,
    GraphdistError,
    LoopbackUnavailableError,
    PlacementError,
    PortInUseError,
    StateError,
    TaskExitError,
)
from graphdist._proc.signals import Interrupted
from graphdist._tflog import tf_logs_live

__all__ = [
    "EXIT_FAILURE",
    "EXIT_PIPE",
    "EXIT_USAGE",
    "USER_MISTAKES",
    "exit_status",
    "main",
    "task_exit_status",
]

EXIT_FAILURE = 1
EXIT_USAGE = 2
USER_MISTAKES = (
    ArgumentError,  # UsageError too
    ClusterSpecError,
    PlacementError,
    PortInUseError,
    StateError,
    LoopbackUnavailableError,
    CredentialsError,
)
"""The error classes that are a user's mistake: exit status 2 (:func:`exit_status`)."""

_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "tf-config": cmd_tf_config,
    "run": cmd_run,
    "up": cmd_up,
    "status": cmd_status,
    "down": cmd_down,
    "logs": cmd_logs,
    "restart": cmd_restart,
    "demo": cmd_demo,
    "certs": cmd_certs,
    "report": cmd_report,
    "warm": cmd_warm,
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
    if isinstance(exc, USER_MISTAKES):
        return EXIT_USAGE
    return EXIT_FAILURE


EXIT_PIPE = 128 + signal.SIGPIPE
"""A reader that went away (``graphdist status | head -1``): 141, what a shell shows for
``yes | head -1``, whose ``yes`` SIGPIPE killed (coreutils, git)."""


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
    goes on when its output is lost and keeps the run's status (see
    :mod:`graphdist._cli.runcmds`)."""
    standard_fds_open()
    streams = sys.stdout, sys.stderr
    sys.stdout = cast(IO[str], CommandStdout(sys.stdout))
    sys.stderr = lossy_stderr(sys.stderr)
    try:
        try:
            status = _main(argv)
        except SystemExit as exc:  # argparse's, after --help or --version
            status = _exit_code(exc.code)
        sys.stdout.flush()  # what is still buffered fails here, not in Python's exit
        return status
    except OSError as exc:
        if not is_output_error(exc):
            raise
        if exc.errno == errno.EPIPE:
            return EXIT_PIPE
        print(f"Error: cannot write output: {exc.strerror}", file=sys.stderr)
        return EXIT_FAILURE
    finally:
        sys.stderr.flush()
        sys.stdout, sys.stderr = streams


def _main(argv: Sequence[str] | None) -> int:
    command = None
    try:
        parser = build_parser()  # it imports the backends: Ctrl-C may come meanwhile
        argv = list(sys.argv[1:] if argv is None else argv)
        args = parser.parse_command(argv)
        tf_logs_live()  # a bad value is one line here, before anything starts
        command = args.command
        if args.command == "serve":
            return cmd_serve(args, argv)
        return _COMMANDS[args.command](args)
    except GraphdistError as exc:
        text = str(exc)
        if command is not None:
            text = cli_words(text, flags_of(parser.commands[command]), getattr(exc, "name", None))
        if command == "run" and argv is not None:  # parsed: argv is the list args came from
            text = _run_again(text, argv[: len(argv) - len(args.argv)])
        print(f"Error: {text}", file=sys.stderr)
        return exit_status(exc)
    except KeyboardInterrupt:
        print("Error: interrupted", file=sys.stderr)
        return 130
    except Interrupted as exc:
        by = "" if exc.signum == signal.SIGINT else f" by {exc.name}"
        print(f"Error: interrupted{by}", file=sys.stderr)
        return 128 + exc.signum


def _run_again(text: str, options: Sequence[str]) -> str:
    """A wrong-Python hint's task command (:data:`GRAPHDIST_PYTHON`) as the whole ``graphdist
    run`` to copy: the user's own options, then ``--`` and the command."""
    from graphdist._distribute.taskproc import GRAPHDIST_PYTHON

    head = shlex.join(["graphdist", *[o for o in options if o != "--"], "--"])
    return re.sub(
        rf"{re.escape(GRAPHDIST_PYTHON)}`([^`]*)`",
        lambda m: f"Run `{head} {m.group(1)}`",
        text,
    )


if __name__ == "__main__":
    sys.exit(main())
