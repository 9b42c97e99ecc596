"""A detached fleet's state folder cannot race or rot: the lock, the marker, corrupt records,
leftovers, and the supervisor's restart policy (backoff, a window for --max-restarts)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime
from types import SimpleNamespace

import psutil
import pytest

from graphdist import Cluster, StateError
from graphdist._detached import supervisor as supervisor_module
from graphdist._detached.fleet import fleet_problem
from graphdist._detached.marked import marked_processes
from graphdist._detached.state import (
    LOCK_FILE,
    CorruptStateError,
    FleetRecord,
    ProcessRef,
    TaskRecord,
    lock_state,
    read_state,
    write_state,
)
from graphdist._detached.supervisor import SupervisorSpec
from graphdist._private import private_dir
from graphdist._proc.restarts import BACKOFF, backoff_s
from tests.conftest import EVENTUALLY_S, QUIET_TF, REPO, processes_marked, read_json, wait_gone

SUPERVISOR = "graphdist._detached.supervisor"


# -- helpers ------------------------------------------------------------------------------------


@pytest.fixture
def mark():
    """A unique GRAPHDIST_TEST_MARK for the commands of one test; whatever carries it at the end
    is killed (the test itself asserts that nothing did)."""
    value = f"detached-state-{uuid.uuid4().hex}"
    yield value
    for pid in processes_marked(value):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def gd_env(mark: str) -> dict[str, str]:
    return {**os.environ, **QUIET_TF, "GRAPHDIST_TEST_MARK": mark}


def start_gd(mark: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "graphdist", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=gd_env(mark),
    )


def gd(mark: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "graphdist", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=gd_env(mark),
    )


def one_error_line(result: subprocess.CompletedProcess[str] | tuple[int, str], fragment: str):
    code, err = (result.returncode, result.stderr) if not isinstance(result, tuple) else result
    lines = err.strip().splitlines()
    assert "Traceback" not in err, err
    errors = [ln for ln in lines if ln.startswith("Error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    assert fragment in errors[0], err
    return code


def supervisors(pids: list[int]) -> list[int]:
    found = []
    for pid in pids:
        try:
            if SUPERVISOR in psutil.Process(pid).cmdline():
                found.append(pid)
        except psutil.Error:
            continue
    return found


def up_detached(mark: str, state_dir: str, *extra: str) -> list[int]:
    """`up --detach` a one-task fleet; return the pids of every process carrying the mark."""
    up = gd(mark, "up", "--cluster", "local=1", "--detach", "--state-dir", state_dir, *extra)
    assert up.returncode == 0, up.stderr
    pids = processes_marked(mark)
    assert len(supervisors(pids)) == 1 and len(pids) >= 3, pids  # + fork server, server
    return pids


def down_stops_everything(mark: str, state_dir: str, pids: list[int]) -> str:
    down = gd(mark, "down", "--state-dir", state_dir)
    assert down.returncode == 0, down.stderr
    assert "Traceback" not in down.stderr, down.stderr
    assert wait_gone(pids, EVENTUALLY_S) == []
    assert wait_gone(processes_marked(mark), EVENTUALLY_S) == []
    assert not os.path.exists(state_dir)
    return down.stdout + down.stderr


# -- records, the lock and the backoff: no servers ---------------------------------------------


def good_record() -> FleetRecord:
    return FleetRecord(
        supervisor=ProcessRef.of(os.getpid()),
        cluster={"local": ["localhost:2020"]},
        tasks=[TaskRecord("local", 0, "localhost:2020", os.getpid(), 0.0, "/x.log")],
        restart_policy="on-failure",
        max_restarts=3,
    )


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\x00\xff garbage",
        b'{"supervisor": {"pid": 1, "starte',
        b'{"supervisor": "x"}',
        b"[1, 2]",
        b"\xff\xfe{}",
        b'{"supervisor": {"pid": "12", "started": 1.0}, "cluster": {}, "tasks": []}',
        b'{"supervisor": {"pid": 12, "started": 1.0}, "cluster": {}, "tasks": [{"job": 1}]}',
        b'{"supervisor": {"pid": 12, "started": 1.0}, "cluster": [], "tasks": []}',
        b'{"supervisor": {"pid": 12, "started": 1.0}, "cluster": {}, "tasks": {}}',
    ],
)
def test_an_unreadable_record_is_corrupt_state_never_a_raw_error(tmp_path, content):
    state_dir = private_dir(str(tmp_path / "state"))
    (tmp_path / "state" / "fleet.json").write_bytes(content)
    with pytest.raises(CorruptStateError, match="is corrupt") as info:
        read_state(state_dir)
    assert isinstance(info.value, StateError) and info.value.reason
    assert "\n" not in str(info.value)


def test_a_record_round_trips_with_its_restart_policy(tmp_path):
    state_dir = private_dir(str(tmp_path / "state"))
    record = good_record()
    write_state(state_dir, record)
    assert read_state(state_dir) == record
    # A record written before the policy fields existed still reads, with their defaults.
    data = json.loads(record.to_json())
    for key in ("max_restarts", "restart_window_s"):
        del data[key]
    for key in ("gave_up", "restart_at"):
        del data["tasks"][0][key]
    (tmp_path / "state" / "fleet.json").write_text(json.dumps(data))
    old = read_state(state_dir)
    assert old is not None and not old.tasks[0].gave_up and old.restart_window_s == 60.0


def test_status_of_a_corrupt_record_is_one_line_exit_2(tmp_path):
    state_dir = private_dir(str(tmp_path / "state"))
    (tmp_path / "state" / "fleet.json").write_bytes(b"\xff\xfe not json")
    result = gd("unused", "status", "--state-dir", state_dir, timeout=60)
    assert one_error_line(result, "is corrupt") == 2
    # the cure it names is the one for this folder, not the default one (issue 57)
    assert f"`graphdist down --state-dir {state_dir}` stops the fleet's processes" in result.stderr


def dead_process_ref() -> ProcessRef:
    """The pid and start time of a process this test started and reaped: gone for good."""
    proc = subprocess.Popen(["sleep", "60"])
    ref = ProcessRef.of(proc.pid)
    proc.kill()
    proc.wait()
    return ref


def test_a_live_process_stays_itself_when_the_wall_clock_moves(monkeypatch):
    """A process is known by its pid and its start counted from boot: a step or slew of the
    wall clock, which moves psutil's boot time (and so its ``create_time``) by a second, does
    not make a live process look gone (red with ``create_time``: a CI run's two warm agents
    were so taken for gone) nor a reused pid look alive."""
    import psutil

    with subprocess.Popen(["sleep", "60"]) as proc:
        try:
            ref = ProcessRef.of(proc.pid)
            booted, created = psutil.boot_time(), psutil.Process(proc.pid).create_time()
            for step in (1.0, -1.0):
                monkeypatch.setattr(psutil._psplatform, "boot_time", lambda s=step: booted + s)
                assert psutil.Process(proc.pid).create_time() == pytest.approx(created + step)
                assert ref.alive(), f"the wall clock moved by {step:+.0f} s"
            assert not ProcessRef(proc.pid, ref.started - 0.01).alive()  # another process
        finally:
            proc.kill()
    assert not ref.alive()  # gone (reaped by the with)


def test_a_stale_record_is_cleaned_up_and_said_so_only_where_it_was(tmp_path):
    """``status`` of a fleet whose supervisor is gone cleans the folder and says so; while
    another command holds the folder's lock, it says that instead and leaves the folder."""
    from graphdist._detached.fleet import live_record

    state_dir = private_dir(str(tmp_path / "state"))
    stale = FleetRecord(**{**good_record().__dict__, "supervisor": dead_process_ref()})
    write_state(state_dir, stale)
    with lock_state(state_dir), pytest.raises(StateError) as held:
        live_record(state_dir, cleanup=False)
    assert "another graphdist command holds its folder, so it was left as it is" in str(held.value)
    assert read_state(state_dir) == stale
    with pytest.raises(StateError) as cleaned:
        live_record(state_dir, cleanup=False)
    assert str(cleaned.value).endswith("its state was cleaned up"), str(cleaned.value)
    assert not os.path.exists(state_dir)


