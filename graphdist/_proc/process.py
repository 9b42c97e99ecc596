"""Process control, one home for it: how graphdist stops processes, ties a child's life to its
parent's, and waits for processes to be gone.

- :func:`stop_all` escalates: SIGTERM to every target at once, up to ``grace_s`` for them to exit,
  then SIGKILL to the rest and up to ``kill_wait_s`` more. Fleets (their server processes), the
  launcher (each task's guard) and detached fleets (recorded pids) all stop this way; each wraps its
  processes in a small object with ``signal(sig)`` and ``running()`` (:class:`Stoppable`).
  :func:`stop_processes` does the same for child processes (``Popen``), reaping them: a gateway,
  a zygote, ``srun`` and the like. Nothing outside this file writes that escalation by hand.
- :func:`set_parent_death_signal` asks the kernel to signal the calling process (SIGKILL unless
  told otherwise) when its parent thread exits (``PR_SET_PDEATHSIG``); the guard below uses it so
  that nothing outlives its owner.
- :func:`guarded_argv` wraps a command in a *guard*, what ``graphdist run`` starts for each task
  (below): this file run as a script (``python -I -S``: the standard library and its report's
  module only, so it starts in tens of milliseconds and no user environment reaches it).
- :func:`descendants`: a process's live descendants (``/proc``); :func:`wait_gone`: until pids
  have exited (a zombie counts as exited).

The guard exists because a task's command is often not the process that matters: ``sh -c 'python
train.py; true'`` runs TensorFlow in a grandchild. ``PR_SET_PDEATHSIG`` reaches only a direct child
and is not inherited by the grandchildren it forks; a signal to the task's process group misses a
grandchild that called ``setsid``, and once the shell is gone its orphans belong to init, where no
one looks for them. So the guard

- is a child subreaper (``PR_SET_CHILD_SUBREAPER``): every orphan in its tree, daemons that forked
  twice into a session of their own included, is re-parented to it, so its descendants are exactly
  what the task started and still runs;
- has ``PR_SET_PDEATHSIG`` = SIGTERM on its owner (the launcher's thread), checked against a race
  with the owner's pid, so even a SIGKILLed launcher sets it off; SIGTERM, SIGINT and SIGHUP from
  anyone do the same;
- then, and also when the command exits (its leftovers go with it), ends every descendant: SIGTERM
  (SIGINT when SIGINT stopped it: a Ctrl-C passed on), ``grace_s`` (:data:`STOP_GRACE_S`) for
  them to exit, SIGKILL for the rest (a TensorFlow program may catch or ignore SIGTERM), reaping
  as it goes; :data:`NOW_SIGNAL` (SIGUSR1), at any time, cuts the grace: SIGKILL at once; it
  exits only once none is left, with the command's exit code, or dying of the signal that
  killed the command, so the owner sees the command's status as if it had started it itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

if TYPE_CHECKING:
    import subprocess

__all__ = [
    "KILL_WAIT_S",
    "NOW_SIGNAL",
    "STOP_GRACE_S",
    "TASK_STOP_GRACE_S",
    "ProcStat",
    "Stoppable",
    "descendants",
    "guard",
    "guarded_argv",
    "proc_stat",
    "set_child_subreaper",
    "set_parent_death_signal",
    "stop_all",
    "stop_processes",
    "wait_gone",
]

#: Seconds a server process gets between SIGTERM and SIGKILL.
STOP_GRACE_S = 3.0
#: Seconds a task's guard gets between SIGTERM and SIGKILL: its tree's grace plus time to reap.
TASK_STOP_GRACE_S = STOP_GRACE_S + 2.0
#: Seconds to wait for SIGKILLed processes to be gone before reporting them as survivors.
KILL_WAIT_S = 5.0
#: A task's progress channel's variable (:data:`graphdist._proc.guardreport.PROGRESS_ENV`).
PROGRESS_ENV = "GRAPHDIST_PROGRESS_FD"
_POLL_S = 0.02
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
#: What the guard's owner's death sends the guard: catchable, unlike SIGKILL, so it can clean up.
GUARD_DEATH_SIGNAL = signal.SIGTERM
_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
#: What tells a guard to end its task at once, no grace: its group broke, waiting delays a restart.
NOW_SIGNAL = signal.SIGUSR1
#: What tells a guard to pass a preemption notice on: SIGTERM to its command alone (TensorFlow's
#: preemption handler saves on it); a guard Slurm started (``parent``, whose every process of a
#: step Slurm signals) runs its command with this signal ignored.
PREEMPT_SIGNAL = signal.SIGUSR2
_GUARD_SIGNALS = _STOP_SIGNALS | {NOW_SIGNAL, PREEMPT_SIGNAL, signal.SIGCHLD}


class Stoppable(Protocol):
    """Something :func:`stop_all` can stop: it takes signals and says whether it still runs."""

    def signal(self, sig: int) -> None: ...

    def running(self) -> bool: ...


_S = TypeVar("_S", bound=Stoppable)


def _wait(targets: list[_S], seconds: float) -> list[_S]:
    deadline = time.monotonic() + seconds
    live = [t for t in targets if t.running()]
    while live and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        live = [t for t in live if t.running()]
    return live


def stop_all(
    targets: Iterable[_S],
    grace_s: float = STOP_GRACE_S,
    kill_wait_s: float = KILL_WAIT_S,
    *,
    before_kill: Callable[[list[_S]], object] | None = None,
) -> list[_S]:
    """SIGTERM every running target, wait up to ``grace_s`` seconds, SIGKILL the rest and wait up
    to ``kill_wait_s``; return the targets still running after that (normally none).
    ``before_kill(live)``, where given, runs once the grace is over (or every target has
    exited: ``live`` is then empty), before the SIGKILL: a Slurm fleet cancels its steps there."""
    live = [t for t in targets if t.running()]
    for target in live:
        target.signal(signal.SIGTERM)
    live = _wait(live, grace_s)
    if before_kill is not None:
        before_kill(live)
        live = [t for t in live if t.running()]
    for target in live:
        target.signal(signal.SIGKILL)
    return _wait(live, kill_wait_s)


class _Child:
    """A child process (``Popen``) for :func:`stop_all`; asking whether it runs reaps it."""

    def __init__(self, proc: subprocess.Popen[Any]) -> None:
        self.proc = proc

    def signal(self, sig: int) -> None:
        with contextlib.suppress(OSError):  # gone and reaped in between
            self.proc.send_signal(sig)

    def running(self) -> bool:
        return self.proc.poll() is None


def stop_processes(
    procs: Iterable[subprocess.Popen[Any]],
    grace_s: float = STOP_GRACE_S,
    kill_wait_s: float = KILL_WAIT_S,
    *,
    before_kill: Callable[[Sequence[subprocess.Popen[Any]]], object] | None = None,
) -> list[subprocess.Popen[Any]]:
    """:func:`stop_all` for this process's children: SIGTERM, up to ``grace_s`` seconds, SIGKILL,
    up to ``kill_wait_s``, each reaped once it has exited; the children still running after that
    (normally none). ``before_kill(live)`` runs once the grace is over, as for :func:`stop_all`,
    with the children still running then."""

    def hook(live: list[_Child]) -> None:
        if before_kill is not None:
            before_kill([child.proc for child in live])

    left = stop_all([_Child(p) for p in procs], grace_s, kill_wait_s, before_kill=hook)
    return [child.proc for child in left]


def _prctl(option: int, value: int) -> bool:
    with contextlib.suppress(OSError, AttributeError):
        return int(ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)) == 0
    return False


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when the thread that forked it exits.

    Safe between fork and exec (``preexec_fn``). Returns False where ``prctl`` is unavailable."""
    return _prctl(_PR_SET_PDEATHSIG, sig)


