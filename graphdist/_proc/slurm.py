"""Slurm, as graphdist's run backend and fleets use it: an allocation's nodes, which of them
are alive, job steps started with ``srun`` on one node each, and steps cancelled by name.

Everything goes through Slurm's own commands (``scontrol``, ``sinfo``, ``squeue``, ``srun``,
``scancel``), with bounded timeouts, so graphdist works with any Slurm its user can reach, from
inside an allocation (``sbatch``, ``salloc``) or from a host outside it (a login node, with the
job's id). A step is named ``graphdist-TAG-TASK`` (``srun --job-name``), which is how leftovers
are found and cancelled: a killed ``srun`` does not always take its step with it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from graphdist._engine import register
from graphdist._exceptions import ArgumentError
from graphdist._net.exposure import host_addresses
from graphdist._net.probe import SLURMD_PROBE_S, tcp_connect_error
from graphdist._registry import Option

__all__ = [
    "JOBID_HELP",
    "Allocation",
    "SlurmEngine",
    "allocation",
    "cancel_steps",
    "dead_nodes",
    "free_ports",
    "host_addresses",
    "node_addresses",
    "out_of_memory",
    "srun_argv",
    "step_ids",
]

JOBID_HELP = (
    "the Slurm job whose allocation runs the tasks (default: SLURM_JOB_ID, set inside salloc "
    "and sbatch)"
)
"""The help of the ``jobid`` option of the Slurm backends (fleet and run)."""
#: Seconds one query of Slurm's controller (scontrol, sinfo, squeue, scancel) may take.
QUERY_TIMEOUT_S = 20.0
#: Seconds the step that reserves ports on the nodes may take.
PORTS_TIMEOUT_S = 60.0
#: Node states in which a node runs nothing more (sinfo's short forms; ``*``: not responding).
DEAD_STATES = ("down", "drain", "drng", "fail", "failg", "maint", "unk", "boot", "npc")


@dataclass(frozen=True)
class Allocation:
    """A running Slurm job's allocation: its id, its nodes (Slurm's order) and their addresses."""

    jobid: str
    nodes: tuple[str, ...]
    addresses: Mapping[str, str]
    kill_wait_s: float = 30.0  # Slurm's KillWait: SIGTERM to SIGKILL when it ends a step
    slurmd_port: int = 6818  # SlurmdPort: where each node's slurmd listens

    def describe(self) -> str:
        return f"job {self.jobid} ({len(self.nodes)} node(s): {','.join(self.nodes)})"


def _env(env: Mapping[str, str] | None) -> dict[str, str]:
    return dict(os.environ if env is None else env)


def _slurm(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """The output of a Slurm command; ArgumentError with its own words when it fails."""
    try:
        done = subprocess.run(
            list(argv),
            env=_env(env),
            capture_output=True,
            text=True,
            timeout=QUERY_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except FileNotFoundError:
        raise _not_found(argv) from None
    except subprocess.TimeoutExpired:
        raise ArgumentError(
            f"Slurm's `{' '.join(argv)}` did not answer within {QUERY_TIMEOUT_S:g} s: is "
            "slurmctld up (scontrol ping)?",
            name="backend",
            value="slurm",
        ) from None
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise ArgumentError(
            f"Slurm's `{' '.join(argv)}` failed: {said[-1] if said else done.returncode}",
            name="backend",
            value="slurm",
        )
    return done.stdout


def _not_found(argv: Sequence[str]) -> ArgumentError:
    return ArgumentError(
        f"Slurm's {argv[0]} is not on PATH: run graphdist on a host of the Slurm cluster "
        "(a login node, or inside salloc/sbatch)",
        name="backend",
        value="slurm",
    )


def _in_background(argv: Sequence[str], env: Mapping[str, str] | None) -> subprocess.Popen[bytes]:
    """Start a Slurm command whose end the caller does not wait for: a thread reaps it (and
    kills it after :data:`QUERY_TIMEOUT_S`), not a daemon one, so that the interpreter waits
    for it at its exit and no such command outlives this process."""
    try:
        proc = subprocess.Popen(
            list(argv),
            env=_env(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    except FileNotFoundError:
        raise _not_found(argv) from None

    def reap() -> None:
        try:
            proc.wait(QUERY_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    threading.Thread(target=reap, name="graphdist-slurm-reap", daemon=False).start()
    return proc


def expand_hostlist(hostlist: str, env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """``node[1-3]`` as ``("node1", "node2", "node3")``, by Slurm's own ``scontrol``."""
    return tuple(_slurm(["scontrol", "show", "hostnames", hostlist], env).split())