@pytest.mark.timeout(60)
def test_down_on_stale_state_says_so_in_one_line_and_removes_it(tmp_path, mark):
    """A record whose supervisor and server are both gone (a reboot, a SIGKILL of the group):
    `down` exits 0, says it cleaned up a stale fleet, and leaves no state folder."""
    state_dir = private_dir(str(tmp_path / "state"))
    supervisor, server = dead_process_ref(), dead_process_ref()
    record = FleetRecord(
        supervisor=supervisor,
        cluster={"local": ["localhost:2020"]},
        tasks=[TaskRecord("local", 0, "localhost:2020", server.pid, server.started, "/x.log")],
    )
    write_state(state_dir, record)
    result = gd(mark, "down", "--state-dir", state_dir, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"graphdist: cleaned up a stale fleet; removed {state_dir}"
    ], result.stdout
    assert "Traceback" not in result.stderr and "Error" not in result.stderr, result.stderr
    assert not os.path.exists(state_dir)
    assert processes_marked(mark) == []


def test_the_lock_refuses_at_once_or_waits_and_survives_the_folder_being_removed(tmp_path):
    state_dir = str(tmp_path / "state")
    with lock_state(state_dir, create=True) as locked:
        assert locked and os.path.isdir(state_dir)
        with open(os.path.join(state_dir, LOCK_FILE)) as f:
            assert f.read().strip() == str(os.getpid())
        busy = rf"pid {os.getpid()}\) is already starting or stopping"
        with pytest.raises(StateError, match=busy), lock_state(state_dir):
            pass

        # A waiter that gets the lock only after the holder removed the folder (as `down`
        # does) must not hold a lock on the removed file: it makes the folder again.
        got: list[object] = []
        waits: list[str] = []

        def waiter() -> None:
            with lock_state(state_dir, wait_s=30, create=True, on_wait=waits.append) as ok:
                mine = os.stat(os.path.join(state_dir, LOCK_FILE)).st_ino
                got.append((ok, mine))

        thread = threading.Thread(target=waiter)
        thread.start()
        deadline = time.monotonic() + 10
        while not waits and time.monotonic() < deadline:
            time.sleep(0.01)
        assert waits == [f"another graphdist command (pid {os.getpid()})"]
        assert not got
        shutil.rmtree(state_dir)
    thread.join(30)
    assert got and got[0][0] is True
    # Nothing to lock where there is no folder, unless asked to make it.
    with lock_state(str(tmp_path / "none")) as locked:
        assert locked is False and not os.path.exists(tmp_path / "none")


