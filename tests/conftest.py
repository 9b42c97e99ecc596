"""Shared helpers. The fleets themselves come from graphdist's own pytest plugin
(``graphdist_fleet``, ``graphdist_fleet_factory``), loaded through its ``pytest11`` entry point."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import psutil
import pytest

# --dist loadgroup that ends after a crashed worker instead of hanging (xdist 3.8's #1323, #1327)
from tests import xdist_sched
from tests.xdist_sched import pytest_xdist_make_scheduler  # noqa: F401 - a hook

if TYPE_CHECKING:
    from graphdist._detached.state import ProcessRef

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
# A Ray cluster that a test starts on hosts of a bed (tests/net/test_ray_hosts.py) is visible to
# Ray's "latest local cluster" lookup, which reads running gcs_server command lines: a RayFleet
# or `run --backend ray` of another test, given no address, would then pick that cluster, which
# it cannot reach from this namespace. Tests that want a cluster name its address.
os.environ.setdefault("RAY_ADDRESS", "local")
# A warm agent of the user's (`graphdist warm start`) would serve the runs of every test: tests
# that want one start their own in a folder of their own; the others look where none is.
# Those whose runs' subject is not how tasks start share one (:func:`warm_agent`).
WARM_DIR = "GRAPHDIST_WARM_DIR"
os.environ[WARM_DIR] = os.path.join(REPO, ".no-warm-agents")


def pytest_configure(config: pytest.Config) -> None:
    """SIGINT as a terminal gives it, and a hung test reported in an xdist worker's log.

    A suite started in the background by a shell without job control (``make test &`` in a
    script, ``(setsid pytest &)``) inherits SIGINT ignored, and so would every process it
    starts: Python then installs no KeyboardInterrupt handler, the tests that press Ctrl-C on
    a child would test nothing, and the one that waits for its interrupted step hung until
    pytest-timeout ended its worker. Seen twice here as a "crashed" worker."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    xdist_sched.pytest_configure(config)


def signals_by_default() -> None:
    """``preexec_fn`` for a process a test sends SIGINT or SIGHUP to: both by default in it
    (and in all it starts), between fork and exec. A suite started under ``nohup`` has SIGHUP
    ignored and one started in the background SIGINT, every process it starts inherits that,
    and the signal the test sends would then be ignored (a ``graphdist run`` given SIGHUP ran
    on until the test's 60 s wait ended, under ``nohup make test``)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def sigstop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until it is stopped (``/proc`` state ``T``). A signal sent right
    after a bare SIGSTOP can act first: the kernel takes a process's pending signals lowest
    number first once it runs, so a SIGTERM (15) that came before the target ran again ended a
    "stopped" server at once (a tracefs record of tests/cli/test_interrupt.py, 1 run in 6 here
    beside a load)."""
    from graphdist._proc.process import proc_stat

    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + EVENTUALLY_S
    while (state := (proc_stat(pid) or ("gone", 0))[0]) != "T":
        assert time.monotonic() < deadline, f"pid {pid} did not stop on SIGSTOP: {state}"
        time.sleep(0.005)


def is_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie waiting to be reaped counts as exited)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Killed:
    """The processes a teardown SIGKILLs, each held as the process it was when first seen (by
    its start time): a pid that a new process took since is neither killed (psutil refuses a
    reused pid) nor counted as left behind. Waiting on bare pids did both: a bed's teardown
    reported another test's new process on a recycled pid as its own survivor."""

    def __init__(self) -> None:
        self.procs: dict[int, psutil.Process] = {}

    def kill(self, pids: Iterable[int]) -> None:
        for pid in pids:
            proc = self.procs.get(pid)
            if proc is None or not _running(proc):  # new, or a new process on a known pid
                try:
                    proc = psutil.Process(pid)
                except psutil.NoSuchProcess:
                    continue
                self.procs[pid] = proc
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                proc.kill()

    def alive_after(self, timeout_s: float) -> list[int]:
        """The pids of those still running after up to ``timeout_s`` seconds (a zombie is
        gone)."""
        deadline = time.monotonic() + timeout_s
        left = [p for p in self.procs.values() if _running(p)]
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = [p for p in left if _running(p)]
        return sorted(p.pid for p in left)


def listening(pid: int) -> list[tuple[str, int]]:
    """Where process ``pid`` listens, as psutil reads it: the tests' own oracle, independent of
    graphdist's reading (``graphdist._net.exposure``)."""
    return sorted(
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    )


