"""Warm task interpreters on the nodes of an engine's run (Slurm's, Ray's): one *agent* per node
and run, and a thin *client* as each task's step.

The agent is the warm agent of :mod:`graphdist._distribute.warmagent`
(:func:`~graphdist._distribute.warmagent.node_agent_main`, :data:`AGENT_CODE`: a ``srun
--overlap`` step of its own, started by the run before the first attempt places a task on the
node and kept across attempts): it imports the run's preloads, listens on a socket in Linux's
abstract namespace (no file, nothing left behind; a peer of another user is closed at once,
``SO_PEERCRED``), prints ``ready @NAME`` and forks a *session* per connection, as it does for a
local launcher. Each task's step is then the client (:data:`CLIENT_CODE`, ``python -I -S``: the
standard library only, no TensorFlow) and speaks the session's protocol
(:func:`graphdist._distribute.zygote.serve`), as a local launcher does: its hello (the signals
it found ignored, its umask, limits, CPU affinity and niceness: what the task would inherit from
the step), then one request with its environment (the task's, as srun set it), working folder
and command, and its stdout and stdin (``SCM_RIGHTS``; and its guard's progress channel where
it has one: the warm task writes its records there, :mod:`graphdist._proc.guardreport`). The
session decides whether the task
runs warm there (:func:`~graphdist._distribute.warm.warm_target`) and forks its guard on those
descriptors, so the task's output goes through srun as a cold task's does. The client forwards
the signals srun and Slurm send its step to the guard (a stop, the preemption notice) and exits
with the guard's status, or dies of its signal; where the node's kernel killed the task for
memory, the session says so and the client prints it first. A client the agent cannot serve (no
agent, a task that runs cold) executes the cold command in its place, so the step is a cold
task's. A client that ends first (its step cancelled: a frozen task, a broken attempt) has its
guard SIGKILLed by its session (its hello's ``on_close``); the session (a subreaper) ends what
the guard leaves.

A warm task runs in the agent's step, not its own: Slurm accounts its CPU and memory to the
agent's step (``sstat`` on the task's step shows the client only).

On Ray (:class:`graphdist._ray.agents.RayAgents`) the agent is a process of a Ray actor pinned
to its node (no CPU of its own), under graphdist's guard tied to the actor, so it ends with the
actor however the actor ends; each task's actor runs the client under its guard instead of the
command (the client's cold fallback is the command itself, under the same guard). Abstract
sockets are per network namespace: a node's agent and its tasks share the node's.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence

from graphdist._distribute.warm import warm_target
from graphdist._distribute.warmagent import SESSION_RLIMITS
from graphdist._distribute.zygote import TASK_SIGNALS
from graphdist._proc import guardreport
from graphdist._proc.guardreport import PROGRESS_ENV
from graphdist._proc.oom import NODE_OOM_PREFIX

__all__ = [
    "AGENT_CODE",
    "CLIENT_CODE",
    "client_argv",
    "run_cold_because",
]

#: The agent's command: ``python -c AGENT_CODE TAG PRELOAD...``.
AGENT_CODE = (
    "import sys; from graphdist._distribute.warmagent import node_agent_main; "
    "sys.exit(node_agent_main(sys.argv[1], sys.argv[2:]))"
)

#: A task's step: ``python -I -S -c CLIENT_CODE PATH SPEC -- COLD_ARGV...`` (SPEC: JSON of the
#: task's name, command and guard's grace).
CLIENT_CODE = (
    r"""
import json, os, resource, signal, socket, sys
path, spec, cold = sys.argv[1], json.loads(sys.argv[2]), sys.argv[4:]
relay = None
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
def run_cold():
    if relay is not None:  # the cold command's guard makes its own
        os.environ.pop(PROGRESS_ENV, None)
        os.close(relay.write_fd)
    os.execvp(cold[0], cold)
def said():
    data = sock.recv(1 << 20)
    if not data:
        raise EOFError
    return json.loads(data)
try:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect("\0" + path[1:] if path.startswith("@") else path)
    umask = os.umask(0o022)
    os.umask(umask)
    sock.send(json.dumps({
        "ignored": [s for s in TASK_SIGNALS if signal.getsignal(s) == signal.SIG_IGN],
        "umask": umask,
        "rlimits": {n: resource.getrlimit(getattr(resource, n)) for n in SESSION_RLIMITS},
        "affinity": sorted(os.sched_getaffinity(0)),
        "nice": os.nice(0),
        "on_close": "kill",
    }).encode())
    said()  # the session is ready
    spec.update(id=1, env=dict(os.environ), cwd=os.getcwd(), stdin=True, report="session")
    fds = [1, 0]
    fd, _, inode = os.environ.get(PROGRESS_ENV, "").partition(":")
    try:
        mine = fd.isdigit() and inode.isdigit() and os.fstat(int(fd)).st_ino == int(inode)
    except OSError:
        mine = False
    if mine:
        fds.append(int(fd))  # our guard's progress channel: the warm task's own
        spec["progress"] = True
    elif spec.get("relay"):  # none (a step's client): ours, on our stderr as a node guard's
        sys.path.append(spec.pop("relay"))
        from guardreport import ProgressRelay
        relay = ProgressRelay(2)
        fds.append(relay.write_fd)
        spec["progress"] = True
    socket.send_fds(sock, [json.dumps(spec).encode()], fds)
    answer = said()
except (OSError, ValueError, EOFError, ImportError):
    run_cold()
if "pid" not in answer:  # it runs cold, or the session could not fork it
    sock.close()
    run_cold()
guard = int(answer["pid"])
if relay is not None:  # its thread never takes the signals forward() passes on
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    relay.started()
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
def forward(sig, frame):
    try:
        os.kill(guard, sig)
    except ProcessLookupError:
        pass
for sig in FORWARDED:
    signal.signal(sig, forward)
while True:
    try:
        answer = said()
    except InterruptedError:
        continue
    except (OSError, ValueError, EOFError):
        sys.exit(70)
    if answer.get("exit") != guard:
        continue
    if relay is not None:  # the task's last records, before its end
        relay.finish(1.0)
    if answer.get("oom"):  # its node's kernel killed the task for memory: say so first
        os.write(2, (NODE_OOM_PREFIX + answer["oom"] + "\n").encode())
    code = os.waitstatus_to_exitcode(int(answer["status"]))
    if code < 0:  # die of the guard's signal, as the guard died of its command's (no core)
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
    .replace("PROGRESS_ENV", repr(PROGRESS_ENV))
    .replace("TASK_SIGNALS", repr(tuple(int(s) for s in TASK_SIGNALS)))
    .replace("SESSION_RLIMITS", repr(SESSION_RLIMITS))
)


def run_cold_because(
    command: Sequence[str], base_env: Mapping[str, str], preload: Sequence[str]
) -> str | None:
    """Why none of a run's tasks can run warm (so it starts no agent, as a local run starts no
    zygote), or None."""
    if not preload:
        return "no warm interpreter in this run (--preload none)"
    target = warm_target(command, base_env, base_env, preload)
    return target if isinstance(target, str) else None


def client_argv(
    path: str, name: str, command: Sequence[str], grace_s: float, *, relay: bool = False
) -> list[str]:
    """The client's argv up to its ``--`` (the cold command follows): task ``name`` running
    ``command`` as a client of the agent at ``path``, its warm guard's grace ``grace_s``.
    ``relay``: a client with no guard's channel (a Slurm step's) makes one of its own, whose
    records it writes on its stderr as a node guard does (``process.guarded_argv``'s
    ``report_fd`` 2), loading :mod:`graphdist._proc.guardreport` from its folder."""
    spec: dict[str, object] = {"name": name, "command": list(command), "grace_s": grace_s}
    if relay:
        spec["relay"] = os.path.dirname(os.path.abspath(guardreport.__file__))
    return [sys.executable, "-I", "-S", "-c", CLIENT_CODE, path, json.dumps(spec), "--"]
