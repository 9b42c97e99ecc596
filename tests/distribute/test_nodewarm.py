"""The warm agent and its clients (graphdist/_distribute/nodewarm.py) on this machine, without
Slurm: what a Slurm run's warm tasks rely on, one process each as on a node. The end to end
runs are tests/slurm/test_slurm_run.py's (warm by default there)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from tests.conftest import QUIET_TF, wait_gone

COLD = ["sh", "-c", "echo ran cold; exit 4"]


@pytest.fixture
def agent() -> Iterator[tuple[subprocess.Popen[str], str]]:
    """An agent (NumPy preloaded) and its socket's path; stopped and checked gone after."""
    from graphdist._distribute.nodewarm import AGENT_CODE

    proc = subprocess.Popen(
        [sys.executable, "-c", AGENT_CODE, f"t{os.getpid()}", "numpy"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **QUIET_TF},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    tree = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    try:
        assert line.startswith("ready "), line
        yield proc, line.split(" ", 1)[1]
    finally:
        with contextlib.suppress(psutil.Error):  # gone already: a test stopped it
            tree += [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        proc.terminate()
        proc.wait(30)
        assert wait_gone(tree, 15) == []
        assert not os.path.exists(line.split(" ", 1)[-1])  # its socket removed


def _client(path: str, command: list[str], **kwargs: Any) -> subprocess.Popen[str]:
    from graphdist._distribute.nodewarm import CLIENT_CODE

    spec = json.dumps({"name": "worker-0", "command": command, "grace_s": 2})
    argv = [sys.executable, "-I", "-S", "-c", CLIENT_CODE, path, spec, "--", *COLD]
    kwargs["env"] = {**os.environ, **QUIET_TF, **kwargs.get("env", {})}  # as the agent's
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, **kwargs)


@pytest.mark.timeout(120)
def test_a_client_runs_its_task_warm_with_its_env_folder_and_exit_status(agent, tmp_path):
    _, path = agent
    code = (
        "import numpy, os, sys; print(os.environ['FOO'], os.getcwd(), __name__, flush=True); "
        "sys.exit(3)"
    )
    client = _client(path, [sys.executable, "-c", code], env={"FOO": "bar"}, cwd=str(tmp_path))
    out, _ = client.communicate(timeout=60)
    assert client.returncode == 3 and out.split() == ["bar", str(tmp_path), "__main__"], out


@pytest.mark.timeout(120)
def test_a_task_that_runs_cold_runs_in_the_clients_place(agent):
    """A command that is not graphdist's Python: the agent says so and the client executes
    the cold command itself (its exit status, its output)."""
    _, path = agent
    client = _client(path, ["sh", "-c", "echo not python"])
    out, _ = client.communicate(timeout=60)
    assert (client.returncode, out) == (4, "ran cold\n")


@pytest.mark.timeout(120)
def test_a_killed_client_takes_its_task_with_it_and_a_sigterm_reaches_the_task(agent):
    """The client SIGKILLed (its step cancelled): its guard and task are ended by the agent. A
    SIGTERM to the client reaches the task through its guard, and the client dies of it as the
    guard did (a cold guard dies of its command's signal too): a launcher reads it as Popen does
    a cold task's, "killed by SIGTERM"."""
    _, path = agent
    sleeper = [sys.executable, "-c", "import numpy, os, time; print(os.getpid(), flush=True); "
               "time.sleep(60)"]  # fmt: skip
    client = _client(path, sleeper)
    assert client.stdout is not None
    task = int(client.stdout.readline())
    client.kill()
    client.wait(10)
    assert wait_gone([task], 10) == []
    client = _client(path, sleeper)
    assert client.stdout is not None
    task = int(client.stdout.readline())
    client.terminate()
    assert client.wait(30) == -signal.SIGTERM
    assert wait_gone([task], 10) == []


@pytest.mark.timeout(120)
def test_a_sigterm_to_the_agent_waits_for_its_running_tasks(agent):
    """Slurm cancelling the job SIGTERMs every step: the agent takes no new task (a client
    that comes now runs cold at once) but lets the running ones end (they got the signal too,
    and save), then tells their clients how."""
    proc, path = agent
    code = (
        "import numpy, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1), sys.exit(42)))\n"
        "print('up', flush=True)\n"
        "time.sleep(60)\n"
    )
    client = _client(path, [sys.executable, "-c", code])
    assert client.stdout is not None and client.stdout.readline() == "up\n"
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    late = _client(path, [sys.executable, "-c", "import numpy"])  # refused: it runs cold
    assert late.communicate(timeout=10) == ("ran cold\n", None)
    assert late.returncode == 4
    client.send_signal(signal.SIGTERM)  # Slurm signals the client's step as well
    assert client.wait(30) == 42
    assert proc.wait(30) == 0


@pytest.mark.promise
@pytest.mark.timeout(120)
def test_another_user_is_never_served(agent, tmp_path):
    """The agent's socket is in the abstract namespace (no file mode keeps anyone out): a
    process of ``nobody`` that connects and asks for a task (which would run as this user) is
    closed at once, and the task never runs."""
    import shutil

    from tests.nobody import AS_NOBODY, AS_PLAIN_NOBODY, nobody_code

    if os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a process as nobody")
    _, path = agent
    marker = tmp_path / "ran-as-the-agents-user"
    command = [sys.executable, "-c", f"import numpy; open({str(marker)!r}, 'w')"]
    code = nobody_code(
        "import json, socket, sys\n",
        f"""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect("\\0" + {path[1:]!r})
        spec = {{"name": "x", "command": {command!r}, "grace_s": 1, "env": {{}}, "cwd": "/"}}
        try:
            socket.send_fds(sock, [json.dumps(spec).encode()], [0, 1, 2])
            print("answer", repr(sock.recv(4096)))
        except OSError as exc:
            print("refused", type(exc).__name__)
        """,
    )
    done = subprocess.run([*AS_NOBODY, sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    lines = done.stdout.splitlines()
    assert lines[:1] == [AS_PLAIN_NOBODY], done.stdout + done.stderr
    assert lines[1] in ("answer b''", "refused BrokenPipeError", "refused ConnectionResetError")
    time.sleep(1.0)
    assert not marker.exists()


@pytest.mark.timeout(120)
def test_a_task_holds_no_descriptor_of_the_session_beside_its_own_while_another_runs(agent):
    """A fresh interpreter's descriptors: 0, 1 and 2 only (its stdout is also its stderr).
    The session keeps each guard's report pipe, and the kernel's log, for the out-of-memory
    check: no guard takes those (its own, another's that still runs), nor the session's
    socket or wake-up pipe, into its task."""
    _, path = agent
    sleeper = [sys.executable, "-c", "import numpy, time; print('up', flush=True); time.sleep(60)"]
    first = _client(path, sleeper)
    assert first.stdout is not None and first.stdout.readline() == "up\n"
    fds = "import numpy, os; print(sorted(int(f) for f in os.listdir('/proc/self/fd')))"
    second = _client(path, [sys.executable, "-c", fds])
    out, _ = second.communicate(timeout=60)
    first.kill()
    first.wait(10)
    # the listing's own descriptor is the one above 2
    assert second.returncode == 0 and json.loads(out) == [0, 1, 2, 3], out