def node_addresses(nodes: Sequence[str], env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Each node's address as Slurm knows it: its ``NodeAddr`` (which is its name where the
    configuration sets none), resolved on this host. A node's name need not be a host name
    (``slurmd -N``, several slurmd per host, ``NodeHostname``): Slurm reaches it at its
    NodeAddr, and so does graphdist. ArgumentError, one line, for one that does not resolve."""
    said: dict[str, str] = {}
    for line in _slurm(
        ["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %o"], env
    ).splitlines():
        words = line.split()
        if len(words) == 2:
            said[words[0]] = words[1]
    return {node: _address(node, said.get(node, node)) for node in nodes}


def _address(node: str, addr: str) -> str:
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        where = f"Slurm node {node!r}" + (f" (NodeAddr {addr!r})" if addr != node else "")
        raise ArgumentError(
            f"{where} does not resolve ({exc.strerror}) on this host; the run's TF_CONFIG "
            "needs every node's address: give the node a NodeAddr that resolves here",
            name="backend",
            value=node,
        ) from None
    return str(infos[0][4][0])


def allocation(jobid: object, env: Mapping[str, str] | None = None) -> Allocation:
    """The allocation of running Slurm job ``jobid`` (``None``: ``SLURM_JOB_ID`` of ``env``);
    ArgumentError, one line, when there is none, it is not running, or ``srun`` is missing."""
    environ = _env(env)
    if jobid is None:
        jobid = environ.get("SLURM_JOB_ID")
    if shutil.which("srun", path=environ.get("PATH", os.defpath)) is None:
        raise ArgumentError(
            "backend='slurm' needs Slurm's srun on PATH: run it on a host of the Slurm cluster "
            "(inside salloc/sbatch, or a login node with jobid=)",
            name="backend",
            value="slurm",
        )
    if jobid is None:
        raise ArgumentError(
            "backend='slurm' runs inside a Slurm allocation, and SLURM_JOB_ID is not set: run "
            "graphdist in an sbatch script or under salloc, or name the job with jobid=",
            name="jobid",
        )
    text = str(jobid)
    if not text.isascii() or not text.isdigit():
        raise ArgumentError(
            f"jobid must be a Slurm job's number, not {jobid!r}", name="jobid", value=jobid
        )
    fields = dict(
        word.split("=", 1)
        for word in _slurm(["scontrol", "show", "job", "--oneliner", text], environ).split()
        if "=" in word
    )
    state = fields.get("JobState", "?")
    if state != "RUNNING":
        raise ArgumentError(
            f"Slurm job {text} is {state}, not RUNNING: a run needs its allocation (salloc "
            "waits for one)",
            name="jobid",
            value=jobid,
        )
    nodes = expand_hostlist(fields.get("NodeList", ""), environ)
    if not nodes:
        raise ArgumentError(f"Slurm job {text} has no nodes", name="jobid", value=jobid)
    config = _numbers(environ)  # one read of Slurm's configuration for the whole run
    return Allocation(
        text,
        nodes,
        node_addresses(nodes, environ),
        float(config.get("KillWait", 30)),
        config.get("SlurmdPort", 6818),
    )


def _numbers(env: Mapping[str, str] | None = None) -> dict[str, int]:
    """The whole-number settings of Slurm's configuration (``scontrol show config``)."""
    found = {}
    for line in _slurm(["scontrol", "show", "config"], env).splitlines():
        name, _, value = line.partition("=")
        words = value.split()
        if words and words[0].isdigit():
            found[name.strip()] = int(words[0])
    return found


