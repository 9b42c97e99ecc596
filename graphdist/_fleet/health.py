"""Task health, checked over gRPC: alive, dead (its process exited), or not answering.

A frozen task (SIGSTOP, a stuck machine) still has its port open, so only a real call with a
deadline tells it apart from a live one. All tasks are probed at once, so a health check takes at
most one probe timeout however many tasks are frozen.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from graphdist._fleet.probe import Prober

__all__ = ["ALIVE", "DEAD", "NOT_ANSWERING", "TaskHealth", "probe_all"]

ALIVE = "alive"
DEAD = "dead"
NOT_ANSWERING = "not answering"


@dataclass(frozen=True)
class TaskHealth:
    """One task's health: ``status`` is ``"alive"``, ``"dead"`` or ``"not answering"``."""

    job: str
    index: int
    address: str
    pid: int | None
    status: str
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == ALIVE

    def __str__(self) -> str:
        extra = f" ({self.detail})" if self.detail else ""
        return f"{self.job}:{self.index} at {self.address} pid={self.pid}: {self.status}{extra}"


def _probe(address: str, timeout_s: float) -> tuple[bool, str | None]:
    with Prober(address) as prober:
        ok = prober.probe(timeout_s)
        return ok, prober.last_error


def probe_all(addresses: Sequence[str], timeout_s: float) -> list[tuple[bool, str | None]]:
    """Probe every address in parallel; ``(answered, last gRPC error)`` for each, in order."""
    if not addresses:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(addresses))) as pool:
        return list(pool.map(lambda a: _probe(a, timeout_s), addresses))
