"""``graphdist run --backend slurm``: every task of a tf.distribute run a Slurm job step on a node
of the run's allocation, restarted inside the same allocation.

The run is started inside an allocation (an ``sbatch`` script, ``salloc``: ``SLURM_JOB_ID``) or
from a host outside it, a login node, with ``jobid=``. Before anything starts the allocation is
read from Slurm (:func:`graphdist._proc.slurm.allocation`) and checked to fit the run
(``ntasks_per_node`` tasks on each node, default 1). Each attempt places its tasks on the nodes
Slurm does not call down or not responding (one per node first, then a second per node ...),
reserves a free port for each with one step on those nodes, and so knows every TF_CONFIG before
any task starts; a run whose nodes are too few for it after a node was lost ends with one line
saying so.

Each command task is ``srun --overlap`` of the command under graphdist's guard on its node
(the guard there ends the task's whole tree when its step ends), and the step's output comes
back through ``srun`` as a local task's does, under a local guard of its own. A stop asks
``srun`` (SIGTERM, which it forwards); a broken attempt's and a frozen task's steps are
cancelled with SIGKILL (``scancel``), and every step an attempt started is gone before the next
starts. The tasks' servers listen on their node's address, with the bind shim letting in only
the allocation's nodes and this host (whose heartbeat probes them). A parameter-server run's
worker and ps tasks are ``graphdist serve`` steps, restarted on their node and port when one dies
(the coordinator carries on, as on the other backends).

With ``tls`` (TLS mode, :mod:`graphdist._net.gateway`) each attempt makes its credentials
(:class:`~graphdist._net.tlsmode.TlsMode`, with this host's gateway for the heartbeat's probes);
each TF_CONFIG names the nodes' loopback aliases, and each task's step is wrapped
(:func:`~graphdist._proc.tlsexec.tls_exec_argv`): it reads its node's credentials on srun's
stdin, starts the node's gateway, deletes them and executes the guarded command in its place.
"""

from __future__ import annotations

import collections
import contextlib
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from graphdist._cluster import Cluster, Task
from graphdist._distribute.nodewarm import AGENT_CODE, client_argv, run_cold_because
from graphdist._distribute.runbackends import register, start_servers
from graphdist._distribute.runspec import RunSpec
from graphdist._distribute.taskproc import GuardedTask, RunSink
from graphdist._distribute.warm import PRELOAD_OPTION, READY_TIMEOUT_S, check_preload, warm_target
from graphdist._exceptions import ArgumentError, LaunchError
from graphdist._net.gateway import read_line
from graphdist._net.policy import NetPolicy
from graphdist._proc.process import (
    NOW_SIGNAL,
    PREEMPT_SIGNAL,
    STOP_GRACE_S,
    TASK_STOP_GRACE_S,
    guarded_argv,
    stop_processes,
)
from graphdist._proc.signals import SignalScope
from graphdist._proc.slurm import (
    JOBID_HELP,
    Allocation,
    allocation,
    cancel_steps,
    dead_nodes,
    free_ports,
    host_addresses,
    out_of_memory,
    srun_argv,
)
from graphdist._proc.tlsexec import tls_exec_argv
from graphdist._registry import Option
from graphdist._validate import ascii_int, count

if TYPE_CHECKING:
    from graphdist._net.tlsmode import TlsMode

__all__ = ["SlurmRun"]

#: Seconds a cancelled step's srun gets to end by itself before its local guard is told to end it.
SRUN_END_WAIT_S = 1.0


