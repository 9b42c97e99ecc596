"""``graphdist run`` on an engine (:mod:`graphdist._engine`; ``--backend slurm``): every task of
a tf.distribute run a step on one of the engine's nodes, restarted on the same engine.

On Slurm the run is started inside an allocation (an ``sbatch`` script, ``salloc``:
``SLURM_JOB_ID``) or from a host outside it, a login node, with ``jobid=``. Before anything
starts the engine is joined (:meth:`~graphdist._engine.Engine.join`: Slurm reads the allocation)
and checked to fit the run (``ntasks_per_node`` tasks on each node, default 1). Each attempt
places its tasks on the nodes the engine does not call lost (one per node first, then a second
per node ...), reserves a free port for each on those nodes, and so knows every TF_CONFIG before
any task starts; a run whose nodes are too few for it after a node was lost ends with one line
saying so.

Each command task is the engine's command line (Slurm: ``srun --overlap``) of the command under
graphdist's guard on its node (the guard there ends the task's whole tree when its step ends),
and the step's output comes back through that line as a local task's does, under a local guard
of its own. A stop goes to the step through the engine (Slurm forwards a SIGTERM); a broken
attempt's and a frozen task's steps are ended with SIGKILL, and every step an attempt started
is gone before the next starts. The tasks' servers listen on their node's address, with the
bind shim letting in only the engine's nodes and this host (whose heartbeat probes them). A
parameter-server run's worker and ps tasks are ``graphdist serve`` steps (the engine's fleet,
:mod:`graphdist._fleet.command`), restarted on their node and port when one dies (the
coordinator carries on, as on the other backends).

With ``tls`` (TLS mode, :mod:`graphdist._net.gateway`) each attempt makes its credentials
(:class:`~graphdist._net.tlsmode.TlsMode`, with this host's gateway for the heartbeat's probes);
each TF_CONFIG names the nodes' loopback aliases, and each task's step is wrapped
(:func:`~graphdist._proc.tlsexec.tls_exec_argv`): it reads its node's credentials on the step's
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
from graphdist._distribute.runspec import RunSpec
from graphdist._distribute.taskproc import GuardedTask, RunSink
from graphdist._distribute.warm import PRELOAD_OPTION, READY_TIMEOUT_S, check_preload, warm_target
from graphdist._engine import Engine
from graphdist._exceptions import ArgumentError, LaunchError
from graphdist._failures import from_exit_status
from graphdist._net.exposure import host_addresses
from graphdist._net.gateway import read_line
from graphdist._net.policy import NetPolicy
from graphdist._proc.oom import node_words
from graphdist._proc.process import (
    NOW_SIGNAL,
    PREEMPT_SIGNAL,
    STOP_GRACE_S,
    TASK_STOP_GRACE_S,
    guarded_argv,
    stop_processes,
)
from graphdist._proc.signals import SignalScope
from graphdist._proc.tlsexec import tls_exec_argv
from graphdist._registry import Option
from graphdist._validate import ascii_int, count

if TYPE_CHECKING:
    from graphdist._net.tlsmode import TlsMode

__all__ = ["CommandRun", "run_for"]

#: Seconds a killed step's command line gets to end by itself before its local guard is told to
#: end it.
STEP_END_WAIT_S = 1.0

NTASKS_OPTION = Option(
    "ntasks_per_node", "tasks on each node of the allocation (default 1)", "N", parse=ascii_int
)


def _host_port(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


class _StepTask(GuardedTask):
    """A command task as a step: the engine's command line under a local guard, the command
    under a guard on its node. Its processes are the node's (the heartbeat probes its server
    instead); a SIGKILL (a frozen task, a broken attempt) goes through the engine, which
    reaches a stopped one. Its progress records come on the step's stderr, from the guard (or
    the warm client) on its node, and the local guard relays them (``"step"``)."""

    RELAYS_PROGRESS = "step"

    def __init__(
        self,
        task: Task,
        argv: Sequence[str],
        env: Mapping[str, str],
        run: RunSink,
        log_path: str | None,
        *,
        engine: Engine,
        step: str,
        stdin: bytes | None = None,
        cold_because: str | None = "the task's node has no warm interpreter",
    ) -> None:
        self.engine, self.step = engine, step
        self.stop_grace_s = engine.kill_wait_s + TASK_STOP_GRACE_S  # a checkpoint, then reaping
        # the local guard's grace too: Slurm's stop of the batch step (scancel, requeue) reaches
        # it and srun as well, which must wait for the tasks' own exits
        grace = engine.kill_wait_s + STOP_GRACE_S
        super().__init__(
            task, argv, env, run, log_path, grace_s=grace, stdin=stdin, cold_because=cold_because
        )

    def _line(self, raw: bytes, more: int) -> None:
        lost = self.engine.lost_line(raw)
        if lost is not None:  # the step's command line then exits 0 (srun, Slurm 22.05)
            self.result.lost = lost
        # the step over its memory limit (srun then exits 1), or a warm client's word
        ran_out = node_words(raw) or self.engine.out_of_memory(raw)
        if ran_out is not None:
            self.result.oom = ran_out
        super()._line(raw, more)

    def ended(self) -> int | None:
        """The command line's exit, as a local task's code; a step whose node failed ended
        killed."""
        code = from_exit_status(super().ended())
        if code in (0, -signal.SIGKILL) and self.result.lost is None and self.result.oom is None:
            # the command line's last words (a node failure; a warm task's client's word that
            # its kernel killed it for memory) come before its exit: read them first
            self._reader.join(2.0)
        if code == 0 and self.result.lost is not None:
            return -signal.SIGKILL
        return code

    def processes(self) -> list[int] | None:
        return None

    def preempt(self) -> None:
        """The notice to the guard on the node (``PREEMPT_SIGNAL``, through the engine to every
        process of the step, which only the guard does not ignore): it sends SIGTERM to the
        command alone, once. A SIGTERM from Slurm to the whole step would be a cancel, and the
        command would get it twice (Slurm's and the guard's)."""
        if self.running():
            self.engine.signal(self.step, PREEMPT_SIGNAL, self.proc)

    def signal(self, sig: int) -> None:
        """A stop (SIGTERM, SIGINT, SIGHUP) goes to the step's processes on the node through
        the engine, as Slurm's own scancel would: the command line is not cut off meanwhile,
        and the command gets what the guard there grants it (Slurm's KillWait) to save and
        exit. SIGKILL and the broken-attempt signal end the step, then the local side."""
        if not self.running():
            return
        if sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self.engine.signal(self.step, sig, self.proc)
            return
        if sig in (signal.SIGKILL, NOW_SIGNAL):
            self.engine.signal(self.step, signal.SIGKILL, self.proc)
            # srun ends with its step, which then leaves Slurm's queue at once; an srun killed
            # first leaves its step listed ~2.3 s more (measured), which the next attempt waits
            # out: give the command line a moment to end by itself
            deadline = time.monotonic() + STEP_END_WAIT_S
            while self.running() and time.monotonic() < deadline:
                time.sleep(0.02)
        super().signal(sig)


class _StepPlacement:
    def __init__(
        self, spec: RunSpec, engine: Engine, attempt: int, tag: str, agents: _Agents
    ) -> None:
        self.spec, self.engine, self.agents = spec, engine, agents
        self.prefix = f"graphdist-{tag}-{attempt}-"
        per_node = int(spec.options["ntasks_per_node"])
        addresses = engine.addresses()
        dead = engine.lost(list(addresses))
        live = [n for n in addresses if n not in dead]
        names = [(job, i) for job in sorted(spec.jobs) for i in range(spec.jobs[job])]
        if len(live) * per_node < len(names):
            lost = ", ".join(f"{n} ({s})" for n, s in dead.items())
            raise LaunchError(
                f"Attempt {attempt} cannot be placed: the run needs {len(names)} task(s) and "
                f"{engine.describe()} has {len(live)} node(s) left for {per_node} task(s) each "
                f"(lost: {lost}); the run ends here",
                [],
            )
        slots = [node for _ in range(per_node) for node in live][: len(names)]
        ports = engine.free_ports(collections.Counter(slots), self.prefix + "ports")
        jobs: dict[str, list[str]] = {}
        self.nodes: dict[str, str] = {}
        for (job, i), node in zip(names, slots, strict=True):
            jobs.setdefault(job, []).append(_host_port(addresses[node], ports[node].pop(0)))
            self.nodes[f"{job}-{i}"] = node
        self.cluster = self.real_cluster = Cluster(jobs)
        # the members (the engine's nodes, this host), resolved once for the attempt
        self.net = NetPolicy(expose=True, tls=spec.tls).node_tasks(self.cluster, host_addresses())
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
        the node's address and the members (the engine's nodes, this host); in TLS mode the
        shim on the node's alias, where only this user gets in."""
        return self.net.env(task.host.strip("[]"), inherit=True)

    def start_servers(
        self, jobs: Sequence[str], log_folder: str | None, signals: SignalScope
    ) -> Any:
        from graphdist._fleet.command import fleet_for

        fleet = fleet_for(type(self.engine))(
            self.real_cluster,
            jobs=jobs,
            engine=self.engine,
            log_dir=log_folder,
            step_prefix=self.prefix,
            allow=None if self._tls is not None else self.net.allow,
            env=self.spec.base_env,
            tls=self._tls is not None,
            tls_mode=self._tls,  # one CA for the attempt: its command tasks and its servers
        )
        return fleet.start_within(signals)

    def task_env(self, task: Task) -> Mapping[str, str]:
        return {}  # the node's part goes on the step's command line (_node_env): not srun's own

    def start_task(
        self, task: Task, env: Mapping[str, str], run: RunSink, log_path: str | None
    ) -> _StepTask:
        node_env = [f"{k}={v}" for k, v in self._node_env(task).items()]
        # the engine kills at its own grace (Slurm's KillWait) anyway
        grace = max(STOP_GRACE_S, self.engine.kill_wait_s)
        # its report (its command's progress records) on the step's stderr, which srun brings
        # back to the local guard's relay; the command's stderr joins its stdout
        guarded = guarded_argv(
            self.spec.command,
            grace_s=grace,
            name=task.name,
            parent=True,
            report_fd=2,
            progress=True,
        )
        cold_because = self._warm_client(task, env)
        if cold_because is None:  # a client of its node's agent, the cold command its fallback
            guarded = self.agents.client_argv(self.nodes[task.name], task.name, grace, guarded)
        on_node = ["env", *node_env, *guarded]
        stdin = None
        if self._tls is not None:  # the gateway first, the node's credentials on the stdin
            real = self.real_cluster.task(task.job, task.index)
            on_node = tls_exec_argv(self.real_cluster, real, on_node)
            stdin = self._tls.host_json(real.host)
        step = self.prefix + task.name
        argv = self.engine.command(
            self.nodes[task.name], step, on_node, stdin=stdin is not None, grace_s=TASK_STOP_GRACE_S
        )
        return _StepTask(
            task,
            argv,
            env,
            run,
            log_path,
            engine=self.engine,
            step=step,
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
        left = self.engine.cancel(self.prefix, lost=_lost_now(self.engine))
        if self._tls is not None:
            self._tls.close()
            self._tls = None
        if left:
            print(
                f"graphdist: steps {', '.join(left)} of {self.engine.describe()} did not end; "
                f"`scancel {' '.join(left)}` ends them",
                file=sys.stderr,
            )


def _lost_now(engine: Engine) -> dict[str, str]:
    """The nodes of ``engine`` lost now (none where it cannot say): their steps are not waited
    for when a run or an attempt cancels its own (Slurm lists a lost node's steps until it
    calls the node down, many seconds later)."""
    with contextlib.suppress(ArgumentError, OSError, subprocess.SubprocessError):
        return engine.lost(list(engine.addresses()))
    return {}


class _Agents:
    """The run's warm agents (:mod:`graphdist._distribute.nodewarm`): one step per node, started
    when an attempt first places a task there (or again if it ended), kept across attempts,
    ended with the run. Each imports ``--preload`` in a warm interpreter of its node."""

    def __init__(self, spec: RunSpec, engine: Engine, tag: str) -> None:
        self.spec, self.engine, self.tag = spec, engine, tag
        self.preload: tuple[str, ...] = tuple(spec.options.get("preload", ()))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.paths: dict[str, str] = {}  # node -> its agent's socket
        self.why: dict[str, str] = {}  # node -> why its agent serves no task
        self.cold = run_cold_because(spec.command, spec.base_env, self.preload)

    def env(self, node: str) -> dict[str, str]:
        """The agent's environment on ``node`` (as its tasks', in what is read at import)."""
        shim = NetPolicy().env(self.engine.addresses()[node], inherit=True)
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
        client = client_argv(self.paths[node], name, self.spec.command, grace, relay=True)
        return [*client, *cold]

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
            shim = NetPolicy().env(self.engine.addresses()[node], inherit=True)
            env = [f"{k}={v}" for k, v in shim.items()]
            on_node = ["env", *env, sys.executable, "-c", AGENT_CODE, self.tag, *self.preload]
            step = f"graphdist-{self.tag}-warm-{node}"
            argv = self.engine.command(node, step, on_node, stdin=False, grace_s=STOP_GRACE_S)
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
        """Stop the agents; on a ``lost`` node, only its command line here: Slurm ends the step
        once it calls the node down, and until then an srun told to stop it waits for the
        node."""
        for node in lost:
            if node in self.procs and self.procs[node].poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    self.procs[node].kill()
        # srun cancels the agent's step on its SIGTERM: SIGTERM, then KillWait
        stop_processes(self.procs.values(), grace_s=STOP_GRACE_S + self.engine.kill_wait_s)
        for proc in self.procs.values():
            if proc.stdout is not None:
                proc.stdout.close()


class CommandRun:
    """A run on an engine (see the module docstring); a class of it is bound to one engine
    (:data:`ENGINE`, :func:`run_for`)."""

    ENGINE: ClassVar[type[Engine]]
    name: ClassVar[str]
    summary: ClassVar[str]
    requires: ClassVar[tuple[str, str] | None]
    tls: ClassVar[bool]
    options: ClassVar[tuple[Option, ...]]

    @classmethod
    def check_options(cls, spec: RunSpec, options: Mapping[str, Any]) -> dict[str, Any]:
        per_node = options.get("ntasks_per_node", 1)
        count(per_node, "ntasks_per_node")
        own = {o.name for o in cls.ENGINE.options}
        engine = cls.ENGINE.join({k: v for k, v in options.items() if k in own}, spec.base_env)
        tasks = sum(spec.jobs.values())
        nodes = len(engine.addresses())
        if nodes * per_node < tasks:
            raise ArgumentError(
                f"The run needs {tasks} task(s) and {engine.describe()} holds "
                f"{nodes * per_node} at ntasks_per_node={per_node}: {cls.ENGINE.more_nodes}, "
                "or raise ntasks_per_node",
                name="ntasks_per_node",
                value=per_node,
            )
        preload = check_preload(options.get("preload", "auto"))
        return {**options, "ntasks_per_node": per_node, "engine": engine, "preload": preload}

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.engine: Engine = spec.options["engine"]
        self.tag = secrets.token_hex(4)
        self.agents = _Agents(spec, self.engine, self.tag)

    def place(self, attempt: int, signals: SignalScope) -> _StepPlacement:
        return _StepPlacement(self.spec, self.engine, attempt, self.tag, self.agents)

    def close(self) -> None:
        lost = _lost_now(self.engine)
        self.agents.close(lost)
        with contextlib.suppress(ArgumentError, OSError, subprocess.SubprocessError):
            self.engine.cancel(f"graphdist-{self.tag}-", lost=lost)


_BOUND: dict[type[Engine], type[CommandRun]] = {}


def run_for(engine: type[Engine]) -> type[CommandRun]:
    """The run backend of ``engine``: :class:`CommandRun` bound to it (one class per engine),
    which takes the engine's own options, ``ntasks_per_node`` and ``preload``."""
    bound = _BOUND.get(engine)
    if bound is None:
        declared = {
            "ENGINE": engine,
            "name": engine.name,
            "summary": engine.summary,
            "requires": engine.requires,
            "tls": engine.tls,
            "options": (*engine.options, NTASKS_OPTION, PRELOAD_OPTION),
            "__module__": __name__,
        }
        name = f"{engine.__name__.removesuffix('Engine')}Run"
        bound = _BOUND[engine] = type(name, (CommandRun,), declared)
    return bound
