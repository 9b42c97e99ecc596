"""The lifecycle of a detached fleet, which ``graphdist up --detach``, ``status`` and ``down``
only wrap (the handle on a running one, :func:`~graphdist._detached.fleet.attach`, is
:mod:`graphdist._detached.fleet`'s):

- :func:`start_detached` locks the state folder (``state.lock_state``: of several concurrent
  starts one proceeds, the others get a one-line :class:`StateError`), refuses a folder whose
  fleet is live, cleans what an earlier fleet left (a stale record, ``error.json``, orphaned
  processes) with a one-line note, spawns the supervisor (``supervisor``) from a
  :class:`SupervisorSpec`, carrying the folder's marker, and waits until it writes
  ``fleet.json`` (ready) or ``error.json`` (failed), or the start timeout passes; whatever it
  started is stopped again if the start fails;
- :func:`live_record` reads the running fleet's record, cleaning up a stale one (its supervisor
  is gone); :func:`status_rows` turns it into one row per task and :func:`fleet_problem` says
  whether a task is dead for good (``graphdist status`` then exits 1);
- :func:`stop_detached` (under the lock) stops the supervisor and every process of the fleet,
  those in ``fleet.json`` and those found by their marker (so a corrupt, truncated or wrongly
  typed record still stops everything), makes sure they are gone and removes the state folder.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterable
from typing import Any

from graphdist._cluster import Cluster
from graphdist._detached.marked import marked_processes, stop_processes
from graphdist._detached.state import (
    LOGS_DIR,
    MARK_ENV,
    STATE_FILE,
    SUPERVISOR_LOG,
    TLS_DIR,
    CorruptStateError,
    FleetRecord,
    ProcessRef,
    clear_state,
    default_state_dir,
    down_command,
    fleet_command,
    fleet_logs,
    fleet_mark,
    foreign_entries,
    leftovers,
    lock_state,
    read_error,
    read_state,
    remove_leftovers,
)
from graphdist._detached.supervisor import SupervisorSpec
from graphdist._exceptions import ArgumentError, FleetError, FleetStartError, StateError
from graphdist._failures import exited
from graphdist._fleet.backends import backend
from graphdist._proc.process import STOP_GRACE_S
from graphdist._validate import flag, path_text, show

__all__ = [
    "fleet_problem",
    "live_record",
    "no_fleet",
    "resolve_state_dir",
    "start_detached",
    "status_rows",
    "stop_detached",
]

READY_MARGIN_S = 30.0
"""Seconds beyond the start timeout for the supervisor's own start (importing TensorFlow)."""
SUPERVISOR_GRACE_S = 10.0
"""Seconds between SIGTERM and SIGKILL of a supervisor (it stops its servers, each with its own
grace, on SIGTERM)."""
DOWN_LOCK_WAIT_S = 240.0
"""Seconds ``down`` waits for another command that holds the state folder's lock: an ``up``
still starting its fleet takes up to the backend's start timeout (the slowest default, Ray's,
is 180 s) plus READY_MARGIN_S."""

Note = Callable[[str], None]


def _quiet(text: str) -> None:
    pass


def resolve_state_dir(state_dir: str | os.PathLike[str] | None = None) -> str:
    """``state_dir`` made absolute, or the default one (see ``state.default_state_dir``) where
    it is None. An empty one (``--state-dir "$UNSET"``) is an ArgumentError: taken for the
    default, a ``down`` would stop the user's default fleet."""
    if state_dir is None:
        return default_state_dir()
    path = os.fspath(state_dir)
    if not str(path).strip():
        raise ArgumentError(
            f"state_dir must name a folder, not {show(path)}; leave it out for the default "
            "(GRAPHDIST_STATE_DIR, else ~/.local/state/graphdist)",
            name="state_dir",
            value=path,
        )
    return os.path.abspath(path)


def no_fleet(state_dir: str) -> StateError:
    return StateError(
        f"No detached fleet is running in {path_text(state_dir)}; start one with "
        f"`{fleet_command(state_dir, 'up', '--cluster', 'local=2', '--detach')}`",
        state_dir,
    )


