"""Warm task interpreters on the nodes of an engine's run (Slurm's, Ray's): one *agent* per node
and run, and a thin *client* as each task's step.

The agent (:func:`agent_main`, a ``srun --overlap`` step of its own, started by the run before
the first attempt places a task on the node and kept across attempts) starts a
:class:`~graphdist._distribute.warm.Zygote` on its node, which imports the run's preloads, then
listens on a socket there (``SOCK_SEQPACKET``, in Linux's abstract namespace: no file, nothing
left behind; a peer of another user is closed at once, ``SO_PEERCRED``) and prints ``ready
@NAME``. Each task's step is
then the client (:data:`CLIENT_CODE`, ``python -I -S``: the standard library only, no
TensorFlow): it sends its environment (the task's, as srun set it), working folder and command
with its stdin/stdout/stderr (``SCM_RIGHTS``); the agent asks :func:`warm_target` and has the
zygote fork the task's guard on those descriptors, so the task's output goes through srun as a
cold task's does. The client forwards the signals srun and Slurm send its step to the guard (a
stop, the preemption notice) and exits with the guard's status, or dies of its signal. A client
the agent cannot serve (no agent, a task that runs cold) executes the cold command in its place,
so the step is a cold task's. A client that ends first (its step cancelled: a frozen task, a
broken attempt) has its guard SIGKILLed by the agent; the zygote (a subreaper) ends what the
guard leaves.

A warm task runs in the agent's step, not its own: Slurm accounts its CPU and memory to the
agent's step (``sstat`` on the task's step shows the client only).

On Ray (:class:`graphdist._ray.agents.RayAgents`) the agent is a process of a Ray actor pinned
to its node (no CPU of its own), under graphdist's guard tied to the actor, so it ends with the
actor however the actor ends; each task's actor runs the client under its guard instead of the
command (the client's cold fallback is the command itself, under the same guard). Abstract
sockets are per network namespace: a node's agent and its tasks share the node's.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from graphdist._distribute.warm import (
    READY_TIMEOUT_S,
    WarmProc,
    Zygote,
    peer_credentials,
    warm_target,
)
from graphdist._proc import oom
from graphdist._proc.oom import NODE_OOM_PREFIX

__all__ = [
    "AGENT_CODE",
    "CLIENT_CODE",
    "agent_main",
    "client_argv",
    "run_cold_because",
]

#: The agent's command: ``python -c AGENT_CODE TAG PRELOAD...``.
AGENT_CODE = (
    "import sys; from graphdist._distribute.nodewarm import agent_main; "
    "sys.exit(agent_main(sys.argv[1], sys.argv[2:]))"
)

#: A task's step: ``python -I -S -c CLIENT_CODE PATH SPEC -- COLD_ARGV...`` (SPEC: JSON of the
#: task's name, command and guard's grace).
CLIENT_CODE = r"""
import json, os, signal, socket, sys
path, spec, cold = sys.argv[1], json.loads(sys.argv[2]), sys.argv[4:]
def run_cold():
    os.execvp(cold[0], cold)
try:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect("\0" + path[1:] if path.startswith("@") else path)
    spec.update(env=dict(os.environ), cwd=os.getcwd())
    socket.send_fds(sock, [json.dumps(spec).encode()], [0, 1, 2])
    answer = json.loads(sock.recv(1 << 16) or b'{"cold": "gone"}')
except (OSError, ValueError):
    run_cold()
if "cold" in answer:
    sock.close()
    run_cold()
guard = int(answer["pid"])
def forward(sig, frame):
    try:
        os.kill(guard, sig)
    except ProcessLookupError:
        pass
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, forward)
while True:
    try:
        said = sock.recv(1 << 16)
    except InterruptedError:
        continue
    if not said:
        sys.exit(70)
    answer = json.loads(said)
    if answer.get("oom"):  # its node's kernel killed the task for memory: say so first
        os.write(2, (NODE_OOM_PREFIX + answer["oom"] + "\n").encode())
    code = int(answer["exit"])
    if code < 0:  # die of the guard's signal, as the guard died of its command's (no core)
        import resource
        sock.close()
        try:
            hard = resource.getrlimit(resource.RLIMIT_CORE)[1]
            resource.setrlimit(resource.RLIMIT_CORE, (0, hard))
            signal.signal(-code, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {-code})
        os.kill(os.getpid(), -code)
    sys.exit(code if code >= 0 else 128 - code)