def _host_port(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def _exit_code(code: int | None) -> int | None:
    """srun's exit status as Popen's code: 128 + N (a task killed by signal N, as srun and the
    guard say it) is -N, so the words are those of a local task's."""
    if code is not None and 128 < code < 128 + signal.NSIG:
        return -(code - 128)
    return code


class _SlurmTask(GuardedTask):
    """A command task as a Slurm step: ``srun`` under a local guard, the command under a guard
    on its node. Its processes are the node's (the heartbeat probes its server instead); a
    SIGKILL (a frozen task, a broken attempt) cancels its step, which reaches a stopped one."""

    def __init__(
        self,
        task: Task,
        argv: Sequence[str],
        env: Mapping[str, str],
        run: RunSink,
        log_path: str | None,
        *,
        jobid: str,
        step: str,
        kill_wait_s: float,
        stdin: bytes | None = None,
        cold_because: str | None = "the task's node has no warm interpreter",
    ) -> None:
        self.jobid, self.step, self._slurm_env = jobid, step, env
        self.stop_grace_s = kill_wait_s + TASK_STOP_GRACE_S  # a checkpoint's save, then reaping
        # the local guard's grace too: Slurm's stop of the batch step (scancel, requeue) reaches
        # it and srun as well, which must wait for the tasks' own exits
        grace = kill_wait_s + STOP_GRACE_S
        super().__init__(
            task, argv, env, run, log_path, grace_s=grace, stdin=stdin, cold_because=cold_because
        )

    def _line(self, raw: bytes, more: int) -> None:
        if raw.startswith(b"srun: error: Node failure on "):  # srun then exits 0 (Slurm 22.05)
            self.result.lost = raw.decode("utf-8", "replace").strip().removeprefix("srun: error: ")
        ran_out = out_of_memory(raw)
        if ran_out is not None:  # the step's cgroup was over its memory limit: srun exits 1
            self.result.oom = ran_out
        super()._line(raw, more)

    def ended(self) -> int | None:
        """srun's exit, as a local task's code; a step whose node failed ended killed."""
        code = _exit_code(super().ended())
        if code in (0, -signal.SIGKILL) and self.result.lost is None and self.result.oom is None:
            # srun's last words (a node failure; a warm task's client's word that its kernel
            # killed it for memory) come before its exit: read them first
            self._reader.join(2.0)
        if code == 0 and self.result.lost is not None:
            return -signal.SIGKILL
        return code

    def processes(self) -> list[int] | None:
        return None

    def preempt(self) -> None:
        """The notice to the guard on the node (``PREEMPT_SIGNAL``, through Slurm to every
        process of the step, which only the guard does not ignore): it sends SIGTERM to the
        command alone, once. A SIGTERM from Slurm to the whole step would be a cancel, and the
        command would get it twice (Slurm's and the guard's)."""
        if self.running():
            name = signal.Signals(PREEMPT_SIGNAL).name.removeprefix("SIG")
            cancel_steps(self.jobid, self.step, signal_name=name, wait_s=0.0, env=self._slurm_env)

    def signal(self, sig: int) -> None:
        """A stop (SIGTERM, SIGINT, SIGHUP) goes to the step's processes on the node through
        Slurm, as Slurm's own scancel would: srun is not cut off meanwhile, and the command gets
        what the guard there grants it (Slurm's KillWait) to save and exit. SIGKILL and the
        broken-attempt signal cancel the step, then end the local side."""
        if not self.running():
            return
        if sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            name = signal.Signals(sig).name.removeprefix("SIG")
            cancel_steps(self.jobid, self.step, signal_name=name, wait_s=0.0, env=self._slurm_env)
            return
        if sig in (signal.SIGKILL, NOW_SIGNAL):
            cancel_steps(self.jobid, self.step, wait_s=0.0, env=self._slurm_env)
            # srun ends with its step, which then leaves Slurm's queue at once; an srun killed
            # first leaves its step listed ~2.3 s more (measured), which the next attempt waits
            # out: give srun a moment to end by itself
            deadline = time.monotonic() + SRUN_END_WAIT_S
            while self.running() and time.monotonic() < deadline:
                time.sleep(0.02)
        super().signal(sig)


class _SlurmPlacement:
    def __init__(
        self, spec: RunSpec, alloc: Allocation, attempt: int, tag: str, agents: _Agents
    ) -> None:
        self.spec, self.alloc, self.agents = spec, alloc, agents
        self.prefix = f"graphdist-{tag}-{attempt}-"
        per_node = int(spec.options["ntasks_per_node"])
        env = spec.base_env
        dead = dead_nodes(alloc.nodes, env, alloc)
        live = [n for n in alloc.nodes if n not in dead]
        names = [(job, i) for job in sorted(spec.jobs) for i in range(spec.jobs[job])]
        if len(live) * per_node < len(names):
            lost = ", ".join(f"{n} ({s})" for n, s in dead.items())
            raise LaunchError(
                f"Attempt {attempt} cannot be placed: the run needs {len(names)} task(s) and "
                f"{alloc.describe()} has {len(live)} node(s) left for {per_node} task(s) each "
                f"(lost: {lost}); the run ends here",
                [],
            )
        slots = [node for _ in range(per_node) for node in live][: len(names)]
        ports = free_ports(alloc, collections.Counter(slots), self.prefix + "ports", env)
        jobs: dict[str, list[str]] = {}
        self.nodes: dict[str, str] = {}
        for (job, i), node in zip(names, slots, strict=True):
            jobs.setdefault(job, []).append(_host_port(alloc.addresses[node], ports[node].pop(0)))
            self.nodes[f"{job}-{i}"] = node
        self.cluster = self.real_cluster = Cluster(jobs)
        # the members (the allocation's nodes, this host), resolved once for the attempt
        self.net = NetPolicy(expose=True, tls=spec.tls).slurm_tasks(self.cluster, host_addresses())
        self._tls: TlsMode | None = None
        if spec.tls:  # the tasks on their nodes' aliases; this host's gateway for its probes
            from graphdist._net.tlsmode import TlsMode

            self._tls = TlsMode(self.real_cluster)
            self.cluster = self._tls.cluster
        # the warm agents of the nodes of the command's tasks (a ps run's servers are `graphdist
        # serve` steps: no agent on a node of servers only), those not up from an earlier attempt
        commands = {n for (job, _), n in zip(names, slots, strict=True) if job not in spec.served}
        agents.ensure(sorted(commands))

    def _node_env(self, task: Task) -> dict[str, str]:
        """What the task's processes on its node get besides the run's env: the bind shim on
        the node's address and the members (the allocation's nodes, this host); in TLS mode the
        shim on the node's alias, where only this user gets in."""
        return self.net.env(task.host.strip("[]"), inherit=True)

    def start_servers(
        self, jobs: Sequence[str], log_folder: str | None, signals: SignalScope
    ) -> Any:
        from graphdist._fleet.slurm import SlurmFleet

        fleet = SlurmFleet(
            self.real_cluster,
            jobs=jobs,
            jobid=self.alloc.jobid,
            log_dir=log_folder,
            step_prefix=self.prefix,
            allow=None if self._tls is not None else self.net.allow,
            env=self.spec.base_env,
            tls=self._tls is not None,
            tls_mode=self._tls,  # one CA for the attempt: its command tasks and its servers
        )
        return start_servers(fleet, signals)

    def task_env(self, task: Task) -> Mapping[str, str]:
        return {}  # the node's part goes on srun's command line (_node_env): not srun's own

    def start_task(
        self, task: Task, env: Mapping[str, str], run: RunSink, log_path: str | None
    ) -> _SlurmTask:
        node_env = [f"{k}={v}" for k, v in self._node_env(task).items()]
        grace = max(STOP_GRACE_S, self.alloc.kill_wait_s)  # Slurm kills at KillWait anyway
        guarded = guarded_argv(self.spec.command, grace_s=grace, name=task.name, parent=True)
        cold_because = self._warm_client(task, env)
        if cold_because is None:  # a client of its node's agent, the cold command its fallback
            guarded = self.agents.client_argv(self.nodes[task.name], task.name, grace, guarded)
        on_node = ["env", *node_env, *guarded]
        stdin = None
        if self._tls is not None:  # the gateway first, the node's credentials on srun's stdin
            real = self.real_cluster.task(task.job, task.index)
            on_node = tls_exec_argv(self.real_cluster, real, on_node)
            stdin = self._tls.host_json(real.host)
        step = self.prefix + task.name
        argv = srun_argv(
            self.alloc.jobid,
            self.nodes[task.name],
            step,
            on_node,
            grace_s=TASK_STOP_GRACE_S,
            stdin=stdin is not None,
        )
        return _SlurmTask(
            task,
            argv,
            env,
            run,
            log_path,
            jobid=self.alloc.jobid,
            step=step,
            kill_wait_s=self.alloc.kill_wait_s,
            stdin=stdin,
            cold_because=cold_because,
        )

    def _warm_client(self, task: Task, env: Mapping[str, str]) -> str | None:
        """Why ``task`` runs cold on its node, or None: it runs warm, its step a client of the
        node's agent (:mod:`graphdist._distribute.nodewarm`, which decides again there). In TLS
        mode the client runs behind the task's gateway (:func:`tls_exec_argv` executes it), and
        the task binds its node's alias: the shim reads where it binds when it binds, from the
        environment the agent gives the task."""
        node = self.nodes[task.name]
        why = self.agents.why_cold(node)
        if why is not None:
            return why
        task_env = {**env, **self._node_env(task)}
        target = warm_target(
            self.spec.command, task_env, self.agents.env(node), self.agents.preload
        )
        return target if isinstance(target, str) else None

    def close(self) -> None:
        env = self.spec.base_env
        left = cancel_steps(self.alloc.jobid, self.prefix, env=env, lost=_lost_now(self.alloc, env))
        if self._tls is not None:
            self._tls.close()
            self._tls = None
        if left:
            print(
                f"graphdist: Slurm steps {', '.join(left)} of job {self.alloc.jobid} did not end; "
                f"`scancel {' '.join(left)}` ends them",
                file=sys.stderr,
            )


def _lost_now(alloc: Allocation, env: Mapping[str, str]) -> dict[str, str]:
    """The nodes of ``alloc`` lost now (``dead_nodes``; none where Slurm cannot say): their
    steps are not waited for when a run or an attempt cancels its own (Slurm lists a lost
    node's steps until it calls the node down, many seconds later)."""
    with contextlib.suppress(ArgumentError, OSError, subprocess.SubprocessError):
        return dead_nodes(alloc.nodes, env, alloc)
    return {}


class _Agents:
    """The run's warm agents (:mod:`graphdist._distribute.nodewarm`): one step per node, started
    when an attempt first places a task there (or again if it ended), kept across attempts,
    cancelled with the run. Each imports ``--preload`` in a warm interpreter of its node."""

    def __init__(self, spec: RunSpec, alloc: Allocation, tag: str) -> None:
        self.spec, self.alloc, self.tag = spec, alloc, tag
        self.preload: tuple[str, ...] = tuple(spec.options.get("preload", ()))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.paths: dict[str, str] = {}  # node -> its agent's socket
        self.why: dict[str, str] = {}  # node -> why its agent serves no task
        self.cold = run_cold_because(spec.command, spec.base_env, self.preload)

    def env(self, node: str) -> dict[str, str]:
        """The agent's environment on ``node`` (as its tasks', in what is read at import)."""
        shim = NetPolicy().env(self.alloc.addresses[node], inherit=True)
        return {**self.spec.base_env, **shim}

    def why_cold(self, node: str) -> str | None:
        if self.cold is not None:
            return self.cold
        proc = self.procs.get(node)
        if proc is None or proc.poll() is not None or node not in self.paths:
            return self.why.get(node, f"the warm agent on {node} is not running")
        return None

    def client_argv(self, node: str, name: str, grace: float, cold: Sequence[str]) -> list[str]:
        """A task's command on ``node`` as a client of its agent; ``cold`` where it cannot be."""
        return [*client_argv(self.paths[node], name, self.spec.command, grace), *cold]

    def ensure(self, nodes: Sequence[str]) -> None:
        """Start the agents of ``nodes`` that are not running, and wait for their first line
        (bounded: one that says nothing in time serves no task, which then runs cold)."""
        if self.cold is not None:
            return
        started = []
        for node in nodes:
            proc = self.procs.get(node)
            if proc is not None and proc.poll() is None:
                continue
            self.paths.pop(node, None)
            shim = NetPolicy().env(self.alloc.addresses[node], inherit=True)
            env = [f"{k}={v}" for k, v in shim.items()]
            on_node = ["env", *env, sys.executable, "-c", AGENT_CODE, self.tag, *self.preload]
            step = f"graphdist-{self.tag}-warm-{node}"
            argv = srun_argv(self.alloc.jobid, node, step, on_node, grace_s=STOP_GRACE_S)
            self.procs[node] = subprocess.Popen(
                argv,
                env=self.spec.base_env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            started.append(node)
        deadline = time.monotonic() + min(READY_TIMEOUT_S, self.spec.timeout_s or READY_TIMEOUT_S)
        for node in started:
            line = read_line(self.procs[node], max(0.0, deadline - time.monotonic()))
            if line.startswith("ready "):
                self.paths[node] = line.split(" ", 1)[1]
            else:
                self.why[node] = f"the warm agent on {node} did not start ({line or 'no word'})"

    def close(self, lost: Collection[str] = ()) -> None:
        """Stop the agents; on a ``lost`` node, only its srun here: Slurm ends the step once it
        calls the node down, and until then an srun told to stop it waits for the node."""
        for node in lost:
            if node in self.procs and self.procs[node].poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    self.procs[node].kill()
        # srun cancels the agent's step on its SIGTERM: SIGTERM, then KillWait
        stop_processes(self.procs.values(), grace_s=STOP_GRACE_S + self.alloc.kill_wait_s)
        for proc in self.procs.values():
            if proc.stdout is not None:
                proc.stdout.close()


class SlurmRun:
    """The ``slurm`` run backend (see the module docstring)."""

    name: ClassVar[str] = "slurm"
    summary: ClassVar[str] = (
        "every task a Slurm job step on a node of this allocation (run inside salloc or sbatch, "
        "or name the job with --jobid), restarted inside the same allocation"
    )
    requires: ClassVar[tuple[str, str] | None] = None
    tls: ClassVar[bool] = True
    options: ClassVar[tuple[Option, ...]] = (
        Option("jobid", JOBID_HELP, "JOBID"),
        Option(
            "ntasks_per_node",
            "tasks on each node of the allocation (default 1)",
            "N",
            parse=ascii_int,
        ),
        PRELOAD_OPTION,
    )

    @classmethod
    def check_options(cls, spec: RunSpec, options: Mapping[str, Any]) -> dict[str, Any]:
        per_node = options.get("ntasks_per_node", 1)
        count(per_node, "ntasks_per_node")
        alloc = allocation(options.get("jobid"), spec.base_env)
        tasks = sum(spec.jobs.values())
        if len(alloc.nodes) * per_node < tasks:
            raise ArgumentError(
                f"The run needs {tasks} task(s) and Slurm {alloc.describe()} holds "
                f"{len(alloc.nodes) * per_node} at ntasks_per_node={per_node}: ask salloc/sbatch "
                "for more nodes, or raise ntasks_per_node",
                name="ntasks_per_node",
                value=per_node,
            )
        preload = check_preload(options.get("preload", "auto"))
        return {
            "jobid": alloc.jobid,
            "ntasks_per_node": per_node,
            "allocation": alloc,
            "preload": preload,
        }

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.alloc: Allocation = spec.options["allocation"]
        self.tag = secrets.token_hex(4)
        self.agents = _Agents(spec, self.alloc, self.tag)

    def place(self, attempt: int, signals: SignalScope) -> _SlurmPlacement:
        return _SlurmPlacement(self.spec, self.alloc, attempt, self.tag, self.agents)

    def close(self) -> None:
        env = self.spec.base_env
        lost = _lost_now(self.alloc, env)
        self.agents.close(lost)
        with contextlib.suppress(ArgumentError, OSError, subprocess.SubprocessError):
            cancel_steps(self.alloc.jobid, f"graphdist-{self.tag}-", env=env, lost=lost)


register(SlurmRun)
