"""``graphdist run --backend ray``: the tasks of a tf.distribute run as processes on Ray's nodes.

Each attempt of a run (:mod:`graphdist._distribute.launcher` decides the attempts: restarts, the
policy, events, logs and the summary are the same as for local runs) places one bundle per
command task, ``STRICT_SPREAD`` (one task per node) where there are nodes enough, else
``SPREAD``, and reserves a free port on each bundle's node (:func:`~graphdist._ray.nodes.
place_bundles`, as a RayFleet does), so that every task's TF_CONFIG names its node's address
before any task starts. Then a small Ray actor per bundle runs the command on its node, under
graphdist's guard (:mod:`graphdist._proc.process`: nothing the command starts outlives the
actor), and hands its output and its progress records (a warm task's through its node client's
channel) to this process, which shows it, logs it and watches its exit as for a local task.

Where the tasks' servers listen is decided as for a RayFleet (:func:`~graphdist._ray.nodes.
plan_hosts`): all on this machine, loopback; on other hosts only with ``expose``, each on its
node's own address, letting in only the Ray cluster's nodes (the bind shim, inherited by the
command's processes). The script must be reachable on every node: each task starts in this
process's working folder where its node has it (a shared file system), or, with ``working_dir``,
in that folder as Ray ships it (``runtime_env``: uploaded once per run, at most Ray's limit).
In a parameter-server run (``ps``) the chief runs the command and the worker and ps tasks are
servers, each a Ray actor as a RayFleet's (Ray brings a dead one back on its node and port; a
worker then serves the coordinator again, a ps task's loss fails the coordinator and so restarts
the run).
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

from graphdist._cluster import Cluster, Task
from graphdist._distribute.events import TaskStarted
from graphdist._distribute.runspec import RunSpec, check_folder
from graphdist._distribute.taskproc import LINE_LIMIT, RunSink, TaskOutput, TaskResult
from graphdist._distribute.warm import PRELOAD_OPTION, check_preload, warm_target
from graphdist._exceptions import ArgumentError, LaunchError
from graphdist._net.policy import NetPolicy
from graphdist._net.probe import GCS_PROBE_S, tcp_connect_error
from graphdist._proc.guardreport import parse_progress
from graphdist._proc.process import STOP_GRACE_S, guarded_argv
from graphdist._proc.signals import SignalScope
from graphdist._ray.agents import RayAgents
from graphdist._registry import Option

__all__ = ["RayRun"]

POLL_WAIT_S = 0.2
"""How long one poll of a task's actor waits for output before it answers with none."""
CPUS_PER_TASK = 1.0
PLACE_TIMEOUT_S = 180.0
"""Seconds Ray gets to place an attempt's tasks (a group it cannot place fails the run)."""
HEAD_PROBE_S = 0.5
"""How often the run asks the Ray head's GCS port for a connection."""
HEAD_MISSES = 2
"""Refused probes in a row that make the head lost (its GCS gone: the cluster ends with it)."""
WARM_GRACE_MARGIN_S = 2.0
"""How much longer a warm task's guard in its actor waits for the client than the node's warm
guard for the task (the task's stop is the warm guard's)."""