def on_loopback(address: str) -> bool:
    """Whether ``ss``'s local-address column ``address`` (``10.1.2.3:80``, ``*:80``,
    ``[::ffff:127.0.0.2]:80``) is a loopback address. Parsed, not matched: a host bed's
    subnet may be ``10.169.127.0/24``, whose addresses contain ``"127."`` and are not loopback."""
    host = address.rsplit(":", 1)[0].strip("[]").split("%", 1)[0]
    if host == "*":
        return False
    ip = ipaddress.ip_address(host)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


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


def received_of(pids: Iterable[int], folder: str | None = None) -> list[str]:
    """The received-credentials folders (:func:`graphdist._net.tlsmode.write_received`:
    ``graphdist-tls-<pid>-received-*``) in ``folder`` (the temporary folder) made by one of
    ``pids``: a test's own processes, never another test's, which makes and removes folders of
    the same name in the same folder while it runs on the other xdist worker."""
    import fnmatch
    import tempfile

    from graphdist._net.tlsmode import RECEIVED_GLOB

    owners = {str(pid) for pid in pids}
    names = fnmatch.filter(os.listdir(folder or tempfile.gettempdir()), RECEIVED_GLOB)
    return sorted(name for name in names if name.split("-")[2] in owners)


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


def start_python(
    *args: str, new_session: bool = False, group: int | None = None
) -> subprocess.Popen[str]:
    """``python ARGS`` in the background, stdout and stderr captured as text; with
    ``new_session``, in a session and process group of its own (what a terminal or a Jupyter
    kernel gives it: signals to "the group" then reach it and its children only); with
    ``group``, in that process group (:func:`anchored_group`)."""
    return subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, **QUIET_TF},
        start_new_session=new_session,
        **_in_group(group),
    )


def _in_group(group: int | None) -> dict[str, Any]:
    """Popen's arguments that start its child in process group ``group`` (0: a new one)."""
    if group is None:
        return {}
    if sys.version_info >= (3, 11):
        return {"process_group": group}
    return {"preexec_fn": functools.partial(os.setpgid, 0, group)}  # pragma: no cover


@contextlib.contextmanager
def anchored_group() -> Iterator[int]:
    """A process group that is never orphaned while the test runs: its first member, a sleeping
    anchor, is a child of this process, which is in another group of the same session. A process
    that a test SIGSTOPs and must find still stopped belongs in one. When a process exits, the
    kernel looks at its own group (if its parent is in another group of the session) and at the
    groups of its children that are not in its own: a group that is orphaned then and holds a
    stopped process gets SIGHUP and SIGCONT, every member of it (``kill_orphaned_pgrp``). So a
    stopped process is continued when the last link of its group to the rest of the session
    dies (its parent, say, in the pool tests), and, in a group that is orphaned already, by the
    exit of any process that is such a link. The suite's own group is orphaned whenever the suite
    runs under a shell without job control whose parent is in another session (a CI runner,
    ``setsid``). tests/test_sigtrace.py shows both, and the anchor keeping its group linked.
    Yields the group's id."""
    anchor = subprocess.Popen(["sleep", "3600"], **_in_group(0))
    try:
        yield anchor.pid
    finally:
        anchor.kill()
        anchor.wait()


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


@dataclasses.dataclass(frozen=True)
class CliResult:
    """What ``graphdist ARGV`` run in this process did, named as a CompletedProcess names it."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str


def _started_since(before: set[int]) -> list[int]:
    """This process's descendants that are none of ``before`` nor under one of them (a fork
    server an earlier test left forks spares of its own accord: not the command's)."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.pid not in before and not {p.pid for p in proc.parents()} & before:
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