def dead_nodes(
    nodes: Sequence[str],
    env: Mapping[str, str] | None = None,
    alloc: Allocation | None = None,
) -> dict[str, str]:
    """``{node: why}`` for the nodes that run nothing more: those Slurm says are down, drained
    or not responding (``*``), from one ``sinfo``, and (given their ``alloc``) those whose
    slurmd refuses a connection now, which Slurm notices only after its pings time out (many
    seconds): a lost node is found at once, as a Ray node by its raylet."""
    out = _slurm(["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %t"], env)
    dead: dict[str, str] = {}
    for line in out.splitlines():
        words = line.split()
        if len(words) == 2 and (words[1].endswith("*") or words[1].rstrip("*~#$@+") in DEAD_STATES):
            dead[words[0]] = f"Slurm says {words[1]}"
    if alloc is not None:
        addresses, port = alloc.addresses, alloc.slurmd_port
        for node in nodes:
            if node in dead or node not in addresses:
                continue
            exc = tcp_connect_error(addresses[node], port, SLURMD_PROBE_S)
            if exc is not None:
                dead[node] = f"its slurmd at {addresses[node]}:{port}: {exc.strerror or exc}"
    return dead


def srun_argv(
    jobid: str,
    node: str,
    name: str,
    command: Sequence[str],
    *,
    grace_s: float = 2.0,
    stdin: bool = False,
) -> list[str]:
    """``srun`` of ``command`` as one task on ``node`` of job ``jobid``, a step named ``name``
    that shares the allocation with the job's other steps (``--overlap``), whose output comes
    back unbuffered, and whose tasks Slurm leaves alone when one fails (graphdist decides).
    ``grace_s``: Slurm's wait between SIGTERM and SIGKILL when the step is cancelled.
    ``stdin``: srun's stdin goes to the task (else it reads none)."""
    return [
        "srun",
        f"--jobid={jobid}",
        f"--job-name={name}",
        f"--nodelist={node}",
        "--nodes=1",
        "--ntasks=1",
        "--overlap",
        "--kill-on-bad-exit=0",
        "--unbuffered",
        "--quiet",
        "--input=0" if stdin else "--input=none",
        f"--wait={max(1, int(grace_s))}",
        *command,
    ]


#: What srun says of a task its step's cgroup killed for memory (Slurm 22.05 and later).
_OOM_LINE = re.compile(rb"^srun: error: (\S+): tasks? [\d,-]+: Out Of Memory")


def out_of_memory(line: bytes) -> str | None:
    """srun's word that the kernel killed its step's task for memory, in words, or None for any
    other line: ``srun: error: NODE: task 0: Out Of Memory`` (its cgroup was over the job's
    limit, under ``task/cgroup``; srun then exits 1), as ``out of memory (over its Slurm job's
    memory limit on node NODE)``. (A warm task's client says its node's kernel's words itself:
    :func:`graphdist._proc.oom.node_words`.)"""
    found = _OOM_LINE.match(line)
    if found is None:
        return None
    node = found[1].decode("utf-8", "replace")
    return f"out of memory (over its Slurm job's memory limit on node {node})"


def step_ids(
    jobid: str,
    prefix: str,
    env: Mapping[str, str] | None = None,
    *,
    off: Collection[str] = (),
) -> list[str]:
    """The ids (``JOB.STEP``) of job ``jobid``'s steps whose name starts with ``prefix``, but
    those on a node of ``off`` (lost nodes: Slurm ends their steps once it calls them down)."""
    try:
        out = _slurm(["squeue", "-h", "-s", "-j", jobid, "-o", "%i %j %N"], env)
    except ArgumentError:  # the job is gone: so are its steps
        return []
    found = []
    for words in (line.split() for line in out.splitlines()):
        if len(words) >= 2 and words[1].startswith(prefix):
            nodes = expand_hostlist(words[2], env) if len(words) > 2 and off else ()
            if not set(nodes) & set(off):
                found.append(words[0])
    return found