""".replace("NODE_OOM_PREFIX", repr(NODE_OOM_PREFIX))


def run_cold_because(
    command: Sequence[str], base_env: Mapping[str, str], preload: Sequence[str]
) -> str | None:
    """Why none of a run's tasks can run warm (so it starts no agent, as a local run starts no
    zygote), or None."""
    if not preload:
        return "no warm interpreter in this run (--preload none)"
    target = warm_target(command, base_env, base_env, preload)
    return target if isinstance(target, str) else None


def client_argv(path: str, name: str, command: Sequence[str], grace_s: float) -> list[str]:
    """The client's argv up to its ``--`` (the cold command follows): task ``name`` running
    ``command`` as a client of the agent at ``path``, its warm guard's grace ``grace_s``."""
    spec = json.dumps({"name": name, "command": list(command), "grace_s": grace_s})
    return [sys.executable, "-I", "-S", "-c", CLIENT_CODE, path, spec, "--"]


def agent_main(tag: str, preload: Sequence[str]) -> int:
    """The agent on its node (module docstring): 0 once stopped (SIGTERM: its step cancelled
    at the run's end), 1 where no warm interpreter could start (said in one line)."""
    import secrets

    zygote = Zygote(preload, dict(os.environ))
    why = zygote.ready(READY_TIMEOUT_S)
    if why is not None:
        zygote.close()
        print(f"cold: {why}", flush=True)
        return 1
    # Linux's abstract namespace: no file to leave behind, even if the agent is SIGKILLed;
    # any process of the node's network namespace may connect, so SO_PEERCRED (_accept) is the
    # check: only this user's processes are served
    name = f"graphdist-warm-{tag}-{os.getpid()}-{secrets.token_hex(8)}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind("\0" + name)
    path = "@" + name  # as ss and lsof write it; the client turns "@" back into NUL
    listener.listen(64)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    print(f"ready {path}", flush=True)
    clients: dict[socket.socket, WarmProc | None] = {}
    try:
        # a SIGTERM (the run's end; Slurm cancelling or requeueing the job, which signals every
        # step) takes no new task and waits for the guards still running: they got it too and
        # grant their tasks their grace to save; Slurm's KillWait bounds the wait
        while zygote.alive and (not stop or any(_running(p) for p in clients.values())):
            _serve(listener, zygote, clients, accepting=not stop)
    finally:
        _tell_exits(clients)  # the last guards' ends, read in the loop's last round
        for client, proc in clients.items():
            if _running(proc):
                assert proc is not None
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
            client.close()
        zygote.close()
        listener.close()
    return 0


def _running(proc: WarmProc | None) -> bool:
    return proc is not None and proc.returncode is None


def _serve(
    listener: socket.socket,
    zygote: Zygote,
    clients: dict[socket.socket, WarmProc | None],
    *,
    accepting: bool,
) -> None:
    """One round of the agent: guards' exits told to their clients, then what is readable
    (new clients only while ``accepting``)."""
    _tell_exits(clients)
    zygote_sock = zygote._sock
    with contextlib.suppress(InterruptedError):
        waited = [listener] if accepting else []
        readable, _, _ = select.select([*waited, zygote_sock, *clients], [], [], 0.5)
        for sock in readable:
            if sock is listener:
                _accept(listener, clients)
            elif sock is not zygote_sock:
                _request(sock, zygote, clients)
    zygote.pump()


def _tell_exits(clients: dict[socket.socket, WarmProc | None]) -> None:
    """Tell each client whose guard ended its exit status (and, when the node's kernel says
    it killed the task for memory, that), and let it go."""
    for client, proc in list(clients.items()):
        if proc is not None and proc.returncode is not None:
            said: dict[str, Any] = {"exit": proc.returncode}
            ran_out = _reports.ran_out(proc)
            if ran_out is not None:
                said["oom"] = ran_out
            with contextlib.suppress(OSError):
                client.send(json.dumps(said).encode())
            client.close()
            del clients[client]


