"""Warm agents: a warm interpreter that outlives runs (``graphdist warm start``), so that a run on
this machine pays no TensorFlow import at all, not even once.

A run's own warm interpreter (:class:`~graphdist._distribute.warm.Zygote`) saves every task but
one import; the run still waits for that one, which on a small machine is most of a cold start.
An agent is a process of its own session that has imported the preloads and waits, listening on
a socket in Linux's abstract namespace (a random name: nothing to leave behind, nothing to guess)
that serves this user only (``SO_PEERCRED``; the launcher checks the agent's pid and user the same
way before it sends anything). Its record (pid and start time, socket, Python, preloads, the
environment its imports read, idle timeout) is ``warm-agent-KEY.json`` in :func:`warm_dir`, KEY
naming the Python and the preloads: one agent per interpreter and preload list.

A local run (:class:`~graphdist._local.run.LocalRun`) whose preloads and Python are an
agent's, and whose environment agrees with it in every variable read at import, connects instead
of starting its own zygote. The agent forks a *session* for the connection: a zygote
(:func:`graphdist._distribute.zygote.serve`) on that socket, with the signals the launcher found
ignored, which forks the run's guards and tasks as the run's own zygote would. A session ends as
a zygote does when its launcher's end closes (the run ends, or the launcher dies: the kernel
closes it), SIGTERMing its guards, which end their tasks; a session and its guards die with the
agent (their death signal). The agent is a subreaper and ends what is orphaned under it.

The agent exits after ``idle_timeout_s`` without a session (0: never), on SIGTERM (``graphdist
warm stop``: the sessions, and the runs' tasks in them, end with it; the runs restart their
attempt on their own zygote if they may restart), and removes its record as it goes. A record
whose process is gone (SIGKILL) is stale: found so, it is removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import select
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from graphdist._detached.state import ProcessRef
from graphdist._distribute.warm import (
    MSG_MAX,
    READY_TIMEOUT_S,
    Zygote,
    check_preload,
    env_differences,
    import_time_env,
    peer_credentials,
)
from graphdist._distribute.zygote import (
    TASK_SIGNALS,
    end_orphans,
    import_preloads,
    reap,
    serve,
    set_title,
)
from graphdist._exceptions import ArgumentError, StateError
from graphdist._private import private_dir, runtime_dir
from graphdist._proc.process import set_child_subreaper, set_parent_death_signal, stop_all

__all__ = [
    "IDLE_TIMEOUT_S",
    "SESSION_RLIMITS",
    "WARM_DIR_ENV",
    "AgentRecord",
    "NotAttached",
    "agent_command",
    "attach",
    "env_mismatch",
    "live_agent",
    "node_agent_main",
    "start_agent",
    "stop_agent",
    "warm_dir",
]

WARM_DIR_ENV = "GRAPHDIST_WARM_DIR"
#: Seconds an agent waits without a session before it exits (``--idle-timeout``; 0: never).
IDLE_TIMEOUT_S = 1800.0
#: Seconds a launcher waits for an agent's session to say ready (it imports nothing).
SESSION_READY_S = 10.0
#: ``python -c AGENT_CODE RECORD IDLE_S PRELOAD...``: ``-c``, as the run's own zygote.
AGENT_CODE = (
    "import sys; from graphdist._distribute.warmagent import agent_main; "
    "sys.exit(agent_main(sys.argv[1], float(sys.argv[2]), sys.argv[3:]))"
)


@dataclass(frozen=True)
class AgentRecord:
    """A warm agent as its record says it (the module docstring)."""

    pid: int
    boot_s: float  # when it started, in seconds after boot (ProcessRef)
    path: str  # "@NAME": its socket in the abstract namespace
    python: str
    preload: tuple[str, ...]
    env: dict[str, str]  # what of its environment its imports read
    idle_timeout_s: float
    started: float  # time.time()
    log: str
    served: int = 0  # sessions forked so far (runs served), rewritten as each one starts

    def alive(self) -> bool:
        """Whether the agent still runs: this pid, started at this time, not a zombie."""
        return ProcessRef(self.pid, self.boot_s).alive()


def warm_dir(create: bool = True) -> str:
    """Where warm agents' records live: ``$GRAPHDIST_WARM_DIR``, else ``warm`` in graphdist's
    runtime folder; private to this user either way (:func:`graphdist._private.private_dir`:
    a folder another user owns or can write to is a :class:`StateError`). Without ``create``,
    a missing folder stays missing (no agent is recorded there)."""
    chosen = os.environ.get(WARM_DIR_ENV)
    path = os.path.abspath(chosen) if chosen else os.path.join(runtime_dir(), "warm")
    return private_dir(path, "graphdist's warm agents' folder", create=create)


def _record_path(preload: Sequence[str], *, create: bool = True) -> str:
    key = json.dumps([os.path.abspath(sys.executable), list(preload)])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return os.path.join(warm_dir(create), f"warm-agent-{digest}.json")


def _read(path: str) -> AgentRecord | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        data["preload"] = tuple(data["preload"])
        return AgentRecord(**data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError):
        return None  # torn or foreign: no agent to use (start replaces it)


def live_agent(preload: Sequence[str]) -> AgentRecord | None:
    """The running agent of this Python and these preloads, or None (a stale record, whose
    process is gone, is removed)."""
    path = _record_path(preload, create=False)
    record = _read(path)
    if record is None:
        return None
    if record.alive():
        return record
    with contextlib.suppress(OSError):
        os.unlink(path)
    return None


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """The record's lock (``RECORD.lock``): one start or stop at a time. A stop removes the lock
    file while it holds it (:func:`_remove_files`); whoever then gets the lock on the removed file
    finds it is no longer the one at its path and locks the new one."""
    lock = path + ".lock"
    for _ in range(100):
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.path.samestat(os.fstat(fd), os.stat(lock)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # removed by a stop while this waited: lock the file at the path now
    else:
        raise StateError(f"The warm agents' lock {lock} is removed as soon as it is taken", lock)
    try:
        yield
    finally:
        os.close(fd)


def _remove_files(path: str) -> None:
    """What an agent leaves beside its record once it is gone: its log and the lock (held by
    the caller, :func:`_locked`)."""
    for name in (path.removesuffix(".json") + ".log", path + ".lock"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


def start_agent(
    preload: Sequence[str], env: Mapping[str, str], idle_timeout_s: float = IDLE_TIMEOUT_S
) -> tuple[AgentRecord, bool]:
    """The agent of these preloads, started with ``env`` unless one runs: ``(record, started)``.
    A preload that fails to import is an :class:`ArgumentError` naming it; an agent that does
    not get ready in :data:`READY_TIMEOUT_S` is a :class:`StateError`; neither leaves a
    process."""
    path = _record_path(preload)
    with _locked(path):
        running = live_agent(preload)
        if running is not None:
            return running, False
        log = path.removesuffix(".json") + ".log"
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
        with os.fdopen(os.open(log, flags, 0o600), "ab") as err:
            proc = subprocess.Popen(
                [sys.executable, "-c", AGENT_CODE, path, repr(float(idle_timeout_s)), *preload],
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                start_new_session=True,
            )
        try:
            line = _first_line(proc, READY_TIMEOUT_S)
        except BaseException:
            _end(proc)
            raise
        record = _read(path) if line.startswith("ready ") else None
        if record is None:
            _end(proc)
            why = line.removeprefix("cold: ") or f"it exited with code {proc.returncode}"
            if line.startswith("cold: cannot import"):
                raise ArgumentError(
                    f"preload: {why}; name modules that import in this Python",
                    name="preload",
                    value=",".join(preload),
                )
            raise StateError(f"The warm agent did not start: {why}; see {log}", log)
        assert proc.stdout is not None
        proc.stdout.close()
        return record, True


def _first_line(proc: subprocess.Popen[bytes], timeout_s: float) -> str:
    """The agent's first line on stdout ("ready @NAME" or "cold: WHY"), "" if it exited or
    said nothing in ``timeout_s``."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    if not ready:
        return ""
    return proc.stdout.readline().decode("utf-8", "replace").strip()


