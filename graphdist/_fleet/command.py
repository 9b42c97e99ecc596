"""Fleets on an engine (:mod:`graphdist._engine`): each server a ``graphdist serve`` step on
one of the engine's nodes. Slurm's is :class:`SlurmFleet`; :func:`fleet_for` makes the fleet of
any other engine, which the backend registry hands out by the engine's name.

``SlurmFleet("worker=2")`` inside an allocation (``salloc``, ``sbatch``; or from a host outside
it, a login node, with ``jobid=``) starts one ``graphdist serve`` step per server (``srun
--overlap`` on one node), one per node first, on a port found free on that node (the engine's
:meth:`~graphdist._engine.Engine.free_ports`), so every address is known before any server
starts. A cluster of addresses names the nodes itself; a host that is not one of the engine's
nodes is refused, with the nodes in the message.

Each server listens on its node's address only and lets in only the engine's nodes, this host
and ``allow`` (members only, :mod:`graphdist._net.members`): ``graphdist serve`` loads the bind
shim and checks where its server listens before it says it is ready, which is the proof this
fleet waits for (with a gRPC answer). A step's output goes to ``JOB-INDEX.log`` in ``log_dir``.
A server killed on its node ends its step: the fleet's watcher sees the local command line exit,
and sessions fail with :class:`TaskFailedError` naming the task and its node; ``kill`` and
``restart`` signal the step through the engine (Slurm: ``scancel``) and start it again on its
node and port; ``close()`` asks every step to stop (SIGTERM, forwarded by ``srun``), then
cancels what is left, and returns once no step of the fleet is left. ``scancel`` of the whole
job ends every step: the tasks are then dead, never waited for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from graphdist._cluster import Cluster, Task
from graphdist._engine import Engine
from graphdist._exceptions import ClusterSpecError, FleetStartError
from graphdist._failures import DEAD, from_exit_status
from graphdist._fleet.lifecycle import OwnedFleet
from graphdist._fleet.task import TaskView, read_log_tail
from graphdist._net.exposure import ListeningTable, host_addresses
from graphdist._net.policy import NetPolicy, member_list
from graphdist._private import owned_temp_dir
from graphdist._proc.process import stop_processes
from graphdist._proc.slurm import SlurmEngine
from graphdist._registry import Option
from graphdist._validate import flag, timeout_ms, timeout_s
from graphdist._verdicts import ProcessFacts

if TYPE_CHECKING:
    from graphdist._net.tlsmode import TlsMode

__all__ = ["CommandFleet", "CommandTask", "SlurmFleet", "SlurmTask", "fleet_for"]

log = logging.getLogger("graphdist.engine")

_READY_RE = re.compile(r"graphdist serve: /job:(\S+)/task:(\d+) ready at .*; pid (\d+)\)")
#: Seconds a killed step gets to end before the kill is reported as not done.
KILL_WAIT_S = 10.0


class CommandTask(TaskView):
    """One server of a :class:`CommandFleet`: its task, node, step name, the local command line
    that runs its step, its log, and the server's pid on its node (from its ready line)."""

    def __init__(self, task: Task, node: str, step: str, log_path: str, engine: Engine) -> None:
        self.task = task
        self.node = node
        self.step = step
        self.engine = engine
        self.log_path: str | None = log_path
        self.restarts = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None
        self._log_start = 0  # where this start's lines begin in the log

    @property
    def pid(self) -> int | None:
        """The server's pid on its node (its ready line, written since its step started, says
        it); None before it is ready."""
        if self._pid is None and self.log_path is not None:
            with contextlib.suppress(OSError), open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                for line in f.read(1 << 20).decode("utf-8", "replace").splitlines():
                    found = _READY_RE.search(line)
                    if found and (found[1], int(found[2])) == (self.job, self.index):
                        self._pid = int(found[3])
        return self._pid

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def exitcode(self) -> int | None:
        """How the step ended, as its command line says it (a server killed by signal N: -N)."""
        return from_exit_status(None if self._proc is None else self._proc.poll())

    def log_tail(self, lines: int = 12) -> list[str]:
        return read_log_tail(self.log_path, lines)

    def out_of_memory(self) -> str | None:
        """The engine's word, in this start's lines of the log, that the kernel killed the
        server for memory (Slurm: its step over the job's limit): ``out of memory (...)``; None
        without it. srun writes it before it exits, so it is there once :attr:`alive` is
        False."""
        if self.log_path is None:
            return None
        with contextlib.suppress(OSError), open(self.log_path, "rb") as f:
            f.seek(self._log_start)
            for line in f:
                ran_out = self.engine.out_of_memory(line)
                if ran_out is not None:
                    return ran_out
        return None

    def _start(
        self, argv: Sequence[str], env: Mapping[str, str], stdin: bytes | None = None
    ) -> None:
        self._pid = None
        assert self.log_path is not None
        with open(self.log_path, "ab") as out:
            self._log_start = out.tell()
            self._proc = subprocess.Popen(
                list(argv),
                env=dict(env),
                stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C to the owner's group is not the fleet's
            )
        if stdin is not None and self._proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):  # the step ended at once: its log says
                self._proc.stdin.write(stdin)
            with contextlib.suppress(BrokenPipeError):
                self._proc.stdin.close()

    def _wait(self, seconds: float) -> bool:
        if self._proc is None:
            return True
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(seconds)
        return self._proc.poll() is not None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, node={self.node!r}, alive={self.alive})"