def cancel_steps(
    jobid: str,
    prefix: str,
    *,
    signal_name: str = "KILL",
    wait_s: float = 10.0,
    env: Mapping[str, str] | None = None,
    lost: Collection[str] = (),
) -> list[str]:
    """Send ``signal_name`` to every step of ``jobid`` named ``prefix...`` and wait up to
    ``wait_s`` for them to be gone, but for those on ``lost`` nodes (signalled, not waited
    for: Slurm removes them once it calls the node down); the ids still there after that
    (normally none). A KILL's ``scancel`` is not waited for: while a node of the job does not
    answer, and Slurm has not called it down yet, each scancel of the job's steps, those on
    other nodes too, returns only after Slurm's MessageTimeout (10 s by default), although the
    steps get the signal at once (measured on the test bed: 6.0 s at MessageTimeout=5). Any
    other signal's is, so that two signals to a step arrive in the order they were sent."""
    steps = step_ids(jobid, prefix, env)
    deadline = time.monotonic() + wait_s
    sent: subprocess.Popen[bytes] | None = None
    while steps:
        argv = ["scancel", f"--signal={signal_name}", *steps]
        with contextlib.suppress(ArgumentError):
            if signal_name != "KILL":
                _slurm(argv, env)
            elif sent is None or sent.poll() is not None:  # one scancel of this call at a time
                sent = _in_background(argv, env)
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
        steps = step_ids(jobid, prefix, env, off=lost)
    return steps


# The node's ports are picked by graphdist._ports, as on this machine: below the node's ephemeral
# range and free on both wildcards. A port-0 bind (the step before) gave an ephemeral port, which
# the node's own outgoing connections (srun's, slurmd's, the job's) may take before the task's
# server binds it seconds later (a requeued run's MWMS worker: "Could not start gRPC server").
_PORTS = (
    "import os\n"
    "from graphdist._ports import pick_free_ports, release_ports\n"
    "ports = pick_free_ports({k})\n"
    "print(os.environ['SLURMD_NODENAME'], *ports, flush=True)\n"
    "release_ports(ports)\n"
)