@pytest.fixture
def run_cli(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> Callable[..., CliResult]:
    """``run_cli(*ARGV, env={...})``: ``graphdist ARGV`` in this process, through
    :func:`graphdist._cli.main.main`, with its exit status and what it printed (``env`` is set
    for the rest of the test). For the checks of a user mistake, refused before anything starts:
    a subprocess each, a fresh import of graphdist, made them the slow part of the suite (issue
    54); the real entry point keeps tests of its own (tests/cli/test_no_traceback.py). The
    command must leave nothing behind, no process (each call has a GRAPHDIST_TEST_MARK of its
    own) and no signal handler; the import refusal ``serve`` and ``demo`` install
    (:func:`graphdist._proc.lean.install`) is taken back, and ``serve`` re-executing itself (a
    mistake it no longer refused) fails the test instead of replacing pytest's process."""
    from graphdist._cli.main import main

    def no_exec(*args: object) -> None:
        raise AssertionError(f"the command would replace the test's process: exec {args}")

    monkeypatch.setattr(os, "execv", no_exec)
    monkeypatch.setattr(os, "execve", no_exec)

    def run(*argv: str, env: dict[str, str] | None = None) -> CliResult:
        # whatever the command starts carries the mark, however deep, whoever adopted it
        monkeypatch.setenv("GRAPHDIST_TEST_MARK", f"run-cli-{uuid.uuid4().hex}")
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        capsys.readouterr()  # what the test printed before is not the command's
        signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE)
        handlers = {sig: signal.getsignal(sig) for sig in signals}
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        meta_path = list(sys.meta_path)
        try:
            code = main(list(argv))
        finally:
            sys.meta_path[:] = meta_path
        out, err = capsys.readouterr()
        result = CliResult(list(argv), code, out, err)
        assert {sig: signal.getsignal(sig) for sig in signals} == handlers, result
        marked = processes_marked(os.environ["GRAPHDIST_TEST_MARK"])
        started = [pid for pid in marked if pid != os.getpid()] + _started_since(before)
        assert wait_gone(started, EVENTUALLY_S) == [], result
        return result

    return run


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
    if call.when == "teardown" and _unit_tier(item.config):
        started = _tripwire_records()
        if started and report.outcome != "failed":
            report.outcome = "failed"
            report.longrepr = (
                "a unit-tier test started a process that imported TensorFlow:\n"
                + "".join(
                    f"  {r['test']}: pid {r['pid']} {' '.join(r['argv'])[:300]}\n" for r in started
                )
                + "Mark it integration (tests/conftest.py: INTEGRATION_FIXTURES or "
                "INTEGRATION_TESTS, or pytest.mark.integration): `make check` is the fast tier."
            )
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


def _declared_missing(item: pytest.Item) -> str | None:
    """What a ``needs(MODULE, extra=EXTRA)`` mark of ``item`` names that is not installed (a
    declared test dependency: setup.cfg's ``test`` or ``ray`` extra), said as a skip reason;
    None where all of it is."""
    import importlib.util

    for mark in item.iter_markers("needs"):
        module, extra = mark.args[0], mark.kwargs.get("extra", "test")
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install -e '.[{extra}]')"
    return None


# -- the unit tier: `make check` runs -m "not integration" ---------------------------------------

#: Fixtures that start real TensorFlow servers, a warm agent, Ray, a host bed or a Slurm bed: a
#: test that uses one (directly or through another fixture) is marked ``integration`` when it is
#: collected, whatever its module says.
INTEGRATION_FIXTURES = frozenset(
    {
        "graphdist_fleet",
        "graphdist_fleet_factory",
        "graphdist_faults",
        "warm_agent",
        "_suite_agent",
        "hosts",
        "slurm",
        "ray_env",
    }
)
#: Tests that start such processes themselves (``graphdist run``/``up``/``demo``, a script that
#: imports TensorFlow) or a host bed, by node id prefix: a whole module, or a test of one with
#: all its parameters. Each is marked ``integration`` likewise. (A module of one's own may carry
#: the mark itself, as most do; this list also reaches the modules whose owners are busy.)
INTEGRATION_TESTS = (
    "tests/cli/test_interrupt.py",
    "tests/cli/test_cli.py::test_demo_",
    "tests/cli/test_cli.py::test_detached_fleet_up_status_down",
    "tests/cli/test_cli.py::test_stale_state_is_detected_and_cleaned",
    "tests/cli/test_cli.py::test_foreground_up_reports_a_death_and_stops_everything_on_ctrl_c",
    "tests/cli/test_cli.py::test_status_names_a_foreground_up_instead_of_saying_only_no_fleet",
    "tests/cli/test_first_use.py::test_a_closed_fleets_table_shows_stopped_and_a_killed_task",
    "tests/cli/test_first_use.py::test_run_console_leaves_out_tensorflows_lines_and_the_logs",
    "tests/cli/test_first_use.py::test_the_demo_shows_",
    "tests/distribute/test_heartbeat.py::test_the_cli_takes_off_for_no_heartbeat",
    "tests/distribute/test_resume.py::test_keras_3_is_refused_with_what_to_set",
    "tests/distribute/test_resume.py::test_a_non_checkpoint_and_steps_under_ps_are_refused",
    "tests/distribute/test_warm.py",
    "tests/net/test_hostbed.py",
    "tests/proc/test_lean.py",
    "tests/slurm/test_slurmbed.py",
    "tests/test_bad_input.py::test_bad_cli_arguments['warm start --idle-timeout ",
    "tests/test_bad_input.py::test_a_one_line_error_shows_the_users_own_values",
    "tests/test_bench.py::test_suite_smoke_run",
    "tests/test_tflog.py::test_import_tensorflow_quietly_keeps_only_the_programs_lines",
)
#: The tripwire (tests/unit_tier/sitecustomize.py): a unit-tier test that starts a process which
#: imports TensorFlow fails, naming it, so that no test slows the tier down unseen.
TRIPWIRE = os.path.join(REPO, "tests", "unit_tier")
TRIPWIRE_RECORDS = "GRAPHDIST_UNIT_TIER_RECORDS"
TRIPWIRE_TEST = "GRAPHDIST_UNIT_TIER_TEST"
_records: list[str] = []  # this process's records folder, once made