class _Reports:
    """Each warm guard's report pipe (its command's pid, its end: :func:`graphdist._proc.
    process.guard`), read once the guard ended, to ask the node's kernel whether it killed the
    command for memory (:mod:`graphdist._proc.oom`: its record by pid, or nothing where the
    kernel's log cannot be read)."""

    def __init__(self) -> None:
        self._pipes: dict[int, tuple[int, float]] = {}  # guard pid: (read end, started)

    def pipe(self) -> tuple[int, int]:
        oom.shared()  # the kernel's log is read from before the task starts
        read, write = os.pipe()
        os.set_blocking(read, False)
        return read, write

    def keep(self, guard: int, read: int, started_s: float) -> None:
        self._pipes[guard] = (read, started_s)

    def ran_out(self, proc: WarmProc) -> str | None:
        """``out of memory (...)`` when the ended guard's command died by SIGKILL and the
        kernel's record says it killed it for memory; else None."""
        read, started_s = self._pipes.pop(proc.pid, (-1, 0.0))
        if read < 0:
            return None
        text = b""
        with contextlib.suppress(OSError):
            while chunk := os.read(read, 4096):
                text += chunk
        os.close(read)
        if proc.returncode != -signal.SIGKILL:
            return None
        pids = [
            w[1]
            for w in (ln.split() for ln in text.decode("ascii", "replace").splitlines())
            if len(w) == 2 and w[0] == "pid" and w[1].isdigit()
        ]
        killed = oom.shared().killed(int(pids[-1]), started_s) if pids else None
        return None if killed is None else killed.words()


_reports = _Reports()


def _accept(listener: socket.socket, clients: dict[socket.socket, WarmProc | None]) -> None:
    with contextlib.suppress(BlockingIOError, InterruptedError):
        conn, _ = listener.accept()
        if peer_credentials(conn)[1] != os.getuid():  # another user's: never served
            conn.close()
            return
        clients[conn] = None


def _request(
    client: socket.socket, zygote: Zygote, clients: dict[socket.socket, WarmProc | None]
) -> None:
    """A client's request (fork its task's guard, or say why it runs cold), or its end (its
    step cancelled: its guard killed)."""
    from graphdist._distribute.zygote import receive

    got = receive(client)
    if got is None:
        return
    data, fds = got
    proc = clients.get(client)
    if not data:
        if _running(proc):
            assert proc is not None
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        client.close()
        del clients[client]
        return
    try:
        answer = _spawn(zygote, json.loads(data), fds)
        if isinstance(answer, WarmProc):
            clients[client] = answer
            client.send(json.dumps({"pid": answer.pid}).encode())
        else:
            client.send(json.dumps({"cold": answer}).encode())
            client.close()
            del clients[client]
    finally:
        for fd in fds:
            os.close(fd)


def _spawn(zygote: Zygote, request: dict[str, Any], fds: list[int]) -> WarmProc | str:
    """The request's task forked warm on ``fds`` (stdin, stdout, stderr), or why it runs cold."""
    if len(fds) != 3:
        return "its step sent no stdin, stdout and stderr"
    target = warm_target(request["command"], request["env"], zygote.env, zygote.preload)
    if isinstance(target, str):
        return target
    read, write = _reports.pipe()  # the guard's report: its command's pid, for an OOM kill
    started_s = time.monotonic()
    try:
        proc = zygote.spawn(
            request["command"],
            target,
            request["env"],
            name=str(request["name"]),
            grace_s=float(request["grace_s"]),
            report_fd=write,
            stdin=fds[0],
            out=fds[1],
            cwd=str(request["cwd"]),
        )
    except OSError as exc:
        os.close(read)
        return f"the warm interpreter could not fork it ({exc})"
    finally:
        os.close(write)
    _reports.keep(proc.pid, read, started_s)
    return proc


if __name__ == "__main__":  # pragma: no cover - started as AGENT_CODE
    sys.exit(agent_main(sys.argv[1], sys.argv[2:]))