def free_ports(
    alloc: Allocation,
    per_node: Mapping[str, int],
    name: str,
    env: Mapping[str, str] | None = None,
) -> dict[str, list[int]]:
    """``per_node[node]`` free ports on each node, found by one step on every node at once
    (each picks them with graphdist's own picker, :func:`pick_free_ports`, and says which under
    its node's Slurm name, ``SLURMD_NODENAME``: a host name need not be one; taken again by the
    tasks a moment later)."""
    nodes = [n for n in alloc.nodes if per_node.get(n)]
    most = max(per_node.values())
    argv = [
        "srun",
        f"--jobid={alloc.jobid}",
        f"--job-name={name}",
        f"--nodelist={','.join(nodes)}",
        f"--nodes={len(nodes)}",
        f"--ntasks={len(nodes)}",
        "--ntasks-per-node=1",
        "--overlap",
        "--quiet",
        "--input=none",
        sys.executable,
        "-I",
        "-c",
        _PORTS.format(k=most),
    ]
    try:
        done = subprocess.run(
            argv,
            env=_env(env),
            capture_output=True,
            text=True,
            timeout=PORTS_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise ArgumentError(
            f"Slurm did not run graphdist's port step on {','.join(nodes)} within "
            f"{PORTS_TIMEOUT_S:g} s",
            name="backend",
            value="slurm",
        ) from None
    found: dict[str, list[int]] = {}
    for line in done.stdout.splitlines():
        words = line.split()
        if words and all(w.isdigit() for w in words[1:]):
            found[words[0]] = [int(w) for w in words[1:]]
    strays = sorted(set(found) - set(nodes))
    if strays:  # SLURMD_NODENAME is not the name Slurm gave the allocation's node
        raise ArgumentError(
            f"graphdist's port step on {','.join(nodes)} answered as node(s) "
            f"{','.join(strays)}, which {alloc.describe()} does not have: the nodes' "
            "SLURMD_NODENAME must be their Slurm node names (slurmd -N NAME on a host that "
            "runs several)",
            name="backend",
            value="slurm",
        )
    missing = [n for n in nodes if len(found.get(n, ())) < per_node[n]]
    if done.returncode != 0 or missing:
        said = done.stderr.strip().splitlines()
        raise ArgumentError(
            f"Slurm could not run graphdist's port step on {','.join(missing or nodes)}"
            + (f": {said[-1]}" if said else ""),
            name="backend",
            value="slurm",
        )
    return {n: found[n][: per_node[n]] for n in nodes}


#: What srun says when its step's node failed (it then exits 0, Slurm 22.05).
_NODE_FAILURE = b"srun: error: Node failure on "


class SlurmEngine:
    """Slurm as an engine (:mod:`graphdist._engine`): an allocation's nodes, each step ``srun
    --overlap`` on one node, signals and ends through ``scancel``; graphdist's Slurm fleet and
    Slurm run are the engine-free halves over it."""

    name: ClassVar[str] = "slurm"
    summary: ClassVar[str] = (
        "Slurm job steps on the nodes of an allocation (inside salloc/sbatch, or --jobid), "
        "restarted inside the same allocation"
    )
    requires: ClassVar[tuple[str, str] | None] = None
    options: ClassVar[tuple[Option, ...]] = (Option("jobid", JOBID_HELP, "JOBID"),)
    node_word: ClassVar[str] = "Slurm node"
    DEFAULT_START_TIMEOUT_S: ClassVar[float] = 120.0
    tls: ClassVar[bool] = True
    more_nodes: ClassVar[str] = "ask salloc/sbatch for more nodes"
    FLEET: ClassVar[str | None] = "graphdist._fleet.command:SlurmFleet"  # with a jobid
    RUN: ClassVar[str | None] = None

    def __init__(self, alloc: Allocation, env: Mapping[str, str]) -> None:
        self.alloc, self.env = alloc, dict(env)
        self.kill_wait_s = alloc.kill_wait_s

    @classmethod
    def join(cls, options: Mapping[str, Any], env: Mapping[str, str]) -> SlurmEngine:
        return cls(allocation(options.get("jobid"), env), env)

    def describe(self) -> str:
        return f"Slurm {self.alloc.describe()}"

    def addresses(self) -> Mapping[str, str]:
        return {node: self.alloc.addresses[node] for node in self.alloc.nodes}

    def lost(self, nodes: Sequence[str]) -> dict[str, str]:
        return dead_nodes(nodes, self.env, self.alloc)

    def free_ports(self, per_node: Mapping[str, int], tag: str) -> dict[str, list[int]]:
        return free_ports(self.alloc, per_node, tag, self.env)

    def command(
        self, node: str, step: str, argv: Sequence[str], *, stdin: bool, grace_s: float
    ) -> list[str]:
        return srun_argv(self.alloc.jobid, node, step, argv, grace_s=grace_s, stdin=stdin)

    def signal(self, step: str, sig: int, local: Any) -> None:
        """Through Slurm, as its own scancel would (a KILL's scancel is not waited for)."""
        name = signal_name(sig)
        cancel_steps(self.alloc.jobid, step, signal_name=name, wait_s=0.0, env=self.env)

    def cancel(self, prefix: str, lost: Collection[str] = ()) -> list[str]:
        return cancel_steps(self.alloc.jobid, prefix, env=self.env, lost=lost)

    def lost_line(self, line: bytes) -> str | None:
        if not line.startswith(_NODE_FAILURE):
            return None
        return line.decode("utf-8", "replace").strip().removeprefix("srun: error: ")

    def out_of_memory(self, line: bytes) -> str | None:
        return out_of_memory(line)

    def __repr__(self) -> str:
        return f"SlurmEngine({self.describe()})"


def signal_name(sig: int) -> str:
    """``KILL`` for SIGKILL: a signal as scancel names it."""
    return signal.Signals(sig).name.removeprefix("SIG")


register(SlurmEngine)