def forbid_in_unit_tier(what: str) -> None:
    """Fail the running test if it is a unit-tier one (:func:`pytest_runtest_protocol` names it)
    about to start ``what`` (a network namespace, a host bed, a Ray instance): an integration
    test that does not say so. The tripwire's twin, for what imports no TensorFlow."""
    test = os.environ.get(TRIPWIRE_TEST)
    if test:
        pytest.fail(
            f"a unit-tier test starts {what} ({test}): mark it integration (tests/conftest.py: "
            "INTEGRATION_FIXTURES or INTEGRATION_TESTS, or pytest.mark.integration)"
        )


def _unit_tier(config: pytest.Config) -> bool:
    """Whether this run is the unit tier: its ``-m`` leaves the integration tests out."""
    return "not integration" in (config.getoption("markexpr", default="") or "")


def pytest_itemcollected(item: pytest.Item) -> None:
    """``integration`` on each test that uses an :data:`INTEGRATION_FIXTURES` fixture or is one
    of :data:`INTEGRATION_TESTS` (before ``-m`` selects)."""
    uses = INTEGRATION_FIXTURES.intersection(getattr(item, "fixturenames", ()))
    if uses or item.nodeid.startswith(INTEGRATION_TESTS):
        item.add_marker(pytest.mark.integration)


def _tripwire_records() -> list[dict[str, Any]]:
    """The processes that imported TensorFlow since the last look (their records, removed)."""
    found = []
    for folder in _records:
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            try:
                found.append(read_json(path))
            except (OSError, ValueError):
                continue
            finally:
                with contextlib.suppress(OSError):
                    os.remove(path)
    return found


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, object]:
    """In the unit tier, every process a test starts has the tripwire on its ``PYTHONPATH``."""
    if not _unit_tier(item.config):
        return (yield)
    if not _records:
        import tempfile

        _records.append(tempfile.mkdtemp(prefix=f"gd-unit-tier-{os.getpid()}-"))
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", TRIPWIRE_RECORDS, TRIPWIRE_TEST)}
    path = [TRIPWIRE, *filter(None, [saved["PYTHONPATH"]])]
    os.environ.update(
        {
            "PYTHONPATH": os.pathsep.join(path),
            TRIPWIRE_RECORDS: _records[0],
            TRIPWIRE_TEST: item.nodeid,
        }
    )
    try:
        return (yield)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def pytest_unconfigure(config: pytest.Config) -> None:
    import shutil

    for folder in _records:
        shutil.rmtree(folder, ignore_errors=True)


def seed_ports_free(ports: tuple[int, ...] = (2020, 2021), timeout_s: float = EVENTUALLY_S) -> bool:
    """Whether the seed ports can be listened on, waiting up to ``timeout_s`` for them: the
    servers of the previous seed-port test (xdist_group "seed_ports") exit with their owner,
    a moment after it."""
    from graphdist._ports import is_port_free

    deadline = time.monotonic() + timeout_s
    while not all(map(is_port_free, ports)):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


# -- order: the longest tests first ------------------------------------------------------------