def set_child_subreaper() -> bool:
    """Make this process a child subreaper (``PR_SET_CHILD_SUBREAPER``): every orphan among its
    descendants is re-parented to it, not to init. Returns False where ``prctl`` is unavailable."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def _gone(pid: int) -> bool:
    import psutil  # here, not at the top: the guard runs this file without site-packages

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def wait_gone(pids: Iterable[int], timeout_s: float) -> list[int]:
    """Wait until every pid has exited; return those still running after ``timeout_s``."""
    pending = list(pids)
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        pending = [p for p in pending if not _gone(p)]
        if pending:
            time.sleep(_POLL_S)
    return [p for p in pending if not _gone(p)]


# --- descendants and the guard -------------------------------------------------------------------

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class ProcStat(NamedTuple):
    """What /proc/PID/stat says of a process."""

    state: str  # R, S, D, T, t, Z, X, ...
    ppid: int
    #: When it started, in seconds after boot: the kernel's count, which no change of the wall
    #: clock moves (psutil's ``create_time`` adds the boot time read now, which a clock step
    #: moves: two live warm agents of one CI run no longer matched their records).
    started: float


def proc_stat(pid: int) -> ProcStat | None:
    """:class:`ProcStat` of ``pid``, None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # the name, in (), may hold anything
        return ProcStat(fields[0].decode(), int(fields[1]), int(fields[19]) / _CLOCK_TICKS)
    except (OSError, IndexError, ValueError):
        return None