class _Head:
    """The Ray head, watched from the run: its GCS port asked every :data:`HEAD_PROBE_S`,
    :data:`HEAD_MISSES` refusals in a row make it lost (Ray says so 60 s later, by killing this
    process; every call that needs the GCS blocks until then). Once lost, the run's tasks end
    as lost with it (without GCS fault tolerance every raylet exits), the run says so in one
    line, the next attempt is refused, and nothing more asks the GCS."""

    def __init__(self) -> None:
        import ray

        self.lost: str | None = None
        self.address: str | None = None
        self._stop = threading.Event()
        with contextlib.suppress(Exception):  # a Ray client (ray://) has no GCS address here
            self.address = str(ray.get_runtime_context().gcs_address)
        host, _, port = (self.address or "").rpartition(":")
        self._where = (host, int(port)) if host and port.isdigit() else None
        if self._where is not None:  # an address not HOST:PORT is not watched (nor crashes)
            threading.Thread(target=self._watch, daemon=True, name="graphdist-ray-head").start()

    def _probe(self) -> str | None:
        assert self._where is not None
        exc = tcp_connect_error(*self._where, GCS_PROBE_S)
        return None if exc is None else exc.strerror or str(exc)

    def _watch(self) -> None:
        misses = 0
        while not self._stop.wait(HEAD_PROBE_S) and self.lost is None:
            why = self._probe()
            misses = misses + 1 if why is not None else 0
            if why is not None and misses >= HEAD_MISSES:
                self.lost = f"its GCS at {self.address} does not answer: {why}"

    def is_lost(self) -> bool:
        """Whether the head is lost, asked now (twice, :data:`HEAD_PROBE_S` apart, as the watch
        does) unless the watch already knows."""
        if self.lost is None and self.address is not None:
            why = self._probe()
            if why is not None:
                time.sleep(HEAD_PROBE_S)
                why = self._probe()
            if why is not None:
                self.lost = f"its GCS at {self.address} does not answer: {why}"
        return self.lost is not None

    def check(self, attempt: int) -> None:
        """Refuse attempt ``attempt`` while the head is lost (before any call that would block
        on the GCS)."""
        if self.is_lost():
            raise LaunchError(
                f"Attempt {attempt} cannot be placed: the Ray head is lost ({self.lost}), and "
                "the Ray cluster with it; the run ends here (start the cluster again, then the "
                "run: it resumes from its tasks' last backup)",
                [],
            )

    def close(self) -> None:
        self._stop.set()


class _CommandActor:
    """Runs in a Ray actor on the task's node: the command under a guard, its output in chunks.

    The guard ties itself to the thread that started it (``PR_SET_PDEATHSIG``), so the command
    is started by a thread of the actor's own that lives until the command has exited."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        bind: str,
        name: str,
        cwd: str,
        warm: str | None = None,
    ) -> None:
        from graphdist._distribute.nodewarm import client_argv

        grace = STOP_GRACE_S
        if warm is not None:  # a client of its node's agent, the command its cold fallback
            argv = [*client_argv(warm, name, argv, STOP_GRACE_S), *argv]
            grace += WARM_GRACE_MARGIN_S  # the warm guard, which has the task, ends it first
        self._env = {**env, **NetPolicy().env(bind, env.get("LD_PRELOAD"), inherit=True)}
        # the driver's folder where the node has it; "" (a shipped working_dir): the actor's own
        self._cwd = cwd if cwd and os.path.isdir(cwd) else None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._progress: list[bytes] = []  # the guard's progress lines not taken yet
        self._ready = threading.Condition()
        self._code: int | None = None
        self._ended_at: float | None = None
        self._pid: int | None = None
        self._error: str | None = None
        self._limit = LINE_LIMIT
        thread = threading.Thread(target=self._run, args=(argv, name, grace), daemon=True)
        thread.start()
        with self._ready:
            self._ready.wait_for(lambda: self._pid is not None or self._error is not None, 60)

    def _run(self, argv: list[str], name: str, grace_s: float) -> None:
        report_r, report_w = os.pipe2(os.O_CLOEXEC)  # the guard's report: its progress lines
        try:
            proc = subprocess.Popen(
                guarded_argv(argv, grace_s=grace_s, name=name, report_fd=report_w, progress=True),
                env=self._env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self._cwd,
                pass_fds=(report_w,),
            )
        except OSError as exc:
            os.close(report_r)
            with self._ready:
                self._error = f"{type(exc).__name__}: {exc}"
                self._code, self._ended_at = 127, time.time()
                self._ready.notify_all()
            return
        finally:
            os.close(report_w)
        reader = threading.Thread(target=self._read_report, args=(report_r,), daemon=True)
        reader.start()
        with self._ready:
            self._pid = proc.pid
            self._ready.notify_all()
        assert proc.stdout is not None
        for chunk in iter(lambda: proc.stdout.readline(self._limit), b""):  # type: ignore[union-attr]
            with self._ready:
                self._chunks.append(chunk)
                self._ready.notify_all()
        code = proc.wait()
        reader.join(2.0)  # the guard's last records (it has exited: its report's end is near)
        with self._ready:
            self._code, self._ended_at = code, time.time()
            self._ready.notify_all()

    def _read_report(self, fd: int) -> None:
        """The guard's report as it comes: its progress lines, for :meth:`take`."""
        with os.fdopen(fd, "rb") as report:
            for line in (ln for ln in report if ln.startswith(b"progress ")):
                with self._ready:
                    self._progress.append(line)
                    self._ready.notify_all()

    def pid(self) -> int | None:
        return self._pid

    def take(
        self, wait_s: float
    ) -> tuple[list[bytes], int | None, float | None, str | None, bytes]:
        """The output since the last call (waiting up to ``wait_s`` for some), and once all of
        it was taken, the exit code and when it ended (the node's wall clock); the guard's
        progress lines since the last call."""
        with self._ready:
            self._ready.wait_for(
                lambda: self._chunks or self._progress or self._code is not None, wait_s
            )
            chunks, progress = list(self._chunks), b"".join(self._progress)
            self._chunks.clear()
            self._progress.clear()
            return chunks, self._code, self._ended_at, self._error, progress

    def signal(self, sig: int) -> None:
        if self._pid is not None and self._code is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self._pid, sig)


