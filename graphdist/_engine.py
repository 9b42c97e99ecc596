"""Engines: a cluster manager's primitives, from which graphdist builds both a fleet and a run.

An :class:`Engine` knows its nodes and nothing of TensorFlow or of ``graphdist run``: it says
every node's address (:meth:`Engine.addresses`), which nodes are lost now (:meth:`Engine.lost`),
free ports on nodes (:meth:`Engine.free_ports`), the command line that runs a command on one
node as a named step (:meth:`Engine.command`: its environment is the caller's, its output and
stdin those of the local process that runs that line), how to signal such a step
(:meth:`Engine.signal`) and end every step of a prefix (:meth:`Engine.cancel`), and what a
step's output line says of its node or of a kill for memory (:meth:`Engine.lost_line`,
:meth:`Engine.out_of_memory`). The engine-free halves serve every engine alike:

- a fleet (:class:`graphdist._fleet.command.CommandFleet`): each server a ``graphdist serve``
  step on its node, its ready line the proof, ``kill``/``restart``/``close`` through the engine;
- a run (:class:`graphdist._distribute.commandrun.CommandRun`): each command task a step under
  graphdist's guard on its node, a parameter-server run's servers that fleet, warm agents on
  the nodes, TLS mode's credentials on a step's stdin.

So an engine is one module: an :class:`Engine` class registered with :func:`register` (listed
in :data:`BUILTIN`, or named by an entry point of :data:`ENTRY_POINT_GROUP`), and ``graphdist up
--backend NAME`` and ``graphdist run --backend NAME`` both find it by name. Slurm is one
(:class:`graphdist._proc.slurm.SlurmEngine`). Every cluster manager is one engine in this one
registry: the local and Ray engines (:mod:`graphdist._local`, :mod:`graphdist._ray`) declare
halves of their own instead of primitives (:attr:`EngineInfo.FLEET`, :attr:`EngineInfo.RUN`: a
fork server's children and a Zygote's warm tasks; Ray actors), and :func:`fleet_class` and
:func:`run_class` give an engine's halves, its own or the engine-free ones over its primitives.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any, ClassVar, Protocol

from graphdist._registry import Option, Registry

__all__ = [
    "BUILTIN",
    "ENTRY_POINT_GROUP",
    "Engine",
    "EngineInfo",
    "classes",
    "engine",
    "fleet_class",
    "halves",
    "names",
    "register",
    "run_class",
]

BUILTIN = ("graphdist._local", "graphdist._ray", "graphdist._proc.slurm")
"""The modules of the engines graphdist ships (each registers its engine when imported)."""
ENTRY_POINT_GROUP = "graphdist.engines"
"""Entry points of this group name the modules of other engines (``name = package.module``)."""


class EngineInfo(Protocol):
    """What every engine declares: its name and, for an engine with halves of its own, where
    they are (``"package.module:Class"``, imported on first use)."""

    name: ClassVar[str]
    summary: ClassVar[str]
    requires: ClassVar[tuple[str, str] | None]
    """``(module, how to install it)`` for a package graphdist does not install, else None."""
    FLEET: ClassVar[str | None]
    """The engine's own fleet class (a :class:`graphdist._fleet.backends.Backend`), or None:
    :class:`graphdist._fleet.command.CommandFleet` over its primitives."""
    RUN: ClassVar[str | None]
    """The engine's own run class (a :class:`graphdist._distribute.runbackends.RunBackend`), or
    None: :class:`graphdist._distribute.commandrun.CommandRun` over its primitives."""


class Engine(EngineInfo, Protocol):
    """A cluster manager's primitives (see the module docstring). The class declares what the
    registry and the command line show; one instance, made by :meth:`join`, serves one fleet or
    one run."""

    options: ClassVar[tuple[Option, ...]]
    """The engine's own options (Slurm's ``jobid``), given to :meth:`join`."""
    node_word: ClassVar[str]
    """How a node is named in messages: ``"Slurm node"``."""
    DEFAULT_START_TIMEOUT_S: ClassVar[float]
    """Seconds a fleet's servers get to start: a step's start and a TensorFlow import."""
    tls: ClassVar[bool]
    """Whether a step's stdin reaches its command (TLS mode feeds a node's credentials there)."""
    more_nodes: ClassVar[str]
    """What to do when there are too few nodes (``"ask salloc/sbatch for more nodes"``)."""

    kill_wait_s: float
    """Seconds the engine grants a stopped step before it kills it (Slurm's KillWait)."""

    @classmethod
    def join(cls, options: Mapping[str, Any], env: Mapping[str, str]) -> Engine:
        """The engine for ``options`` (its own, checked: ArgumentError naming a bad one) and
        ``env`` (the environment its commands run with), before anything starts."""
        ...

    def describe(self) -> str:
        """What the nodes are, for messages: ``"Slurm job 12 (2 node(s): n1,n2)"``."""
        ...

    def addresses(self) -> Mapping[str, str]:
        """Every node's name -> its address, in the engine's order."""
        ...

    def lost(self, nodes: Sequence[str]) -> dict[str, str]:
        """``{node: why}`` for those of ``nodes`` that run nothing more now."""
        ...

    def free_ports(self, per_node: Mapping[str, int], tag: str) -> dict[str, list[int]]:
        """``per_node[node]`` ports free now on each node; ``tag`` names the work it may start."""
        ...

    def command(
        self, node: str, step: str, argv: Sequence[str], *, stdin: bool, grace_s: float
    ) -> list[str]:
        """The command line that runs ``argv`` on ``node`` as step ``step``, its output this
        line's; ``stdin``: this line's stdin reaches it; ``grace_s``: SIGTERM to SIGKILL when
        the engine ends the step."""
        ...

    def signal(self, step: str, sig: int, local: Any) -> None:
        """Send ``sig`` to step ``step``'s processes on its node; ``local`` is the process of
        this machine that runs its :meth:`command` line (a Popen), which some engines signal."""
        ...

    def cancel(self, prefix: str, lost: Collection[str] = ()) -> list[str]:
        """End every step whose name starts with ``prefix`` and wait (bounded) until they are
        gone, but for those on ``lost`` nodes; the steps still there."""
        ...

    def lost_line(self, line: bytes) -> str | None:
        """A step's output line saying that its node was lost (its command line then exits
        0), in words; None for any other line."""
        ...

    def out_of_memory(self, line: bytes) -> str | None:
        """A step's output line saying that its command was killed for memory, in words
        (``out of memory (...)``); None for any other line."""
        ...


log = logging.getLogger("graphdist")

_registry: Registry[EngineInfo] = Registry("engine", BUILTIN, ENTRY_POINT_GROUP, "name")


def register(cls: type[EngineInfo]) -> type[EngineInfo]:
    """Register engine ``cls`` under ``cls.name`` (usable as a class decorator)."""
    return _registry.register(cls)


def names() -> tuple[str, ...]:
    """Every registered engine's name, the built-in ones first."""
    return _registry.names()


def classes() -> dict[str, type[EngineInfo]]:
    """Every registered engine by name."""
    return _registry.classes()


def _load(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def fleet_class(cls: type[EngineInfo]) -> Any:
    """The fleet class of engine ``cls``: its own (:attr:`EngineInfo.FLEET`), or the engine-free
    fleet bound to it."""
    own = getattr(cls, "FLEET", None)
    if own is not None:
        return _load(own)
    return _load("graphdist._fleet.command:fleet_for")(cls)


def halves(which: str) -> dict[str, Any]:
    """Every engine's fleet class (``which="fleet"``) or run class (``"run"``) by the engine's
    name: the fleet and run registries' views. An engine whose half cannot be imported (a third
    party's) is left out, and why said."""
    get = fleet_class if which == "fleet" else run_class
    found = {}
    for name, cls in classes().items():
        try:
            found[name] = get(cls)
        except ImportError as exc:
            log.warning("the %s of engine %s cannot be imported: %s", which, name, exc)
    return found


def run_class(cls: type[EngineInfo]) -> Any:
    """The run class of engine ``cls``: its own (:attr:`EngineInfo.RUN`), or the engine-free run
    bound to it."""
    own = getattr(cls, "RUN", None)
    if own is not None:
        return _load(own)
    return _load("graphdist._distribute.commandrun:run_for")(cls)


def engine(name: object, *, check: bool = True) -> type[EngineInfo]:
    """The engine registered as ``name``; ArgumentError names the known ones, or (``check``)
    says what to install when its package is missing."""
    return _registry.get(name, check=check)
