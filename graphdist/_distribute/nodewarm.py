"""Warm task interpreters on the nodes of a Slurm run: one *agent* per node and run, and a thin
*client* as each task's step.

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
stop, the preemption notice) and exits with the guard's status. A client the agent cannot serve
(no agent, a task that runs cold) executes the cold command in its place, so the step is a cold
task's. A client that ends first (its step cancelled: a frozen task, a broken attempt) has its
guard SIGKILLed by the agent; the zygote (a subreaper) ends what the guard leaves.

A warm task runs in the agent's step, not its own: Slurm accounts its CPU and memory to the
agent's step (``sstat`` on the task's step shows the client only).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import struct
import sys
from collections.abc import Sequence
from typing import Any

from graphdist._distribute.warm import READY_TIMEOUT_S, WarmProc, Zygote, warm_target

__all__ = ["AGENT_CODE", "CLIENT_CODE", "agent_main"]

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
    code = int(json.loads(said)["exit"])
    sys.exit(code if code >= 0 else 128 - code)
"""


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
    """Tell each client whose guard ended its exit status, and let it go."""
    for client, proc in list(clients.items()):
        if proc is not None and proc.returncode is not None:
            with contextlib.suppress(OSError):
                client.send(json.dumps({"exit": proc.returncode}).encode())
            client.close()
            del clients[client]


def _accept(listener: socket.socket, clients: dict[socket.socket, WarmProc | None]) -> None:
    with contextlib.suppress(BlockingIOError, InterruptedError):
        conn, _ = listener.accept()
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        if struct.unpack("3i", creds)[1] != os.getuid():  # another user's: never served
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
    devnull = os.open(os.devnull, os.O_WRONLY)  # the guard's exec report: only a cold one has
    try:
        return zygote.spawn(
            request["command"],
            target,
            request["env"],
            name=str(request["name"]),
            grace_s=float(request["grace_s"]),
            report_fd=devnull,
            stdin=fds[0],
            out=fds[1],
            cwd=str(request["cwd"]),
        )
    except OSError as exc:
        return f"the warm interpreter could not fork it ({exc})"
    finally:
        os.close(devnull)


if __name__ == "__main__":  # pragma: no cover - started as AGENT_CODE
    sys.exit(agent_main(sys.argv[1], sys.argv[2:]))
