"""graphdist's fork servers when something dies under a start: the fork server itself (a typed
error, then a fresh fork server) or the fleet's owner (nothing left running, no folders left)."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

import psutil
import pytest

from graphdist._proc.forkserver import PRELOAD
from graphdist._proc.forkserver_exit import FOLDER_ENV, OWNER_ENV
from tests.conftest import EVENTUALLY_S, QUIET_TF, REPO, processes_marked, run_python, wait_gone

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

# Runs in a subprocess: killing a fork server kills every server it forked, and the test
# process's own fleets must not be among them.
KILL_FORK_SERVER = textwrap.dedent(
    """
    import os, signal, threading, time
    import psutil
    import graphdist
    from graphdist._proc import forkserver

    killed = []

    def kill_when_spawned():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for server in list(forkserver._servers.values()):
                pid = server._forkserver_pid
                if pid:
                    os.kill(pid, signal.SIGKILL)  # while it still imports TensorFlow
                    killed.append(pid)
                    return
            time.sleep(0.001)

    killer = threading.Thread(target=kill_when_spawned)
    killer.start()
    try:
        graphdist.LocalFleet("local=2").start()
    except graphdist.FleetStartError as exc:
        killer.join()
        assert type(exc) is graphdist.FleetStartError, repr(exc)
        # every request is sent before the first answer is read: the lost one may be either
        assert exc.task in ("local-0", "local-1"), exc.task
        assert "fork server" in str(exc) and "died" in str(exc), str(exc)
        assert str(killed[0]) in str(exc), str(exc)
    else:
        raise AssertionError("the start did not fail")
    left = [p for p in psutil.Process().children(recursive=True) if p.pid == killed[0]]
    assert not left or left[0].status() == psutil.STATUS_ZOMBIE, left
    with graphdist.LocalFleet("local=1") as fleet:
        (pid,) = fleet.pids
        assert psutil.Process(pid).ppid() != killed[0]
        assert fleet.state is graphdist.FleetState.RUNNING
    print("OK")
    """
)


def test_fork_server_killed_during_start_gives_a_fleet_start_error_then_a_fresh_one():
    result = run_python(["-c", KILL_FORK_SERVER], timeout=200)
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr


OWNER = textwrap.dedent(
    """
    import graphdist
    graphdist.LocalFleet("local=2", start_timeout_s=120).start()
    """
)


def _fork_server_of(owner: psutil.Process, timeout_s: float) -> psutil.Process:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for child in owner.children():
            try:
                if "forkserver" in " ".join(child.cmdline()):
                    return child
            except psutil.Error:
                continue
        time.sleep(0.01)
    raise AssertionError("the owner never started a fork server")


@pytest.fixture
def short_tmpdir():
    """A private temp folder (nobody else's folders are looked at) with a short path: a fork
    server's socket path must fit in 108 bytes, and pytest's tmp_path can be longer."""
    path = tempfile.mkdtemp(prefix="gd-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_owner_killed_during_start_leaves_no_process_and_no_folder(short_tmpdir):
    tmpdir = short_tmpdir
    env = {**os.environ, **QUIET_TF, "TMPDIR": tmpdir}
    proc = subprocess.Popen([sys.executable, "-c", OWNER], cwd=REPO, env=env)
    try:
        owner = psutil.Process(proc.pid)
        _fork_server_of(owner, EVENTUALLY_S)
        time.sleep(0.5)  # well inside the fork server's TensorFlow import
        started = [p.pid for p in owner.children(recursive=True)]
        assert started
        killed_at = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(EVENTUALLY_S)
        assert wait_gone(started, EVENTUALLY_S) == []
        print(
            f"owner SIGKILLed during a start: its processes gone in "
            f"{time.monotonic() - killed_at:.2f} s"
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(EVENTUALLY_S)

    left = sorted(os.listdir(tmpdir))
    assert glob.glob(os.path.join(tmpdir, f"graphdist-fleet-{proc.pid}-*")), left
    assert not glob.glob(os.path.join(tmpdir, "pymp-*")), left

    result = run_python(
        ["-c", "import graphdist\nwith graphdist.LocalFleet('local=1'): pass"],
        env={"TMPDIR": tmpdir},
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert not glob.glob(os.path.join(tmpdir, f"graphdist-*-{proc.pid}-*")), os.listdir(tmpdir)
    assert not glob.glob(os.path.join(tmpdir, "pymp-*")), os.listdir(tmpdir)


def test_the_owner_keeps_its_own_exit_status():
    """The fork server's quick-exit hook (os._exit(0)) belongs in fork servers only: an owner
    that imports the fork-server machinery and starts a fleet still exits with its own status."""
    code = (
        "import sys, graphdist\n"
        "import graphdist._proc.forkserver, graphdist._proc.server\n"
        "with graphdist.LocalFleet('local=1'):\n"
        "    pass\n"
        "sys.exit(3)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert result.returncode == 3, result.stderr


# A fork server whose TensorFlow import takes a minute: only the early watch (started by the
# first preload, before anything else) can end it when its owner dies; multiprocess's own exit
# path (the "alive" pipe, looked at once the preloads are done) is not even there.
SLOW_IMPORT = textwrap.dedent(
    """
    import time
    from graphdist._proc import forkserver_exit
    assert forkserver_exit.IN_FORK_SERVER
    print("importing", flush=True)
    time.sleep(60)
    print("imported", flush=True)
    """
)
EARLY_EXIT_S = 10.0  # the early watch: ~0.05 s; without it: the import's 60 s


@pytest.mark.timeout(60)
def test_the_early_watch_ends_a_fork_server_still_importing_and_removes_its_folder(tmp_path):
    assert PRELOAD[0] == "graphdist._proc.forkserver_exit"  # before TensorFlow's import
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    folder = tmp_path / f"graphdist-forkserver-{owner.pid}-x"
    folder.mkdir()
    (folder / "listener-x").touch()
    env = {**os.environ, OWNER_ENV: str(owner.pid), FOLDER_ENV: str(folder)}
    server = subprocess.Popen(
        [sys.executable, "-c", SLOW_IMPORT], env=env, cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None and server.stdout.readline() == "importing\n"
        owner.kill()
        owner.wait()
        killed = time.monotonic()
        server.wait(EARLY_EXIT_S)
        print(f"\nfork server still importing: gone {time.monotonic() - killed:.2f} s after")
        assert (server.returncode, server.stdout.read()) == (0, "")  # the import never ended
        assert not folder.exists()
    finally:
        for proc in (owner, server):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert wait_gone([owner.pid, server.pid], EVENTUALLY_S) == []


# The chief of a ps run: says it runs, then waits to be stopped.
CHIEF = "import sys, time; open(sys.argv[1], 'w').close(); time.sleep(120)"


@pytest.mark.timeout(120)
def test_a_run_launcher_killed_by_sigterm_leaves_no_fork_server_folder(short_tmpdir):
    # The launcher stops its tasks and dies of the signal (no exit hook runs): its fork server,
    # which exits after it, removes the socket folder the launcher could not.
    mark = f"forkserver-folder-{uuid.uuid4().hex}"
    running = os.path.join(short_tmpdir, "chief-running")
    argv = ["run", "--chief", "--ps", "1", "--workers", "1", "--", sys.executable, "-c", CHIEF]
    env = {**os.environ, **QUIET_TF, "TMPDIR": short_tmpdir, "GRAPHDIST_TEST_MARK": mark}
    errors = os.path.join(short_tmpdir, "launcher.err")
    with open(errors, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "graphdist", *argv, running],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )

    def said() -> str:
        with open(errors) as f:
            return f.read()[-2000:]

    pattern = os.path.join(short_tmpdir, f"graphdist-forkserver-{proc.pid}-*")
    try:
        deadline = time.monotonic() + EVENTUALLY_S * 2
        while not os.path.exists(running):
            assert proc.poll() is None, said()
            assert time.monotonic() < deadline, "the chief never ran"
            time.sleep(0.05)
        assert glob.glob(pattern), os.listdir(short_tmpdir)
        started = processes_marked(mark)
        assert proc.pid in started and len(started) >= 4, started  # launcher, fork server, ...
        proc.send_signal(signal.SIGTERM)
        proc.wait(EVENTUALLY_S)
        assert proc.returncode == -signal.SIGTERM, said()
        assert wait_gone(started, EVENTUALLY_S) == []
        assert processes_marked(mark) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pid in processes_marked(mark):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert not glob.glob(pattern), os.listdir(short_tmpdir)


# A Ctrl-C to the owner's process group reaches the fork server too: one sent the moment it is
# spawned (while its interpreter and TensorFlow are still starting) must not kill it, and the
# owner's own SIGINT handling is untouched (its mask is given back).
SIGINT_WHILE_STARTING = textwrap.dedent(
    """
    import os, signal, threading, time
    import graphdist
    from graphdist._proc import forkserver

    sent = []

    def interrupt_when_spawned():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for server in list(forkserver._servers.values()):
                pid = server._forkserver_pid
                if pid:
                    for _ in range(5):  # at once, and on through its start
                        os.kill(pid, signal.SIGINT)
                        sent.append(pid)
                        time.sleep(0.2)
                    return
            time.sleep(0.0005)

    sender = threading.Thread(target=interrupt_when_spawned)
    sender.start()
    with graphdist.LocalFleet("local=2") as fleet:
        sender.join()
        assert sent and fleet.state is graphdist.FleetState.RUNNING
        with open(f"/proc/{sent[0]}/status") as f:
            status = dict(line.split(":\\t", 1) for line in f.read().splitlines())
        assert int(status["SigIgn"], 16) & (1 << (signal.SIGINT - 1)), status["SigIgn"]
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())
    print("OK")
    """
)


def test_a_sigint_while_the_fork_server_starts_does_not_kill_it():
    proc = run_python(["-c", SIGINT_WHILE_STARTING], timeout=180)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


# Runs in a subprocess (its first fleet spawns its fork server): a subprocess started while the
# fork server starts, as another thread of a user's program may, sees the owner's environment.
ENV_WHILE_STARTING = textwrap.dedent(
    """
    import json, os, subprocess, sys
    from multiprocess import resource_tracker
    import graphdist
    from graphdist._proc import forkserver
    from graphdist._proc.forkserver_exit import FOLDER_ENV, LOG_ENV, OWNER_ENV

    NAMES = ("LD_PRELOAD", OWNER_ENV, FOLDER_ENV, LOG_ENV)
    PRINT = "import json, os, sys; print(json.dumps([os.environ.get(n) for n in sys.argv[1:]]))"
    real, seen = resource_tracker.ensure_running, []

    def ensure_running():  # called by the fork server's start, before its spawn
        seen.append(json.loads(subprocess.check_output([sys.executable, "-c", PRINT, *NAMES])))
        seen.append([os.environ.get(name) for name in NAMES])
        return real()

    before = [os.environ.get(name) for name in NAMES]
    resource_tracker.ensure_running = ensure_running
    with graphdist.LocalFleet("local=1") as fleet:
        [server] = forkserver._servers.values()
        with open(f"/proc/{server._forkserver_pid}/environ", "rb") as f:
            environ = dict(e.split(b"=", 1) for e in f.read().split(b"\\0") if b"=" in e)
        given = {n: environ.get(n.encode(), b"").decode() for n in NAMES}
    print(json.dumps({"seen": seen, "before": before, "given": given, "owner": os.getpid()}))
    """
)


def test_a_subprocess_started_while_the_fork_server_starts_gets_the_owners_environment():
    """The fork server's LD_PRELOAD (the bind shim) and owner variables go to it alone: red if
    they were set in os.environ for its start, where a subprocess that another thread starts
    at that moment inherits them (its servers bound by the shim, itself taken for a fork
    server's child that exits with us)."""
    proc = run_python(["-c", ENV_WHILE_STARTING], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["seen"] and all(seen == found["before"] for seen in found["seen"]), found
    given = found["given"]  # what the fork server itself was given
    assert "loopback-bind" in given["LD_PRELOAD"], given
    assert given[OWNER_ENV] == str(found["owner"]) and given[FOLDER_ENV], given
