"""Task health, checked over gRPC: alive, dead (its process exited), or not answering.

A frozen task (SIGSTOP, a stuck machine) still has its port open, so only a real call with a
deadline tells it apart from a live one. All tasks are probed at once, so a health check takes at
most one probe timeout however many tasks are frozen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from graphdist._fleet.probe import probe_many, probers

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


def probe_all(addresses: Sequence[str], timeout_s: float) -> list[tuple[bool, str | None]]:
    """Probe every address at once; ``(answered, last gRPC error)`` for each, in order."""
    with probers(addresses) as each:
        answered = probe_many(each, timeout_s)
        return [(ok, p.last_error) for ok, p in zip(answered, each, strict=True)]
