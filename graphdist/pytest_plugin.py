"""pytest plugin (registered through the ``pytest11`` entry point): fixtures that give fleets.

- ``graphdist_fleet``: one two-task ``local`` fleet on free ports, shared by the whole test
  session and closed at its end. The cluster is chosen with ``--graphdist-cluster`` (default
  ``local=2``).
- ``graphdist_fleet_factory``: call it with any cluster spec (and LocalFleet keywords) to get a
  started fleet; every fleet it made is closed after the test.

The heavy machinery is imported only when a fixture is used, so the plugin costs nothing to
test runs that do not use it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from graphdist._fleet.local import LocalFleet


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("graphdist")
    group.addoption(
        "--graphdist-cluster",
        default="local=2",
        metavar="SPEC",
        help="cluster of the session-wide graphdist_fleet fixture (default: local=2)",
    )


@pytest.fixture(scope="session")
def graphdist_fleet(request: pytest.FixtureRequest) -> Iterator[LocalFleet]:
    """A running fleet shared by the whole test session."""
    from graphdist._fleet.local import LocalFleet

    fleet = LocalFleet(request.config.getoption("--graphdist-cluster")).start()
    try:
        yield fleet
    finally:
        fleet.close()


@pytest.fixture
def graphdist_fleet_factory() -> Iterator[Callable[..., LocalFleet]]:
    """``factory(cluster="local=2", **LocalFleet keywords)`` → a started fleet, closed after
    the test."""
    from graphdist._fleet.local import LocalFleet

    made: list[LocalFleet] = []

    def factory(cluster: Any = "local=2", **kwargs: Any) -> LocalFleet:
        fleet = LocalFleet(cluster, **kwargs)
        made.append(fleet)
        return fleet.start()

    try:
        yield factory
    finally:
        for fleet in made:
            fleet.close()
