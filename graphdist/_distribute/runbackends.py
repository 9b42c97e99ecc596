"""Run backends by contract, looked up by name: where ``graphdist run``'s tasks run.

The attempt loop (:mod:`graphdist._distribute.supervise`) knows no backend: it asks the run's
:class:`RunBackend` to :meth:`~RunBackend.place` each attempt, and the :class:`Placement` it
returns to start the attempt's servers (a parameter-server run's workers and ps tasks) and
command tasks; everything else is the loop's own: the ``attempt-started`` event, each task's
environment (``TF_CONFIG``, ``GRAPHDIST_TASK``, ``GRAPHDIST_RESTART``, what the placement adds),
its log file, the supervision, the heartbeat, the restarts, the events and the summary. Every
engine (:mod:`graphdist._engine`, the one registry of cluster managers) is a run backend by its
name: its run is its own (local, Ray) or a :class:`~graphdist._distribute.commandrun.CommandRun`
bound to its primitives (Slurm, an engine of an entry point), :func:`graphdist._engine.
run_class`; :func:`register` adds a run class under a name of its own (a test's copy).

A backend class declares its ``name``, a ``summary``, what it ``requires`` and its own
``options`` (:class:`graphdist._registry.Option`: Ray's ``address``), which
:meth:`RunBackend.check_options` checks before anything starts and no other backend sees. One
instance serves one run: made once the spec is checked (it joins its engine: ``ray.init``),
it places every attempt, and :meth:`RunBackend.close` gives back what it joined. A backend
may have ``gone()`` (what is lost for good: no attempt can be placed), and a placement
``prepare_next(count)``: called as a failed attempt is stopped, before the restart is decided,
to ready ``count`` tasks of the next (the local backend's spare guards).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from graphdist._registry import Option, Registry

if TYPE_CHECKING:
    from graphdist._cluster import Cluster, Task
    from graphdist._distribute.runspec import RunSpec
    from graphdist._distribute.taskproc import RunSink, TaskProcess
    from graphdist._proc.signals import SignalScope

__all__ = [
    "Placement",
    "RunBackend",
    "ServerGroup",
    "check_options",
    "describe",
    "names",
    "register",
    "run_backend",
]


class ServerGroup(Protocol):
    """A parameter-server run's servers (worker and ps tasks) as the loop supervises them: a
    dead one is restarted on its address or fails the attempt; a frozen one is killed. Its
    ``tasks`` are :class:`graphdist._fleet.task.TaskHandle`-like (name, job, index, address,
    pid, alive, exitcode, ``log_tail()``); ``pids_here``: whether those pids are processes of
    this machine (not a Slurm or Ray node's), whose state the heartbeat may read."""

    pids_here: bool

    @property
    def tasks(self) -> Sequence[Any]: ...

    def dead_tasks(self) -> list[Any]: ...

    def kill(self, job: str, index: int) -> None: ...

    def restart(self, job: str, index: int) -> None: ...

    def close(self) -> None: ...


class Placement(Protocol):
    """One attempt's tasks, placed: every task's address is known before any starts."""

    @property
    def cluster(self) -> Cluster:
        """Every task at the address its TF_CONFIG names (fresh for every attempt)."""
        ...

    @property
    def nodes(self) -> Mapping[str, str]:
        """Task name -> where it runs (a host name, a Ray node's id), for the attempt's event."""
        ...

    def start_servers(
        self, jobs: Sequence[str], log_folder: str | None, signals: SignalScope
    ) -> ServerGroup | None:
        """Start the servers of ``jobs`` and return once they answer; None when the backend
        supervises them itself (Ray restarts a dead actor on its node and port)."""
        ...

    def task_env(self, task: Task) -> Mapping[str, str]:
        """What this backend adds to a command task's environment (the bind shim, the
        members' addresses)."""
        ...

    def start_task(
        self, task: Task, env: Mapping[str, str], run: RunSink, log_path: str | None
    ) -> TaskProcess:
        """Start the run's command as ``task`` with ``env`` (whole: the loop built it)."""
        ...

    def close(self) -> None:
        """Give back what the placement holds (ports, placement groups, server actors), once
        every task ended; called however the attempt ended."""
        ...


class RunBackend(Protocol):
    """What a run backend class declares and does (see the module docstring)."""

    name: ClassVar[str]
    summary: ClassVar[str]
    requires: ClassVar[tuple[str, str] | None]
    """``(module, how to install it)`` for an engine graphdist does not install, else None."""
    options: ClassVar[tuple[Option, ...]]

    @classmethod
    def check_options(cls, spec: RunSpec, options: Mapping[str, Any]) -> dict[str, Any]:
        """This backend's options for ``spec``, checked (ArgumentError naming the bad one, or
        what is wrong with where the run would go), before anything starts."""
        ...

    def __init__(self, spec: RunSpec) -> None: ...

    def place(self, attempt: int, signals: SignalScope) -> Placement:
        """Place attempt ``attempt`` (from 1): the cluster it runs, every task's address."""
        ...

    def close(self) -> None:
        """Give back what the backend joined for the run (a Ray instance it started)."""
        ...

    # Optional: ``tls: ClassVar[bool]``, True where the backend builds TLS mode (RunSpec.tls:
    # its placements put every task's server on its host's loopback alias, behind mutual-TLS
    # gateways); a run with tls on a backend without it is refused before anything starts.
    # Optional: ``gone() -> str | None``, what is gone for good so that no attempt can be
    # placed (Ray's head, and its cluster with it), in words; the loop then spends no restart
    # and ends the run with them (supervise._gone). A backend without it never is.


def _engine_runs() -> dict[str, type[RunBackend]]:
    """Each engine's run (:func:`graphdist._engine.run_class`), by the engine's name."""
    from graphdist._engine import halves

    return halves("run")


_registry: Registry[RunBackend] = Registry("run backend", (), "", "name", more=_engine_runs)


def register(cls: type[RunBackend]) -> type[RunBackend]:
    """Register run backend ``cls`` under ``cls.name`` (usable as a class decorator)."""
    return _registry.register(cls)


def names() -> tuple[str, ...]:
    """Every run backend's name, the built-in ones first."""
    return _registry.names()


def run_backend(name: object, *, check: bool = True) -> type[RunBackend]:
    """The run backend registered as ``name``; ArgumentError names the known ones, or
    (``check``) says what to install when its engine is missing."""
    return _registry.get(name, check=check)


def check_options(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` if every one is run backend ``name``'s own; ArgumentError naming the one
    that is not, and whose it is (the backend then checks their values)."""
    return _registry.check_options(name, options)


def describe(name: str) -> str:
    """``"ray: ... (needs `pip install 'ray==2.60.*'`)"``, for help texts."""
    return _registry.describe(name)
