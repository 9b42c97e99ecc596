"""The Slurm bed of the tests under tests/slurm (tests/slurmbed.py)."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

SHAPES = ("bed", "site")
"""The Slurm bed's shapes: ``bed`` (each node's name its host's name) and ``site`` (node names
that are no host name and resolve nowhere, one host name shared by every node, steps tracked by
cgroups): a test parametrized ``@pytest.mark.parametrize("slurm", SHAPES, indirect=True)`` runs
on both. What the shapes differ in (how a node is named and reached, how its steps are tracked
and ended) is checked on both by the address test and the fleet scenario (a kill, a restart,
``scancel``, nothing left); a training run, a restart with its weights or a preemption runs on
the strict shape, ``site``, only: the same scenario on ``bed`` tested nothing more and cost a
minute of CPU."""


@pytest.fixture(scope="session")
def slurm(request: pytest.FixtureRequest) -> Generator[Any, None, None]:
    """A :class:`tests.slurmbed.SlurmBed` of three compute nodes and a controller (the login
    host): made once per session and xdist worker and shape (:data:`SHAPES`; ``bed`` unless a
    test asks for another), on first use (about a second: each worker has a bed of its own),
    and closed at the end, which fails if anything of it is left. A test that kills a node
    starts it again. Skips, naming why (a failure for a ``promise`` test), where the bed cannot
    be made: no root, no network namespaces, Slurm or munge not installed."""
    from tests.slurmbed import SlurmBed, SlurmBedError, require_slurmbed

    shape = getattr(request, "param", "bed")
    assert shape in SHAPES, shape
    require_slurmbed()
    try:
        bed = SlurmBed(3, site=shape == "site")
    except SlurmBedError as exc:
        pytest.skip(f"cannot make a Slurm bed: {exc}")
    with bed:
        yield bed
