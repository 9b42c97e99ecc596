"""Warm agents (``graphdist warm``, :mod:`graphdist._distribute.warmagent`): a warm interpreter
that outlives runs, from which a local run forks its tasks without importing anything. Agents
here preload NumPy only (what makes a task warm is the same; TensorFlow's import would only
cost the suite time), each in a folder of the test's own (``GRAPHDIST_WARM_DIR``); every agent a
test starts is stopped, and checked gone."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest

from graphdist._detached.state import ProcessRef
from graphdist._distribute.warmagent import WARM_DIR_ENV
from tests.conftest import EVENTUALLY_S, QUIET_TF, CliResult, is_gone, wait_gone
from tests.distribute.test_warm import SLEEPER, VIEW, _events, _launcher, _lines, _run, _started

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
PRELOAD = ["--preload", "numpy"]
TREE = (
    "import numpy, os, psutil\n"
    "guard = psutil.Process(os.getppid())\n"
    "print('TREE', guard.pid, guard.ppid(), psutil.Process(guard.ppid()).ppid(), flush=True)\n"
)


def _warm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "graphdist", "warm", *args],
        env={**os.environ, **QUIET_TF, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


class Agents:
    """A test's folder for its agents (``path``) and the agents recorded there (``note``)."""

    def __init__(self, path: Any) -> None:
        self.path = path
        self.started: list[psutil.Process] = []

    def records(self) -> list[dict[str, Any]]:
        if not os.path.isdir(self.path):
            return []
        names = [n for n in os.listdir(self.path) if n.startswith("warm-agent-")]
        return [json.loads((self.path / n).read_text()) for n in names if n.endswith(".json")]

    def note(self) -> None:
        for record in self.records():
            if ProcessRef(record["pid"], record["boot_s"]).alive():
                with contextlib.suppress(psutil.Error):
                    self.started.append(psutil.Process(record["pid"]))


@pytest.fixture
def warm_dir(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Agents]:
    """A folder of the test's own for its agents; any agent still recorded there at the end is
    stopped by its pid (only if it is the same process) and checked gone."""
    agents = Agents(tmp_path / "warm")
    monkeypatch.setenv(WARM_DIR_ENV, str(agents.path))
    yield agents
    agents.note()
    for proc in agents.started:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    assert wait_gone([p.pid for p in agents.started], EVENTUALLY_S) == []