def test_backoff_doubles_from_half_a_second_and_is_capped():
    assert [backoff_s(n) for n in range(1, 10)] == [0, 0.5, 1, 2, 4, 8, 16, 30, 30]
    assert backoff_s(10_000) == 30


class FakeTask:
    def __init__(self, index: int) -> None:
        self.job, self.index, self.address = "local", index, f"localhost:{2020 + index}"
        self.name, self.log_path = f"local-{index}", f"/logs/local-{index}.log"
        self.pid, self.alive, self.exitcode, self.restarts = os.getpid(), True, None, 0


FAKE_CLUSTER = {"local": ["localhost:2020", "localhost:2021"]}


class FakeFleet:
    """What the supervisor's policy uses of a LocalFleet; a restart can be made to fail."""

    def __init__(self) -> None:
        self.cluster = Cluster.parse(FAKE_CLUSTER)
        self.tasks = [FakeTask(0), FakeTask(1)]
        self.restart_fails = True
        self.restart_times: list[float] = []

    def dead_tasks(self):
        return [t for t in self.tasks if not t.alive]

    def task(self, job, index):
        return self.tasks[index]

    def restart(self, job, index):
        task = self.tasks[index]
        task.restarts += 1
        self.restart_times.append(clock.now)
        if self.restart_fails:
            task.pid, task.exitcode = GONE_PID + task.restarts, 4
            raise supervisor_module.GraphdistError("port in use")
        task.pid, task.alive, task.exitcode = os.getpid(), True, None


GONE_PID = 4_100_000  # above any pid this machine hands out (pid_max is at most 4194304)


def die(task: FakeTask, code: int) -> None:
    task.pid, task.alive, task.exitcode = GONE_PID, False, code


clock = SimpleNamespace(now=1000.0)


@pytest.fixture
def fake_time(monkeypatch):
    clock.now = 1000.0
    fake = SimpleNamespace(monotonic=lambda: clock.now, time=lambda: clock.now + 1e9)
    monkeypatch.setattr(supervisor_module, "time", fake)
    return clock


def run_for(sup, seconds: float, step: float = 0.05) -> None:
    end = clock.now + seconds
    while clock.now < end:
        clock.now += step
        sup.tick()