# Tests that take 10 s or more in a full run on the 2-core machine, by node id prefix, with
# those seconds (measured 2026-12-05: a full run's per-test wall times, parameters merged).
# xdist hands each of its two workers the next test when it is done, in collection order:
# started last, a 60 s test would leave one worker alone for its last minute; started first,
# the short tests fill in around it (longest first).
SLOW_TESTS_S = {
    "tests/net/test_ray_hosts.py::test_the_ray_guide_runs_as_the_page_writes_it": 128,
    "tests/net/test_ray_hosts.py::test_a_launcher_on_a_host_that_is_no_ray_node_is_a_member_o": 78,
    "tests/test_bench.py::test_suite_smoke_run": 76,
    "tests/slurm/test_slurm_guide.py::test_the_interactive_allocation_and_the_fleet_run_as_th": 68,
    "tests/net/test_ray_hosts.py::test_run_on_ray_restarts_a_worker_killed_on_host_2_and_ends": 51,
    "tests/fleet/test_fast_failure.py::test_a_healthy_40_s_step_succeeds_with_default_setting": 44,
    "tests/net/test_ray_hosts.py::test_a_ray_fleet_in_tls_mode_across_hosts": 37,
    "tests/distribute/test_resume.py::test_custom_loop_resumes_from_the_latest_checkpoint_and": 36,
    "tests/slurm/test_slurm_run.py::test_a_tls_run_trains_behind_the_nodes_gateways_and_resta": 36,
    "tests/slurm/test_slurm_preemption.py::test_a_warning_then_a_requeue_lose_no_step": 35,
    "tests/test_plugin.py::test_user_tests_inject_faults_into_a_run_and_nothing_is_left": 32,
    "tests/slurm/test_slurmbed.py::test_the_warning_signal_reaches_the_batch_script": 31,
    "tests/distribute/test_run_ray.py::test_ray_tasks_run_warm_on_their_node_across_a_restart": 30,
    "tests/fleet/test_ray_exposure.py::test_the_ray_graphdist_starts": 20,
    "tests/fleet/test_ray_exposure.py::test_a_ray_node_on_a_network_address_still_gets_loopba": 30,
    "tests/net/test_ray_hosts.py::test_a_two_node_ray_fleet_across_hosts": 29,
    "tests/net/test_tls_hosts.py::test_a_local_tls_run_is_reached_only_through_its_gateway_an": 29,
    "tests/net/test_ray_hosts.py::test_a_ps_run_on_ray_survives_a_worker_server_killed_on_hos": 29,
    "tests/fleet/test_ray.py::test_three_servers_on_three_nodes_run_the_split_graph_and_recov": 28,
    "tests/slurm/test_slurm_run.py::test_a_lost_node_restarts_the_run_on_the_nodes_left": 27,
    "tests/test_bench_smoke.py::test_mwms_throughput_trains_on_one_and_two_workers": 26,
    "tests/distribute/test_restarts.py::test_a_killed_worker_is_restarted_and_the_run_resumes": 26,
    "tests/net/test_ray_hosts.py::test_a_run_on_ray_in_tls_mode_trains_across_hosts_with_no_s": 25,
    "tests/slurm/test_slurm_fleet.py::test_a_slurm_fleet_in_tls_mode_is_reached_by_its_creden": 25,
    "tests/net/test_tls_hosts.py::test_a_tls_local_fleet_is_reached_with_its_own_credentials_": 25,
    "tests/slurm/test_slurm_run.py::test_a_lost_node_ends_the_run_in_one_line_when_the_nodes_": 25,
    "tests/test_examples.py::test_between_graph_replication_learns_the_known_weights": 24,
    "tests/distribute/test_run_ray_lost.py::test_a_lost_ray_head_ends_the_run_in_one_line_wit": 24,
    "tests/distribute/test_preemption.py::test_a_preemption_notice_saves_and_resumes_with_no_": 24,
    "tests/slurm/test_slurm_run.py::test_a_worker_killed_on_its_node_restarts_in_the_allocati": 24,
    "tests/distribute/test_restarts.py::test_a_hung_worker_is_caught_by_the_heartbeat_and_the": 24,
    "tests/fleet/test_load.py::test_many_clients_and_threads_lose_no_update": 24,
    "tests/fleet/test_ray.py::test_alive_comes_from_ray_and_the_watcher_sees_each_kill": 24,
    "tests/net/test_tls_hosts.py::test_without_credentials_or_with_another_clusters_everyone_": 23,
    "tests/net/test_ray_hosts.py::test_up_on_ray_in_tls_mode_detached_is_reached_by_its_print": 23,
    "tests/distribute/test_run_ray_lost.py::test_a_lost_ray_node_restarts_the_run_on_the_node": 23,
    "tests/distribute/test_warm.py::test_mwms_training_warm_ends_with_the_cold_runs_weights": 23,
    "tests/slurm/test_slurmbed.py::test_a_killed_node_is_noticed_and_its_job_requeued": 23,
    "tests/distribute/test_resume.py::test_keras_3_is_refused_with_what_to_set": 23,
    "tests/net/test_same_user.py::test_local_fleet_serves_its_own_user_only": 22,
    "tests/slurm/test_slurm_run.py::test_a_ps_run_on_slurm_survives_a_worker_server_killed_on": 22,
    "tests/distribute/test_training.py::test_parameter_server_run_resumes_after_its_ps_task_d": 21,
    "tests/net/test_tls_hosts.py::test_a_string_tensor_between_hosts_is_in_clear_without_tls_": 21,
    "tests/distribute/test_run_ray_lost.py::test_a_lost_ray_node_ends_the_run_in_one_line_whe": 21,
    "tests/net/test_ports.py::test_eight_fleets_started_at_once_by_eight_processes_all_come_u": 20,
    "tests/net/test_deploy_hosts.py::test_the_slurm_script_serves_on_two_hosts": 20,
    "tests/net/test_ps_hosts.py::test_the_ps_example_trains_with_its_tasks_on_three_hosts": 20,
    "tests/slurm/test_slurm_fleet.py::test_a_slurm_fleet_serves_runs_fails_fast_restarts_and_": 20,
    "tests/slurm/test_slurmbed.py::test_graphdist_serve_as_a_slurm_step": 19,
    "tests/fleet/test_pool.py::test_warm_start_and_restart_hand_over_spares_that_refill_and_n": 19,
    "tests/test_notebook.py::test_the_tutorial_runs_twice_in_one_kernel_and_an_interrupt_spar": 18,
    "tests/test_examples.py::test_seed_ports_work_when_free_and_fail_clearly_when_taken": 18,
    "tests/fleet/test_long_lived.py::test_dropping_a_session_in_any_state_never_crashes": 18,
    "tests/distribute/test_run_ray.py::test_a_ray_run_tasks_server_listens_on_loopback_only": 17,
    "tests/distribute/test_run_ray.py::test_the_runs_timeout_bounds_a_placement_ray_cannot_ma": 17,
    "tests/distribute/test_frozen.py::test_a_frozen_ps_task_is_killed_and_the_run_resumes_fro": 17,
    "tests/fleet/test_long_lived.py::test_churn_fifty_seeded_rounds_of_random_operations": 17,
    "tests/fleet/test_fast_failure.py::test_a_ray_fleet_fails_fast_too": 17,
    "tests/test_bench_smoke.py::test_tls_measures_both_sides_on_a_bed_of_hosts": 16,
    "tests/slurm/test_slurm_fleet.py::test_up_detach_on_slurm_serves_from_the_login_host_and_": 16,
    "tests/detached/test_detached.py::test_a_detached_fleet_keeps_a_spare_per_server_not_the_": 16,
    "tests/test_examples.py::test_two_client_processes_share_a_variable": 16,
    "tests/slurm/test_slurm_run.py::test_a_frozen_worker_is_found_from_the_login_host_and_its": 15,
    "tests/detached/test_detached_ray.py::test_up_detach_with_the_ray_backend_serves_the_spli": 15,
    "tests/net/test_same_user.py::test_graphdist_run_task_serves_its_own_user_only": 15,
    "tests/net/test_hosts.py::test_an_exposed_fleet_lets_in_its_allow_list_only": 15,
    "tests/net/test_same_user.py::test_detached_fleet_serves_its_own_user_only": 15,
    "tests/fleet/test_long_lived.py::test_restarts_while_the_watcher_reads_the_same_processes": 15,
    "tests/net/test_deploy_hosts.py::test_the_systemd_unit_serves_on_two_hosts": 14,
    "tests/net/test_tls_hosts.py::test_a_client_with_the_credentials_runs_from_any_host_and_n": 14,
    "tests/fleet/test_ray.py::test_cli_up_with_the_ray_backend_runs_until_ctrl_c": 14,
    "tests/fleet/test_long_lived.py::test_the_tutorial_cells_rerun_three_times_in_one_process": 14,
    "tests/net/test_hosts_guide.py::test_the_tls_guide_runs_as_the_page_writes_it": 14,
    "tests/fleet/test_long_lived.py::test_make_callable_on_a_session_whose_master_died_fails_": 13,
    "tests/net/test_same_user.py::test_graphdist_serve_serves_its_own_user_only": 13,
    "tests/net/test_hosts_guide.py::test_the_serve_and_connect_guide_runs_as_the_page_writes_": 13,
    "tests/test_install.py::test_installed_wheel_runs_a_local_fleet_session": 12,
    "tests/net/test_hosts.py::test_members_run_the_split_graph_and_another_host_is_refused_an": 12,
    "tests/slurm/test_slurm_fleet.py::test_up_in_the_foreground_on_slurm_stops_every_step_on_": 11,
    "tests/distribute/test_frozen.py::test_a_worker_hung_in_native_code_is_found_by_its_silen": 11,
    "tests/fleet/test_pool.py::test_servers_get_one_grpc_queue_per_cpu_and_an_empty_setting_i": 11,
    "tests/distribute/test_warm.py::test_a_killed_warm_interpreter_ends_its_tasks_and_the_run": 11,
    "tests/test_bench_smoke.py::test_restart_measures_one_kill_and_its_recovery": 11,
    "tests/test_examples.py::test_matrix_products_split_over_four_tasks_match_local": 11,
    "tests/net/test_same_user.py::test_without_the_shim_nobody_reads_roots_file": 11,
    "tests/distribute/test_warm.py::test_modules_code_and_what_runs_cold": 11,
    "tests/distribute/test_run_ray.py::test_a_working_dir_is_shipped_to_the_tasks": 11,
    "tests/fleet/test_long_lived.py::test_a_script_that_ends_with_its_fleet_running_exits_pro": 10,
    "tests/fleet/test_faults.py::test_detached_supervisor_restarts_a_dead_task_up_to_the_cap": 10,
    "tests/distribute/test_frozen.py::test_a_frozen_ps_worker_server_is_killed_and_restarted_": 10,
    "tests/fleet/test_faults.py::test_frozen_worker_is_reported_within_the_operation_timeout": 10,
    "tests/test_examples.py::test_two_variables_on_two_tasks_initialized_by_one_call": 10,
    "tests/test_examples.py::test_variable_shared_by_two_sessions_on_two_servers": 10,
    "tests/net/test_tls_hosts.py::test_a_killed_server_is_named_with_its_host_in_tls_mode": 10,
    "tests/test_examples.py::test_split_graph_prints_238_locally_and_split": 10,
}


