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
stop, the preemption notice) and exits with the guard's status, or dies of its signal. A client
the agent cannot serve (no agent, a task that runs cold) executes the cold command in its place,
so the step is a cold task's. A client that ends first (its step cancelled: a frozen task, a
broken attempt) has its guard SIGKILLed by the agent; the zygote (a subreaper) ends what the
guard leaves.

A warm task runs in the agent's step, not its own: Slurm accounts its CPU and memory to the
agent's step (``sstat`` on the task's step shows the client only).

On Ray (:class:`RayAgents`) the agent is a process of a Ray actor pinned to its node (no CPU of
its own), under graphdist's guard tied to the actor, so it ends with the actor however the actor
ends; each task's actor runs the client under its guard instead of the command (the client's cold
fallback is the command itself, under the same guard). Abstract sockets are per network
namespace: a node's agent and its tasks share the node's.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
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
from graphdist._net.policy import NetPolicy
from graphdist._proc import oom
from graphdist._proc.oom import NODE_OOM_PREFIX

__all__ = [
    "AGENT_CODE",
    "CLIENT_CODE",
    "AgentActor",
    "RayAgents",
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


# -- Ray ------------------------------------------------------------------------------------------


class AgentActor:
    """A Ray actor on one node: the run's agent there, under a guard started by a thread of the
    actor that lives as long as the agent (the guard's death signal is tied to that thread)."""

    def __init__(self, tag: str, preload: list[str], env: dict[str, str]) -> None:
        self._line: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._said = threading.Event()
        threading.Thread(target=self._run, args=(tag, preload, env), daemon=True).start()

    def _run(self, tag: str, preload: list[str], env: dict[str, str]) -> None:
        from graphdist._proc.process import guarded_argv

        argv = guarded_argv([sys.executable, "-c", AGENT_CODE, tag, *preload], name="warm-agent")
        try:
            self._proc = proc = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as exc:
            self._line = f"cold: {exc}"
            self._said.set()
            return
        assert proc.stdout is not None
        self._line = proc.stdout.readline().decode("utf-8", "replace").strip()
        self._said.set()
        proc.wait()
        proc.stdout.close()

    def ready(self, timeout_s: float) -> str:
        """The agent's first line (``ready @NAME``, or why it serves no task), once said."""
        self._said.wait(timeout_s)
        return self._line or ""

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None


class RayAgents:
    """A Ray run's warm agents: one :class:`AgentActor` per node, started when an attempt first
    places a task there (or again if it ended), kept across attempts, killed with the run."""

    def __init__(self, command: Sequence[str], base_env: Mapping[str, str], preload: Sequence[str]):
        import secrets

        self.command, self.preload = list(command), tuple(preload)
        self.tag = secrets.token_hex(4)
        self.actors: dict[str, Any] = {}  # node id -> its AgentActor
        self.paths: dict[str, str] = {}  # node id -> its agent's socket
        self.why: dict[str, str] = {}  # node id -> why its agent serves no task
        self.cold = run_cold_because(self.command, base_env, self.preload)
        # as a task's on its node (rayrun's _CommandActor) in what is read at import
        self.env: dict[str, str] = {}
        if self.cold is None:
            shim = NetPolicy().env("127.0.0.1", base_env.get("LD_PRELOAD"), inherit=True)
            self.env = {**base_env, **shim}

    def why_cold(self, node: str) -> str | None:
        if self.cold is not None:
            return self.cold
        if node not in self.paths:
            return self.why.get(node, f"the warm agent on Ray node {node[:8]} is not running")
        return None

    def ensure(self, nodes: Sequence[str], timeout_s: float = READY_TIMEOUT_S) -> None:
        """Start the agents of ``nodes`` that are not running, and wait for their first line
        (bounded: one that says nothing in time serves no task, which then runs cold)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if self.cold is not None:
            return
        for node in [n for n in nodes if n in self.actors]:  # up from an earlier attempt?
            try:
                if ray.get(self.actors[node].alive.remote(), timeout=10.0):
                    continue
            except Exception:  # its node was lost, or Ray cannot tell: a new one
                pass
            self._drop(node)
        started = [n for n in dict.fromkeys(nodes) if n not in self.actors]
        actor_class = ray.remote(AgentActor)
        for node in started:
            self.why.pop(node, None)
            self.actors[node] = actor_class.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                num_cpus=0,
                max_restarts=0,
            ).remote(self.tag, list(self.preload), self.env)
        deadline = time.monotonic() + timeout_s
        for node in started:
            left = max(0.0, deadline - time.monotonic())
            try:
                line = str(ray.get(self.actors[node].ready.remote(left), timeout=left + 10.0))
            except Exception as exc:
                line = f"{type(exc).__name__}"
            if line.startswith("ready "):
                self.paths[node] = line.split(" ", 1)[1]
            else:
                self.why[node] = (
                    f"the warm agent on Ray node {node[:8]} did not start ({line or 'no word'})"
                )

    def _drop(self, node: str) -> None:
        import ray

        self.paths.pop(node, None)
        actor = self.actors.pop(node, None)
        if actor is not None:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)

    def close(self) -> None:
        for node in list(self.actors):
            self._drop(node)


if __name__ == "__main__":  # pragma: no cover - started as AGENT_CODE
    sys.exit(agent_main(sys.argv[1], sys.argv[2:]))
