"""`graphdist run` on a hostile afternoon (issue 30): a reader that goes away, a full disk, a
guard killed, a hundred restarts, a shared log folder another user can write to, long lines,
signals and deadlines during the back-off, and bad arguments. Every test checks that the processes
it started are gone."""

from __future__ import annotations

import errno
import gc
import io
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import uuid

import psutil
import pytest

import graphdist
from graphdist import _ports as ports
from graphdist._distribute import launcher
from graphdist._distribute.runlogs import RunLogs
from graphdist._proc import restarts
from tests.conftest import EVENTUALLY_S, REPO, processes_marked, signals_by_default, wait_gone

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
PY = sys.executable
NOBODY = 65534


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _cli(*args: str, env: dict[str, str] | None = None) -> list[str]:
    return [PY, "-m", "graphdist", *args]


# -- 1. output that can never block a task ---------------------------------------------------------

CHATTY = "import sys\nfor i in range(200000):\n    print('line', i, 'x' * 40)\nprint('done')\n"


@pytest.mark.timeout(90)
def test_a_reader_that_goes_away_does_not_hang_the_run(tmp_path):
    """`graphdist run ... | head -n 1`: 10 MB of output into a pipe nobody reads any more. The
    run must end by itself (the task's pipe keeps draining), say so once on stderr, keep the
    whole output in its log folder, and leave no process."""
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)
    mark = uuid.uuid4().hex
    logs = tmp_path / "logs"
    shell = (
        f"{PY} -m graphdist run --workers 1 --log-dir {logs} -- {PY} {script} 2>{tmp_path}/err "
        f"| head -n 1; echo status ${{PIPESTATUS[0]}} >&2"
    )
    started = time.monotonic()
    done = subprocess.run(
        ["bash", "-c", shell],
        capture_output=True,
        text=True,
        timeout=80,
        cwd=REPO,
        env={**os.environ, "GRAPHDIST_TEST_MARK": mark},
    )
    took = time.monotonic() - started
    assert done.stdout.startswith("[worker-0] line 0 ") and done.stdout.count("\n") == 1
    err = (tmp_path / "err").read_text()
    assert err.count("cannot write the run's output any more (Broken pipe)") == 1, err
    assert f"({logs / 'run-1'} keeps every line)" in err, err  # where the lines still are
    assert "Traceback" not in err
    assert "status 0" in done.stderr, (done.stderr, err, took)
    log = (logs / "run-1" / "attempt-1" / "worker-0.log").read_text()
    assert log.endswith("done\n") and log.count("\n") == 200001
    assert wait_gone(processes_marked(mark), EVENTUALLY_S) == []


class _FullDisk(io.TextIOBase):
    """A stream whose writes fail as on a full disk, after ``ok`` lines."""

    def __init__(self, ok: int) -> None:
        self.ok = ok
        self.lines: list[str] = []

    def write(self, text: str) -> int:
        if len(self.lines) >= self.ok:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.lines.append(text)
        return len(text)


def test_an_output_stream_that_fails_is_dropped_and_the_run_ends(tmp_path, capfd):
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)
    out = _FullDisk(ok=3)
    results = graphdist.run_command([PY, str(script)], workers=1, output=out, timeout_s=60)
    assert [r.exitcode for r in results] == [0]
    assert len(out.lines) == 3
    err = capfd.readouterr().err
    assert err.count("cannot write the run's output any more (No space left on device)") == 1
    assert "(pass --log-dir to keep every line)" in err, err  # no --log-dir: none kept
    assert wait_gone([r.pid for r in results], EVENTUALLY_S) == []