def _children_by_scan() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = proc_stat(int(entry))
            if stat is not None:
                children.setdefault(stat[1], []).append(int(entry))
    return children


def _children(pid: int) -> list[int] | None:
    """pid's children from /proc/PID/task/*/children; None where the kernel lacks that file."""
    kids: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                kids.extend(int(k) for k in f.read().split())
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue  # the thread is gone
            return None  # no CONFIG_PROC_CHILDREN
        except OSError:
            continue
    return kids


def descendants(pid: int) -> list[int]:
    """The live (not zombie) descendants of ``pid``, parents before children (Linux ``/proc``)."""
    found: list[int] = []
    table: dict[int, list[int]] | None = None
    todo = [pid]
    while todo:
        parent = todo.pop(0)
        kids = _children(parent) if table is None else table.get(parent, [])
        if kids is None:
            table = _children_by_scan()
            kids = table.get(parent, [])
        for kid in kids:
            if kid not in found and kid != pid:
                found.append(kid)
                todo.append(kid)
    return [p for p in found if (proc_stat(p) or ("Z", 0))[0] not in ("Z", "X")]


def guarded_argv(
    command: Sequence[str],
    owner: int | None = None,
    grace_s: float = STOP_GRACE_S,
    *,
    name: str | None = None,
    report_fd: int | None = None,
    parent: bool = False,
    progress: bool | str = False,
) -> list[str]:
    """The argv that runs ``command`` under a guard (see the module docstring) whose owner is
    ``owner`` (default: this process), which must be the process that starts it; ``parent``:
    whichever process starts it (a guard that another program starts for graphdist, as Slurm's
    step daemon does on a node). ``name`` (a task's, ``worker-1``) shows in ``ps``;
    ``report_fd``, an inherited pipe, gets the guard's reports (:mod:`graphdist._proc.
    guardreport`), the command's end before the guard ends what it left behind; ``progress``:
    and the command's progress records (where the command is the task), or ``"step"``: those
    its command's stderr carries from the guard on an engine's node (the command is ``srun``:
    :class:`~graphdist._proc.guardreport.ProgressRelay`). A guard whose ``report_fd`` is 2 (on a
    node, its report on the step's stderr) gives its command its stdout as stderr."""
    owner = os.getpid() if owner is None else owner
    script = os.path.abspath(__file__)
    options = [] if name is None else ["--name", name]
    options += [] if report_fd is None else ["--report", str(report_fd)]
    if progress and report_fd is not None:
        options += ["--progress-step" if progress == "step" else "--progress"]
    whose = "parent" if parent else str(owner)
    head = [sys.executable, "-I", "-S", script, *options, whose, repr(float(grace_s))]
    return [*head, "--", *command]


