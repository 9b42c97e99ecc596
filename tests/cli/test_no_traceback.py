"""No traceback from the CLI, ever (issue 39): every subcommand with its stdout closed, on a full
disk (/dev/full) and piped into ``head -1`` ends with at most one line on stderr and the status a
shell expects; ``serve`` refuses an address this host lacks before TensorFlow starts, and is
quiet until its ready line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Generator

import pytest

from graphdist._cli.main import EXIT_FAILURE, EXIT_PIPE, EXIT_USAGE
from graphdist._cli.parser import build_parser
from graphdist._ports import pick_free_ports, release_ports
from graphdist._tflog import TF_LOGS_ENV, is_tf_log
from tests.conftest import EVENTUALLY_S, REPO, is_gone, wait_gone

PY = sys.executable
NOT_HERE = "192.0.2.1"  # TEST-NET-1 (RFC 5737): documentation only, never a host's own
FULL = "Error: cannot write output: No space left on device"
CLOSED = "Error: cannot write output: Bad file descriptor"

# Each subcommand with arguments that make it quick: its real output where that is quick
# (status reads the fleet of the `fleet` fixture: STATE), a mistake where it would start servers.
STATE = "@STATE@"
REAL = "real"  # prints on stdout: a lost stdout is status 1 (closed, full) or 0/141 (head)
RUN = "run"  # a run's status is the run's: lost output is one line on stderr
MISTAKE = "mistake"  # one line "Error: ..." and exit 2, whatever stdout is
CASES: dict[str, tuple[list[str], str]] = {
    "up": (["up", "--cluster", "local=1", "--restart", "on-failure"], MISTAKE),
    "status": (["status", "--state-dir", STATE], REAL),
    "down": (["down", "--state-dir", "/nonexistent/graphdist-state"], MISTAKE),
    "logs": (["logs", "--state-dir", STATE], REAL),
    "restart": (["restart", "local-9", "--state-dir", STATE], MISTAKE),
    "run": (["run", "--workers", "1", "--", PY, "-c", "print('hello')"], RUN),
    "serve": (
        [
            "serve",
            "--cluster",
            json.dumps({"w": [f"{NOT_HERE}:2222"]}),
            "--job",
            "w",
            "--task",
            "0",
        ],
        MISTAKE,
    ),
    "tf-config": (
        ["tf-config", "--cluster", '{"worker": ["h1:2222", "h2:2222"]}', "--task", "worker:1"],
        REAL,
    ),
    "demo": (["demo", "--master", "5"], MISTAKE),
    "certs": (["certs", "--cluster", "worker=2", "--out", "/nonexistent/graphdist-certs"], MISTAKE),
    "warm": (["warm", "status", "--idle-timeout", "3"], MISTAKE),
    "report": (["report", "/nonexistent/graphdist-run"], MISTAKE),
    "--help": (["--help"], REAL),
    "--version": (["--version"], REAL),
}
MODES = ("closed", "full", "head")


def _env(**extra: str) -> dict[str, str]:
    # Python's default buffering (a user's shell), not this machine's PYTHONUNBUFFERED
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return {**env, **extra}


def _run(argv: list[str], mode: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``python -m graphdist ARGV`` with stdout closed, on /dev/full or piped into head -1."""
    command = [PY, "-m", "graphdist", *argv]
    if mode == "closed":
        shell = ["bash", "-c", 'exec "$@" >&-', "bash", *command]
    elif mode == "head":
        shell = ["bash", "-c", '"$@" | head -1 >/dev/null; exit "${PIPESTATUS[0]}"', "bash"]
        shell += command
    else:
        shell = ["bash", "-c", 'exec "$@" >/dev/full', "bash", *command]
    return subprocess.run(
        shell, stderr=subprocess.PIPE, text=True, timeout=90, cwd=REPO, env=env, check=False
    )