def live_record(state_dir: str, *, cleanup: bool) -> FleetRecord | None:
    """The running fleet in ``state_dir``, or ``None``. A stale one (supervisor gone) is cleaned
    up (when no other command holds the folder's lock) and reported as StateError unless
    ``cleanup`` is set, in which case ``None`` is returned. Raises :class:`CorruptStateError` for
    an unreadable ``fleet.json`` (``graphdist down`` deals with it)."""
    record = read_state(state_dir)
    if record is None or record.supervisor.alive():
        return record
    done = "another graphdist command holds its folder, so it was left as it is"
    with contextlib.suppress(StateError), lock_state(state_dir) as locked:
        if locked and read_state(state_dir) == record:
            left = _stop_all(state_dir, record)
            clear_state(state_dir, keep_logs=True)  # they may say why it died
            done = "its state was cleaned up"
            done += f"; {len(left)} process(es) would not die" if left else ""
            if fleet_logs(state_dir):
                read = fleet_command(state_dir, "logs")
                done += (
                    f"; its logs are kept in {path_text(state_dir)} (`{read}`; "
                    f"`{down_command(state_dir)}` removes them)"
                )
        elif locked:
            done = "another graphdist command has dealt with it"
    if cleanup:
        return None
    raise StateError(
        f"The fleet in {path_text(state_dir)} was stale (supervisor pid "
        f"{record.supervisor.pid} is gone); {done}",
        state_dir,
    )


def status_rows(record: FleetRecord) -> list[dict[str, Any]]:
    """One row per task: job, task, address (the real one, in TLS mode: not the alias), pid,
    alive, log, restarts, gave_up."""
    real = Cluster.parse(record.real_cluster) if record.real_cluster else None
    return [
        {
            "job": t.job,
            "task": t.task,
            "address": real.task(t.job, t.task).address if real else t.address,
            "pid": t.pid,
            "alive": t.process.alive(),
            "log": t.log,
            "restarts": t.restarts,
            "gave_up": t.gave_up,
        }
        for t in record.tasks
    ]


def fleet_problem(record: FleetRecord, state_dir: str) -> str | None:
    """One line naming the tasks that are dead for good (the restart policy gave up on them, or
    there is none), else ``None``, with the command that stops the fleet in ``state_dir``. A
    task waiting for its scheduled restart is not one."""
    dead = [t for t in record.tasks if not t.process.alive()]
    lines = []
    for t in dead:
        if t.gave_up:
            lines.append(
                (
                    t.name,
                    f"task {t.name} died {record.max_restarts + 1} times within "
                    f"{record.restart_window_s:g} s and is not restarted again (max_restarts "
                    f"{record.max_restarts}; log: {t.log})",
                )
            )
        elif record.restart_policy == "no":
            lines.append(
                (t.name, f"task {exited(t.name, t.exitcode)} and is not restarted (log: {t.log})")
            )
    if not lines:
        return None
    name, line = lines[0]
    more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
    return (
        f"{line[0].upper()}{line[1:]}{more}; `{fleet_command(state_dir, 'restart', name)}` "
        f"starts it again, `{down_command(state_dir)}` stops the fleet"
    )


def _stop_all(
    state_dir: str,
    record: FleetRecord | None,
    also: Iterable[ProcessRef] = (),
    *,
    graceful: bool = True,
) -> list[ProcessRef]:
    """Stop every process of the fleet in ``state_dir``: its supervisors first (recorded, found
    by the marker, ``also``: each stops its servers), then every other recorded or marked
    process; then look again for marked ones (a server forked during the stop). Returns those
    that would not die. Not ``graceful`` (a start that failed or was interrupted: no fleet ran,
    nothing is saved): SIGKILL at once, since a supervisor still importing TensorFlow runs its
    SIGTERM handler only once the import is done (Ctrl-C of a starting `up --detach` took 5-11
    s to return)."""
    marked = marked_processes(state_dir)
    supervisors = [*also, *(m.ref for m in marked if m.supervisor)]
    others = [m.ref for m in marked if not m.supervisor]
    if record is not None:
        supervisors.append(record.supervisor)
        others.extend(t.process for t in record.tasks)
    grace, supervisor_grace = (STOP_GRACE_S, SUPERVISOR_GRACE_S) if graceful else (0.0, 0.0)
    left = stop_processes(_unique(supervisors), grace_s=supervisor_grace)
    left += stop_processes(_unique(others), grace_s=grace)
    left += stop_processes(_unique(m.ref for m in marked_processes(state_dir)), grace_s=grace)
    return _unique(left)


def _unique(refs: Iterable[ProcessRef]) -> list[ProcessRef]:
    seen: dict[int, ProcessRef] = {}
    for ref in refs:
        seen.setdefault(ref.pid, ref)
    return list(seen.values())


def _pids(refs: Iterable[ProcessRef]) -> str:
    return ", ".join(str(r.pid) for r in refs)


