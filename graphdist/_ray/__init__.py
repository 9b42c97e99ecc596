"""The Ray engine: the Ray a fleet and a run share (``nodes``: joining it, placement, lost nodes,
Ray's own out-of-memory words), its actors (``actors``: servers, TLS gateways), the fleet
(``fleet``), ``graphdist run``'s Ray backend (``run``) and its warm agents (``agents``)."""

from __future__ import annotations

from typing import ClassVar

from graphdist._engine import register


class RayEngine:
    """A Ray cluster as an engine: its fleet and its run are its own (Ray actors), not the
    engine-free halves."""

    name: ClassVar[str] = "ray"
    summary: ClassVar[str] = "actors on a Ray cluster (this machine's, or one at an address)"
    requires: ClassVar[tuple[str, str] | None] = ("ray", "pip install 'ray==2.60.*'")
    FLEET: ClassVar[str | None] = "graphdist._ray.fleet:RayFleet"
    RUN: ClassVar[str | None] = "graphdist._ray.run:RayRun"


register(RayEngine)
