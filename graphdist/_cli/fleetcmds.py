"""The ``graphdist`` commands that start or read a fleet of servers: ``up`` (in the foreground
or detached), ``status``, ``logs``, ``restart``, ``down`` and ``demo``, with the table of tasks
they print. Each parses nothing and decides nothing itself: it calls the library and prints."""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import signal
import sys
import threading
from typing import Any

from graphdist._cli.helptext import MAX_LOGS_LINES
from graphdist._cli.parser import allow_text, given_backend_options, refuse_unused
from graphdist._exceptions import (
    ArgumentError,
    GraphdistError,
    PictureError,
    StateError,
    UsageError,
)
from graphdist._fleet.backends import backend, check_options
from graphdist._net.members import parse_allow
from graphdist._ports import release_ports
from graphdist._proc.process import STOP_GRACE_S
from graphdist._proc.signals import STOP_SIGNALS, Interrupted, on_stop_signals, wait_for_stop

__all__ = [
    "cmd_demo",
    "cmd_down",
    "cmd_logs",
    "cmd_restart",
    "cmd_status",
    "cmd_up",
]


def _rows_table(rows: list[dict[str, Any]]) -> str:
    """The tasks' table; RESTARTS where the rows have it (a detached fleet's: how often its
    supervisor started the task again, ``gave up`` once its restart policy did)."""
    restarts = all("restarts" in r for r in rows)
    header = [
        "JOB",
        "TASK",
        "ADDRESS",
        "PID",
        "ALIVE",
        *(["RESTARTS"] if restarts else []),
        "TARGET",
    ]
    table = [header] + [
        [
            r["job"],
            str(r["task"]),
            r["address"],
            str(r["pid"]),
            "yes" if r["alive"] else "NO",
            *([f"{r['restarts']}{' (gave up)' if r.get('gave_up') else ''}"] if restarts else []),
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


def _backend_options(args: argparse.Namespace) -> dict[str, Any]:
    """The backend options given on the command line, refused unless the chosen backend's own."""
    return check_options(args.backend, given_backend_options(args))


def cmd_up(args: argparse.Namespace) -> int:
    if args.restart != "no" and not args.detach:
        raise UsageError("--restart needs --detach (a foreground fleet stops on any failure)")
    if args.restart != "on-failure":
        refuse_unused(args, "--detach --restart on-failure", "max_restarts", "restart_window_s")
    kind = _backend(args.backend)
    options = _backend_options(args)
    cluster = kind.parse_cluster(args.cluster)  # parsed once here; the fleet checks it
    if args.detach:
        return _up_detached(args, cluster, options)
    fleet = kind.for_command(
        cluster,
        start_timeout_s=args.start_timeout_s,
        expose=args.expose,
        allow=parse_allow(allow_text(args)) or None,
        tls=args.tls,
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
        with on_stop_signals(lambda signum: _kill_now(fleet)):
            _say_stopping(fleet, received[0])
            fleet.close()
    # Ctrl-C ends it as a shell expects of an interrupted command (a loop of them stops);
    # SIGTERM and SIGHUP, a service manager's stop, are a normal end
    return 128 + signal.SIGINT if received[0] == signal.SIGINT else 0


def _say_stopping(fleet: Any, signum: int) -> None:
    """The one line a stop signal gets at once, in the words of a run's (``stopping``)."""
    from graphdist._distribute.events import Event, Stopping, render

    names = [f"{t.job}-{t.index}" for t in fleet.tasks]
    name = signal.Signals(signum).name
    told = Event.of(Stopping(name, names, STOP_GRACE_S, again=True), 0.0, 1)
    print(render(told), file=sys.stderr, flush=True)


def _kill_now(fleet: Any) -> None:
    """A second stop signal while the fleet stops: its servers on this machine are SIGKILLed
    now (the stop under way finds them gone); a fleet whose processes are elsewhere (Ray's)
    goes on stopping as it was."""
    if not getattr(fleet, "pids_here", False):
        return
    for task in fleet.tasks:
        if task.pid is not None and task.alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(task.pid, signal.SIGKILL)


def _start_noting_signals(fleet: Any, *, keep: bool) -> tuple[threading.Event, list[int]]:
    """``fleet.start()`` with stop signals only noted meanwhile (a KeyboardInterrupt in the
    middle of starting processes could leave one unrecorded, or fail its cleanup): the start
    ends, or fails because the same SIGINT killed a fork server still importing TensorFlow;
    then the fleet is closed and :class:`Interrupted` raised (exit 130 for Ctrl-C, 128 + N for
    another signal). Returns the event a later stop signal sets and the signals received, with
    the handlers kept (``keep``) or given back (a later Ctrl-C is a KeyboardInterrupt again).
    A start that fails or is interrupted gives them back whatever ``keep`` says: the command
    ends there, and a caller of :func:`graphdist._cli.main.main` in the same process (a test, a
    notebook) gets its own handlers back."""
    stop = threading.Event()
    received: list[int] = []

    def note(signum: int, frame: Any) -> None:
        received.append(signum)
        stop.set()

    previous = {sig: signal.signal(sig, note) for sig in STOP_SIGNALS}

    def give_back() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    started = False
    try:
        fleet.start()
        started = True
    except GraphdistError:
        if received:
            raise Interrupted(received[0]) from None
        raise
    finally:
        if not keep or not started:
            give_back()
    if received:
        fleet.close()  # a second signal meanwhile is noted too (keep), not a KeyboardInterrupt
        if keep:
            give_back()
        raise Interrupted(received[0])
    return stop, received


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
    from graphdist._detached.state import down_command

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
        allow=parse_allow(allow_text(args)),
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
        raise Interrupted(signum)  # start_detached stops what it started, as for a Ctrl-C

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
        # the ports this command picked (job=N) are the supervisor's once its servers listen,
        # or free once it failed: their lock files go now (issue 57: each detached start left
        # one per task in the ports folder, removed only by a releasing holder)
        release_ports(task.port for task in getattr(cluster, "tasks", ()))
    _print_rows(status_rows(record), args.json)
    if spec.tls_client is not None:  # the real cluster: a Ray or Slurm fleet's nodes' addresses
        from graphdist._cluster import Cluster

        _say_tls_client(spec.tls_client, Cluster.parse(record.real_cluster or cluster))
    print(
        f"graphdist: fleet detached (supervisor pid {record.supervisor.pid}, state "
        f"{spec.state_dir}); stop it with `{down_command(spec.state_dir)}`",
        file=sys.stderr,
    )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
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
    problem = fleet_problem(record, state_dir)
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


def cmd_logs(args: argparse.Namespace) -> int:
    """The last ``-n`` lines of the fleet's logs, each after ``==> PATH <==`` (tail's header);
    exit 2 (a StateError) where the folder has none, or none of TASK."""
    from graphdist._detached.fleet import no_fleet
    from graphdist._detached.state import fleet_logs

    if not 0 <= args.lines <= MAX_LOGS_LINES:
        raise UsageError(f"-n must be 0 to {MAX_LOGS_LINES} lines, not {args.lines}")
    state_dir = _state_dir(args)
    logs = fleet_logs(state_dir)
    if not logs:
        raise no_fleet(state_dir)
    if args.task is not None:
        name = _task_name(args.task)
        if name not in logs:
            raise UsageError(
                f"{args.task}: no log of that task in {state_dir}; its logs are {', '.join(logs)}"
            )
        logs = {name: logs[name]}
    for i, path in enumerate(logs.values()):
        print(f"{'' if i == 0 else chr(10)}==> {path} <==")
        for line in _tail(path, args.lines):
            print(line)
    return 0


def _tail(path: str, lines: int) -> list[str]:
    """The last ``lines`` lines of ``path`` (read through once, ``lines`` kept at a time; []
    where it cannot be read: a log removed meanwhile)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return [line.rstrip("\n") for line in collections.deque(f, maxlen=lines)]
    except OSError:
        return []


def _task_name(text: str) -> str:
    """A task as the user wrote it (``worker-1``, as status and every message name it, or
    ``worker:1``, as ``tf-config --task``) as graphdist names it: ``worker-1``."""
    return text.strip().replace(":", "-") if text.count(":") == 1 else text.strip()


def cmd_restart(args: argparse.Namespace) -> int:
    from graphdist._detached.fleet import attach

    fleet = attach(_state_dir(args))
    names = {t.name: t for t in fleet.tasks}
    task = names.get(_task_name(args.task))
    if task is None:
        raise UsageError(
            f"{args.task}: no such task in this fleet; its tasks are {', '.join(names)}"
        )
    was = task.pid
    fleet.restart(task.job, task.index)
    print(
        f"graphdist: task {task.name} restarted at {task.address}: pid {task.pid} (was {was}), "
        f"restart {task.restarts}"
    )
    fleet.detach()
    return 0


def cmd_down(args: argparse.Namespace) -> int:
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


def cmd_demo(args: argparse.Namespace) -> int:
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

    from graphdist._graph.graphs import split_graph
    from graphdist._graph.trace import no_folding_config, run_traced
    from graphdist._local.fleet import LocalFleet
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