def _clean_before_start(state_dir: str, note: Note) -> None:
    """Under the lock: refuse a folder whose fleet runs; otherwise stop the orphans of an
    earlier one and remove its leftover files, saying so in one line."""
    corrupt: CorruptStateError | None = None
    try:
        record = read_state(state_dir)
    except CorruptStateError as exc:
        record, corrupt = None, exc
    if record is not None and record.supervisor.alive():
        raise StateError(
            f"A fleet is already running in {state_dir} (supervisor pid "
            f"{record.supervisor.pid}); stop it with `{down_command(state_dir)}` or pass another "
            "state_dir",
            state_dir,
        )
    marked = marked_processes(state_dir)
    supervisors = [m.ref for m in marked if m.supervisor]
    if supervisors:
        why = f"its {STATE_FILE} is corrupt" if corrupt else f"it has no valid {STATE_FILE}"
        raise StateError(
            f"A fleet is already running in {state_dir} (supervisor pid {_pids(supervisors)}; "
            f"{why}); stop it with `{down_command(state_dir)}` or pass another state_dir",
            state_dir,
        )
    done = []
    orphans = _unique([*(m.ref for m in marked), *(t.process for t in (record or _NO).tasks)])
    orphans = [r for r in orphans if r.alive()]
    if orphans:
        left = stop_processes(orphans)
        if left:
            raise StateError(
                f"Process(es) {_pids(left)} of an earlier fleet in {state_dir} would not die; "
                "stop them, then try again",
                state_dir,
            )
        done.append(f"stopped {len(orphans)} orphaned process(es) (pid {_pids(orphans)})")
    removed = remove_leftovers(state_dir)
    if removed:
        what = {
            STATE_FILE: f"{STATE_FILE} ({'corrupt' if corrupt else 'stale'})",
            "error.json": "error.json (a failed start)",
            TLS_DIR: f"{TLS_DIR} (its TLS credentials)",
        }
        done.append("removed " + ", ".join(what.get(n, n) for n in removed))
    if done:
        note(f"cleaned up after an earlier fleet in {state_dir}: {'; '.join(done)}")


_NO = FleetRecord(ProcessRef(0, 0.0), {})


def start_detached(
    spec: SupervisorSpec, *, note: Note | None = None, on_ready: Callable[[], None] | None = None
) -> FleetRecord:
    """Start a supervisor for ``spec`` and return the fleet's record once every server answers.

    Holds the state folder's lock throughout. Raises :class:`StateError` if a fleet is already
    running in ``spec.state_dir`` or another command holds the lock, :class:`ClusterSpecError`/
    :class:`PortInUseError` before anything starts, and :class:`FleetStartError` if the
    supervisor reports a failed start, exits, or is not ready within ``spec.start_timeout_s``
    (plus a margin for its own start); then nothing it started is left running. ``note`` gets a
    one-line message for each thing cleaned up on the way (what an earlier fleet left).
    ``on_ready`` is called once the fleet is ready, still inside the start's clean-up: a Ctrl-C
    that comes before it returns stops everything as any other; the CLI has it ignore SIGINT,
    so that a Ctrl-C after that point cannot leave a fleet the command calls interrupted."""
    # checked when the spec was built; again before anything is created or started, for a
    # spec changed since (it is frozen, but object.__setattr__ gets past that)
    flag(spec.expose, "expose")
    state_dir = spec.state_dir
    created = not os.path.lexists(state_dir)
    foreign = foreign_entries(state_dir)
    if foreign:  # checked before the lock makes the folder private (0700)
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        shown = ", ".join(foreign[:5]) + more
        raise StateError(
            f"{state_dir} holds files that are not a fleet's ({shown}): a fleet's state folder "
            "is removed when the fleet stops; pass a new or empty folder as state_dir",
            state_dir,
        )
    with lock_state(state_dir, create=True):
        try:
            _clean_before_start(state_dir, note or _quiet)
            backend(spec.backend).check_cluster(
                spec.cluster, expose=spec.expose, **({"tls": True} if spec.tls else {})
            )
        except BaseException:
            if created:
                clear_state(state_dir)
            raise
        log_path = os.path.join(state_dir, SUPERVISOR_LOG)
        env = {**os.environ, MARK_ENV: fleet_mark(state_dir)}
        proc: subprocess.Popen[bytes] | None = None
        also: list[ProcessRef] = []
        try:
            with open(log_path, "ab") as log_file:
                proc = subprocess.Popen(
                    spec.command(),
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    close_fds=True,
                    env=env,
                )
            try:
                also.append(ProcessRef.of(proc.pid))
            except ProcessLookupError:  # it is gone already; the wait below says why
                also.append(ProcessRef(proc.pid, 0.0))
            record = _wait_ready(spec, proc, log_path)
            if on_ready is not None:
                on_ready()
            return record
        except BaseException:
            # a failed start, or Ctrl-C at any moment of it (a supervisor started before its
            # Popen returned carries the marker): nothing runs after it, and nothing is left in
            # the folder for `down` or the next `up` to wonder about
            left = _stop_all(state_dir, None, also=also, graceful=False)
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(1.0)
            if not left:
                clear_state(state_dir)
            raise


