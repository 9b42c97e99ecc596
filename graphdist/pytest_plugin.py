"""pytest plugin (registered through the ``pytest11`` entry point): fixtures that give fleets,
and one that injects faults into a training run.

- ``graphdist_fleet``: one two-task ``local`` fleet on free ports, shared by the whole test
  session and closed at its end. The cluster is chosen with ``--graphdist-cluster`` (default
  ``local=2``).
- ``graphdist_fleet_factory``: call it with any cluster spec (and LocalFleet keywords) to get a
  started fleet; every fleet it made is closed after the test.
- ``graphdist_faults``: a :class:`graphdist._faults.injector.FaultInjector`, to test that *your*
  training script survives a dead or hung worker. ``graphdist_faults.run(COMMAND, faults=[...],
  workers=2, max_restarts=N, ...)`` runs ``python -m graphdist run ... -- COMMAND`` (also
  ``ps``, ``chief``, ``restart_window_s``, ``timeout_s``, ``log_dir``, ``expose``,
  ``launcher_args``, ``env``, ``cwd``; ``wait_s`` bounds the wait for the launcher: by default
  ``timeout_s`` + 60 s, or 600 s, ``DEFAULT_RUN_TIMEOUT_S``, without a ``timeout_s``; past it
  the run is stopped and ``outcome.timed_out`` is true, so a frozen task never hangs the test),
  kills or freezes the tasks the faults name when they are due, and returns a ``RunOutcome``:
  ``returncode``, ``lines`` (stdout as printed, ``[worker-1] ...``), ``stderr``,
  ``lines_of(task, attempt)``, ``injected`` (task, pid, attempt, ``at_s``, ``confirmed``),
  ``missed`` (faults never injected, and why), ``attempts``, ``leftovers``, ``describe()``.
  Faults:

  - ``graphdist_faults.kill("worker-1", after=r"epoch 2/\\d+ done")``: SIGKILL the task's
    command (and what it started) after the first line of that task matching the regex;
  - ``graphdist_faults.freeze("worker-1", after_s=5.0, for_s=20.0)``: SIGSTOP it 5 s after its
    process started, SIGCONT 20 s later (without ``for_s``: not during the run);
  - ``attempt=K`` (default 0): in the launcher's attempt K (``--max-restarts``); ``of="worker-0"``:
    wait for a line of another task.

  Example::

      def test_training_survives_a_dead_worker(graphdist_faults, tmp_path):
          outcome = graphdist_faults.run(
              [sys.executable, "train.py", "--out", str(tmp_path)],
              max_restarts=1,
              faults=[graphdist_faults.kill("worker-1", after=r"epoch 2/\\d+ done")],
          )
          assert outcome.returncode == 0, outcome.describe()
          assert outcome.attempts == 2

  At teardown whatever is left of every run (the launcher, every process it started, anything
  carrying the run's mark) is sent SIGCONT and SIGKILL, and the test errors if a process
  survives that. Bad arguments raise ``graphdist.ArgumentError`` naming the argument and quoting
the value, before anything starts (``expose`` and ``chief`` must be ``True`` or ``False``:
``expose="no"`` is refused, not read as true).

The heavy machinery is imported only when a fixture is used, so the plugin costs nothing to
test runs that do not use it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from graphdist._faults.injector import FaultInjector
    from graphdist._local.fleet import LocalFleet


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
    from graphdist._local.fleet import LocalFleet

    fleet = LocalFleet(request.config.getoption("--graphdist-cluster")).start()
    try:
        yield fleet
    finally:
        fleet.close()


@pytest.fixture
def graphdist_fleet_factory() -> Iterator[Callable[..., LocalFleet]]:
    """``factory(cluster="local=2", **LocalFleet keywords)`` → a started fleet, closed after
    the test."""
    from graphdist._local.fleet import LocalFleet

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


@pytest.fixture
def graphdist_faults() -> Iterator[FaultInjector]:
    """A fault injector for ``graphdist run`` (see the module docstring); every run it made is
    stopped after the test, which errors if one of its processes survives SIGKILL."""
    from graphdist._faults.injector import FaultInjector

    injector = FaultInjector()
    try:
        yield injector
    finally:
        survivors = injector.close()
        if survivors:
            pytest.fail(
                f"graphdist_faults: processes {survivors} of a run were still alive after "
                "SIGKILL at teardown",
                pytrace=False,
            )
