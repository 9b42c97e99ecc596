"""The local engine: a fleet whose servers are processes of this machine forked from a fork server
that imported TensorFlow once (``fleet``, ``task``, ``checks``), and ``graphdist run``'s local
backend, its tasks warm where they can be (``run``)."""

from __future__ import annotations

from typing import ClassVar

from graphdist._engine import register


class LocalEngine:
    """This machine as an engine: its fleet and its run are its own (forked from a fork server
    that imported TensorFlow once; warm tasks from a Zygote), not the engine-free halves."""

    name: ClassVar[str] = "local"
    summary: ClassVar[str] = "processes of this machine (default)"
    requires: ClassVar[tuple[str, str] | None] = None
    FLEET: ClassVar[str | None] = "graphdist._local.fleet:LocalFleet"
    RUN: ClassVar[str | None] = "graphdist._local.run:LocalRun"


register(LocalEngine)