def _check_quiet(result: subprocess.CompletedProcess[str]) -> list[str]:
    assert "Traceback" not in result.stderr, result.stderr
    assert "Exception ignored" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) <= 1, result.stderr
    return lines


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Generator[str, None, None]:
    """A detached one-server fleet for `status`; stopped at the end by a `down` whose own stdout
    is /dev/full: the fleet is gone all the same, and it says once that its line was lost."""
    state = str(tmp_path_factory.mktemp("fleet") / "state")
    argv = ["up", "--cluster", "local=1", "--detach", "--json", "--state-dir", state]
    up = subprocess.run(
        [PY, "-m", "graphdist", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=_env(),
        check=False,
    )
    assert up.returncode == 0, up.stderr
    pids = [row["pid"] for row in json.loads(up.stdout)]
    supervisor = int(up.stderr.split("supervisor pid ")[1].split(",")[0])
    try:
        yield state
    finally:
        down = _run(["down", "--state-dir", state], "full", _env())
        assert down.returncode == EXIT_FAILURE and _check_quiet(down) == [FULL], down.stderr
        assert wait_gone([*pids, supervisor], EVENTUALLY_S) == []


def test_every_subcommand_has_a_case():
    """A new subcommand fails here until it has a quick case in CASES."""
    commands = set(build_parser().commands)
    assert commands == {c for c in CASES if not c.startswith("-")}


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_lost_stdout_is_at_most_one_line_and_the_status_a_shell_expects(case, fleet):
    argv, kind = CASES[case]
    argv = [fleet if a == STATE else a for a in argv]
    for mode in MODES:
        result = _run(argv, mode, _env())
        lines = _check_quiet(result)
        where = (case, mode, result.returncode, result.stderr)
        if kind == MISTAKE:
            assert result.returncode == EXIT_USAGE, where
            assert lines and lines[0].startswith("Error: "), where
        elif kind == RUN:
            assert result.returncode == 0, where
            if mode != "head":  # the lines lost are said; a reader gone away got its line
                assert lines and ("No space left" in lines[0] or "Bad file" in lines[0]), where
        elif mode == "head":
            # the reader may be gone before the last write or only after it, as for `yes`
            assert result.returncode in (0, EXIT_PIPE) and not lines, where
        else:
            assert result.returncode == EXIT_FAILURE, where
            assert lines == [FULL if mode == "full" else CLOSED], where


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv", [["--help"], CASES["tf-config"][0]])
def test_unbuffered_output_ends_the_same_way(argv):
    """With PYTHONUNBUFFERED=1 the write itself fails, in the middle of the command (argparse's
    --help ignored that error and exited 0); buffered, the last flush does."""
    for mode, status in (("full", EXIT_FAILURE), ("closed", EXIT_FAILURE), ("head", EXIT_PIPE)):
        result = _run(argv, mode, _env(PYTHONUNBUFFERED="1"))
        lines = _check_quiet(result)
        if mode == "head":
            assert result.returncode in (0, status) and not lines, result
        else:
            assert result.returncode == status and lines == [FULL if mode == "full" else CLOSED]


@pytest.mark.timeout(60)
def test_lost_stderr_changes_nothing():
    """A mistake's line cannot be said on a full stderr: the status is still the mistake's."""
    argv = [PY, "-m", "graphdist", *CASES["demo"][0]]
    with open("/dev/full", "w") as full:
        result = subprocess.run(argv, stdout=subprocess.PIPE, stderr=full, timeout=50, cwd=REPO)
    assert result.returncode == EXIT_USAGE and result.stdout == b""


def _host_has(ip: str) -> bool:
    with socket.socket() as s:
        try:
            s.bind((ip, 0))
        except OSError:
            return False
        return True


@pytest.mark.timeout(60)
def test_serve_refuses_an_address_this_host_lacks_before_tensorflow_starts():
    if _host_has(NOT_HERE):
        pytest.skip(f"this host has {NOT_HERE}")
    (argv, _) = CASES["serve"]
    # TensorFlow's log lines live: any TensorFlow start would show before the refusal
    result = subprocess.run(
        [PY, "-m", "graphdist", *argv],
        capture_output=True,
        text=True,
        timeout=50,
        cwd=REPO,
        env={**_env(**{TF_LOGS_ENV: "1"}), "TF_CPP_MIN_LOG_LEVEL": "0"},
        check=False,
    )
    assert result.returncode == EXIT_USAGE, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"Error: Task w-0 is at '{NOT_HERE}:2222', which is not an address")
    assert "--bind-all" in line and result.stdout == ""
    # the same refusal in one process, which then says whether it imported TensorFlow
    code = (
        "import sys\nfrom graphdist._cli.main import main\ncode = main(sys.argv[1:])\n"
        "print('tensorflow' in sys.modules)\nsys.exit(code)\n"
    )
    inproc = subprocess.run(
        [PY, "-c", code, *argv], capture_output=True, text=True, timeout=50, cwd=REPO, check=False
    )
    assert (inproc.returncode, inproc.stdout) == (EXIT_USAGE, "False\n"), inproc.stderr


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_serve_says_only_its_ready_line_then_stops_on_sigterm():
    """No TensorFlow line before serve's ready line (it printed ten), with nothing set to quiet
    TensorFlow; a loopback name still serves."""
    (port,) = pick_free_ports(1)
    release_ports([port])
    cluster = json.dumps({"w": [f"localhost:{port}"]})
    env = {k: v for k, v in _env().items() if k not in ("TF_CPP_MIN_LOG_LEVEL", TF_LOGS_ENV)}
    proc = subprocess.Popen(
        [PY, "-m", "graphdist", "serve", "--cluster", cluster, "--job", "w", "--task", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()
        assert "/job:w/task:0 ready at" in first, first + proc.stderr.read()
        assert not is_tf_log(first.rstrip("\n"))
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        assert proc.wait(60) == 0
        assert rest.splitlines() == ["graphdist serve: /job:w/task:0 stopping"], rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert is_gone(proc.pid)
