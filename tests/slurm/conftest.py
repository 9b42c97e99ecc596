"""The Slurm bed of the tests under tests/slurm (tests/slurmbed.py)."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def slurm() -> Generator[Any, None, None]:
    """A :class:`tests.slurmbed.SlurmBed` of three compute nodes and a controller (the login
    host): made once per session and xdist worker, on first use (about a second: each worker has
    a bed of its own), and closed at the end, which fails if anything of it is left. A test that
    kills a node starts it again. Skips, naming why (a failure for a ``promise`` test), where
    the bed cannot be made: no root, no network namespaces, Slurm or munge not installed."""
    from tests.slurmbed import SlurmBed, SlurmBedError, require_slurmbed

    require_slurmbed()
    try:
        bed = SlurmBed(3)
    except SlurmBedError as exc:
        pytest.skip(f"cannot make a Slurm bed: {exc}")
    with bed:
        yield bed
