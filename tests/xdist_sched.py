"""``--dist loadgroup`` that ends after a crashed worker instead of hanging (pytest-xdist 3.8).

pytest-timeout's thread method ends a worker whose test hangs (``os._exit``), and xdist replaces
the worker. With ``--dist loadgroup`` (this suite's, for its ``xdist_group`` beds) xdist 3.8.0
then hangs for good, both workers idle, until CI's hard limit: seen here at 98 % of a suite. Two
faults of its ``LoadScopeScheduling``, reported upstream (pytest-dev/pytest-xdist#1323 and #1327,
fixed by #1324 and #1328, released in no version this suite can install):

- ``remove_node`` puts the crashed worker's whole workload back in the queue, units whose tests
  all ran included: such a unit is sent as an empty list, and its worker waits for tests forever;
- a worker runs a test only once it knows the next one, or is told to shut down; a replacement
  worker given one unit of one test, with nothing more to come, is told neither.

:class:`NoHangLoadGroup` mends both, and does not run the crashed test again (xdist has reported
it failed already; run again it would most often crash the next worker too, as upstream's open
pytest-dev/pytest-xdist#1371 says). It is installed through xdist's own hook,
``pytest_xdist_make_scheduler``; the suite's conftest imports it.

And a hung test's report: pytest-timeout's thread method writes its banner and every thread's
stack to pytest's terminal writer, which in an xdist worker is execnet's ``/dev/null`` (fd 1):
the log said only "node down: Not properly terminated", a hang read as a crash.
:func:`pytest_configure` sends them to the worker's stderr, which is the controller's.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from xdist.scheduler import LoadGroupScheduling


class NoHangLoadGroup(LoadGroupScheduling):
    """xdist's ``LoadGroupScheduling``, minus its two hangs after a crash (module docstring)."""

    def remove_node(self, node: Any) -> str | None:
        workload = self.assigned_work.pop(node)
        if not self._pending_of(workload):
            return None
        crashitem = next(
            nodeid for unit in workload.values() for nodeid, done in unit.items() if not done
        )
        for scope, unit in workload.items():
            if crashitem in unit:
                unit[crashitem] = True  # reported failed by xdist; not run again
            if not all(unit.values()):  # only units with a test still to run go back
                self.workqueue[scope] = unit
        for other in self.assigned_work:
            self._reschedule(other)
        return crashitem

    def _reschedule(self, node: Any) -> None:
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        if self._pending_of(self.assigned_work[node]) > 2:
            return
        self._assign_work_unit(node)
        # a worker runs its last test only once it is given another or told to shut down
        while self.workqueue and self._pending_of(self.assigned_work[node]) < 2:
            self._assign_work_unit(node)
        if not self.workqueue:
            node.shutdown()


# optionalhook: a pytest without xdist (mutmut's, -p no:xdist) has no such hook to check it by
@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """:class:`NoHangLoadGroup` for ``--dist loadgroup``; xdist's own for every other mode."""
    if config.getvalue("dist") == "loadgroup":
        return NoHangLoadGroup(config, log)
    return None


def pytest_configure(config: pytest.Config) -> None:
    """In an xdist worker, pytest-timeout's thread-method report goes to stderr (module doc)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    try:
        import pytest_timeout
    except ImportError:
        return
    original = pytest_timeout.timeout_timer
    if getattr(original, "to_stderr", False):
        return

    def timeout_timer(item: pytest.Item, settings: Any) -> None:
        if not settings.disable_debugger_detection and pytest_timeout.is_debugging():
            return original(item, settings)  # which then lets the test run on, untouched
        capman = item.config.pluginmanager.getplugin("capturemanager")
        if capman is not None:  # (again in pytest-timeout's own: a no-op once suspended)
            capman.suspend_global_capture(item)  # fd 1 and 2 back to the worker's own
        os.dup2(2, 1)  # the terminal writer's fd: the report reaches the controller's log
        original(item, settings)  # reports, then os._exit(1)

    timeout_timer.to_stderr = True  # type: ignore[attr-defined]
    pytest_timeout.timeout_timer = timeout_timer
