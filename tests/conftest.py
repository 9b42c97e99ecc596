"""Shared helpers. The fleets themselves come from graphdist's own pytest plugin
(``graphdist_fleet``, ``graphdist_fleet_factory``), loaded through its ``pytest11`` entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Generator, Iterable
from typing import Any

import psutil
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUIET_TF = {"TF_CPP_MIN_LOG_LEVEL": "2"}
# How long a test waits for something that must happen "eventually" (a stopped or orphaned
# process is gone). Generous on purpose: the suite must pass on a loaded 2-core machine, where a
# TensorFlow process can take seconds to exit; how fast it really happens is a benchmark figure.
EVENTUALLY_S = 30.0
# The documented defaults (README "Sessions"; LocalFleet's docstring, `graphdist up --help`), not
# the code's own constants: a default of 0 would mean "wait forever" to TensorFlow.
DOCUMENTED_OPERATION_TIMEOUT_MS = 30_000
# A fleet session's default: ten minutes, the last resort behind the fleet's own failure watch.
DOCUMENTED_FLEET_OPERATION_TIMEOUT_MS = 600_000
DOCUMENTED_START_TIMEOUT_S = 60.0
# Set to 1 on a machine that cannot provide what a `promise` test needs (root, setpriv, network
# namespaces, a git checkout): its skips stay skips. Unset, as in CI, such a skip is a failure.
ALLOW_PROMISE_SKIPS = "GRAPHDIST_ALLOW_PROMISE_SKIPS"


def is_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie waiting to be reaped counts as exited)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def listening(pid: int) -> list[tuple[str, int]]:
    """Where process ``pid`` listens, as psutil reads it: the tests' own oracle, independent of
    graphdist's reading (``graphdist._net.exposure``)."""
    return sorted(
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    )


def wait_gone(pids: Iterable[int], timeout_s: float) -> list[int]:
    """Wait until every pid is gone; return those still alive after ``timeout_s``."""
    pending = list(pids)
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        pending = [p for p in pending if not is_gone(p)]
        if pending:
            time.sleep(0.05)
    return [p for p in pending if not is_gone(p)]


def processes_marked(mark: str) -> list[int]:
    """Pids of the live processes whose environment has ``GRAPHDIST_TEST_MARK=mark``: everything
    a command started with that mark, however deep, whoever adopted it."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("GRAPHDIST_TEST_MARK") == mark:
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


def run_python(
    args: list[str],
    *,
    timeout: float = 90,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` (a script, ``-m graphdist ...``) and capture its output."""
    full_env = {**os.environ, **QUIET_TF, **(env or {})}
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd or REPO,
        env=full_env,
    )


def start_python(*args: str, new_session: bool = False) -> subprocess.Popen[str]:
    """``python ARGS`` in the background, stdout and stderr captured as text; with
    ``new_session``, in a session and process group of its own (what a terminal or a Jupyter
    kernel gives it: signals to "the group" then reach it and its children only)."""
    return subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, **QUIET_TF},
        start_new_session=new_session,
    )


def start_graphdist(*args: str) -> subprocess.Popen[str]:
    """``python -m graphdist ARGS`` in the background (see :func:`start_python`)."""
    return start_python("-m", "graphdist", *args)


def read_json_rows(proc: subprocess.Popen[str]) -> list[dict[str, Any]]:
    """Read the JSON list a foreground ``graphdist up --json`` prints once its fleet is up."""
    assert proc.stdout is not None
    text = ""
    while not text.rstrip().endswith("]"):
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else "no output"
        text += line
    rows: list[dict[str, Any]] = json.loads(text)
    return rows


def read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture
def state_dir(tmp_path: object) -> str:
    """A private state folder for CLI fleets, so tests never touch the user's default one."""
    path = os.path.join(str(tmp_path), "state")
    return path


# -- promises: a security or robustness test that cannot run fails, unless allowed -------------


def promise_skips_allowed() -> bool:
    return os.environ.get(ALLOW_PROMISE_SKIPS) == "1"


def _skip_reason(report: pytest.TestReport) -> str:
    if isinstance(report.longrepr, tuple):  # (path, line, "Skipped: why")
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    return str(report.longrepr)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A skipped ``promise`` test becomes a failure that names what was missing: a promise
    whose test never runs where CI runs is a promise nobody checks. Skips from ``xfail`` and
    tests without the marker are left alone."""
    report = yield
    if (
        report.skipped
        and not hasattr(report, "wasxfail")
        and item.get_closest_marker("promise") is not None
        and not promise_skips_allowed()
    ):
        report.outcome = "failed"
        report.longrepr = (
            f"promise test could not run: {_skip_reason(report)}\n"
            f"Give this machine what it names, or set {ALLOW_PROMISE_SKIPS}=1 to let such "
            "tests skip here (CI never sets it)."
        )
    return report


def seed_ports_free(ports: tuple[int, ...] = (2020, 2021), timeout_s: float = EVENTUALLY_S) -> bool:
    """Whether the seed ports can be listened on, waiting up to ``timeout_s`` for them: the
    servers of the previous seed-port test (xdist_group "seed_ports") exit with their owner,
    a moment after it."""
    from graphdist._net.ports import is_port_free

    deadline = time.monotonic() + timeout_s
    while not all(map(is_port_free, ports)):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True