def _wait_ready(spec: SupervisorSpec, proc: subprocess.Popen[bytes], log_path: str) -> FleetRecord:
    state_dir = spec.state_dir
    deadline = time.monotonic() + spec.start_timeout + READY_MARGIN_S
    while True:
        with contextlib.suppress(CorruptStateError):  # written atomically: never, but be sure
            record = read_state(state_dir)
            if record is not None and record.supervisor.pid == proc.pid:
                return record
        error = read_error(state_dir)
        if error is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(SUPERVISOR_GRACE_S)  # it exits right after writing error.json
            _stop_all(state_dir, None)
            clear_state(state_dir)
            raise error  # the class the supervisor raised, with its attributes
        code = proc.poll()
        if code is not None:
            raise FleetStartError(
                f"The supervisor exited with code {code} before the fleet was ready; see {log_path}"
            )
        if time.monotonic() > deadline:
            raise FleetStartError(
                f"The detached fleet was not ready after {spec.start_timeout:g} s; raise "
                f"start_timeout_s (supervisor log: {log_path})"
            )
        time.sleep(0.05)


def stop_detached(state_dir: str, *, note: Note | None = None) -> str:
    """Stop the fleet in ``state_dir`` (or clean up a stale one), check that every process is
    gone and remove the folder. Returns what was done, in a few words (``"stopped N
    server(s)"``, ``"cleaned up a stale fleet"``, ...). Every process the fleet's supervisor
    started is found, by ``fleet.json`` and by its marker, so a corrupt, truncated or wrongly
    typed ``fleet.json`` (or none) still stops everything.

    Waits up to :data:`DOWN_LOCK_WAIT_S` for a command that holds the folder's lock (``note``
    says so once). Raises :class:`StateError` if there is no fleet (and nothing to clean up),
    :class:`FleetError` if a process would not die."""
    with lock_state(state_dir, wait_s=DOWN_LOCK_WAIT_S, on_wait=note) as locked:
        corrupt: StateError | None = None
        record = None
        if locked:
            try:
                record = read_state(state_dir)
            except StateError as exc:  # corrupt, or unreadable: the marker finds the processes
                corrupt = exc
        marked = marked_processes(state_dir)
        if record is None and corrupt is None and not marked:
            found = _start_leftovers(state_dir) if locked else []
            if not found:
                raise no_fleet(state_dir)
            clear_state(state_dir)
            return f"no fleet was running; removed what an earlier one left ({', '.join(found)})"
        stale = record is not None and not record.supervisor.alive()
        left = _stop_all(state_dir, record)
        if left:
            raise FleetError(f"Could not stop pid(s) {_pids(left)} of {state_dir}")
        clear_state(state_dir)
    if record is None:
        reason = corrupt.reason if isinstance(corrupt, CorruptStateError) else None
        why = (
            f"{STATE_FILE} was corrupt ({reason})"
            if reason
            else f"{STATE_FILE} was unreadable"
            if corrupt
            else f"there was no {STATE_FILE}"
        )
        if not marked:
            return f"{why}; no process of the fleet was running"
        return f"{why}; stopped {len(marked)} process(es) of the fleet found by their marker"
    if stale:
        return "cleaned up a stale fleet"
    return f"stopped {len(record.tasks)} server(s)"


def _start_leftovers(state_dir: str) -> list[str]:
    """What an earlier fleet, or a start that did not finish, left in ``state_dir``: the
    :func:`leftovers` and the supervisor's log (the folder and its lock are graphdist's own)."""
    found = leftovers(state_dir)
    for name in (SUPERVISOR_LOG, LOGS_DIR):  # kept after a stale fleet was cleaned up
        if os.path.lexists(os.path.join(state_dir, name)):
            found.append(name)
    return found