SlurmTask = CommandTask
"""A :class:`SlurmFleet`'s server (the name graphdist has always exported)."""


def _counts_or_cluster(cluster: object) -> dict[str, int] | Cluster:
    if isinstance(cluster, Cluster):
        return cluster
    if isinstance(cluster, str) and ":" not in cluster and not cluster.lstrip().startswith("{"):
        return dict(Cluster.parse_counts(cluster))
    if isinstance(cluster, Mapping) and all(isinstance(v, int) for v in cluster.values()):
        return Cluster.check_counts(cluster)
    return Cluster.parse_addresses(cluster, what="A fleet's cluster")


class CommandFleet(OwnedFleet[CommandTask]):
    """A fleet of TensorFlow servers as steps of an engine (see the module docstring); a class
    of it is bound to one engine (:data:`ENGINE`: :class:`SlurmFleet`, :func:`fleet_for`).

    ``cluster``: task counts (``"worker=2"``: one server per node first, then a second per node
    ...; ports picked free on each node) or every task's address (the hosts must be the
    engine's nodes, by name or address). ``jobs``: serve only these jobs of ``cluster`` (the
    others are, say, a run's command tasks). ``engine``: the engine to use (a run's own);
    without it, one joined with ``options``, the engine's own (Slurm's ``jobid``: the job whose
    allocation runs the servers, default ``SLURM_JOB_ID``). ``allow``: other machines let in
    besides the engine's nodes and this host. ``start_timeout_s`` (default: the engine's, a
    step's start and a TensorFlow import on its node). ``log_dir``: where ``JOB-INDEX.log`` go
    (default: a private temporary folder, removed at close). ``env``: the environment of the
    steps (default this process's). ``expose`` must stay True: a server listens on its node's
    address (members only); it is there for the same signature as the other backends. ``tls``:
    TLS mode (each step ``serve --tls -`` fed its node's credentials on its stdin, this
    process's own gateway; ``allow`` refused); ``tls_mode``: a :class:`~graphdist._net.tlsmode.
    TlsMode` of the caller's to use instead of one of the fleet's own (a run's attempt: one CA
    for its command tasks and its servers), which close leaves to the caller; ``tls_dir``:
    where the fleet's own credentials are made (a detached fleet's state folder), removed at
    close."""

    ENGINE: ClassVar[type[Engine]]
    backend_name: ClassVar[str]
    DEFAULT_START_TIMEOUT_S: ClassVar[float]
    summary: ClassVar[str]
    requires: ClassVar[tuple[str, str] | None]
    options: ClassVar[tuple[Option, ...]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        engine = cls.__dict__.get("ENGINE")
        if engine is not None:  # the engine's declarations are the backend's
            cls.backend_name = engine.name
            cls.DEFAULT_START_TIMEOUT_S = engine.DEFAULT_START_TIMEOUT_S
            cls.summary = engine.summary
            cls.requires = engine.requires
            cls.options = engine.options
            _BOUND.setdefault(engine, cls)

    @classmethod
    def parse_cluster(cls, spec: Any) -> dict[str, int]:
        return Cluster.parse_counts(spec) if isinstance(spec, str) else Cluster.check_counts(spec)

    @classmethod
    def cluster_data(cls, cluster: Mapping[str, int]) -> dict[str, int]:
        return dict(cluster)

    @classmethod
    def task_count(cls, cluster: Mapping[str, int]) -> int:
        return sum(cluster.values())

    @classmethod
    def check_cluster(cls, cluster: Mapping[str, int], *, expose: bool, tls: bool = False) -> None:
        """Only ``expose`` and ``tls``: the engine's nodes are read when the fleet starts."""
        flag(expose, "expose")
        flag(tls, "tls")

    COMMAND_ARGS = ("start_timeout_s", "log_dir", "allow", "tls", "tls_dir")  # always exposed

    def __init__(
        self,
        cluster: str | Mapping[str, Any] | Cluster = "worker=2",
        *,
        jobs: Iterable[str] | None = None,
        engine: Engine | None = None,
        start_timeout_s: float | None = None,
        operation_timeout_ms: int | None = None,
        expose: bool = True,
        allow: Iterable[str] | str | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        step_prefix: str | None = None,
        tls: bool = False,
        tls_mode: TlsMode | None = None,
        tls_dir: str | os.PathLike[str] | None = None,
        **options: Any,
    ) -> None:
        unknown = sorted(set(options) - {o.name for o in self.ENGINE.options})
        if unknown:
            raise TypeError(f"{type(self).__name__}() got an unexpected keyword {unknown[0]!r}")
        words = self.ENGINE.node_word.split()[0]
        net = NetPolicy.checked(expose, allow, tls, nodes=words)  # expose: always True
        self.expose, self.allow, self.tls = net.expose, net.allow, net.tls
        super().__init__()
        self._wanted = _counts_or_cluster(cluster)
        self._jobs = None if jobs is None else tuple(jobs)
        self._env = dict(os.environ if env is None else env)
        # checked before anything starts
        self.engine: Engine = engine or self.ENGINE.join(options, self._env)
        self.real_cluster = self._place()
        self.cluster = self.real_cluster
        if self.tls:
            from graphdist._net.gateway import tls_cluster

            self.cluster = tls_cluster(self.real_cluster)  # what TensorFlow sees: the aliases
        self.tls_dir: str | None = None
        # a run's attempt shares its own TlsMode (one CA for the command tasks and the servers)
        self._tls_given = tls_mode
        self._tls_dir_given = os.fspath(tls_dir) if tls_dir is not None else None
        self._tls: TlsMode | None = None
        self.start_timeout_s = timeout_s(
            start_timeout_s, "start_timeout_s", self.DEFAULT_START_TIMEOUT_S
        )
        self.operation_timeout_ms = timeout_ms(operation_timeout_ms, "operation_timeout_ms")
        self.gpus = None
        self._own_log_dir = log_dir is None
        self.log_dir = "" if log_dir is None else os.fspath(log_dir)
        self.prefix = step_prefix or f"graphdist-{secrets.token_hex(4)}-"
        # what each server's `graphdist serve --allow` lets in besides the cluster's hosts
        own = [*self.engine.addresses().values(), *host_addresses()]
        self._members = member_list(own, self.allow)

    # -- where the servers go ------------------------------------------------------------------

    def _place(self) -> Cluster:
        if isinstance(self._wanted, Cluster):
            return self._check_hosts(self._wanted)
        names = [(job, i) for job in sorted(self._wanted) for i in range(self._wanted[job])]
        addresses = self.engine.addresses()
        dead = self.engine.lost(list(addresses))
        live = [n for n in addresses if n not in dead]
        if not live:
            raise ClusterSpecError(
                f"Every node of {self.engine.describe()} is down: {dead}", self._wanted
            )
        slots = [live[i % len(live)] for i in range(len(names))]
        per_node: dict[str, int] = {}
        for node in slots:
            per_node[node] = per_node.get(node, 0) + 1
        ports = self.engine.free_ports(per_node, f"graphdist-{os.getpid()}-ports")
        jobs: dict[str, list[str]] = {}
        for (job, _), node in zip(names, slots, strict=True):
            address = addresses[node]
            host = f"[{address}]" if ":" in address else address
            jobs.setdefault(job, []).append(f"{host}:{ports[node].pop(0)}")
        return Cluster(jobs)

    def _check_hosts(self, cluster: Cluster) -> Cluster:
        addresses = self.engine.addresses()
        by_address = {a: n for n, a in addresses.items()}
        for task in cluster:
            host = task.host.strip("[]")
            if host not in addresses and host not in by_address:
                raise ClusterSpecError(
                    f"Task {task.name} is at {task.address}, which is not a node of "
                    f"{self.engine.describe()}; name one of them (by name or address: "
                    f"{', '.join(f'{n}={a}' for n, a in addresses.items())})",
                    task.address,
                )
        return cluster

    def _node_of(self, task: Task) -> str:
        host = task.host.strip("[]")
        addresses = self.engine.addresses()
        by_address = {a: n for n, a in addresses.items()}
        return host if host in addresses else by_address[host]

    # -- the backend's primitives --------------------------------------------------------------

    def _serve_argv(self, task: CommandTask) -> list[str]:
        serve = [
            sys.executable,
            "-m",
            "graphdist",
            "serve",
            "--cluster",
            json.dumps(self.real_cluster.as_dict()),
            "--job",
            task.job,
            "--task",
            str(task.index),
            *(["--tls", "-"] if self.tls else ["--allow", self._members]),
        ]
        return self.engine.command(task.node, task.step, serve, stdin=self.tls, grace_s=2.0)

    def _start_task(self, task: CommandTask) -> None:
        """Start ``task``'s step; in TLS mode its host's credentials go on the step's stdin
        (the engine's own channel to the node; ``serve --tls -`` keeps them on disk only until
        its gateway has read them)."""
        host = self.real_cluster.task(task.job, task.index).host
        stdin = self._tls.host_json(host) if self._tls is not None else None
        task._start(self._serve_argv(task), self._env, stdin=stdin)

    def _start_tls(self) -> None:
        """TLS mode: the cluster's credentials and this process's gateway for the tasks on
        other hosts (a run's own, when it gave one)."""
        from graphdist._net.tlsmode import TlsMode

        self._tls = self._tls_given or TlsMode(self.real_cluster, folder=self._tls_dir_given)
        self.tls_dir = self._tls.folder

    def _launch(self) -> None:
        if self._own_log_dir:
            self.log_dir = owned_temp_dir("fleet")
        os.makedirs(self.log_dir, exist_ok=True)
        jobs = self.cluster.jobs if self._jobs is None else self._jobs
        if self.tls:
            self._start_tls()
        for task in self.real_cluster:
            if task.job not in jobs:
                continue
            handle = CommandTask(
                self.cluster.task(task.job, task.index),  # TLS mode: at its alias
                self._node_of(task),
                f"{self.prefix}{task.job}-{task.index}",
                os.path.join(self.log_dir, f"{task.name}.log"),
                self.engine,
            )
            self._tasks[(task.job, task.index)] = handle
            self._start_task(handle)

    def _wait_ready(self, tasks: list[CommandTask], timeout_s: float) -> None:
        """Each step's ready line (``graphdist serve`` prints it once it checked where its
        server listens), then a gRPC answer from every server; a step that ends first fails
        the start with its log's last lines."""
        deadline = time.monotonic() + timeout_s
        waiting = list(tasks)
        while waiting:
            for task in list(waiting):
                if task.pid is not None:
                    waiting.remove(task)
                elif not task.alive:
                    raise FleetStartError(
                        f"The step of {task.name} on {self.engine.node_word} {task.node} ended "
                        f"({task.exitcode}) before its server was ready; its last lines:\n"
                        + "\n".join(f"    {line}" for line in task.log_tail()),
                        task=task.name,
                        address=task.address,
                    )
            if waiting and time.monotonic() > deadline:
                self._wait_answering(waiting, 0.0, budget_s=timeout_s)  # raises, with counts
            if waiting:
                time.sleep(0.05)
        self._wait_answering(tasks, max(0.1, deadline - time.monotonic()), budget_s=timeout_s)

    def _check_listening(
        self, task: CommandTask, allowed: frozenset[str] | None, table: ListeningTable | None = None
    ) -> None:
        """Where a server on a node listens is checked on the node: ``graphdist serve`` reads its
        own sockets and refuses to say it is ready unless its server listens on its task's
        address only; its ready line is the proof (:meth:`_wait_ready` waited for it)."""
        if task.pid is None:
            raise FleetStartError(
                f"The server of {task.name} never said where it listens; refusing it",
                task=task.name,
                address=task.address,
            )

    def _kill_task(self, task: CommandTask, sig: int) -> None:
        """``sig`` to the task's step through the engine; with SIGKILL or SIGTERM, return once
        its local command line has ended (at most :data:`KILL_WAIT_S`)."""
        self.engine.signal(task.step, sig, task._proc)
        if sig in (signal.SIGKILL, signal.SIGTERM) and not task._wait(KILL_WAIT_S):
            log.warning("The step of %r did not end within %g s", task, KILL_WAIT_S)

    def _restart_task(self, task: CommandTask) -> None:
        if task.alive:
            self._kill_task(task, signal.SIGKILL)
        self.engine.cancel(task.step)
        task.restarts += 1
        self._start_task(task)

    def _stop_tasks(self, tasks: list[CommandTask], grace_s: float) -> None:
        """SIGTERM to each step's local command line (srun forwards it to the server), up to
        ``grace_s``, then the fleet's steps cancelled (whichever are left, their command line
        gone or not) before the command lines still running are SIGKILLed."""
        stop_processes(
            [task._proc for task in tasks if task._proc is not None],
            grace_s,
            KILL_WAIT_S,
            before_kill=lambda _live: self.engine.cancel(self.prefix),
        )

    def _teardown(self) -> None:
        import shutil

        if self._tls is not None and self._tls is not self._tls_given:
            self._tls.close()
        self._tls = None
        if self._own_log_dir and self.log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def _facts(self, task: CommandTask, wait_s: float = 0.0) -> ProcessFacts:
        """Its step's end as its command line says it; when the engine says the kernel killed
        the server for memory, that, and the end the kernel's OOM killer gives: SIGKILL (srun's
        own exit status is then 1, which is no exit of the server's)."""
        facts = super()._facts(task, wait_s)
        ran_out = task.out_of_memory() if facts.ended else None
        if ran_out is None:
            return facts
        return dataclasses.replace(facts, exitcode=-signal.SIGKILL, oom=ran_out)

    def _explain(self, task: CommandTask, status: str, detail: str) -> tuple[str, str]:
        """A failed task, told with its node (and the node's state, when the engine says it is
        lost: every task of this fleet on it is named)."""
        try:
            dead = self.engine.lost([task.node])
        except Exception:  # the engine cannot be asked: say what is known
            dead = {}
        node = f"{self.engine.node_word} {task.node}"
        if task.node not in dead:
            return status, f"{detail}; on {node}" if detail else f"on {node}"
        on_it = [t.name for t in self._tasks.values() if t.node == task.node]
        why = dead[task.node]
        return DEAD, f"{node} is lost ({why}); tasks on it: {', '.join(on_it)}"

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.state.value} {self.engine.describe()} "
            f"{self.cluster.as_dict()}>"
        )


_BOUND: dict[type[Engine], type[CommandFleet]] = {}


def fleet_for(engine: type[Engine]) -> type[CommandFleet]:
    """The fleet class of ``engine``: :class:`CommandFleet` bound to it (one class per engine)."""
    bound = _BOUND.get(engine)
    if bound is None:
        name = f"{engine.__name__.removesuffix('Engine')}Fleet"
        bound = type(name, (CommandFleet,), {"ENGINE": engine, "__module__": __name__})
    return bound


class SlurmFleet(CommandFleet):
    """A fleet of TensorFlow servers as Slurm job steps on the nodes of an allocation (see
    :class:`CommandFleet`; ``jobid``: the Slurm job, default ``SLURM_JOB_ID``)."""

    ENGINE: ClassVar[type[Engine]] = SlurmEngine

    def __init__(
        self,
        cluster: str | Mapping[str, Any] | Cluster = "worker=2",
        *,
        jobid: str | int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(cluster, jobid=jobid, **kwargs)
