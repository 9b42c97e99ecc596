"""Shared helpers. The fleets themselves come from graphdist's own pytest plugin
(``graphdist_fleet``, ``graphdist_fleet_factory``), loaded through its ``pytest11`` entry point."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Generator, Iterable
from typing import Any

import psutil
import pytest

# --dist loadgroup that ends after a crashed worker instead of hanging (xdist 3.8's #1323, #1327)
from tests import xdist_sched
from tests.xdist_sched import pytest_xdist_make_scheduler  # noqa: F401 - a hook

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


# -- order: the longest tests first ------------------------------------------------------------

# Tests that take 10 s or more in a full run on the 2-core machine (``--durations``), by node id
# prefix, with those seconds. xdist hands each of its two workers the next test when it is done,
# in collection order: started last, a 60 s test would leave one worker alone for its last
# minute; started first, the short tests fill in around it (longest first).
SLOW_TESTS_S = {
    "tests/test_bench.py::test_suite_smoke_run": 69,
    "tests/distribute/test_restarts.py::test_a_hung_worker_is_caught": 59,
    "tests/distribute/test_restarts.py::test_a_killed_worker_is_restarted": 47,
    "tests/distribute/test_frozen.py::test_a_worker_hung_in_native_code": 50,
    "tests/distribute/test_frozen.py::test_a_frozen_ps_task": 45,
    "tests/distribute/test_frozen.py::test_a_frozen_ps_worker_server": 40,
    "tests/distribute/test_heartbeat.py::test_a_silent_server": 10,
    "tests/fleet/test_long_lived.py::test_the_tutorial_cells_rerun": 45,
    "tests/fleet/test_fast_failure.py::test_a_healthy_40_s_step": 40,
    "tests/fleet/test_load.py::test_many_clients_and_threads": 40,
    "tests/fleet/test_ray.py::test_three_servers_on_three_nodes": 43,
    "tests/distribute/test_resume.py::test_custom_loop_resumes": 31,
    "tests/fleet/test_long_lived.py::test_dropping_a_session": 30,
    "tests/test_plugin.py::test_user_tests_inject_faults": 29,
    "tests/distribute/test_training.py::test_parameter_server_run_resumes": 27,
    "tests/fleet/test_ray.py::test_alive_comes_from_ray": 24,
    "tests/fleet/test_long_lived.py::test_churn": 23,
    "tests/test_examples.py::test_between_graph_replication": 22,
    "tests/test_bench_smoke.py::test_restart_measures": 21,
    "tests/test_bench_smoke.py::test_mwms_throughput": 20,
    "tests/fleet/test_ray_exposure.py::test_a_ray_node_on_a_network_address": 20,
    "tests/net/test_same_user.py::test_graphdist_run_task_serves": 18,
    "tests/net/test_same_user.py::test_detached_fleet_serves": 18,
    "tests/fleet/test_long_lived.py::test_restarts_while_the_watcher": 18,
    "tests/distribute/test_restarts.py::test_with_ps_tasks": 17,
    "tests/fleet/test_long_lived.py::test_make_callable_on_a_session": 17,
    "tests/test_notebook.py::test_the_tutorial_runs_twice": 17,
    "tests/net/test_loopback.py::test_a_broken_cached_shim": 17,
    "tests/fleet/test_fast_failure.py::test_a_ray_fleet_fails_fast": 17,
    "tests/distribute/test_resume.py::test_keras_3_is_refused": 16,
    "tests/distribute/test_resume.py::test_fit_backed_up_every_n_steps": 16,
    "tests/net/test_ports.py::test_eight_fleets_started_at_once": 16,
    "tests/net/test_same_user.py::test_graphdist_serve_serves": 21,
    "tests/fleet/test_long_lived.py::test_ctrl_c_to_the_process_group": 15,
    "tests/detached/test_detached_ray.py::test_up_detach_with_the_ray_backend": 15,
    "tests/test_examples.py::test_two_client_processes_share_a_variable": 14,
    "tests/fleet/test_ray_exposure.py::test_the_ray_graphdist_starts": 14,
    "tests/fleet/test_fleet.py::test_a_closed_fleet_and_its_sessions_still_referenced": 13,
    "tests/fleet/test_port_race.py::test_two_processes_started_at_once": 14,
    "tests/test_examples.py::test_seed_ports_work_when_free": 14,
    "tests/distribute/test_run_hostile.py::test_a_hundred_restarts": 13,
    "tests/fleet/test_long_lived.py::test_a_session_of_a_closed_fleet": 13,
    "tests/test_install.py::test_installed_wheel_runs_a_local_fleet": 13,
    "tests/net/test_same_user.py::test_local_fleet_serves": 18,
    "tests/fleet/test_long_lived.py::test_a_script_that_ends_with_its_fleet": 12,
    "tests/fleet/test_faults.py::test_detached_supervisor_restarts": 12,
    "tests/cli/test_cli.py::test_detached_fleet_up_status_down": 12,
    "tests/detached/test_detached_state.py::test_restarts_back_off": 11,
    "tests/fleet/test_ray.py::test_cli_up_with_the_ray_backend": 11,
    "tests/fleet/test_faults.py::test_frozen_worker_is_reported": 10,
    "tests/fleet/test_ray.py::test_unplaceable_fleet_fails": 14,
    "tests/net/test_hosts.py::test_an_exposed_fleet_lets_in": 31,
    "tests/net/test_hosts.py::test_members_run_the_split_graph": 24,
    "tests/net/test_hosts.py::test_an_allowed_host_runs": 15,
    "tests/net/test_ps_hosts.py": 25,
    "tests/net/test_hosts_guide.py": 14,
    "tests/net/test_ray_hosts.py::test_run_on_ray": 130,
    "tests/net/test_ray_hosts.py::test_a_ps_run_on_ray": 60,
    "tests/net/test_ray_hosts.py::test_a_two_node_ray_fleet": 40,
    "tests/net/test_deploy_hosts.py::test_the_slurm_script": 22,
    "tests/net/test_deploy_hosts.py::test_the_systemd_unit": 16,
    "tests/slurm/test_slurm_run.py::test_a_worker_killed_on_its_node_restarts": 100,
    "tests/slurm/test_slurm_run.py::test_a_frozen_worker": 45,
    "tests/slurm/test_slurm_run.py::test_a_lost_node": 30,
    "tests/slurm/test_slurm_run.py::test_a_ps_run_on_slurm": 36,
    "tests/slurm/test_slurm_fleet.py": 45,
    "tests/slurm/test_slurmbed.py::test_graphdist_serve_as_a_slurm_step": 60,
    "tests/slurm/test_slurmbed.py::test_a_killed_node_is_noticed": 23,
    "tests/slurm/test_slurmbed.py::test_the_warning_signal": 25,
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

    And ``xdist_group`` made to work again: ``--dist loadgroup`` sends the tests whose node id
    ends in ``@NAME`` to one worker, and xdist adds that suffix by setting ``item._nodeid``,
    which pytest 9 no longer reads (a node id now comes from ``item._id``): without this, the
    "seed_ports" tests ran on both workers at once."""
    if config.getoption("loadgroup", default=False):  # set on xdist workers only
        from _pytest.nodeid import NodeId

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
        self.pid: int | None = None
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
        if self.pid is not None:
            differs = env_differs(env, self.env)
            if differs is None and not is_gone(self.pid):
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
        self.pid = int(started.stdout.split("pid ")[1].split(",")[0])
        self.seen = 0

    def served(self) -> int:
        """Runs the running agent has served."""
        status = self._warm("status")
        assert status.returncode == 0, status.stdout + status.stderr
        self.seen = int(status.stdout.split("served ")[1].split()[0])
        return self.seen

    def stop(self) -> None:
        if self.pid is not None:
            if not is_gone(self.pid):
                self.served()
                stopped = self._warm("stop")
                assert stopped.returncode == 0, stopped.stdout + stopped.stderr
            assert wait_gone([self.pid], EVENTUALLY_S) == [], f"warm agent {self.pid} survived"
            self.served_before += self.seen
            self.pid, self.seen = None, 0


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
    if not is_gone(_suite_agent.pid or 0):
        _suite_agent.served()  # its count so far, kept if it is replaced or ends on its own