class _RayTaskProcess(TaskOutput):
    """A command task on a Ray node: what the launcher reads of a local task (its exit and
    when, its output, stop and finish), from the task's actor."""

    def __init__(
        self,
        task: Task,
        run: RunSink,
        log_path: str | None,
        *,
        actor: Any,
        node: str,
        head: _Head,
        cold_because: str | None,
    ) -> None:
        import ray

        self.head = head
        self._start_output(task, run, log_path)
        self.mark = ""
        self.command_pid: int | None = None
        self.command_exit: tuple[int, float] | None = None
        self.actor = actor
        self.node = node
        self._done = threading.Event()
        self.result.pid = ray.get(actor.pid.remote())
        run.emit(TaskStarted(self.result.pid, cold_because is None, cold_because), task.name)
        self._reader = threading.Thread(
            target=self._pump, daemon=True, name=f"graphdist-run-{task.name}"
        )
        self._reader.start()

    def _chunks(self) -> Iterator[bytes]:
        import ray

        while True:
            try:
                taken = ray.get(self.actor.take.remote(POLL_WAIT_S))
                chunks, code, ended_at, error, progress = taken
            except Exception as exc:  # the actor died: its node was lost, Ray's memory
                # monitor killed it (Ray's error says so), or Ray went away
                from graphdist._ray.nodes import ray_out_of_memory

                self.command_exit = (-9, time.monotonic() - self._run.started)
                self.result.oom = ray_out_of_memory(exc)
                if self.result.oom is None and not self.head.is_lost():  # the head's loss is
                    self._run.out.note(  # told once (gone), not per task
                        f"graphdist: {self.result.name} on Ray node {self.node[:8]} is gone "
                        f"({type(exc).__name__}); counted as killed"
                    )
                self._head_lost()
                return
            for record in parse_progress(progress):
                self._run.progress(self.result.name, record)
            yield from chunks
            if self._head_lost():
                return
            if error is not None:
                yield f"graphdist: cannot start the command: {error}\n".encode()
            if code is not None and not chunks:
                when = time.monotonic() - (time.time() - (ended_at or time.time()))
                self.command_exit = (code, when - self._run.started)
                return

    def _head_lost(self) -> bool:
        """Whether the Ray head is lost: the task then ends as lost with it (the run says so
        once: :meth:`RayRun.gone`)."""
        if self.head.lost is None:
            return False
        self.result.lost = "the Ray head was lost, and the Ray cluster with it"
        if self.command_exit is None:
            self.command_exit = (-9, time.monotonic() - self._run.started)
        return True

    def _pump(self) -> None:
        try:
            self._drain(self._chunks())
        except Exception as exc:  # a bug here must not hide the task's exit
            self._run.out.note(f"graphdist: showing {self.result.name}'s output failed ({exc!r})")
            if self.command_exit is None:
                self.command_exit = (-9, time.monotonic() - self._run.started)
        finally:
            self._close_log()
            self._done.set()

    def ended(self) -> int | None:
        return None if self.command_exit is None else self.command_exit[0]

    def ended_at_s(self) -> float:
        if self.command_exit is not None:
            return self.command_exit[1]
        return time.monotonic() - self._run.started

    def running(self) -> bool:
        return self.command_exit is None

    def processes(self) -> list[int] | None:
        return None  # on its node: the heartbeat probes its server only

    def signal(self, sig: int) -> None:
        with contextlib.suppress(Exception):
            self.actor.signal.remote(sig)

    def preempt(self) -> None:
        self.signal(signal.SIGTERM)  # to its guard on the node: a stop with the guard's grace

    def finish(self) -> TaskResult:
        import ray

        if self._finished or self.command_exit is None:
            return self.result
        self._finished = True
        self._done.wait(5.0)
        self.result.exitcode = self.command_exit[0]
        self.result.tail = list(self._tail)
        if self.head.lost is None:  # else Ray's call would wait for the GCS
            with contextlib.suppress(Exception):
                ray.kill(self.actor, no_restart=True)
        return self.result