def _end(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def stop_agent(preload: Sequence[str], wait_s: float = 10.0) -> AgentRecord | None:
    """Stop the agent of these preloads (SIGTERM, then SIGKILL after ``wait_s``), check it is
    gone and remove its record, log and lock (also those an agent that exited by itself left);
    the record it had, or None where none ran."""
    path = _record_path(preload, create=False)
    if not os.path.isdir(os.path.dirname(path)):
        return None  # no folder: no agent was ever started there (nothing is made to say so)
    with _locked(path):
        record = live_agent(preload)
        if record is not None:
            if stop_all([ProcessRef(record.pid, record.boot_s)], wait_s, wait_s):
                raise StateError(f"The warm agent (pid {record.pid}) did not end", path)
            with contextlib.suppress(OSError):
                os.unlink(path)
        _remove_files(path)
        return record


@dataclass(frozen=True)
class NotAttached:
    """Why a run does not use a warm agent: ``why``; ``said``, one line for the user where an
    agent runs but is passed over (None where none runs: nothing to tell)."""

    why: str
    said: str | None = None


def agent_command(preload: Sequence[str], env: Mapping[str, str], differ: Sequence[str]) -> str:
    """The shell command that replaces the agent of ``preload`` by one that serves a run whose
    environment is ``env``: ``graphdist warm stop`` (one agent per Python and preloads), then
    ``warm start`` with the run's values of the variables in ``differ`` (``env -u`` for those the
    run does not set); ``--preload`` where it is not the default."""
    option = "" if tuple(preload) == check_preload("auto") else f" --preload {','.join(preload)}"
    unset = [f"-u {k}" for k in differ if k not in env]
    values = [f"{k}={shlex.quote(env[k])}" for k in differ if k in env]
    prefix = " ".join(["env", *unset, *values] if unset else values)
    start = f"{prefix} graphdist warm start{option}".lstrip()
    return f"graphdist warm stop{option} && {start}"


def env_mismatch(preload: Sequence[str], env: Mapping[str, str], record: AgentRecord) -> str:
    """Why the agent ``record`` names serves no run whose environment is ``env`` (each variable
    that differs, here and in the agent), and the command that starts one that would ("" where
    none differs)."""
    differ = env_differences(env, record.env)
    if not differ:
        return ""
    shown = "; ".join(
        f"{k} is {_value(env, k)} here, {_value(record.env, k)} in the agent" for k in differ
    )
    return (
        f"{shown}, read once, as the preloads import; the run imports them itself. An agent "
        f"for runs like this one: `{agent_command(preload, env, differ)}`"
    )


def attach(preload: Sequence[str], env: Mapping[str, str]) -> Zygote | NotAttached:
    """A session of the running agent of these preloads, as the run's zygote (its tasks forked
    from it), or why the run starts its own: no agent, another environment at import, an agent
    that does not answer as itself."""
    if not preload:
        return NotAttached("no preloads")
    try:
        record = live_agent(preload)
    except StateError as exc:  # a folder that is not ours: no agent of it is used
        return NotAttached(str(exc))
    if record is None:
        return NotAttached("no warm agent runs (graphdist warm start)")
    passed = f"graphdist: the warm agent (pid {record.pid}) is not used by this run"
    differ = env_differences(env, record.env)
    if differ:
        return NotAttached(
            f"the run's {differ[0]} differs from the warm agent's",
            f"{passed}: {env_mismatch(preload, env, record)}",
        )
    why = _session_of(record)
    if isinstance(why, str):
        return NotAttached(why, f"{passed}: {why}; the run imports its preloads itself")
    return why


def _value(env: Mapping[str, str], key: str) -> str:
    return shlex.quote(env[key]) if key in env else "unset"


def _session_of(record: AgentRecord) -> Zygote | str:
    """A session of the agent ``record`` names, or why there is none."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.connect("\0" + record.path[1:])
        pid, uid, _ = peer_credentials(sock)
        if (pid, uid) != (record.pid, os.getuid()):  # someone else's socket: send nothing
            sock.close()
            return f"the socket {record.path} is not the warm agent's (pid {pid}, uid {uid})"
        elsewhere = _elsewhere(record.pid)
        if elsewhere is not None:
            sock.close()
            return elsewhere
        sock.send(json.dumps(_hello()).encode())
    except OSError as exc:
        sock.close()
        return f"the warm agent does not answer ({exc.strerror or exc})"
    zygote = Zygote(record.preload, record.env, session=sock)
    why = zygote.ready(SESSION_READY_S)
    if why is not None:
        zygote.close()
        return f"the warm agent's session: {why}"
    return zygote


def _elsewhere(pid: int) -> str | None:
    """Why a task forked by agent ``pid`` would not be where a task of this launcher is: another
    cgroup (a Slurm job's, a systemd scope's: its limits and accounting) or namespace; None
    where it would be."""
    try:
        with open("/proc/self/cgroup") as mine, open(f"/proc/{pid}/cgroup") as its:
            if mine.read() != its.read():
                return "the warm agent is in another cgroup than this run"
        for ns in sorted(os.listdir("/proc/self/ns")):
            if os.stat(f"/proc/self/ns/{ns}").st_ino != os.stat(f"/proc/{pid}/ns/{ns}").st_ino:
                return f"the warm agent is in another {ns} namespace than this run"
    except OSError as exc:
        return f"the warm agent's cgroup and namespaces cannot be read ({exc.strerror or exc})"
    return None


#: The resource limits a session takes from its launcher (or node client), as a fresh process
#: would have them.
SESSION_RLIMITS = ("RLIMIT_CORE", "RLIMIT_NOFILE", "RLIMIT_STACK", "RLIMIT_AS", "RLIMIT_NPROC")


def _hello() -> dict[str, Any]:
    """What a session takes from its launcher that a fresh process would inherit from it:
    ignored signals, umask, resource limits, CPU affinity, niceness."""
    import resource

    umask = os.umask(0o022)
    os.umask(umask)
    return {
        "ignored": [int(s) for s in TASK_SIGNALS if signal.getsignal(s) == signal.SIG_IGN],
        "umask": umask,
        "rlimits": {n: resource.getrlimit(getattr(resource, n)) for n in SESSION_RLIMITS},
        "affinity": sorted(os.sched_getaffinity(0)),
        "nice": os.nice(0),
    }


def _take(hello: dict[str, Any]) -> None:
    """In a session: what its launcher passed (:func:`_hello`), each as far as the kernel lets
    (a hard limit above the agent's, a niceness below it: kept as they are)."""
    import resource

    if "umask" in hello:
        os.umask(int(hello["umask"]))
    for name, (soft, hard) in dict(hello.get("rlimits", {})).items():
        with contextlib.suppress(OSError, ValueError, AttributeError):
            resource.setrlimit(getattr(resource, name), (soft, hard))
    with contextlib.suppress(OSError, ValueError):
        os.sched_setaffinity(0, hello.get("affinity") or os.sched_getaffinity(0))
    with contextlib.suppress(OSError):
        os.nice(int(hello.get("nice", os.nice(0))) - os.nice(0))


# -- the agent's own side -------------------------------------------------------------------------


def agent_main(record_path: str, idle_timeout_s: float, preload: Sequence[str]) -> int:
    """The machine's agent (module docstring): 0 once stopped or idle, 2 where a preload did
    not import (said on stdout: ``cold: cannot import ...``)."""
    return _agent(preload, record_path=record_path, idle_timeout_s=idle_timeout_s)


def node_agent_main(tag: str, preload: Sequence[str]) -> int:
    """A run's agent on one of its nodes (:mod:`graphdist._distribute.nodewarm`): the same
    agent, with no record (the run reads its ``ready`` line) and no idle timeout; a SIGTERM
    (the run's end; Slurm cancelling or requeueing the job, which signals every step) takes no
    new task but waits for the sessions still running: their guards got it too and grant their
    tasks their grace to save (Slurm's KillWait bounds the wait)."""
    return _agent(preload, name=f"graphdist-warm-{tag}", drain=True)


def _agent(
    preload: Sequence[str],
    *,
    record_path: str | None = None,
    idle_timeout_s: float = 0.0,
    name: str = "graphdist-warm-agent",
    drain: bool = False,
) -> int:
    why = import_preloads(preload)
    if why is not None:
        print(f"cold: {why}", flush=True)
        return 2
    os.chdir("/")  # holds no folder busy (each task goes to its own)
    set_child_subreaper()
    # Linux's abstract namespace: no file to leave behind, even if the agent is SIGKILLed; any
    # process of the network namespace may connect, so SO_PEERCRED is the check (_session)
    name = f"{name}-{os.getpid()}-{secrets.token_hex(8)}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind("\0" + name)
    listener.listen(64)
    listener.setblocking(False)
    me = ProcessRef.of(os.getpid())
    record = AgentRecord(
        me.pid,
        me.started,
        "@" + name,  # as ss and lsof write it; a client turns "@" back into NUL
        os.path.abspath(sys.executable),
        tuple(preload),
        import_time_env(os.environ),
        idle_timeout_s,
        time.time(),
        "" if record_path is None else record_path.removesuffix(".json") + ".log",
    )
    if record_path is not None:
        _write_record(record_path, record)
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    stop: list[int] = []
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    print(f"ready {record.path}", flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the starter stops reading: nothing more to say there
    os.close(devnull)
    sessions: set[int] = set()
    idle_since = time.monotonic()
    try:
        while not stop or (drain and sessions):
            if stop:  # draining: a new client is refused at once (and runs cold), not held
                listener.close()
            with contextlib.suppress(InterruptedError):
                select.select([wake_r] if stop else [listener.fileno(), wake_r], [], [], 1.0)
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_r, 512):
                    pass
            for pid, _ in reap():
                sessions.discard(pid)
            end_orphans(sessions)
            now = time.monotonic()
            if sessions:
                idle_since = now
            elif idle_timeout_s > 0 and now - idle_since >= idle_timeout_s:
                break
            while not stop:
                try:
                    conn, _ = listener.accept()
                except (BlockingIOError, InterruptedError):
                    break
                session = _session(conn, listener, (wake_r, wake_w), preload)
                if session is not None:
                    sessions.add(session)
                    record = replace(record, served=record.served + 1)
                    if record_path is not None:
                        with contextlib.suppress(OSError):  # a count for status only
                            _write_record(record_path, record)
    finally:
        if record_path is not None and (_read(record_path) or record).pid == record.pid:
            with contextlib.suppress(OSError):
                os.unlink(record_path)
        listener.close()
    return 0  # the sessions die with us (their death signal), their guards with them


def _write_record(path: str, record: AgentRecord) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(asdict(record), f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # a full disk, say: no half-written record left beside the real one
        raise


def _session(
    conn: socket.socket, listener: socket.socket, wake: tuple[int, int], preload: Sequence[str]
) -> int | None:
    """Fork a session for ``conn`` if its peer is this user's; its pid, or None. Its peer's
    hello (:func:`_hello`, a node client's own) says what the session takes from it, and
    ``"on_close": "kill"`` that a guard whose client goes away is SIGKILLed (a node client's
    step cancelled: a frozen task, a broken attempt), not given its grace."""
    _, uid, _ = peer_credentials(conn)
    if uid != os.getuid():
        conn.close()  # another user's process: nothing is read, nothing forked
        return None
    try:
        pid = os.fork()
    except OSError:
        conn.close()
        return None
    if pid != 0:
        conn.close()
        return pid
    code = 70
    try:  # the session: never returns
        set_parent_death_signal(signal.SIGKILL)
        listener.close()
        signal.set_wakeup_fd(-1)
        for fd in wake:
            os.close(fd)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        set_title("graphdist-warm-session")
        conn.setblocking(True)
        ready, _, _ = select.select([conn], [], [], SESSION_READY_S)
        hello = json.loads(conn.recv(MSG_MAX) or b"{}") if ready else None
        if hello is not None:
            _take(hello)
            kill = hello.get("on_close") == "kill"
            code = serve(
                conn,
                frozenset(int(s) for s in hello.get("ignored", ())),
                preload=preload,
                close_signal=signal.SIGKILL if kill else signal.SIGTERM,
            )
    except BaseException:
        code = 70
    finally:
        os._exit(code)
