"""Backends by contract, looked up by name.

A backend is an :class:`~graphdist._fleet.lifecycle.OwnedFleet` that supplies what
:class:`Backend` declares: on the class, its ``name``, its ``DEFAULT_START_TIMEOUT_S`` (seconds),
a one-line ``summary``, how it reads a cluster given on a command line (``parse_cluster``) and
writes it back as JSON (``cluster_data``), what it checks in the caller before anything starts
(``check_cluster``), the options of its own it takes from a command line or a supervisor's spec
(``options``: :class:`BackendOption`, Ray's ``address``, say) and how it is built from them
(``for_command``); on each
fleet, the lifecycle's primitives (start the tasks, stop them with a grace period, kill one,
bring one back, tear down) and task handles that tell where a task is and whether it is alive,
cheaply and without blocking (:class:`~graphdist._fleet.task.TaskHandle`).

Every engine (:mod:`graphdist._engine`, the one registry of cluster managers) is a backend by
its name: its fleet is its own (local, Ray) or a :class:`~graphdist._fleet.command.CommandFleet`
bound to its primitives (Slurm, an engine of an entry point), :func:`graphdist._engine.
fleet_class`. ``graphdist up --backend NAME`` (foreground or ``--detach``) and a detached
fleet's supervisor find it by name; :func:`register` adds a fleet class under a name of its own
(a test's copy of a backend). The CLI makes a flag of each backend's options and hands the chosen
backend only its own (:func:`check_options`); the supervisor passes them through: no backend ever
sees, or has to refuse, another backend's option.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from graphdist._registry import Option, Registry

if TYPE_CHECKING:
    from graphdist._fleet.lifecycle import OwnedFleet

__all__ = [
    "Backend",
    "BackendOption",
    "backend",
    "check_options",
    "describe",
    "names",
    "register",
    "start_timeouts",
]


BackendOption = Option
"""An option of one backend's own (:class:`graphdist._registry.Option`)."""


class Backend(Protocol):
    """What a backend class declares (see the module docstring); its fleets are OwnedFleets;
    ``backend_name`` is the name it is registered and looked up by."""

    backend_name: ClassVar[str]
    DEFAULT_START_TIMEOUT_S: ClassVar[float]
    summary: ClassVar[str]
    requires: ClassVar[tuple[str, str] | None]
    """``(module, how to install it)`` when the backend needs a package graphdist does not
    install by default (Ray), else None."""
    options: ClassVar[tuple[BackendOption, ...]]
    """The options of this backend's own (none for most)."""

    @classmethod
    def parse_cluster(cls, spec: Any) -> Any:
        """The cluster as this backend takes it, from a command line's text or its JSON."""
        ...

    @classmethod
    def cluster_data(cls, cluster: Any) -> Mapping[str, Any]:
        """The parsed cluster as JSON, for a supervisor's spec (parse_cluster reads it back)."""
        ...

    @classmethod
    def task_count(cls, cluster: Any) -> int:
        """How many servers the parsed ``cluster`` asks for."""
        ...

    @classmethod
    def check_cluster(cls, cluster: Any, *, expose: bool, tls: bool = False) -> None:
        """Raise before anything starts what the caller can see is wrong (ports taken, hosts
        that are not this machine); the fleet's start checks again in its own process. A
        backend without TLS mode raises for ``tls``."""
        ...

    @classmethod
    def for_command(
        cls,
        cluster: Any,
        *,
        start_timeout_s: float | None,
        expose: bool,
        log_dir: str | None = None,
        allow: Sequence[str] | None = None,
        tls: bool = False,
        tls_dir: str | None = None,
        **options: Any,
    ) -> OwnedFleet[Any]:
        """A fleet (not started) from command-line options; ``options`` are only this backend's
        own (:func:`check_options` made sure); ``allow``: with ``expose``, the other machines
        let in besides the cluster's own hosts. :meth:`OwnedFleet.for_command
        <graphdist._fleet.lifecycle.OwnedFleet.for_command>` serves every backend."""
        ...


def _engine_fleets() -> dict[str, type[Backend]]:
    """Each engine's fleet (:func:`graphdist._engine.fleet_class`), by the engine's name."""
    from graphdist._engine import halves

    return halves("fleet")


_registry: Registry[Backend] = Registry("backend", (), "", "backend_name", more=_engine_fleets)


def register(cls: type[Backend]) -> type[Backend]:
    """Register backend ``cls`` under ``cls.backend_name`` (usable as a class decorator)."""
    return _registry.register(cls)


def names() -> tuple[str, ...]:
    """Every registered backend's name, the built-in ones first."""
    return _registry.names()


def backend(name: str, *, check: bool = True) -> type[Backend]:
    """The backend registered as ``name``; ArgumentError names the known ones, or (``check``)
    says what to install when the backend's engine is missing."""
    return _registry.get(name, check=check)


def check_options(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` if every one is an option of backend ``name``; ArgumentError naming the one
    that is not, and whose it is."""
    return _registry.check_options(name, options)


def describe(name: str) -> str:
    """``"ray: Ray actors ... (needs `pip install 'ray==2.60.*'`)"``, for help texts."""
    return _registry.describe(name)


def start_timeouts() -> str:
    """``"local 60 s, ray 180 s"``: every backend's default start timeout, for help texts."""
    return ", ".join(f"{n} {b.DEFAULT_START_TIMEOUT_S:g} s" for n, b in _registry.classes().items())