class _Guard:
    def __init__(
        self,
        command: Sequence[str],
        grace_s: float,
        *,
        in_step: bool = False,
        run_child: Callable[[], object] | None = None,
        stderr_fd: int | None = None,
    ) -> None:
        self.command = list(command)
        self.stderr_fd = stderr_fd  # what the command gets as its stderr, if not ours
        # the command run in the forked child instead of exec'ing it (a warm task: the child
        # of an interpreter that has imported what the command needs; it never returns)
        self.run_child = run_child
        self.in_step = in_step  # started by Slurm's step daemon: signalled with its whole step
        self.grace_s = grace_s
        self.pid = os.getpid()
        self.child = 0
        self.status: int | None = None  # the command's wait status, once reaped
        self.now = False  # NOW_SIGNAL came: no grace period
        # the stop the tree is sent: SIGTERM, or SIGINT for a stop by SIGINT (a user's Ctrl-C,
        # passed on as a terminal would have: a TensorFlow program that ignores SIGTERM, as
        # MultiWorkerMirroredStrategy's does, ends on it at its next step)
        self.stop_with = signal.SIGTERM
        # the stop signal reached every process of the task at once (Slurm signals a step's
        # every process): sending it again would be a second SIGTERM, which TensorFlow's
        # preemption handler, busy saving after the first, does not survive
        self.signalled_together = False

    def reap(self) -> None:
        """Reap every child that has exited: the command, and orphans re-parented to us."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.child:
                self.status = status

    def spawn(self) -> int | None:
        """Start the command (the signals we block, unblocked for it), dying with us: its
        ``PR_SET_PDEATHSIG`` is SIGKILL, so a SIGKILLed guard does not leave its command running
        (what the command started is found by its mark: :mod:`graphdist._proc.marks`). An exit
        code on failure."""
        report_r, report_w = os.pipe2(os.O_CLOEXEC)  # closed by a successful exec
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child execs or exits
            try:
                os.close(report_r)
                set_parent_death_signal(signal.SIGKILL)
                if os.getppid() != self.pid:  # the guard died before the signal was armed
                    os._exit(128 + signal.SIGKILL)
                if self.run_child is not None:  # no exec to close the report: it runs
                    os.close(report_w)
                    self.run_child()
                if self.stderr_fd is not None:
                    os.dup2(self.stderr_fd, 2)
                for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # as subprocess's restore_signals
                    signal.signal(sig, signal.SIG_DFL)
                if self.in_step:  # the notice meant for us reaches the command too
                    signal.signal(PREEMPT_SIGNAL, signal.SIG_IGN)
                signal.pthread_sigmask(signal.SIG_SETMASK, ())
                os.execvp(self.command[0], self.command)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.write(report_w, f"{exc.errno or 0} {exc.strerror or exc}".encode())
            finally:
                os._exit(127)
        os.close(report_w)
        with os.fdopen(report_r, "rb") as report:
            failed = report.read()
        if failed:
            os.waitpid(pid, 0)
            code, _, why = failed.decode("utf-8", "replace").partition(" ")
            print(f"graphdist: cannot run {self.command[0]!r}: {why}", file=sys.stderr, flush=True)
            return 127 if code == str(errno.ENOENT) else 126
        self.child = pid
        return None

    def end_tree(self) -> None:
        """SIGTERM every descendant, give them grace_s, then SIGKILL until none is left."""
        if not self.now:
            if not self.signalled_together:
                self._send(self.stop_with)
            self._wait(self.grace_s)
        deadline = time.monotonic() + KILL_WAIT_S
        while (self._send(signal.SIGKILL) or self._unreaped()) and time.monotonic() < deadline:
            self._wait(_POLL_S * 5, grace=False)
        self.reap()

    def _send(self, sig: int) -> list[int]:
        live = descendants(self.pid)
        for pid in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        return live

    def _unreaped(self) -> bool:
        """Whether the command is not reaped yet, though it may look gone: a multi-threaded
        command's main thread is a zombie (state Z, no descendant) while its other threads
        exit, and only once the last one has can it be waited for. A guard that took it for
        gone exited without its status: 143 for a TensorFlow task that had saved and exited
        42 on a requeue's SIGTERM."""
        return self.child != 0 and self.status is None

    def _wait(self, seconds: float, *, grace: bool = True) -> None:
        """Reap until the tree is gone or ``seconds`` are up; a grace period (``grace``) ends
        at once on NOW_SIGNAL."""
        deadline = time.monotonic() + seconds
        while True:
            self.reap()
            left = deadline - time.monotonic()
            if left <= 0 or (grace and self.now):
                return
            if not descendants(self.pid) and not self._unreaped():
                return
            # wakes up for our children's exits; grandchildren's are polled
            info = signal.sigtimedwait(_GUARD_SIGNALS, min(left, _POLL_S * 5))
            if info is not None and info.si_signo == NOW_SIGNAL:
                self.now = True

    def exit_code(self, stop: int) -> int:
        """The command's exit code; for a command killed by a signal, die of that signal."""
        status = self.status
        if status is None:
            return 128 + stop
        if os.WIFSIGNALED(status):
            _die_of(os.WTERMSIG(status))
            return 128 + os.WTERMSIG(status)  # a signal that does not kill by default
        return os.waitstatus_to_exitcode(status)


def _die_of(sig: int) -> None:
    import resource

    with contextlib.suppress(OSError, ValueError):
        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    with contextlib.suppress(OSError, ValueError):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
    os.kill(os.getpid(), sig)


def _relay_class() -> Any:
    """:class:`graphdist._proc.guardreport.ProgressRelay`; where the guard runs as a script
    (``-I -S``: no package on its path), its sibling file, the path's last place."""
    try:
        from graphdist._proc.guardreport import ProgressRelay
    except ImportError:
        sys.path.append(os.path.dirname(os.path.abspath(__file__)))
        from guardreport import ProgressRelay  # type: ignore[import-not-found,no-redef]
    return ProgressRelay


def _report(fd: int | None, line: str) -> None:  # read by guardreport.parse_report
    if fd is not None:
        with contextlib.suppress(OSError):
            os.write(fd, (line + "\n").encode())


def _report_exit(fd: int | None, status: int, relay: Any) -> None:
    """Say the command's exit; a step's (srun's: ``relay.step``) once srun's last words are on
    stdout (``guardreport.DRAIN_S``), so that the launcher reads them first."""
    if relay is not None and relay.step:
        relay.drain(relay.DRAIN_S)
    _report(fd, f"exit {os.waitstatus_to_exitcode(status)} {time.time()!r}")


