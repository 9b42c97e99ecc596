"""Plug-ins by name: the registry of engines (:mod:`graphdist._engine`: built-in modules and
entry points), and its two views by half, fleet backends (:mod:`graphdist._fleet.backends`) and
run backends (:mod:`graphdist._distribute.runbackends`), each engine's fleet and run by its name
(``more``).

A :class:`Registry` knows its built-in modules and an entry-point group; on first look-up it
imports both (a module registers its classes when imported), so another plug-in is one module
and its entry point. Each class declares its name, a one-line ``summary``, what it ``requires``
(``(module, how to install it)`` or None) and its own ``options`` (:class:`Option`), which
:meth:`Registry.check_options` keeps apart: no plug-in sees, or has to refuse, another's.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Generic, TypeVar

from graphdist._exceptions import ArgumentError

__all__ = ["Option", "Registry"]

log = logging.getLogger("graphdist")

T = TypeVar("T")


@dataclass(frozen=True)
class Option:
    """An option of one plug-in's own: ``name`` is the keyword it takes (and a supervisor spec's
    ``options`` key), ``flag`` the command line's (``--address``), ``parse`` turns the command
    line's text into the value."""

    name: str
    help: str
    metavar: str = "VALUE"
    parse: Callable[[str], Any] = str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


class Registry(Generic[T]):
    """Classes registered by name (``name_attr`` on each class), the built-in ``modules`` first,
    then those the entry-point ``group`` names; ``what`` names them in errors ("backend")."""

    def __init__(
        self,
        what: str,
        modules: Sequence[str],
        group: str,
        name_attr: str,
        more: Callable[[], Mapping[str, type[T]]] | None = None,
    ) -> None:
        self.what = what
        self._more = more  # classes made for names it does not hold (an engine's fleet)
        self.modules = tuple(modules)
        self.group = group
        self._name_attr = name_attr
        self._classes: dict[str, type[T]] = {}
        self._loaded = False

    def name_of(self, cls: type[T]) -> str:
        return str(getattr(cls, self._name_attr))

    def register(self, cls: type[T]) -> type[T]:
        """Register ``cls`` under its name (usable as a class decorator); ArgumentError when
        another class has that name."""
        name = self.name_of(cls)
        known = self._classes.get(name)
        if known is not None and known is not cls:
            raise ArgumentError(
                f"Two {self.what}s are named {name!r}: "
                f"{known.__module__}.{known.__qualname__} and {cls.__module__}.{cls.__qualname__}",
                name=self._name_attr,
                value=name,
            )
        self._classes[name] = cls
        return cls

    def _load(self) -> None:
        if self._loaded:
            return
        modules = list(self.modules)
        for entry in metadata.entry_points(group=self.group) if self.group else ():
            modules.append(entry.value.partition(":")[0])
        for module in modules:
            try:
                importlib.import_module(module)
            except ImportError as exc:  # a third party's plug-in that cannot load: skip, say why
                log.warning("%s module %s cannot be imported: %s", self.what, module, exc)
        self._loaded = True
        # the built-in ones first, in their modules' order, whoever was imported first
        rank = {module: i for i, module in enumerate(self.modules)}
        ordered = sorted(
            self._classes.items(), key=lambda kv: rank.get(kv[1].__module__, len(rank))
        )
        self._classes = dict(ordered)
        for name, cls in (self._more() if self._more is not None else {}).items():
            self._classes.setdefault(name, cls)

    def names(self) -> tuple[str, ...]:
        """Every registered name, the built-in ones first."""
        self._load()
        return tuple(self._classes)

    def classes(self) -> dict[str, type[T]]:
        self._load()
        return dict(self._classes)

    def get(self, name: object, *, check: bool = True) -> type[T]:
        """The class registered as ``name``; ArgumentError names the known ones, or (``check``)
        says what to install when its engine is missing."""
        self._load()
        cls = self._classes.get(name) if isinstance(name, str) else None
        if cls is None:
            raise ArgumentError(
                f"No {self.what} is named {name!r}; the {self.what}s are "
                f"{', '.join(self._classes)}",
                name="backend",
                value=name,
            )
        requires = getattr(cls, "requires", None)
        if check and requires is not None and importlib.util.find_spec(requires[0]) is None:
            raise ArgumentError(
                f"The {name} {self.what} needs {requires[0]}: {requires[1]}",
                name="backend",
                value=name,
            )
        return cls

    def check_options(self, name: str, options: Mapping[str, Any]) -> dict[str, Any]:
        """``options`` if every one is an option of ``name``; ArgumentError naming the one that
        is not, and whose it is."""
        own = {o.name for o in getattr(self.get(name, check=False), "options", ())}
        for option in options:
            if option in own:
                continue
            owners = [
                n
                for n, c in self._classes.items()
                if option in {o.name for o in getattr(c, "options", ())}
            ]
            whose = (
                f"an option of the {', '.join(owners)} {self.what}"
                if owners
                else f"no {self.what}'s"
            )
            takes = ", ".join(sorted(own)) or "none"
            raise ArgumentError(
                f"{option} is {whose}, not of {name} (whose options are: {takes})",
                name=option,
                value=options[option],
            )
        return dict(options)

    def describe(self, name: str) -> str:
        """``"ray: Ray actors ... (needs `pip install 'ray==2.60.*'`)"``, for help texts."""
        cls = self.get(name, check=False)
        requires = getattr(cls, "requires", None)
        needs = f" (needs `{requires[1]}`)" if requires else ""
        return f"{name}: {getattr(cls, 'summary', '')}{needs}"