# Modules whose module-scoped fixtures are costly (a Ray cluster, a built wheel in a fresh
# virtual environment, probes of what user nobody can run): kept in one block, at the place of
# their slowest test, so that no worker has to build them more often than before.
KEEP_TOGETHER = ("tests/fleet/test_ray.py", "tests/test_install.py", "tests/net/test_same_user.py")


def known_seconds(nodeid: str) -> float:
    """How long the test ``nodeid`` takes in a full run, as :data:`SLOW_TESTS_S` has it (in a
    :data:`KEEP_TOGETHER` module: its slowest test's); 0 for the rest."""
    module = nodeid.split("::", 1)[0]
    if module in KEEP_TOGETHER:
        nodeid = module
    return max(
        (
            s
            for prefix, s in SLOW_TESTS_S.items()
            if prefix.startswith(nodeid) or nodeid.startswith(prefix)
        ),
        default=0,
    )


def _group_suffix(item: pytest.Item) -> str:
    """``@NAME`` of the ``xdist_group`` marks of ``item`` (names joined by ``_``), as xdist
    writes it; empty without one."""
    names = {
        str(m.args[0] if m.args else m.kwargs.get("name", "default"))
        for m in item.iter_markers("xdist_group")
    }
    return f"@{'_'.join(sorted(names))}" if names else ""


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The known-slow tests first, longest first; the rest keep their order (a stable sort).

    A test marked ``needs(MODULE, extra=EXTRA)`` whose module is not installed is skipped as a
    ``promise``: the skip fails unless promise skips are allowed (:func:`_declared_missing`).

    And ``xdist_group`` made to work again: ``--dist loadgroup`` sends the tests whose node id
    ends in ``@NAME`` to one worker, and xdist adds that suffix by setting ``item._nodeid``,
    which pytest 9 no longer reads (a node id now comes from ``item._id``): without this, the
    "seed_ports" tests ran on both workers at once."""
    for item in items:
        # A declared test dependency that is missing skips the tests that need it, as a
        # promise does: a failure unless GRAPHDIST_ALLOW_PROMISE_SKIPS=1 (never in CI).
        missing = _declared_missing(item)
        if missing is not None:
            item.add_marker(pytest.mark.promise)
            item.add_marker(pytest.mark.skip(reason=missing))
    if config.getoption("loadgroup", default=False):  # set on xdist workers only
        from _pytest.nodeid import NodeId  # private: no public API sets a node id (pinned)

        for item in items:
            suffix = _group_suffix(item)
            if suffix and not item.nodeid.endswith(suffix):
                item._id = NodeId.parse(item.nodeid + suffix)
    items.sort(key=lambda item: -known_seconds(item.nodeid))


# -- hosts: a bed of network namespaces on one bridge (tests/hostbed.py) ------------------------


@pytest.fixture(scope="session")
def hosts() -> Generator[Any, None, None]:
    """A :class:`tests.hostbed.HostBed` of three hosts, each a network namespace with an address
    of its own on one bridge: made once per session and xdist worker (0.2 s: each worker has a
    bed of its own, on a subnet of its own), on first use, and closed at the end, which fails if
    anything of it is left. Skips (a failure for a ``promise`` test) where network namespaces
    cannot be made."""
    from tests.hostbed import HostBed, require_hostbed  # imports this module

    require_hostbed()
    with HostBed(3) as bed:
        yield bed


# -- a warm agent for the suite's local runs (issue 40) -----------------------------------------


class SuiteAgent:
    """The warm agent (``graphdist warm start``, default preloads) of one xdist worker, in a
    folder of its own: a local ``graphdist run`` of a test that uses :func:`warm_agent` forks its
    tasks from it instead of importing TensorFlow in a warm interpreter of its own (the run's
    subject is then its restarts, faults or training, not how its tasks start).

    A run uses it only while the worker's environment agrees with the agent's in what imports
    read (``graphdist warm status``'s troubleshooting entry): :meth:`ensure`, before each test
    that uses it, starts it again with the environment of the moment where that changed (a
    test left such a variable set: said as a warning) or where it is gone (its idle timeout)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.env: dict[str, str] = {}
        self.ref: ProcessRef | None = None  # the agent, by pid and start: never a reused pid
        self.used = 0  # tests that asked for it
        self.seen = 0  # runs the running agent had served at its last look
        self.served_before = 0  # runs served by the agents this one replaced

    def _env_now(self) -> dict[str, str]:
        return {**os.environ, **QUIET_TF, "PYTHONUNBUFFERED": "1", WARM_DIR: self.folder}

    def _warm(self, action: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "graphdist", "warm", action, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    def ensure(self) -> None:
        """The agent running, with an environment a run of this moment agrees with."""
        from graphdist._distribute.warm import env_differs

        env = self._env_now()
        if self.ref is not None:
            differs = env_differs(env, self.env)
            if differs is None and self.ref.alive():
                return
            if differs is not None:
                warnings.warn(
                    f"the suite's warm agent is started again: {differs} changed in this "
                    "worker's environment (a test left it so)",
                    stacklevel=2,
                )
            self.stop()
        self.env = env
        # idle 600 s: gone on its own soon after a crashed worker (whose teardown never runs);
        # one that ended so between two tests is started again above
        started = self._warm("start", "--idle-timeout", "600")
        assert started.returncode == 0, started.stdout + started.stderr
        from graphdist._detached.state import ProcessRef

        self.ref = ProcessRef.of(int(started.stdout.split("pid ")[1].split(",")[0]))
        self.seen = 0

    def served(self) -> int:
        """Runs the running agent has served (as last seen, once it has ended on its own: its
        idle timeout may end it between a look at its process and the question)."""
        status = self._warm("status")
        if status.returncode == 0:
            self.seen = int(status.stdout.split("served ")[1].split()[0])
        else:
            assert self.ref is not None and self._gone(), status.stdout + status.stderr
        return self.seen

    def _gone(self) -> bool:
        deadline = time.monotonic() + EVENTUALLY_S
        while self.ref is not None and self.ref.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.ref is None or not self.ref.alive()

    def stop(self) -> None:
        if self.ref is not None:
            if self.ref.alive():
                self.served()
                stopped = self._warm("stop")
                assert stopped.returncode == 0, stopped.stdout + stopped.stderr
            assert self._gone(), f"warm agent {self.ref.pid} survived"
            self.served_before += self.seen
            self.ref, self.seen = None, 0


@pytest.fixture(scope="session")
def _suite_agent(tmp_path_factory: pytest.TempPathFactory) -> Generator[SuiteAgent, None, None]:
    """:class:`SuiteAgent`, started on first use. At the end it is stopped and checked gone,
    and it must have served a run if a test used it (else every run started its own warm
    interpreter, silently, and the suite paid for it)."""
    agent = SuiteAgent(str(tmp_path_factory.mktemp("warm-agent")))
    try:
        yield agent
    finally:
        agent.stop()
    assert agent.served_before > 0 or not agent.used, (
        f"the suite's warm agent served none of the runs of {agent.used} test(s): "
        "their environment differs from its own at import (graphdist warm status)"
    )


@pytest.fixture
def warm_agent(
    _suite_agent: SuiteAgent, monkeypatch: pytest.MonkeyPatch
) -> Generator[SuiteAgent, None, None]:
    """This test's local runs use the worker's :class:`SuiteAgent` (with ``PYTHONUNBUFFERED=1``,
    as the fault injector sets it for its runs: read at import, it must agree)."""
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    monkeypatch.setenv(WARM_DIR, _suite_agent.folder)
    # Ray's ray.init sets PYTHONBREAKPOINT in its driver's environment, and leaves it there:
    # in-process Ray tests of this worker would make the agent's environment another's
    monkeypatch.delenv("PYTHONBREAKPOINT", raising=False)
    _suite_agent.ensure()
    _suite_agent.used += 1
    yield _suite_agent
    if _suite_agent.ref is not None and _suite_agent.ref.alive():
        _suite_agent.served()  # its count so far, kept if it is replaced or ends on its own