def _guard_main(args: Sequence[str]) -> int:
    """``[--name NAME] [--report FD [--progress]] OWNER GRACE_S -- COMMAND...``: run COMMAND as
    a guard for OWNER (a pid, or ``parent``: whoever started it; module docstring)."""
    args = list(args)
    report_fd, progress = None, ""
    flags = ("--progress", "--progress-step")
    while args[:1] in (["--name"], ["--report"], *([f] for f in flags)) and len(args) > 1:
        progress = args[0] if args[0] in flags else progress
        if args[0] == "--report":
            report_fd = int(args[1])
        args = args[1:] if args[0] in flags else args[2:]
    if len(args) < 4 or args[2] != "--":
        print(
            "usage: process.py [--name NAME] [--report FD [--progress|--progress-step]] "
            "OWNER_PID|parent GRACE_S -- COMMAND...",
            file=sys.stderr,
        )
        return 2
    owner = os.getppid() if args[0] == "parent" else int(args[0])
    grace_s, command = float(args[1]), args[3:]
    in_step = args[0] == "parent"
    how: bool | str = "step" if progress == "--progress-step" else bool(progress)
    return guard(command, owner, grace_s, report_fd=report_fd, in_step=in_step, progress=how)


def guard(
    command: Sequence[str],
    owner: int,
    grace_s: float,
    *,
    report_fd: int | None = None,
    in_step: bool = False,
    run_child: Callable[[], object] | None = None,
    progress: bool | str = False,
) -> int:
    """Be ``command``'s guard (the module docstring) in this process, for ``owner`` (its parent)
    and return the exit code to exit with; ``run_child``: what the command's forked child runs
    instead of exec'ing ``command`` (a warm task); ``progress``: relay the command's progress
    records (its reader reads as they come: :class:`graphdist._proc.guardreport.ProgressRelay`)."""
    # Signals first: from here on a stop request waits for us instead of killing us.
    signal.pthread_sigmask(signal.SIG_BLOCK, _GUARD_SIGNALS)
    set_parent_death_signal(GUARD_DEATH_SIGNAL)
    set_child_subreaper()
    if os.getppid() != owner:  # the owner died before the death signal was armed
        return 128 + GUARD_DEATH_SIGNAL
    os.environ.pop(PROGRESS_ENV, None)  # the command gets ours, or none
    if report_fd is not None:  # the guard's alone, never its command's
        os.set_inheritable(report_fd, False)
    relay = None
    if report_fd is not None and progress:
        relay = _relay_class()(report_fd, step=progress == "step")
    stderr_fd = 1 if report_fd == 2 else None  # the report has our stderr: the command's joins
    if relay is not None and relay.step:  # its stdout (node), or is read by our relay (srun)
        stderr_fd = relay.write_fd
    guard = _Guard(command, grace_s, in_step=in_step, run_child=run_child, stderr_fd=stderr_fd)
    failed = guard.spawn()
    if relay is not None:
        relay.started()
    if failed is not None:
        _report(report_fd, f"exit {failed} {time.time()!r}")
        return failed
    _report(report_fd, f"pid {guard.child}")
    stop = 0
    while guard.status is None and not stop:
        info = signal.sigtimedwait(_GUARD_SIGNALS, 1.0)
        guard.reap()
        if info is not None and info.si_signo == NOW_SIGNAL:
            guard.now, stop = True, signal.SIGKILL
        elif info is not None and info.si_signo == PREEMPT_SIGNAL:
            with contextlib.suppress(ProcessLookupError):
                os.kill(guard.child, signal.SIGTERM)
        elif info is not None and info.si_signo in _STOP_SIGNALS:
            stop = info.si_signo
            guard.stop_with = signal.SIGINT if stop == signal.SIGINT else signal.SIGTERM
            # a guard Slurm started is signalled with its whole step (scancel, a requeue)
            guard.signalled_together = guard.in_step and stop == signal.SIGTERM
        elif os.getppid() != owner:
            stop = GUARD_DEATH_SIGNAL
    ended_first = guard.status is not None
    if guard.status is not None:  # the command ended by itself: said before its leftovers end
        _report_exit(report_fd, guard.status, relay)
    guard.end_tree()
    if not ended_first and guard.status is not None:  # stopped, and ended by the stop
        _report_exit(report_fd, guard.status, relay)
    if relay is not None:  # the tree is gone: what it wrote last is read at once
        relay.finish(1.0)
    return guard.exit_code(stop or GUARD_DEATH_SIGNAL)


if __name__ == "__main__":
    sys.exit(_guard_main(sys.argv[1:]))