def _start(agents: Agents, *args: str) -> int:
    result = _warm("start", *PRELOAD, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    agents.note()
    [record] = agents.records()
    assert f"pid {record['pid']}" in result.stdout, result.stdout
    return int(record["pid"])


def _follow(command: str, env: dict[str, str]) -> None:
    """Run a printed shell ``command`` as the user would, in a shell with ``env`` set (and the
    ``graphdist`` console script of this Python on its PATH); it must succeed."""
    shell_env = {**os.environ, **env}
    shell_env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + shell_env["PATH"]
    followed = subprocess.run(
        command, shell=True, env=shell_env, capture_output=True, text=True, timeout=120
    )
    assert followed.returncode == 0, followed.stdout + followed.stderr


def _tree(tmp_path: Any, env: dict[str, str] | None = None) -> tuple[int, int, int]:
    """(guard, its parent, that one's parent) of a one-task warm run's task."""
    (tmp_path / "tree.py").write_text(TREE)
    result = _run(
        ["--workers", "1", *PRELOAD, "--", sys.executable, "tree.py"], cwd=str(tmp_path), env=env
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    events = _events(result)
    assert _started(events)["worker-0"]["warm"] is True, events
    [line] = [ln for ln in _lines(events) if ln.startswith("TREE ")]
    guard, session, above = map(int, line.split()[1:])
    return guard, session, above


def _children(pid: int) -> list[int]:
    return [c.pid for c in psutil.Process(pid).children() if c.status() != psutil.STATUS_ZOMBIE]


def test_runs_fork_their_tasks_from_the_agent_which_ends_its_sessions_and_stops(
    warm_dir: Agents, tmp_path: Any
) -> None:
    """``warm start`` starts one agent (twice: the same one), ``status`` shows it; a run's
    task is forked by a session of the agent (guard - session - agent) and sees what a cold
    task sees; the session ends with the run; ``stop`` ends the agent and removes its record."""
    agent = _start(warm_dir, "--idle-timeout", "600")
    again = _warm("start", *PRELOAD)
    assert again.returncode == 0 and f"already running: pid {agent}" in again.stdout, again
    status = _warm("status", *PRELOAD)
    assert status.returncode == 0 and f"pid {agent}" in status.stdout, status
    assert "after 600 s idle" in status.stdout and "served 0 runs" in status.stdout, status

    guard, session, above = _tree(tmp_path)
    assert above == agent and session != agent, (guard, session, above)
    assert wait_gone([session, guard], EVENTUALLY_S) == []  # the session ended with the run
    assert _children(agent) == []
    served = _warm("status", *PRELOAD)  # how a user (or the suite's own agent) sees it is used
    assert served.returncode == 0 and "served 1 run," in served.stdout, served

    (tmp_path / "view.py").write_text(VIEW)
    (tmp_path / "helper.py").write_text("VALUE = 'beside'\n")
    views = {}
    for preload in ("none", "numpy"):
        argv = ["--workers", "2", "--preload", preload, "--", sys.executable, "view.py", "a b"]
        result = _run(argv, cwd=str(tmp_path), env={"FOO": "bar"}, ignore=(signal.SIGHUP,))
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        events = _events(result)
        assert {s["warm"] for s in _started(events).values()} == {preload == "numpy"}
        lines = _lines(events)
        [view] = [json.loads(ln[5:]) for ln in lines if ln.startswith("VIEW ")]
        assert "atexit ran" in lines, lines
        assert view.pop("ppid_is_guard") == _started(events)["worker-0"]["pid"]
        views[preload] = view
    cold, warm = views["none"], views["numpy"]
    assert warm == cold, {k: (cold[k], warm.get(k)) for k in cold if cold[k] != warm.get(k)}

    stopped = _warm("stop", *PRELOAD)
    assert stopped.returncode == 0 and f"pid {agent} stopped" in stopped.stdout, stopped
    assert is_gone(agent) and warm_dir.records() == []
    none = _warm("status", *PRELOAD)
    assert none.returncode == 2 and "no warm agent runs" in none.stdout, none


def test_a_sigkilled_launcher_ends_its_session_and_tasks_and_the_agent_serves_on(
    warm_dir: Agents, tmp_path: Any
) -> None:
    """The launcher SIGKILLed while its tasks run from the agent: the kernel closes its end of
    the session's socket, the session ends its guards and they their tasks; the agent stays
    and serves the next run."""
    agent = _start(warm_dir)
    args = ["--workers", "2", *PRELOAD, "--", sys.executable, "-c", SLEEPER]
    with _launcher(*args, cwd=tmp_path) as launcher:
        assert launcher.stdout is not None
        tasks: list[int] = []
        for line in launcher.stdout:
            event = json.loads(line)
            if event["event"] == "line" and event["text"].startswith("up "):
                tasks.append(int(event["text"].split()[1]))
            if len(tasks) == 2:
                break
        [session] = _children(agent)
        everything = [session, *(p.pid for p in psutil.Process(session).children(recursive=True))]
        assert set(tasks) <= set(everything) and len(everything) >= 5, everything
        launcher.kill()
        launcher.wait(30)
    assert wait_gone(everything, EVENTUALLY_S) == [], everything
    assert not is_gone(agent)
    assert _tree(tmp_path)[2] == agent


def test_the_fault_injector_kills_a_task_of_the_agent_and_sees_nothing_left(
    warm_dir: Agents, graphdist_faults: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The injector finds a run's tasks among its launcher's descendants; an agent's are not:
    it finds them from the guards the run said it started, kills worker-1 there, and its sweep
    sees them gone."""
    # the injector's runs get PYTHONUNBUFFERED=1: the agent's environment must agree
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    agent = _start(warm_dir)
    code = (
        "import numpy, os, psutil, sys, time\n"
        "print('agent', psutil.Process(psutil.Process(os.getppid()).ppid()).ppid(), flush=True)\n"
        "if os.environ['GRAPHDIST_RESTART'] == '1': sys.exit(0)\n"
        "for i in range(600):\n"
        "    print('tick', i, flush=True); time.sleep(0.05)\n"
    )
    kill = graphdist_faults.kill("worker-1", after=r"^tick 3$", of="worker-0")
    out = graphdist_faults.run(
        [sys.executable, "-c", code],
        max_restarts=1,
        faults=[kill],
        launcher_args=PRELOAD,
        env=QUIET_TF,
    )
    assert out.returncode == 0 and out.attempts == 2, out.describe()
    said = [o.text for o in out.output if o.task and o.text.startswith("agent ")]
    assert said == [f"agent {agent}"] * 4, said  # every task of both attempts: the agent's
    [killed] = out.injected
    assert killed.confirmed, out.describe()
    assert out.leftovers == [] and wait_gone(out.pids, EVENTUALLY_S) == []
    assert _children(agent) == []  # the sessions ended with the run


def test_without_a_usable_agent_a_run_starts_its_own_warm_interpreter(
    warm_dir: Agents, tmp_path: Any
) -> None:
    """An agent whose environment at import differs from the run's is not used, nor one
    SIGKILLed (its record is stale: removed); the run's tasks come from its own zygote."""
    agent = _start(warm_dir)
    _, zygote, launcher = _tree(tmp_path, env={"TF_CPP_MIN_LOG_LEVEL": "3"})  # the agent: 2
    assert agent not in (zygote, launcher) and psutil.Process(agent).children() == []
    os.kill(agent, signal.SIGKILL)
    assert wait_gone([agent], EVENTUALLY_S) == []
    _, zygote, launcher = _tree(tmp_path)
    assert agent not in (zygote, launcher)
    assert warm_dir.records() == []  # the stale record is gone


def test_an_agent_passed_over_is_said_once_with_a_command_that_starts_one_that_serves(
    warm_dir: Agents, tmp_path: Any
) -> None:
    """A run whose environment at import differs from the agent's says so in one line (not one
    per task), naming the variable, both values and a command; that command, copied into the
    shell the agent was started from, replaces the agent by one the same run then uses."""
    agent = _start(warm_dir)  # TF_CPP_MIN_LOG_LEVEL=2 (QUIET_TF)
    (tmp_path / "tree.py").write_text(TREE)
    argv = ["--workers", "2", *PRELOAD, "--", sys.executable, "tree.py"]
    run_env = {"TF_CPP_MIN_LOG_LEVEL": "3"}
    first = _run(argv, cwd=str(tmp_path), env=run_env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    said = [ln for ln in first.stderr.splitlines() if "warm agent" in ln]
    assert len(said) == 1, first.stderr
    assert f"the warm agent (pid {agent}) is not used by this run" in said[0], said
    assert "TF_CPP_MIN_LOG_LEVEL is 3 here, 2 in the agent" in said[0], said
    command = said[0].split("`")[1]
    assert command == (
        "graphdist warm stop --preload numpy && "
        "TF_CPP_MIN_LOG_LEVEL=3 graphdist warm start --preload numpy"
    )
    _follow(command, QUIET_TF)  # in the shell the agent was started from: level 2
    warm_dir.note()
    assert wait_gone([agent], EVENTUALLY_S) == []
    [record] = warm_dir.records()
    assert record["env"]["TF_CPP_MIN_LOG_LEVEL"] == "3"
    again = _run(argv, cwd=str(tmp_path), env=run_env)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "warm agent" not in again.stderr, again.stderr
    [line] = [ln for ln in _lines(_events(again)) if ln.startswith("TREE ")][:1]
    assert int(line.split()[3]) == record["pid"]  # forked by a session of the new agent


def test_warm_start_from_another_environment_says_what_differs_and_the_command(
    warm_dir: Agents,
) -> None:
    """Issue 57: ``warm start`` from a shell whose environment at import differs from the
    running agent's says so in its one line, with the command that starts an agent for runs
    from that shell; followed there, the next ``warm start`` finds a matching agent."""
    agent = _start(warm_dir)  # TF_CPP_MIN_LOG_LEVEL=2 (QUIET_TF)
    other = _warm("start", *PRELOAD, env={"TF_CPP_MIN_LOG_LEVEL": "3"})
    assert other.returncode == 0 and other.stderr == "", other.stdout + other.stderr
    [line] = other.stdout.splitlines()
    assert line.startswith(f"graphdist: warm agent already running: pid {agent}, "), line
    assert "runs from this shell pass it over: TF_CPP_MIN_LOG_LEVEL is 3 here, 2 in the" in line
    command = line.split("`")[1]
    _follow(command, {**QUIET_TF, "TF_CPP_MIN_LOG_LEVEL": "3"})  # in the other shell
    warm_dir.note()
    assert wait_gone([agent], EVENTUALLY_S) == []
    same = _warm("start", *PRELOAD, env={"TF_CPP_MIN_LOG_LEVEL": "3"})
    warm_dir.note()
    [record] = warm_dir.records()
    assert same.stdout == (
        f"graphdist: warm agent already running: pid {record['pid']}, preloads numpy\n"
    ), same.stdout


def test_warm_stop_leaves_neither_the_agents_lock_nor_its_log(warm_dir: Agents) -> None:
    """``warm stop`` removes what the agent kept beside its record, for a running agent and
    for one that exited by itself (idle); a ``warm start`` after it works as the first did."""
    _start(warm_dir)
    assert sorted(n.split(".", 1)[1] for n in os.listdir(warm_dir.path)) == [
        "json",
        "json.lock",
        "log",
    ]
    assert _warm("stop", *PRELOAD).returncode == 0
    assert os.listdir(warm_dir.path) == []
    agent = _start(warm_dir, "--idle-timeout", "1")
    assert wait_gone([agent], EVENTUALLY_S) == []
    assert sorted(os.listdir(warm_dir.path)) != []  # the idle agent removed its record only
    stopped = _warm("stop", *PRELOAD)
    assert stopped.returncode == 0 and "no warm agent runs" in stopped.stdout, stopped
    assert os.listdir(warm_dir.path) == []


@pytest.mark.promise
def test_an_agent_in_another_cgroup_is_not_used(warm_dir: Agents, tmp_path: Any) -> None:
    """A task forked by an agent in another cgroup would escape the run's (a Slurm job's, a
    systemd scope's limits and accounting): such an agent is not used; back in the run's
    cgroup, it is."""
    from graphdist._faults.freezer import Freezer, freezer_root

    if freezer_root() is None:
        pytest.skip("moving a process to another cgroup needs a writable cgroup v2 hierarchy")
    agent = _start(warm_dir)
    other = Freezer()  # a cgroup of its own (never frozen here)
    try:
        assert other.add([agent]) == [agent]
        _, zygote, launcher = _tree(tmp_path)
        assert agent not in (zygote, launcher) and _children(agent) == []
    finally:
        other.remove()  # the agent back in the hierarchy's root
    with open("/proc/self/cgroup") as mine, open(f"/proc/{agent}/cgroup") as its:
        home = mine.read() == its.read()
    if home:  # the tests run in the root cgroup (CI): there, the agent serves again
        assert _tree(tmp_path)[2] == agent


def test_an_idle_agent_exits_and_removes_its_record(warm_dir: Agents) -> None:
    agent = _start(warm_dir, "--idle-timeout", "1")
    assert wait_gone([agent], EVENTUALLY_S) == []
    assert warm_dir.records() == []


@pytest.mark.promise
def test_another_users_connection_is_closed_unread(warm_dir: Agents) -> None:
    """The agent's socket is in the abstract namespace, which any user can reach: a process of
    another user is closed before anything is read, and no session is forked for it."""
    if os.getuid() != 0:
        pytest.skip("connecting as another user needs root")
    agent = _start(warm_dir)
    [record] = warm_dir.records()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a child that becomes user nobody, connects and says what it got
        said = b"failed"
        try:
            os.setgid(65534)
            os.setuid(65534)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.connect("\0" + record["path"][1:])
            sock.send(b'{"ignored": []}')
            sock.settimeout(20)
            said = b"closed" if sock.recv(100) == b"" else b"answered"
        except (ConnectionResetError, BrokenPipeError):
            said = b"closed"  # closed with our hello unread, or before it was sent
        except BaseException as exc:
            said = repr(exc).encode()
        finally:
            os.write(write, said)
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as f:
        assert f.read() == b"closed"
    assert _children(agent) == []


def test_bad_input_is_one_line_and_starts_nothing(
    warm_dir: Agents, tmp_path: Any, run_cli: Callable[..., CliResult]
) -> None:
    for args, words in [
        (["start", "--preload", "no_such_module_xyz"], "no_such_module_xyz"),
        (["start", "--preload", "none"], "--preload none"),
        (["status", *PRELOAD, "--idle-timeout", "3"], "--idle-timeout goes with start only"),
        (["start", *PRELOAD, "--idle-timeout", "-1"], "--idle-timeout must be 0 or more"),
        (["start", *PRELOAD, "--idle-timeout", "nan"], "finite and at most"),  # never ending
        (["restart"], "invalid choice"),
    ]:
        result = run_cli("warm", *args)  # in this process: it must start nothing
        assert result.returncode == 2, (args, result)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 or "usage:" in result.stderr, (args, result.stderr)
        assert words in result.stderr and "Traceback" not in result.stderr, (args, result.stderr)
    assert warm_dir.records() == []
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    if os.getuid() == 0:
        os.chown(shared, 65534, 65534)  # another user's folder
    result = run_cli("warm", "start", *PRELOAD, env={WARM_DIR_ENV: str(shared)})
    assert result.returncode != 0 and "Error:" in result.stderr, result
    assert str(shared) in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert os.listdir(shared) == []