def _address(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ArgumentError(
            f"address must be a Ray cluster's HOST:PORT, not {value!r}", name="address", value=value
        )
    return value


class RayRun:
    """The ``ray`` run backend (see the module docstring): every task a process on a node of a
    Ray cluster, one per node where there are nodes enough."""

    name: ClassVar[str] = "ray"
    summary: ClassVar[str] = (
        "every task a process on a node of a Ray cluster, one per node where there are nodes "
        "enough (the command must be reachable on every node)"
    )
    requires: ClassVar[tuple[str, str] | None] = ("ray", "pip install 'ray==2.60.*'")
    tls: ClassVar[bool] = True
    options: ClassVar[tuple[Option, ...]] = (
        PRELOAD_OPTION,
        Option(
            "address",
            "the Ray cluster (default: RAY_ADDRESS, else a Ray instance of this machine's own)",
            "HOST:PORT",
        ),
        Option(
            "working_dir",
            "a folder Ray ships to every node, where each task starts (default: this folder, "
            "which every node must have)",
            "DIR",
        ),
    )

    @classmethod
    def check_options(cls, spec: RunSpec, options: Mapping[str, Any]) -> dict[str, Any]:
        checked: dict[str, Any] = {"preload": check_preload(options.get("preload", "auto"))}
        if options.get("address") is not None:
            checked["address"] = _address(options["address"])
        if options.get("working_dir") is not None:
            checked["working_dir"] = check_folder(options["working_dir"], "working_dir")
        return checked

    def __init__(self, spec: RunSpec) -> None:
        from graphdist._ray.nodes import connect_ray

        self.spec = spec
        self._seen: dict[str, str] = {}  # the nodes earlier attempts ran on: id -> address
        folder = spec.options.get("working_dir")
        self._owns_ray = connect_ray(
            spec.options.get("address"), {"working_dir": folder} if folder else None
        )
        self._head = _Head()
        self._agents = RayAgents(spec.command, spec.base_env, spec.options.get("preload", ()))

    def place(self, attempt: int, signals: SignalScope) -> _RayPlacement:
        self._head.check(attempt)
        place_s = signals.budget(PLACE_TIMEOUT_S)
        placement = _RayPlacement(self.spec, attempt, self._seen, self._head, self._agents, place_s)
        self._seen.update({node: ip for ip, _, node in placement._spots})
        return placement

    def gone(self) -> str | None:
        """The Ray head's loss, in words, once it is lost (see :class:`_Head`)."""
        lost = self._head.lost
        return lost and f"The Ray head is lost ({lost}), and the Ray cluster with it"

    def close(self) -> None:
        self._head.close()
        if self._head.lost is None:  # else Ray's calls would wait for the GCS
            self._agents.close()
        # a lost head too (shutdown waits ~5 s for the GCS): Ray ends a process left connected
        # to a dead GCS 60 s later, and a notebook's run_command is its kernel
        if self._owns_ray:
            from graphdist._ray.nodes import shutdown_ray

            shutdown_ray()


def _lost_nodes(seen: Mapping[str, str], lost: Mapping[str, str], live: set[str]) -> str:
    """The nodes lost since the run began, in words: those Ray lists alive but whose raylet does
    not answer, and those an earlier attempt ran on that Ray no longer lists alive."""
    gone = {**{n: "Ray reports it dead" for n in seen if n not in live}, **lost}
    return ", ".join(f"{n[:8]} at {seen.get(n, '?')} ({why})" for n, why in gone.items())


class _RayPlacement:
    """One attempt on Ray: a bundle per task (STRICT_SPREAD where there are nodes enough), a
    free port reserved on each bundle's node, every task's address decided before any starts.

    Only nodes alive now count (:func:`~graphdist._ray.nodes.live_nodes`: their raylet
    answers), none found lost that Ray still lists alive: the next attempt places on the nodes
    left at once, or says in one line that they have too few CPUs (:class:`LaunchError`)."""

    def __init__(
        self,
        spec: RunSpec,
        attempt: int,
        seen: Mapping[str, str],
        head: _Head,
        agents: RayAgents,
        place_s: float = PLACE_TIMEOUT_S,
    ) -> None:
        """``place_s``: how long Ray may take to place the bundles (and gateways), at most
        :data:`PLACE_TIMEOUT_S`, less where the run's deadline comes sooner."""
        from graphdist._ray.nodes import (
            driver_node,
            live_nodes,
            place_bundles,
            plan_hosts,
            ray_members,
        )

        self.spec, self._head, self._agents = spec, head, agents
        names = [(n, i) for n in sorted(spec.jobs) for i in range(spec.jobs[n])]  # Cluster's
        live, lost = live_nodes()
        gone = _lost_nodes(seen, lost, {n["NodeID"] for n in live})
        cpus = sum(float(n.get("Resources", {}).get("CPU", 0.0)) for n in live)
        if gone and cpus < len(names) * CPUS_PER_TASK:  # without a loss: Ray may add nodes
            raise LaunchError(
                f"Attempt {attempt} cannot be placed: the run needs {len(names)} task(s) of "
                f"{CPUS_PER_TASK:g} CPU and the Ray nodes left have {cpus:g} CPU on "
                f"{len(live)} node(s) (lost: {gone}); the run ends here",
                [],
            )
        strategy = "STRICT_SPREAD" if len(live) >= len(names) else "SPREAD"
        self._pg, self._on_bundle, self._spots = place_bundles(
            len(names), strategy, CPUS_PER_TASK, place_s, "tasks", exclude=sorted(lost)
        )
        self._servers: list[Any] = []
        self._tls: Any = None
        try:
            self._hosts = plan_hosts(
                [(node, ip) for ip, _, node in self._spots],
                driver_node(),
                expose=spec.expose or spec.tls,
            )
            jobs: dict[str, list[str]] = {}
            for (name, _), host, (_, port, _) in zip(names, self._hosts, self._spots, strict=True):
                jobs.setdefault(name, []).append(f"{host}:{port}")
            self.cluster = Cluster(jobs)
            self._net = ray_members(NetPolicy(expose=spec.expose, tls=spec.tls), fleet=False)
            if spec.tls:  # every TF_CONFIG names the aliases; each task binds its node's
                from graphdist._ray.actors import TlsGateways

                self._tls = TlsGateways(self.cluster, names, self._spots, place_s)
                self.cluster, self._hosts = self._tls.cluster, self._tls.aliases
        except BaseException:
            self.close()
            raise
        self._index = {t.name: i for i, t in enumerate(self.cluster)}  # the bundle of each
        self.nodes = {t.name: self._spots[i][2][:8] for i, t in enumerate(self.cluster)}
        # the warm agents of the nodes of the command's tasks (kept from an earlier attempt)
        commands = [i for i, t in enumerate(self.cluster) if t.job not in spec.served]
        try:
            agents.ensure(sorted({self._spots[i][2] for i in commands}))
        except BaseException:
            self.close()
            raise

    def start_servers(self, jobs: Sequence[str], log_folder: str | None, signals: Any) -> None:
        """A parameter-server run's worker and ps servers, as a RayFleet's: a Ray actor each on
        its bundle, brought back by Ray on the same node and port if it dies (a worker then
        serves the coordinator again; a ps task's variables are lost and the coordinator fails,
        which restarts the run); returns once every one answers. Ray supervises them: None."""
        import ray

        from graphdist._fleet.remote import RemoteFleet
        from graphdist._ray.actors import ServerActor

        actor_class = ray.remote(ServerActor)
        for i, task in enumerate(self.cluster):
            if task.job not in jobs:
                continue
            signals.check()
            env = self._net.env(self._spots[i][0], inherit=True)
            self._servers.append(
                actor_class.options(
                    scheduling_strategy=self._on_bundle[i],
                    num_cpus=CPUS_PER_TASK,
                    max_restarts=-1,
                    runtime_env={"env_vars": env},
                ).remote(self.cluster.as_dict(), task.job, task.index, self._hosts[i])
            )
        with signals.interruptible():
            RemoteFleet(self.cluster.subset(sorted(jobs))).wait_answering(
                signals.budget(PLACE_TIMEOUT_S)
            )

    def task_env(self, task: Task) -> Mapping[str, str]:
        # the shim itself is set on the node (_CommandActor)
        return self._net.lists()

    def start_task(
        self, task: Task, env: Mapping[str, str], run: RunSink, log_path: str | None
    ) -> _RayTaskProcess:
        import ray

        i = self._index[task.name]
        options: dict[str, Any] = {
            "scheduling_strategy": self._on_bundle[i],
            "num_cpus": CPUS_PER_TASK,
            "max_concurrency": 4,
            "max_restarts": 0,
        }
        # with a working_dir, Ray shipped it (the job's runtime_env) and the actor starts in its
        # copy; else the task starts in this folder, where its node has it
        cwd = "" if self.spec.options.get("working_dir") else os.getcwd()
        node = self._spots[i][2]
        agents = self._agents
        cold_because = agents.why_cold(node)
        if cold_because is None:  # the node's agent decides again there, as on Slurm
            shim = NetPolicy().env(self._hosts[i], env.get("LD_PRELOAD"), inherit=True)
            task_env = {**env, **shim}
            target = warm_target(self.spec.command, task_env, agents.env, agents.preload)
            cold_because = target if isinstance(target, str) else None
        warm = agents.paths[node] if cold_because is None else None
        actor = (
            ray.remote(_CommandActor)
            .options(**options)
            .remote(list(self.spec.command), dict(env), self._hosts[i], task.name, cwd, warm)
        )
        return _RayTaskProcess(
            task,
            run,
            log_path,
            actor=actor,
            node=node,
            head=self._head,
            cold_because=cold_because,
        )

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if self._tls is not None:  # the node gateways end with their actors if Ray cannot ask
            self._tls.close(actors=self._head.lost is None)
            self._tls = None
        if self._head.lost is not None:  # every call below would wait for the GCS
            return
        for server in self._servers:
            with contextlib.suppress(Exception):
                ray.kill(server, no_restart=True)
        with contextlib.suppress(Exception):
            remove_placement_group(self._pg)