def test_policy_backs_off_exponentially_and_gives_up_within_the_window(tmp_path, fake_time):
    spec = SupervisorSpec(
        str(tmp_path), FAKE_CLUSTER, restart="on-failure", max_restarts=4, restart_window_s=60
    )
    fleet = FakeFleet()
    sup = supervisor_module._Supervisor(spec, fleet)  # type: ignore[arg-type]
    die(fleet.tasks[1], -9)
    died = clock.now
    run_for(sup, 60)
    gaps = [b - a for a, b in zip([died, *fleet.restart_times], fleet.restart_times, strict=False)]
    assert len(fleet.restart_times) == 4  # then it gave up: died 5 times within 60 s
    # the restart policy's own back-off (at once, then 0.5 s doubling), within the ticks
    assert gaps == pytest.approx([BACKOFF.delay(n) for n in range(1, 5)], abs=0.11)
    record = read_json(os.path.join(str(tmp_path), "fleet.json"))
    assert [t["gave_up"] for t in record["tasks"]] == [False, True]
    assert (record["max_restarts"], record["restart_window_s"]) == (4, 60)
    problem = fleet_problem(FleetRecord.from_json(json.dumps(record)), str(tmp_path))
    assert problem is not None and "local-1 died 5 times within 60 s" in problem
    assert f"`graphdist restart local-1 --state-dir {tmp_path}` starts it again" in problem

    # A restart by hand clears the give-up and starts the backoff over.
    fleet.restart_fails = False
    sup.handle({"op": "restart", "job": "local", "index": 1})
    assert not read_json(os.path.join(str(tmp_path), "fleet.json"))["tasks"][1]["gave_up"]


def test_policy_counts_restarts_in_a_sliding_window_not_a_lifetime(tmp_path, fake_time):
    spec = SupervisorSpec(
        str(tmp_path), FAKE_CLUSTER, restart="on-failure", max_restarts=2, restart_window_s=10
    )
    fleet = FakeFleet()
    fleet.restart_fails = False
    sup = supervisor_module._Supervisor(spec, fleet)  # type: ignore[arg-type]
    task = fleet.tasks[0]
    for _ in range(6):  # dies every 12 s: never 3 deaths within 10 s
        die(task, 1)
        run_for(sup, 12)
        assert task.alive
    assert len(fleet.restart_times) == 6
    # Each death came after a run longer than the window: the backoff started over each time.
    assert sup._policies[task.name]._in_a_row == 1
    # Three quick deaths within the window: the third is not restarted.
    for _ in range(3):
        die(task, 1)
        run_for(sup, 3)
    assert not task.alive and task.name in sup._given_up
    assert len(fleet.restart_times) == 8


def test_marked_processes_are_exact_and_never_this_process(tmp_path):
    state_dir = private_dir(str(tmp_path / "state"))
    env = {**os.environ, "GRAPHDIST_FLEET_MARK": os.path.realpath(state_dir)}
    code = "import time; time.sleep(60)  # looks like multiprocess's fork server"
    lookalike = subprocess.Popen([sys.executable, "-c", code], env=env)  # "multiprocess" + mark
    other = subprocess.Popen(
        [sys.executable, "-c", code], env={**env, "GRAPHDIST_FLEET_MARK": state_dir + "x"}
    )
    try:
        deadline = time.monotonic() + 30
        found: list[int] = []
        while time.monotonic() < deadline:
            found = [m.ref.pid for m in marked_processes(state_dir)]
            if found:
                break
            time.sleep(0.05)
        assert found == [lookalike.pid]
        assert all(not m.supervisor for m in marked_processes(state_dir))
    finally:
        for proc in (lookalike, other):
            proc.kill()
            proc.wait()


# -- real fleets ----------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_three_concurrent_ups_start_one_fleet_and_down_stops_all(state_dir, mark):
    procs = [
        start_gd(mark, "up", "--cluster", "local=1", "--detach", "--state-dir", state_dir)
        for _ in range(3)
    ]
    results = []
    for proc in procs:
        _out, err = proc.communicate(timeout=180)
        results.append((proc.returncode, err))
    assert sorted(code for code, _ in results) == [0, 2, 2], results
    for code, err in results:
        if code == 2:
            one_error_line((code, err), state_dir)
            assert "already running" in err or "is already starting or stopping" in err, err
    pids = processes_marked(mark)
    assert len(supervisors(pids)) == 1, pids
    record = read_json(os.path.join(state_dir, "fleet.json"))
    assert supervisors(pids) == [record["supervisor"]["pid"]]
    # A later `up` finds the running fleet.
    again = gd(mark, "up", "--cluster", "local=1", "--detach", "--state-dir", state_dir)
    assert one_error_line(again, "already running") == 2
    assert "stopped 1 server(s)" in down_stops_everything(mark, state_dir, pids)


