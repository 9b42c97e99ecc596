"""The suite's ``--dist loadgroup`` ends after a crashed worker (tests/xdist_sched.py): a real
pytest with a real xdist worker that dies in a test, once with the test after it and once with
the test before it, each of which hangs xdist 3.8.0's own scheduler for good."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INNER = """
import os
import pytest

def _crash_once(name):
    mark = os.path.join(os.environ["CRASH_DIR"], name)
    if not os.path.exists(mark):
        open(mark, "w").close()
        os._exit(1)  # as pytest-timeout's thread method ends a worker

@pytest.mark.xdist_group("g")
def test_a():
    if os.environ["CRASH"] == "first":
        _crash_once("a")

@pytest.mark.xdist_group("g")
def test_b():
    if os.environ["CRASH"] == "last":
        _crash_once("b")
"""


def _inner(
    tmp_path: object, crash: str, plugin: str, inner: str = INNER, *options: str
) -> subprocess.CompletedProcess[str]:
    folder = str(tmp_path)
    with open(os.path.join(folder, "test_inner.py"), "w") as f:
        f.write(inner)
    env = {**os.environ, "CRASH": crash, "CRASH_DIR": folder, "PYTHONPATH": REPO}
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "1", *options]
    argv += ["--dist", "loadgroup", "-p", plugin, "-q", "-o", "addopts=", "test_inner.py"]
    with subprocess.Popen(
        argv, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    ) as proc:  # fmt: skip
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the inner pytest and its worker: a session of their own
            out, _ = proc.communicate()
            pytest.fail(f"pytest hung after its worker crashed ({crash} test):\n{out[-3000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("crash", ["first", "last"])
def test_a_crashed_worker_is_replaced_and_the_session_ends_with_the_crash_failed(
    tmp_path: object, crash: str
) -> None:
    done = _inner(tmp_path, crash, "tests.xdist_sched")
    assert done.returncode == 1, done.stdout
    # the other test ran (for "first": in a new worker), the crashed one not again
    assert "1 failed, 1 passed" in done.stdout, done.stdout
    crashed = "test_a" if crash == "first" else "test_b"
    assert f"FAILED test_inner.py::{crashed}" in done.stdout, done.stdout


def test_the_suite_schedules_with_it(pytestconfig: pytest.Config) -> None:
    """The conftest installs it: the suite's own ``--dist loadgroup`` gets the mended scheduler,
    asked before xdist's own."""
    from tests import xdist_sched

    impls = pytestconfig.hook.pytest_xdist_make_scheduler.get_hookimpls()
    ours = [impl for impl in impls if impl.function is xdist_sched.pytest_xdist_make_scheduler]
    assert ours and ours[0].tryfirst, [impl.plugin_name for impl in impls]


HANGS = """
import time

def test_hangs():
    time.sleep(60)  # the line the report must show
"""


@pytest.mark.timeout(180)
def test_a_hung_test_in_a_worker_is_reported_with_its_stack_not_as_a_bare_crash(
    tmp_path: object,
) -> None:
    """pytest-timeout's thread method ends the worker of a hung test; its banner and stacks
    reach the log (red without tests.xdist_sched's pytest_configure: only "node down")."""
    options = ("-o", "timeout=3", "-o", "timeout_method=thread")
    done = _inner(tmp_path, "", "tests.xdist_sched", HANGS, *options)
    assert done.returncode == 1, done.stdout
    assert "FAILED test_inner.py::test_hangs" in done.stdout, done.stdout
    assert "Timeout" in done.stdout and "time.sleep(60)  # the line" in done.stdout, done.stdout


def test_the_suite_and_its_children_take_sigint_as_a_terminal_gives_it() -> None:
    """Started in the background by a shell (SIGINT ignored, inherited by every child), the
    suite restores SIGINT (tests/conftest.py): its Ctrl-C tests' children raise
    KeyboardInterrupt instead of ignoring it, and no step waits for ever."""
    import signal

    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    child = subprocess.run(
        [sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT).__name__)"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert child.stdout.strip() == "default_int_handler", child