@pytest.mark.promise
@pytest.mark.timeout(90)
def test_a_full_log_disk_is_dropped_with_one_line_and_the_run_ends(tmp_path):
    """--log-dir on a real 1 MiB tmpfs (a mount namespace of the test's own): the log stops when
    the disk is full, the console says so once, and the run ends with the task's own status."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to mount a small tmpfs")
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)
    disk = tmp_path / "disk"
    disk.mkdir()
    shell = (
        f"mount -t tmpfs -o size=1m none {disk} && "
        f"{PY} -m graphdist run --workers 1 --log-dir {disk}/logs -- {PY} {script}"
    )
    mark = uuid.uuid4().hex
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", shell],
        capture_output=True,
        text=True,
        timeout=80,
        cwd=REPO,
        env={**os.environ, "GRAPHDIST_TEST_MARK": mark},
    )
    if "mount:" in done.stderr and "permission denied" in done.stderr.lower():
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("No space left on device; its output is no longer logged") == 1
    assert "[worker-0] done" in done.stdout.splitlines()
    assert "Traceback" not in done.stderr
    assert wait_gone(processes_marked(mark), EVENTUALLY_S) == []


# -- 8. long lines ---------------------------------------------------------------------------------

LONG = (
    "import sys\n"
    "for _ in range(MB * 16):\n"
    "    sys.stdout.write('x' * 65536)\n"
    "sys.stdout.write('\\nafter\\n'); sys.stdout.flush()\n"
    "sys.exit(CODE)\n"
)


def test_a_long_line_is_cut_in_memory_and_messages_but_kept_whole_in_the_log(tmp_path):
    script = tmp_path / "long.py"
    script.write_text(LONG.replace("MB", "1").replace("CODE", "4"))
    out = io.StringIO()
    with pytest.raises(graphdist.TaskExitError) as info:
        graphdist.run_command([PY, str(script)], workers=1, output=out, log_dir=tmp_path / "l")
    lines = out.getvalue().splitlines()
    cut = next(line for line in lines if line.startswith("[worker-0] xxx"))
    assert len(cut) < launcher.LINE_LIMIT + 200
    assert cut.endswith(
        f"[graphdist: line cut at {launcher.LINE_LIMIT} bytes; {16 * 65536 - launcher.LINE_LIMIT}"
        " more not shown (whole in its log file)]"
    )
    assert "[worker-0] after" in lines
    assert len(str(info.value)) < 2000  # the message quotes at most MESSAGE_LINE_CHARS a line
    log = (tmp_path / "l" / "run-1" / "attempt-1" / "worker-0.log").read_bytes()
    assert log == b"x" * (16 * 65536) + b"\nafter\n"


# The launcher's own high-water mark, read by itself as it ends (VmHWM: its memory since its exec;
# wait4's ru_maxrss would count the forking test process's memory too, which exec keeps).
PEAK = (
    "import sys\n"
    "from graphdist._cli.main import main\n"
    "code = main(sys.argv[1:])\n"
    "hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
    "print('PEAK_KB', hwm.split()[1], file=sys.stderr)\n"
    "sys.exit(code)\n"
)


@pytest.mark.timeout(120)
def test_a_100_mb_line_does_not_grow_the_launcher(tmp_path):
    """The red-team's case: 100 MB without a newline made the launcher grow to 542 MB. The
    launcher's own peak memory stays far below the line's size."""
    script = tmp_path / "long.py"
    script.write_text(LONG.replace("MB", "100").replace("CODE", "0"))
    done = subprocess.run(
        [PY, "-c", PEAK, "run", "--workers", "1", "--", PY, str(script)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr
    peak_mb = int(done.stderr.split("PEAK_KB ")[1].split()[0]) / 1024
    assert peak_mb < 150, f"the launcher peaked at {peak_mb:.0f} MB"


# -- 2. nothing accumulates across attempts --------------------------------------------------------


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(240)
def test_a_hundred_restarts_leave_fds_ports_threads_and_children_flat(monkeypatch):
    monkeypatch.setattr(restarts, "BACKOFF", restarts.Backoff(min_s=0.0, max_s=0.0))
    failing = [PY, "-I", "-S", "-c", "raise SystemExit(3)"]
    with pytest.raises(graphdist.TaskExitError):  # a warm-up: the imports and lazy fds
        graphdist.run_command(
            failing, workers=2, max_restarts=1, output=io.StringIO(), min_uptime_s=0
        )
    gc.collect()  # what earlier tests left to the garbage collector closes now, not mid-count
    fds, threads, held = _fds(), threading.active_count(), dict(ports._held)
    children = _children()
    out = io.StringIO()
    with pytest.raises(graphdist.TaskExitError) as info:
        graphdist.run_command(
            failing,
            workers=2,
            max_restarts=100,
            restart_window_s=3600,
            output=out,
            min_uptime_s=0,  # no start-up rule: these attempts all fail at once
        )
    assert "gave up on the run after 100 restart(s)" in str(info.value)
    assert out.getvalue().count("restarting the run") == 100
    gc.collect()
    assert _fds() == fds, sorted(os.listdir("/proc/self/fd"))
    assert dict(ports._held) == held and not ports._claims
    deadline = time.monotonic() + 10
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.05)  # the last attempt's reader threads end with their pipes
    assert threading.active_count() == threads
    assert _children() <= children


# -- 3. a task never outlives its guard ------------------------------------------------------------

# Writes its pid and a setsid daemon's pid, then sleeps; the test kills its guard.
ESCAPER = (
    "import os, subprocess, sys, time\n"
    "d = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],"
    " start_new_session=True)\n"
    "path = os.path.join(sys.argv[1], 'pids')\n"
    "open(path + '.tmp', 'w').write(f'{os.getpid()} {d.pid}')\n"
    "os.replace(path + '.tmp', path)\n"
    "time.sleep(120)\n"
)


@pytest.mark.timeout(90)
def test_a_killed_guard_takes_its_task_and_the_task_s_daemon_at_once(tmp_path):
    script = tmp_path / "escaper.py"
    script.write_text(ESCAPER)
    killed: dict[str, float | int] = {}

    def kill_the_guard() -> None:
        path = tmp_path / "pids"
        while not path.exists():
            time.sleep(0.02)
        task, daemon = (int(x) for x in path.read_text().split())
        guard = psutil.Process(task).ppid()
        killed.update(task=task, daemon=daemon, guard=guard, at=time.monotonic())
        os.kill(guard, signal.SIGKILL)

    killer = threading.Thread(target=kill_the_guard, daemon=True)
    killer.start()
    with pytest.raises(graphdist.TaskExitError) as info:
        graphdist.run_command([PY, str(script), str(tmp_path)], workers=1, output=io.StringIO())
    ended = time.monotonic() - float(killed["at"])
    killer.join(5)
    assert info.value.failed.pid == killed["guard"] and info.value.failed.exitcode == -9
    # Gone when the run returns, not eventually: the command died with its guard (its
    # PR_SET_PDEATHSIG), the daemon by the task's mark. A run that waited for its reader thread
    # instead (the old way: 5 s joins) would take over 5 s.
    assert wait_gone([int(killed["task"]), int(killed["daemon"])], 0.5) == []
    assert ended < 2.5, f"the run ended {ended:.2f} s after its guard was killed"


# -- 4. log folders made like graphdist's state folders --------------------------------------------


def test_a_run_gets_a_private_folder_of_its_own_each_time(tmp_path):
    out = io.StringIO()
    for _ in range(2):
        graphdist.run_command([PY, "-c", "print('hi')"], workers=1, output=out, log_dir=tmp_path)
    for n in (1, 2):
        run = tmp_path / f"run-{n}"
        assert stat.S_IMODE(run.stat().st_mode) == 0o700
        assert stat.S_IMODE((run / "attempt-1").stat().st_mode) == 0o700
        log = run / "attempt-1" / "worker-0.log"
        assert stat.S_IMODE(log.stat().st_mode) == 0o600 and log.read_text() == "hi\n"
        assert "every task exited 0" in (run / "summary.txt").read_text()
        assert stat.S_IMODE((run / "summary.txt").stat().st_mode) == 0o600
    assert f"  logs: {tmp_path / 'run-2'}" in out.getvalue()


def _as_nobody(path: os.PathLike[str] | str) -> None:
    os.lchown(path, NOBODY, NOBODY)


@pytest.mark.promise
def test_links_planted_in_a_shared_folder_are_never_followed(tmp_path):
    """A sticky, world-writable folder (as /tmp): another user plants `run-1` and an
    `attempt-1/worker-0.log` link to a file of ours. The run writes into a folder it made itself
    and the target is untouched."""
    if os.geteuid() != 0:
        pytest.skip("needs root to plant files as another user")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    planted = shared / "run-1"
    planted.mkdir()
    (planted / "attempt-1").mkdir()
    (planted / "attempt-1" / "worker-0.log").symlink_to(victim)
    for p in (planted / "attempt-1" / "worker-0.log", planted / "attempt-1", planted):
        _as_nobody(p)
    (shared / "run-2").symlink_to(tmp_path)
    _as_nobody(shared / "run-2")
    graphdist.run_command(
        [PY, "-c", "print('mine')"], workers=1, output=io.StringIO(), log_dir=shared
    )
    assert victim.read_text() == "precious\n"
    # in a folder others write to, the run's own folder is graphdist-run-TIME-PID, never run-N
    (mine,) = shared.glob(f"graphdist-run-*-{os.getpid()}")
    assert mine.stat().st_uid == os.getuid() and not mine.is_symlink()
    assert sorted(p.name for p in shared.iterdir()) == sorted(["run-1", "run-2", mine.name])
    assert (mine / "attempt-1" / "worker-0.log").read_text() == "mine\n"


@pytest.mark.promise
def test_unsafe_log_folders_are_refused_before_anything_starts(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to make files of another user")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    _as_nobody(theirs)
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    _as_nobody(link)
    before = _children()
    for folder, why in [
        (theirs, f"it belongs to uid {NOBODY}, not to you"),
        (open_to_all, "others can write to it (mode 0777, no sticky bit)"),
        (link, f"it is a symbolic link made by uid {NOBODY}"),
    ]:
        with pytest.raises(graphdist.ArgumentError, match="Cannot keep logs in") as info:
            graphdist.run_command([PY, "-c", "1"], workers=1, log_dir=folder)
        assert why in str(info.value) and str(folder) in str(info.value)
        assert not any(name.startswith("run-") for name in os.listdir(folder))
    assert _children() == before


def test_odd_log_paths_are_answered_in_one_line_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a_file = tmp_path / "file"
    a_file.write_text("")
    before = _children()
    for log_dir, fragment in [
        ("", "log_dir must name a folder, not ''"),
        ("  ", "log_dir must name a folder, not '  '"),
        (5, "log_dir must be a path (a str or os.PathLike), not 5"),
        (b"bytes-logs", "log_dir must be a path (a str or os.PathLike), not b'bytes-logs'"),
        (a_file, f"Cannot keep logs in {a_file}: it is not a folder"),
        (a_file / "below", "Not a directory"),
    ]:
        with pytest.raises(graphdist.ArgumentError) as info:
            graphdist.run_command([PY, "-c", "1"], workers=1, log_dir=log_dir)
        assert fragment in str(info.value) and "\n" not in str(info.value)
    assert os.listdir(tmp_path) == ["file"]  # b"bytes-logs" made nothing either
    assert _children() == before


def test_a_folder_named_like_the_run_s_is_stepped_over(tmp_path):
    (tmp_path / "run-1").write_text("a file, not a folder")
    logs = RunLogs(tmp_path)
    assert logs.path == str(tmp_path / "run-2")
    assert RunLogs(tmp_path).path == str(tmp_path / "run-3")


# -- 6. a summary on every ending; the deadline holds during the back-off --------------------------


def test_the_deadline_holds_during_the_back_off_and_the_summary_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(restarts, "BACKOFF", restarts.Backoff(min_s=30.0, max_s=30.0, first_s=30.0))
    out = io.StringIO()
    started = time.monotonic()
    with pytest.raises(graphdist.LaunchTimeoutError) as info:
        graphdist.run_command(
            [PY, "-c", "raise SystemExit(3)"],
            workers=1,
            max_restarts=3,
            timeout_s=2,
            output=out,
            log_dir=tmp_path,
            min_uptime_s=0,
            preload="none",  # the subject is the back-off, not a warm interpreter's import
        )
    took = time.monotonic() - started
    # the fallback (the back-off runs out first) takes 30 s
    assert took < 10, f"the 2 s deadline fired after {took:.1f} s"
    assert "it was waiting 30 s to restart the run after attempt 1 failed" in str(info.value)
    summary = (tmp_path / "run-1" / "summary.txt").read_text()
    assert "1 attempt(s)" in summary and "timed out after 2 s" in summary
    assert "attempt 1: worker-0 exited with code 3" in summary
    assert "graphdist: run summary: 1 attempt(s)" in out.getvalue()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_run_stopped_by_a_signal_writes_its_summary(tmp_path, sig):
    mark = uuid.uuid4().hex
    proc = subprocess.Popen(
        _cli(
            "run",
            "--workers",
            "1",
            "--log-dir",
            str(tmp_path),
            "--",
            PY,
            "-c",
            "import time; print('up', flush=True); time.sleep(60)",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "GRAPHDIST_TEST_MARK": mark},
        preexec_fn=signals_by_default,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "[worker-0] up\n"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    name = signal.Signals(sig).name
    assert proc.returncode == (130 if sig == signal.SIGINT else -sig), err
    assert "graphdist: run summary: 1 attempt(s)" in out and f"stopped by {name}" in out
    assert f"stopped by {name}" in (tmp_path / "run-1" / "summary.txt").read_text()
    assert "Traceback" not in err
    assert wait_gone(processes_marked(mark), EVENTUALLY_S) == []


# -- 7. bad input: a typed error naming the value, before anything starts --------------------------


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (
            {"command": "true"},
            "command must be a list of arguments such as ['python', 'train.py'], not 'true'",
        ),
        ({"command": [1]}, "Every argument of command must be a str without NUL bytes, not 1"),
        ({"command": ["tr\0ue"]}, "not 'tr\\x00ue'"),
        ({"env": {"A": 1}}, "env['A'] must be a str without NUL (an environment value), not 1"),
        (
            {"env": "x"},
            "env must be a mapping of variable names to str values, e.g. "
            "{'TF_CPP_MIN_LOG_LEVEL': '2'}, not 'x'",
        ),
        (
            {"env": {"A=B": "1"}},
            "env must have variable names (non-empty str without '=' or NUL) as keys, not 'A=B'",
        ),
        ({"output": 5}, "output must be a text stream (with write), not 5"),
        ({"expose": "no"}, "expose must be True or False, not 'no'"),
        ({"expose": "false"}, "expose must be True or False, not 'false'"),
        ({"chief": "yes"}, "chief must be True or False, not 'yes'"),
        ({"max_restarts": 1.5}, "max_restarts must be a whole number >= 0, not 1.5"),
    ],
)
def test_bad_arguments_are_typed_errors_before_anything_starts(kwargs, fragment):
    before = _children()
    kwargs = {"command": ["true"], "workers": 1, **kwargs}
    with pytest.raises(graphdist.ArgumentError) as info:
        graphdist.run_command(**kwargs)
    assert fragment in str(info.value)
    assert _children() == before


def test_run_function_refuses_what_it_cannot_run_before_anything_starts():
    before = _children()
    with pytest.raises(
        graphdist.ArgumentError, match="fn must be a callable to run in each task, not 5"
    ):
        graphdist.run_function(5, workers=1)
    with pytest.raises(graphdist.ArgumentError, match="env must be a mapping"):
        graphdist.run_function(print, workers=1, env="x")
    assert _children() == before


def _ends_its_process() -> None:
    os._exit(0)


def test_run_function_whose_task_hands_back_nothing_says_so():
    with pytest.raises(graphdist.LaunchError) as info:
        graphdist.run_function(_ends_its_process, workers=1, output=io.StringIO())
    assert "Task worker-0 exited with code 0 without handing back the result of" in str(info.value)
    assert "os._exit" in str(info.value)
    assert wait_gone([r.pid for r in info.value.results], EVENTUALLY_S) == []


def test_the_cli_says_bad_log_dirs_in_one_line(tmp_path, run_cli):
    a_file = tmp_path / "f"
    a_file.write_text("")
    done = run_cli("run", "--workers", "1", "--log-dir", str(a_file), "--", "true")
    assert done.returncode == 2
    assert done.stderr == (
        f"Error: Cannot keep logs in {a_file}: it is not a folder; pass another --log-dir\n"
    )
    assert json.dumps(done.stdout) == '""'