@pytest.mark.integration
@pytest.mark.timeout(240)
@pytest.mark.parametrize("damage", ["garbage", "truncated", "wrong type", "removed"])
def test_down_stops_every_process_whatever_became_of_the_record(state_dir, mark, damage):
    pids = up_detached(mark, state_dir)
    path = os.path.join(state_dir, "fleet.json")
    with open(path, "rb") as f:
        text = f.read()
    if damage == "removed":
        os.remove(path)
    else:
        content = {
            "garbage": b"\x89PNG\r\n\x1a\n\xff\xfe garbage",
            "truncated": text[: len(text) // 2],
            "wrong type": b'{"supervisor": "x"}',
        }[damage]
        with open(path, "wb") as f:
            f.write(content)
        assert one_error_line(gd(mark, "status", "--state-dir", state_dir), "corrupt") == 2
    # The folder is not reused while its fleet runs, whatever became of its record.
    refused = gd(mark, "up", "--cluster", "local=1", "--detach", "--state-dir", state_dir)
    assert one_error_line(refused, "already running") == 2
    said = down_stops_everything(mark, state_dir, pids)
    assert "found by their marker" in said and ("corrupt" in said or damage == "removed"), said
    assert len(said.strip().splitlines()) == 1, said


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_leftovers_of_a_failed_start_are_cleaned_with_a_one_line_note(state_dir, mark):
    """... a killed TLS fleet's credentials included (before, the next TLS start found the
    folder not empty); and ``down`` removes the fleet's own entries, never a file of the user's
    put in the folder meanwhile."""
    private_dir(state_dir)
    os.makedirs(os.path.join(state_dir, "tls", "credentials", "client"))
    for name, content in [
        ("error.json", '{"kind": "PortInUseError", "message": "an old failure"}'),
        ("control.sock", "not a socket"),
        ("fleet.json.tmp4242", "{half"),
        ("tls/credentials/client/key.pem", "an old private key"),
    ]:
        with open(os.path.join(state_dir, name), "w") as f:
            f.write(content)
    up = gd(mark, "up", "--cluster", "local=1", "--detach", "--state-dir", state_dir)
    assert up.returncode == 0, up.stderr
    assert "Traceback" not in up.stderr and "an old failure" not in up.stderr, up.stderr
    notes = [ln for ln in up.stderr.splitlines() if "cleaned up after an earlier fleet" in ln]
    assert len(notes) == 1, up.stderr
    left = ("error.json", "control.sock", "fleet.json.tmp4242", "tls (its TLS credentials)")
    assert all(name in notes[0] for name in left), notes[0]
    assert not os.path.exists(os.path.join(state_dir, "error.json"))
    assert not os.path.exists(os.path.join(state_dir, "fleet.json.tmp4242"))
    assert not os.path.exists(os.path.join(state_dir, "tls"))
    pids = processes_marked(mark)
    status = gd(mark, "status", "--state-dir", state_dir)
    assert status.returncode == 0, status.stderr
    users = os.path.join(state_dir, "notes.txt")
    with open(users, "w") as f:
        f.write("the user's own")
    down = gd(mark, "down", "--state-dir", state_dir)
    assert down.returncode == 0, down.stderr
    assert wait_gone(pids, EVENTUALLY_S) == []
    assert os.listdir(state_dir) == ["notes.txt"], os.listdir(state_dir)


@pytest.mark.timeout(60)
def test_a_folder_holding_the_users_files_is_refused_as_a_state_folder(tmp_path, run_cli):
    """``up --detach --state-dir .`` in a project: a fleet's state folder is removed when the
    fleet stops, so one holding other files is refused before anything starts, and left as it
    was (its files, its mode)."""
    folder = tmp_path / "project"
    folder.mkdir(mode=0o755)
    (folder / "thesis.tex").write_text("two years of work")
    up = run_cli("up", "--cluster", "local=1", "--detach", "--state-dir", str(folder))
    assert up.returncode == 2, up.stderr
    assert up.stderr.startswith("Error: ") and len(up.stderr.strip().splitlines()) == 1
    assert "thesis.tex" in up.stderr and "new or empty folder" in up.stderr, up.stderr
    assert sorted(os.listdir(folder)) == ["thesis.tex"]
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    assert processes_marked(mark) == []


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_held_lock_makes_up_refuse_at_once_and_down_wait(state_dir, mark):
    pids = up_detached(mark, state_dir)
    with lock_state(state_dir):
        holder = f"another graphdist command (pid {os.getpid()})"
        refused = gd(mark, "up", "--cluster", "local=1", "--detach", "--state-dir", state_dir)
        assert one_error_line(refused, f"{holder[0].upper()}{holder[1:]}") == 2
        down = start_gd(mark, "down", "--state-dir", state_dir)
        assert down.stderr is not None
        line = down.stderr.readline()
        assert f"waiting for {holder}" in line, line
        assert down.poll() is None and wait_gone(pids, 0.5) == pids
    out, err = down.communicate(timeout=120)
    assert down.returncode == 0, err
    assert "stopped 1 server(s)" in out
    assert wait_gone(pids, EVENTUALLY_S) == []
    assert processes_marked(mark) == [] and not os.path.exists(state_dir)


_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) graphdist\.supervisor (.*)$")


def supervisor_events(state_dir: str, fragment: str) -> list[float]:
    with open(os.path.join(state_dir, "supervisor.log"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    stamps = []
    for line in lines:
        match = _STAMP.match(line)
        if match and fragment in match.group(2):
            when = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")
            stamps.append(when.timestamp())
    return stamps


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_restarts_back_off_and_status_fails_once_the_supervisor_gave_up(state_dir, mark):
    up = gd(
        mark,
        *("up", "--cluster", "local=2", "--detach", "--state-dir", state_dir),
        *("--restart", "on-failure", "--max-restarts", "3"),
    )
    assert up.returncode == 0, up.stderr
    pids = processes_marked(mark)
    holder = socket.socket()
    try:
        # Kill local-1 and take its port, so that every restart fails at once (as when another
        # program grabbed the port): only the backoff spaces the attempts.
        task = read_json(os.path.join(state_dir, "fleet.json"))["tasks"][1]
        port = int(task["address"].rsplit(":", 1)[1])
        os.kill(task["pid"], signal.SIGKILL)
        deadline = time.monotonic() + EVENTUALLY_S
        while True:
            try:
                holder.bind(("127.0.0.1", port))
                break
            except OSError:
                assert time.monotonic() < deadline, "the killed server's port stayed taken"
                time.sleep(0.01)
        holder.listen()
        deadline = time.monotonic() + 120
        while not supervisor_events(state_dir, "gave up on local-1"):
            assert time.monotonic() < deadline, "the supervisor did not give up"
            time.sleep(0.2)
        scheduled = supervisor_events(state_dir, "); restarting local-1 ")
        attempts = supervisor_events(state_dir, "local-1: restarting it (restart ")
        gave_up = supervisor_events(state_dir, "gave up on local-1")
        assert (len(scheduled), len(attempts), len(gave_up)) == (3, 3, 1)
        with open(os.path.join(state_dir, "supervisor.log"), encoding="utf-8") as f:
            log = f.read()
        found = re.findall(r"restarting local-1 (at once|in ([\d.]+) s)", log)
        delays = [float(d) if d else 0.0 for _, d in found]
        assert delays == [0.0, 0.5, 1.0]  # the first restart at once, then 0.5 s, doubling
        # Each attempt comes at least its backoff after the death it follows, so the gaps
        # between attempts grow (the log's millisecond stamps; lower bounds only: a slow machine
        # only makes the gaps longer).
        for sched, delay, attempt in zip(scheduled, delays, attempts, strict=True):
            assert attempt - sched >= delay - 0.05
        assert attempts[1] - attempts[0] >= 0.5 - 0.05
        assert attempts[2] - attempts[1] >= 1.0 - 0.05
        assert gave_up[0] >= attempts[2]
        assert "gave up on local-1 after 3 restart(s) (at most 3 within 60 s)" in log

        status = gd(mark, "status", "--json", "--state-dir", state_dir)
        assert status.returncode == 1, status.stderr
        assert one_error_line(status, "local-1 died 4 times within 60 s") == 1
        rows = json.loads(status.stdout)
        assert [(r["alive"], r["gave_up"]) for r in rows] == [(True, False), (False, True)]
    finally:
        holder.close()
    down_stops_everything(mark, state_dir, pids)
