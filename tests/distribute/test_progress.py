"""A run's training progress (graphdist._distribute.progress, graphdist._proc.guardreport): the
task's side writes records that never block it, at most one per interval; a real guard relays
them beside its own report lines, which they never crowd out; the launcher turns them into
``progress`` events with rates and steps redone, recorded but never kept or shown on the
console; the metrics file gets each task's steps; and real runs, cold and warm, restarted, and a
real ``model.fit``, report their steps."""

from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import time

import pytest

from graphdist._distribute import progress as progress_mod
from graphdist._distribute.events import Cause, Event, Progress, Restarting, Straggler
from graphdist._distribute.progress import StepBook, step
from graphdist._distribute.runmetrics import RunMetrics
from graphdist._exceptions import ArgumentError
from graphdist._proc.guardreport import (
    MAX_PROGRESS_LINE,
    PROGRESS_ENV,
    channel_fd,
    channel_value,
    parse_progress,
    parse_report,
)
from graphdist._proc.process import guarded_argv
from tests.conftest import QUIET_TF, REPO, run_python
from tests.distribute.test_runmetrics import samples


@pytest.fixture
def channel(monkeypatch):
    """A fresh channel of this process to a real pipe: (the channel, the pipe's read end)."""
    read, write = os.pipe()
    monkeypatch.setenv(PROGRESS_ENV, channel_value(write))
    fresh = progress_mod._Channel()
    monkeypatch.setattr(progress_mod, "_CHANNEL", fresh)
    os.set_blocking(read, False)
    yield fresh, read
    os.close(read)
    os.close(write)


def records(read: int) -> list[dict]:
    try:
        text = os.read(read, 1 << 20)
    except BlockingIOError:
        return []
    return [json.loads(line) for line in text.splitlines()]


def test_outside_a_run_a_step_does_nothing(monkeypatch):
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    monkeypatch.setattr(progress_mod, "_CHANNEL", progress_mod._Channel())
    step(1, loss=0.5)
    assert progress_mod._CHANNEL.fd == -1


@pytest.mark.parametrize(
    ("args", "kwargs", "fragment"),
    [
        ((True,), {}, "n must be a whole number, not True"),
        ((1.5,), {}, "n must be a whole number, not 1.5"),
        (("3",), {}, "n must be a whole number, not '3'"),
        ((-1,), {}, "n must be at least 0, not -1"),
        ((3,), {"total": 0}, "total must be at least 1, not 0"),
    ],
)
def test_a_bad_count_is_refused_naming_it(args, kwargs, fragment):
    with pytest.raises(ArgumentError, match=fragment):
        step(*args, **kwargs)


def test_a_scalar_that_is_no_number_is_refused_at_the_first_record(channel):
    with pytest.raises(ArgumentError, match="scalar loss must be a number, not 'low'"):
        step(1, loss="low")


def test_the_first_record_goes_at_once_then_the_newest_once_per_interval(channel, monkeypatch):
    chan, read = channel
    monkeypatch.setattr(progress_mod, "INTERVAL_S", 3600.0)
    step(1, total=10, loss=2.0)
    first = records(read)
    assert [(r["step"], r["total"], r["first"], r["scalars"]) for r in first] == [
        (1, 10, True, {"loss": 2.0})
    ]
    for n in range(2, 6):
        step(n, loss=float("nan"))
    assert records(read) == []  # within the interval: held
    chan.flush()  # what the exit (or the interval's end) writes: the newest only
    (last,) = records(read)
    assert (last["step"], last["first"], last["scalars"]) == (5, False, {"loss": None})
    chan.next_at = 0.0
    step(6)
    assert [r["step"] for r in records(read)] == [6]


def test_a_full_pipe_drops_records_without_blocking_and_the_steps_go_on(channel, monkeypatch):
    _, read = channel
    monkeypatch.setattr(progress_mod, "INTERVAL_S", 0.0)
    started = time.monotonic()
    for n in range(20_000):  # far more than a pipe holds, written as fast as they come
        step(n, **{f"s{i}": float(i) for i in range(8)})
    assert time.monotonic() - started < 20  # a blocking write would hang here for ever
    got = []
    while batch := records(read):
        got += batch
    assert 0 < len(got) < 20_000
    steps = [r["step"] for r in got]
    assert steps == sorted(steps)
    step(20_000)
    assert [r["step"] for r in records(read)] == [20_000]  # room again: written


def test_too_many_scalars_leave_the_steps_in_the_record(channel):
    _, read = channel
    step(7, **{f"metric_{i:04d}": 1.0 for i in range(400)})
    (record,) = records(read)
    assert (record["step"], record["scalars"]) == (7, {})


def test_an_inherited_number_that_is_no_pipe_is_not_written_to(tmp_path, monkeypatch):
    with open(tmp_path / "f", "wb") as f:
        monkeypatch.setenv(PROGRESS_ENV, f"{f.fileno()}:{os.fstat(f.fileno()).st_ino}")
        monkeypatch.setattr(progress_mod, "_CHANNEL", progress_mod._Channel())
        step(3)
    assert (tmp_path / "f").read_bytes() == b""


def test_a_variable_inherited_without_its_pipe_names_no_other_pipe():
    read, write = os.pipe()
    value = channel_value(write)
    assert channel_fd(value) == write
    os.close(write)
    os.close(read)
    again = os.pipe()  # the same numbers, another pipe: a descendant without the fd sees this
    try:
        assert channel_fd(value) is None
        assert channel_fd(str(again[1])) is None  # a bare number is no channel
    finally:
        for fd in again:
            os.close(fd)


def test_a_child_forked_while_another_thread_writes_does_not_hang(channel):
    chan, _ = channel
    step(1)
    with chan.lock:  # as if another thread were inside a write at the fork
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                step(2)
                chan.flush()
            finally:
                os._exit(0)
    deadline = time.monotonic() + 20
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0


def line(**record: object) -> bytes:
    return b"progress " + json.dumps(record).encode()


@pytest.mark.parametrize(
    "bad",
    [
        b"progress {not json",
        b"progress [1, 2]",
        line(step=-1, t=1.0),
        line(step=True, t=1.0),
        line(step=1.5, t=1.0),
        line(step=1),
        b'progress {"step": 1, "t": NaN}',
        b"exit 0 12.5",
        b"pid 12",
        b"progressive",
    ],
)
def test_a_line_that_is_no_record_is_left_out(bad):
    assert parse_progress(bad + b"\n" + line(step=2, t=3.0)) == [
        {"step": 2, "t": 3.0, "total": None, "first": False, "scalars": {}, "wait": None}
    ]


def test_a_records_scalars_are_numbers_or_none_and_a_bad_total_is_none():
    (got,) = parse_progress(
        line(step=4, t=1.0, total=0, first=True, scalars={"loss": 0.5, "x": "a", "n": 3})
        + b"\n"
        + b'progress {"step": 5, "t": 2.0, "scalars": {"loss": Infinity}}'
    )[:1]
    assert got == {
        "step": 4,
        "t": 1.0,
        "total": None,
        "first": True,
        "scalars": {"loss": 0.5, "n": 3.0},
        "wait": None,
    }
    assert parse_progress(b'progress {"step": 5, "t": 2.0, "scalars": {"loss": Infinity}}') == [
        {
            "step": 5,
            "t": 2.0,
            "total": None,
            "first": False,
            "scalars": {"loss": None},
            "wait": None,
        }
    ]
    # a wait is a number of seconds, 0 or more; anything else is none
    waits = [0.25, 0, -1.0, "1", True, None]
    got_waits = [parse_progress(line(step=1, t=1.0, wait=w))[0]["wait"] for w in waits]
    assert got_waits == [0.25, 0.0, None, None, None, None]


def record(n: int, t: float, first: bool = False) -> dict:
    return {"step": n, "t": t, "total": 100, "first": first, "scalars": {}}


def test_the_book_gives_rates_within_an_attempt_and_counts_steps_done_again():
    book = StepBook()
    assert book.payload("worker-0", 1, record(1, 10.0, first=True)) == Progress(1, 100, None, {})
    assert book.payload("worker-0", 1, record(51, 10.5)).steps_per_s == 100.0
    assert book.payload("worker-0", 1, record(61, 10.5)).steps_per_s is None  # no time passed
    # attempt 2 resumed from a backup after 40 steps: steps 41..61 are done again
    again = book.payload("worker-0", 2, record(41, 20.0, first=True))
    assert (again.redone, again.steps_per_s) == (21, None)
    assert book.payload("worker-0", 2, record(70, 20.5)).redone == 0
    # attempt 3 resumed right where the last one stopped: nothing done again
    assert book.payload("worker-0", 3, record(71, 30.0, first=True)).redone == 0
    # another task's first record is its own story
    assert book.payload("worker-1", 3, record(1, 30.0, first=True)).redone == 0


@pytest.mark.parametrize("output_format", ["text", "jsonl"])
def test_progress_events_are_recorded_but_neither_kept_nor_shown_as_text(tmp_path, output_format):
    from graphdist._distribute.runlogs import RunLogs
    from graphdist._distribute.runspec import RunSpec
    from graphdist._distribute.runstate import RunState

    out = io.StringIO()
    spec = RunSpec.check(["python", "train.py"], output=out, output_format=output_format)
    logs = RunLogs(str(tmp_path))
    state = RunState(spec, logs)
    state.progress("worker-0", record(5, 1.0, first=True))
    assert state.events == []
    shown = [json.loads(ln)["step"] for ln in out.getvalue().splitlines()]
    assert shown == ([] if output_format == "text" else [5])
    with open(os.path.join(logs.path, "events.jsonl")) as f:
        (got,) = [Event.from_json(ln) for ln in f]
    assert (got.kind, got.task, got.data["step"]) == ("progress", "worker-0", 5)


def test_the_summary_says_each_tasks_steps_and_those_done_again():
    from graphdist._distribute.events import RunEnded, summary

    ended = Event.of(
        RunEnded("every task exited 0", 2, None, True, [], [], {"w-1": 9, "w-0": 9}, 4), 5.0, 2
    )
    assert summary([ended]).splitlines()[1:] == [
        "  steps: w-0 9, w-1 9 (4 done again after restarts)"
    ]
    quiet = Event.of(RunEnded("every task exited 0", 1), 1.0, 1)
    assert "steps" not in summary([quiet])


def at(s_: float, attempt: int, payload: object, task: str | None = None) -> Event:
    return Event.of(payload, s_, attempt, task)  # type: ignore[arg-type]


def test_a_record_held_back_is_written_by_the_timer_and_an_exited_task_steps_no_more(
    tmp_path, monkeypatch
):
    from graphdist._distribute import runmetrics
    from graphdist._distribute.events import TaskExited

    monkeypatch.setattr(runmetrics, "PROGRESS_WRITE_S", 0.3)
    path = tmp_path / "q.prom"
    metrics = RunMetrics(str(path))
    metrics.feed(at(1.0, 1, Progress(10, None, None, {}), "worker-0"))
    metrics.feed(at(1.1, 1, Progress(20, None, 50.0, {}), "worker-0"))  # held back
    key = ("graphdist_run_task_steps", (("run", "q"), ("task", "worker-0")))
    deadline = time.monotonic() + 10
    while samples(path)[key] != 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert samples(path)[key] == 20  # the task went quiet: the timer wrote it
    # a record held back after another event's write is still written by the timer
    metrics.feed(at(1.2, 1, Progress(30, None, 50.0, {}), "worker-0"))  # held back
    metrics.feed(at(1.3, 1, Restarting(Cause("worker-1", 1, 3, "exited", 1.3), 0.0, "run", "r")))
    metrics.feed(at(1.4, 2, Progress(35, None, 50.0, {}), "worker-0"))  # held back again
    deadline = time.monotonic() + 10
    while samples(path)[key] != 35 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert samples(path)[key] == 35
    metrics.feed(at(2.0, 1, TaskExited(10, 0, "exited with code 0", 1.9), "worker-0"))
    rate = ("graphdist_run_task_steps_per_second", (("run", "q"), ("task", "worker-0")))
    assert samples(path)[rate] == 0


def test_the_metrics_file_has_each_tasks_steps_rate_and_steps_redone(tmp_path, monkeypatch):
    path = tmp_path / "p.prom"
    metrics = RunMetrics(str(path))
    metrics.feed(at(1.0, 1, Progress(10, 100, None, {"loss": 1.0}), "worker-0"))
    metrics.feed(at(1.5, 1, Progress(60, 100, 100.0, {}), "worker-0"))  # within 1 s: not written
    run = (("run", "p"),)
    got = samples(path)
    assert got[("graphdist_run_task_steps", (*run, ("task", "worker-0")))] == 10
    metrics.feed(at(2.0, 2, Progress(41, 100, None, {}, redone=20), "worker-0"))  # written
    got = samples(path)
    assert got[("graphdist_run_task_steps", (*run, ("task", "worker-0")))] == 41
    assert got[("graphdist_run_task_steps_per_second", (*run, ("task", "worker-0")))] == 100.0
    assert got[("graphdist_run_steps_redone_total", (*run, ("task", "worker-0")))] == 20
    assert got[("graphdist_run_stragglers_total", (*run, ("task", "worker-0")))] == 0
    metrics.feed(at(3.0, 2, Straggler(None, 1.0, 4.0, 0.75, 30.0), "worker-0"))
    got = samples(path)
    assert got[("graphdist_run_stragglers_total", (*run, ("task", "worker-0")))] == 1


def run_guard(code: str, env: dict[str, str] | None = None) -> tuple[bytes, int]:
    """``python -c CODE`` under a real guard with a report pipe: (its whole report, exit code)."""
    read, write = os.pipe2(os.O_CLOEXEC)
    argv = guarded_argv([sys.executable, "-c", code], grace_s=1.0, report_fd=write, progress=True)
    full = {**os.environ, "PYTHONPATH": REPO, **(env or {})}
    proc = subprocess.Popen(argv, env=full, pass_fds=(write,), stdout=subprocess.DEVNULL)
    os.close(write)
    with os.fdopen(read, "rb") as report:
        text = report.read()
    return text, proc.wait(timeout=60)


@pytest.mark.timeout(60)
def test_a_guard_relays_its_commands_records_beside_its_own_lines():
    text, code = run_guard(
        "import graphdist\nfor n in range(1, 4): graphdist.step(n, total=3, loss=1.0 / n)"
    )
    assert code == 0
    pid, end = parse_report(text)
    assert pid is not None and end is not None and end[0] == 0
    got = [(r["step"], r["first"]) for r in parse_progress(text)]
    assert got == [(1, True), (3, False)]  # the first at once, the last at exit


@pytest.mark.timeout(60)
def test_a_guards_own_lines_are_never_lost_behind_a_flood_of_records():
    flood = (
        "import graphdist._distribute.progress as p\n"
        "p.INTERVAL_S = 0.0\n"
        "for n in range(10_000): p.step(n, **{f's{i}': 1.0 for i in range(20)})\n"
        "raise SystemExit(3)\n"
    )
    text, code = run_guard(flood)
    assert code == 3
    assert parse_report(text)[1] is not None and parse_report(text)[1][0] == 3
    steps = [r["step"] for r in parse_progress(text)]
    assert (
        steps
        and steps == sorted(steps)
        and all(len(ln) < MAX_PROGRESS_LINE for ln in text.splitlines())
    )


@pytest.mark.timeout(60)
def test_a_guards_own_lines_never_wait_behind_records_nobody_read():
    """The report is not read until the guard has exited: records fill what the relay may
    use of the pipe, the rest are dropped, and the exit line still fits. Red if the relay
    writes whatever comes (the guard blocks on its exit line for ever)."""
    flood = (  # records of 1,024 bytes as relayed: a pipe's page holds 4, with no byte left
        "import json, os\n"
        f"fd = int(os.environ[{PROGRESS_ENV!r}].split(':')[0])\n"
        "head = json.dumps({'step': 1, 't': 1.0, 'pad': ''})\n"
        "line = json.dumps({'step': 1, 't': 1.0, 'pad': 'x' * (1014 - len(head))}) + '\\n'\n"
        "assert len('progress ' + line) == 1024\n"
        "for n in range(5_000):\n"
        "    os.write(fd, line.encode())  # blocking: a relay that blocked would block it\n"
        "raise SystemExit(3)\n"
    )
    read, write = os.pipe2(os.O_CLOEXEC)
    argv = guarded_argv([sys.executable, "-c", flood], grace_s=1.0, report_fd=write, progress=True)
    proc = subprocess.Popen(argv, env={**os.environ, "PYTHONPATH": REPO}, pass_fds=(write,))
    os.close(write)
    try:
        code = proc.wait(timeout=40)  # nothing reads the report meanwhile
    finally:
        proc.kill()
    with os.fdopen(read, "rb") as report:
        text = report.read()
    assert code == 3 and parse_report(text)[1] is not None and parse_report(text)[1][0] == 3
    assert 0 < len(text) <= 65536


@pytest.mark.timeout(60)
def test_what_a_task_writes_to_its_channel_never_reads_as_the_guards_own_lines():
    forged = (
        "import os\n"
        f"fd = int(os.environ[{PROGRESS_ENV!r}].split(':')[0])\n"
        "os.write(fd, b'{}\\x1cexit 0 123.0\\n{}\\x0cexit x y\\nexit 0 1.0\\npid 1\\n')\n"
        "raise SystemExit(3)\n"
    )
    text, code = run_guard(forged)
    pid, end = parse_report(text)
    assert code == 3 and end is not None and end[0] == 3 and pid != 1
    assert parse_report(b"exit x y\nexit 4 2.0\n") == (None, (4, 2.0))  # no ValueError


@pytest.mark.timeout(60)
def test_a_command_gets_its_own_guards_channel_and_never_the_report():
    """The command's channel is its guard's (a stale value in the environment replaced), it
    is that pipe (fd and inode), and the report's fd is not the command's. With no report, or
    no relay asked for, no channel at all."""
    read, write = os.pipe2(os.O_CLOEXEC)
    look = (
        "import os, sys\n"
        f"from graphdist._proc.guardreport import channel_fd\n"
        f"value = os.environ.get({PROGRESS_ENV!r})\n"
        "try:\n"
        f"    os.fstat({write})\n"
        "    report = 'open'\n"
        "except OSError:\n"
        "    report = 'closed'\n"
        "print(value != '0:0', channel_fd(value) is not None, report)\n"
    )
    env = {**os.environ, "PYTHONPATH": REPO, PROGRESS_ENV: "0:0"}
    argv = guarded_argv([sys.executable, "-c", look], grace_s=1.0, report_fd=write, progress=True)
    proc = subprocess.Popen(argv, env=env, pass_fds=(write,), stdout=subprocess.PIPE, text=True)
    os.close(write)
    out, _ = proc.communicate(timeout=60)
    os.close(read)
    assert out.split() == ["True", "True", "closed"]
    show_env = f"import os; print(os.environ.get({PROGRESS_ENV!r}))"
    argv = guarded_argv([sys.executable, "-c", show_env], grace_s=1.0)  # no report: no channel
    out2 = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert out2.stdout.strip() == "None"
    # a report but no relay asked for (an engine's step: srun, which would carry it elsewhere)
    read, write = os.pipe2(os.O_CLOEXEC)
    argv = guarded_argv([sys.executable, "-c", show_env], grace_s=1.0, report_fd=write)
    proc = subprocess.Popen(argv, env=env, pass_fds=(write,), stdout=subprocess.PIPE, text=True)
    os.close(write)
    out3, _ = proc.communicate(timeout=60)
    os.close(read)
    assert out3.strip() == "None"


# Each task reports 60 steps; worker-1 exits 3 after 41 in the first attempt, and the second
# resumes both tasks from step 20 (a backup's): 21 steps of worker-1's, 40 of worker-0's, again.
STEPS = (
    "import json, os, sys, time\n"
    "import graphdist\n"
    "again = os.environ['GRAPHDIST_RESTART'] != '0'\n"
    "index = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
    "for i in range(20 if again else 0, 60):\n"
    "    time.sleep(0.01)\n"
    "    graphdist.step(i + 1, total=60, loss=1.0 / (i + 1))\n"
    "    if i == 40 and index == 1 and not again:\n"
    "        sys.exit(3)\n"
)


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("warm", "tls"), [(True, False), (False, False), (True, True)], ids=["warm", "cold", "tls"]
)
def test_a_restarted_run_reports_each_tasks_steps_and_the_steps_done_again(tmp_path, warm, tls):
    python = sys.executable if warm else "python3"  # not graphdist's Python: a cold task
    argv = ["-m", "graphdist", "run", "--workers", "2", "--max-restarts", "1"]
    argv += ["--tls"] if tls else []
    argv += ["--metrics-file", str(tmp_path / "r.prom"), "--output-format", "jsonl"]
    done = run_python([*argv, "--", python, "-c", STEPS], env={"PYTHONPATH": REPO}, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr
    events = [json.loads(ln) for ln in done.stdout.splitlines()]
    started = {e["task"]: e["warm"] for e in events if e["event"] == "task-started"}
    assert set(started.values()) == {warm}
    shown = [e for e in events if e["event"] == "progress"]
    for task, first_end in (("worker-0", 60), ("worker-1", 41)):
        mine = [e for e in shown if e["task"] == task]
        assert [e["step"] for e in mine if e["attempt"] == 1][-1] == first_end
        assert [e["step"] for e in mine if e["attempt"] == 2][-1] == 60
        (again,) = [e for e in mine if e["redone"]]
        assert (again["attempt"], again["step"], again["redone"]) == (2, 21, first_end - 20)
        assert all(e["total"] == 60 for e in mine)
        assert any(e["steps_per_s"] for e in mine)
    (ended,) = [e for e in events if e["event"] == "run-ended"]
    assert (ended["steps"], ended["redone"]) == ({"worker-0": 60, "worker-1": 60}, 40 + 21)
    got = samples(tmp_path / "r.prom")
    run = (("run", "r"),)
    assert got[("graphdist_run_steps_redone_total", (*run, ("task", "worker-1")))] == 21
    assert got[("graphdist_run_task_steps", (*run, ("task", "worker-0")))] == 60


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_the_keras_callback_reports_steps_alone_where_logs_are_no_dict(channel):
    """Under ParameterServerStrategy tf-keras hands the callback a RemoteValue, not a dict,
    and the optimizer's step count may not be readable: the callback reports the batches it
    saw. Red if it took dict(logs) (a TypeError in the first batch of fit)."""
    _, read = channel
    callback = progress_mod.progress()
    callback.set_params({"epochs": 2, "steps": 3})
    callback.set_model(type("Model", (), {"optimizer": None})())  # no iterations to read
    callback.on_train_batch_end(0, logs=object())
    (record,) = records(read)
    assert (record["step"], record["total"], record["scalars"]) == (1, 6, {})


FIT = (
    "import numpy as np, tensorflow as tf, graphdist\n"
    "model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])\n"
    "model.compile(optimizer='sgd', loss='mse')\n"
    "x, y = np.ones((64, 4), 'float32'), np.ones((64, 1), 'float32')\n"
    "model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[graphdist.progress()])\n"
)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_model_fit_reports_its_optimizers_steps_and_loss():
    argv = ["-m", "graphdist", "run", "--workers", "1", "--output-format", "jsonl"]
    done = run_python([*argv, "--", sys.executable, "-c", FIT], timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr
    shown = [e for ln in done.stdout.splitlines() if (e := json.loads(ln))["event"] == "progress"]
    assert shown[0]["step"] == 1 and shown[-1]["step"] == 24  # 8 batches a epoch, 3 epochs
    assert all(e["total"] == 24 for e in shown)
    assert all(isinstance(e["scalars"]["loss"], float) for e in shown)


def test_a_task_below_half_the_others_median_for_the_window_is_named_once():
    from graphdist._distribute.progress import STRAGGLER_WINDOW_S, Stragglers

    rule = Stragglers()
    w = STRAGGLER_WINDOW_S
    assert rule.check("worker-0", 0.0, 40.0, "n0") is None
    assert rule.check("worker-1", 0.0, 42.0, "n1") is None
    assert rule.check("worker-2", 1.0, 19.0, "n2") is None  # below half of 41: since 1.0
    assert rule.check("worker-2", 1.0 + w - 0.1, 19.0, "n2") is None  # not for the window yet
    named = rule.check("worker-2", 1.0 + w, 19.0, "n2")
    assert named is not None
    assert (named.node, named.steps_per_s, named.others_per_s, named.for_s) == ("n2", 19.0, 41.0, w)
    assert named.costs_s == pytest.approx(1 / 19 - 1 / 41, abs=1e-6)
    assert rule.check("worker-2", 2.0 + w, 19.0, "n2") is None  # said once
    assert rule.check("worker-2", 3.0 + w, 30.0, "n2") is None  # above half: a blip so far
    assert rule.check("worker-2", 4.0 + w, 10.0, "n2") is None  # below again: still named
    assert rule.check("worker-2", 4.0 + 2 * w, 10.0, "n2") is None  # ... and said once
    assert rule.check("worker-2", 5.0 + 2 * w, 30.0, "n2") is None  # above half ...
    assert rule.check("worker-2", 5.0 + 3 * w, 30.0, "n2") is None  # ... for the window: recovered
    assert rule.check("worker-2", 6.0 + 3 * w, 10.0, "n2") is None  # below again: a new window
    assert rule.check("worker-2", 6.0 + 4 * w, 10.0, "n2") is not None


def test_a_synchronous_runs_equal_rates_a_stalled_task_and_an_exited_one_name_no_straggler():
    from graphdist._distribute.progress import STRAGGLER_WINDOW_S, Stragglers

    w = STRAGGLER_WINDOW_S
    rule = Stragglers()
    for t in (0.0, w + 1):
        for task in ("worker-0", "worker-1", "worker-2"):
            assert rule.check(task, t, 12.5, None) is None  # all at the slowest one's pace
    # an exited task is no reference: worker-2, slow since 0, has none left at w + 1
    rule = Stragglers()
    rule.check("worker-0", 0.0, 40.0, None)
    rule.check("worker-2", 0.0, 1.0, None)
    rule.forget("worker-0")
    assert rule.check("worker-2", w + 1, 1.0, None) is None
    # a stalled task is the heartbeat's, and its stall is no part of a window
    rule = Stragglers()
    rule.check("worker-0", 0.0, 40.0, None)
    assert rule.check("worker-1", 0.0, 0.0, None) is None
    assert rule.check("worker-1", w + 5, 0.0, None) is None
    assert rule.check("worker-1", w + 6, 5.0, None) is None  # slow from here: a window starts
    named = rule.check("worker-1", 2 * w + 6, 5.0, None)
    assert named is not None and named.for_s == w


# fit under a one-worker MultiWorkerMirroredStrategy (no TF_CONFIG), its channel a file: the
# waits fit's marks give in each case, as "case: waits said / records"
FIT_CORNERS = """
import gc, json, os, sys, time, weakref
os.environ["TF_USE_LEGACY_KERAS"] = "1"
import numpy as np
import tensorflow as tf
import graphdist
from graphdist._distribute import fitmarks, progress

strategy = tf.distribute.MultiWorkerMirroredStrategy()
x = np.random.RandomState(0).rand(256, 4).astype("float32")
y = x.sum(axis=1, keepdims=True)
got = []
progress._CHANNEL.update = lambda n, total, scalars, wait=None: got.append(wait and wait())

def fit(case, model, batch_size=32):
    del got[:]
    model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0, callbacks=[graphdist.progress()])
    said = [w for w in got if w is not None]
    assert all(w < 0.2 for w in said[1:]), (case, said)  # one worker waits for none (the
    # first step traces the step function: its time is in its wait)
    print(f"{case}: {len(said)}/{len(got)}", flush=True)
    assert [w.name for w in model.weights] == names, model.weights
    return model

def model_of(**compile_args):
    global names
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
        model.compile(loss="mse", **{"optimizer": "adam", **compile_args})
    names = [w.name for w in model.weights]
    return model

model = fit("plain", model_of())
fit("again", model)
with strategy.scope():
    model.compile(optimizer=tf.keras.optimizers.SGD(0.01), loss="mse")
fit("recompiled", model)
plain = model_of()
plain.fit(x, y, batch_size=32, epochs=1, verbose=0)
fit("traced-before", plain)
plain.fit(x, y, batch_size=64, epochs=1, verbose=0)  # traced again, without the marks
time.sleep(0.5)  # what the marks of before would say: at least this
fit("retraced-without", plain, batch_size=64)
ref = weakref.ref(plain)
del plain
gc.collect()
print(f"freed: {ref() is None}", flush=True)
fit("jit", model_of(jit_compile=True))
fit("steps-per-execution", model_of(steps_per_execution=4))
tf.keras.mixed_precision.set_global_policy("mixed_float16")
fit("mixed-precision", model_of())
tf.keras.mixed_precision.set_global_policy("float32")
fit("legacy-optimizer", model_of(optimizer=tf.keras.optimizers.legacy.Adam()))
model = model_of(jit_compile=True)  # wrapped once, then compiled with XLA: still fits
model.jit_compile = False
fit("before-jit", model)
model.jit_compile = True
model.compile(loss="mse", optimizer="adam", jit_compile=True)
model.fit(x, y, batch_size=32, epochs=1, verbose=0)
print("xla after: fits", flush=True)
"""


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_fits_marks_tell_a_wait_where_they_can_and_never_break_a_fit():
    """Every fit step says its wait, across fits (traced once), after a re-compile with a new
    optimizer, where the step was traced before the callback came, and with mixed precision
    (its optimizer aggregates with the one inside); none where the marks cannot tell (XLA has
    no timestamp, several steps per execution, a legacy optimizer) and there the fit runs as
    without the callback, as it does later under XLA. The model's weights stay its own."""
    done = subprocess.run(
        [sys.executable, "-c", FIT_CORNERS],
        capture_output=True,
        text=True,
        timeout=200,
        env={**os.environ, "PYTHONPATH": REPO, **QUIET_TF},
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    said = dict(line.split(": ") for line in done.stdout.splitlines())
    assert said == {
        "plain": "8/8",
        "again": "8/8",
        "recompiled": "8/8",
        "traced-before": "8/8",
        "retraced-without": "4/4",
        "freed": "True",
        "jit": "0/8",
        "steps-per-execution": "0/2",
        "mixed-precision": "8/8",
        "legacy-optimizer": "0/8",
        "before-jit": "8/8",
        "xla after": "fits",
    }, done.stdout


def test_under_a_synchronous_strategy_the_task_the_others_wait_for_is_named_once():
    """Equal rates (every worker at the slowest one's pace): the one whose wait a step stays
    below the others' by a share of a step is named, with what they wait for it; the others,
    who wait more, never are; noise below the share names none."""
    from graphdist._distribute.progress import STRAGGLER_WAIT_SHARE, STRAGGLER_WINDOW_S, Stragglers

    w, rate = STRAGGLER_WINDOW_S, 2.0  # a step of 0.5 s: behind from a lag of 0.1 s
    rule = Stragglers()
    waits = {"worker-0": 0.2, "worker-1": 0.001, "worker-2": 0.22}
    named = []
    for i in range(int(2 * w) + 1):
        for task, wait in waits.items():
            if (event := rule.check(task, float(i), rate, f"n{task[-1]}", wait)) is not None:
                named.append((task, i, event))
    assert [(task, i) for task, i, _ in named] == [("worker-1", w)]
    event = named[0][2]
    assert (event.node, event.steps_per_s, event.others_per_s, event.for_s) == ("n1", 2.0, 2.0, w)
    assert event.others_wait_s == pytest.approx(0.21) and event.costs_s == pytest.approx(0.209)
    # it recovers (waits as the others do, two windows: the median turns after half of one,
    # and the recovery holds for one), then falls behind again: named anew
    again = []
    for i in range(int(2 * w) + 1, int(7 * w)):
        for task in ("worker-0", "worker-2"):
            assert rule.check(task, float(i), rate, None, 0.2) is None
        wait = 0.2 if i <= 4 * w else 0.0
        if (event := rule.check("worker-1", float(i), rate, None, wait)) is not None:
            again.append(event)
    assert [e.for_s for e in again] == [w]
    # a pause longer than the window (an evaluation: no other task's wait in it) is no recovery
    rule = Stragglers()
    for i in range(int(w) + 1):
        rule.check("worker-0", float(i), rate, None, 0.2)
        rule.check("worker-1", float(i), rate, None, 0.0)
    assert rule.check("worker-1", 3 * w, rate, None, 0.0) is None  # alone in its window
    for i in range(int(3 * w), int(5 * w)):
        assert rule.check("worker-0", float(i), rate, None, 0.2) is None
        assert rule.check("worker-1", float(i), rate, None, 0.0) is None  # named before: once
    # a pause between two fits: its first step's rate is low (its step looks long), a blip
    # that neither clears the straggler nor names it again
    rule, named = Stragglers(), []
    for i in range(int(4 * w)):
        pause = i == int(2 * w)
        for task, wait in (("worker-0", 0.2), ("worker-1", 0.0)):
            if rule.check(task, float(i), 0.1 if pause else rate, None, wait) is not None:
                named.append((task, i))
    assert named == [("worker-1", w)], named
    # noise: waits apart by less than the share of a step name nobody
    rule = Stragglers()
    lag = 0.9 * STRAGGLER_WAIT_SHARE / rate
    for i in range(int(2 * w)):
        assert rule.check("worker-0", float(i), rate, None, 0.05 + lag) is None
        assert rule.check("worker-1", float(i), rate, None, 0.05) is None
    # alone, or with a stalled peer, a task is no straggler either
    rule = Stragglers()
    for i in range(int(2 * w)):
        assert rule.check("worker-0", float(i), rate, None, 0.0) is None
        assert rule.check("worker-1", float(i), 0.0, None, 0.3) is None


def test_a_record_without_its_wait_in_a_synchronous_run_neither_names_nor_clears():
    """A step that said no wait (a fit step that aggregated by itself, a loop that passes
    ready only sometimes) is no recovery: the straggler stays named once; nor is it judged by
    its rate."""
    from graphdist._distribute.progress import STRAGGLER_WINDOW_S, Stragglers

    w, rule, named = STRAGGLER_WINDOW_S, Stragglers(), []
    for i in range(int(5 * w)):
        rule.check("worker-0", float(i), 2.0, None, 0.2)
        wait = None if i % 7 == 0 else 0.0
        if rule.check("worker-1", float(i), 2.0, None, wait) is not None:
            named.append(i)
    assert named == [int(w) + 1]  # since 1 (its first record, at 0, said none)


def test_a_per_replica_ready_and_scalar_are_read_on_this_worker(channel):
    """strategy.run's results on a worker of several devices: ready is the last replica's,
    a scalar their mean."""

    class PerReplica:  # what tf.distribute's per-replica values show: .values, one a replica
        def __init__(self, *values):
            self.values = values

    import numpy as np

    _, read = channel
    now = time.time()
    step(1, ready=PerReplica(np.float64(now - 0.5), np.float64(now - 0.2)), loss=PerReplica(1, 3))
    (record,) = records(read)
    assert 0.2 <= record["wait"] < 0.45 and record["scalars"] == {"loss": 2.0}


def test_a_steps_ready_becomes_its_records_wait_and_a_bad_one_is_refused(channel):
    import numpy as np

    _, read = channel
    before = time.time()
    step(1, ready=np.float64(before - 0.25))  # a tf.timestamp() reads as such a float
    (record,) = records(read)
    assert 0.25 <= record["wait"] < 0.25 + (time.time() - before)
    assert "wait" not in (step(2) or records(read) or [{}])[0]
    for bad in ("soon", time.monotonic() - 1e7, float("nan"), True):
        progress_mod._CHANNEL.next_at = 0.0
        with pytest.raises(ArgumentError, match=r"graphdist\.step's ready must be the step's"):
            step(3, ready=bad)


def test_a_sync_stragglers_line_says_what_the_others_wait_for_it():
    from graphdist._distribute.events import Straggler, render

    event = Event.of(Straggler("n1", 2.0, 2.0, 0.209, 30.0, 0.21), 40.0, 1, "worker-1")
    assert render(event) == (
        "graphdist: worker-1 on n1 is a straggler: the other tasks wait 209 ms a step for it, "
        "for 30 s, at 2.0 steps/s (nothing is restarted for it)"
    )
    assert Event.from_json(event.to_json()) == event


def test_a_stragglers_line_names_it_its_node_and_what_it_costs_a_step():
    from graphdist._distribute.events import Straggler, render

    event = Event.of(Straggler("n2", 19.0, 41.0, 1 / 19 - 1 / 41, 30.0), 40.0, 1, "worker-2")
    assert render(event) == (
        "graphdist: worker-2 on n2 is a straggler: 19.0 steps/s against the other tasks' 41.0 "
        "for 30 s, 28 ms more a step (nothing is restarted for it)"
    )
    assert Event.from_json(event.to_json()) == event


# worker-2 steps four times slower than the others; nothing else differs.
SLOW = (
    "import json, os, time, graphdist\n"
    "index = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
    "for n in range(1, 121):\n"
    "    time.sleep(0.08 if index == 2 else 0.02)\n"
    "    graphdist.step(n)\n"
    "    if index != 2 and n == 120: time.sleep(0.5)\n"
)


def straggler_run(monkeypatch, script: str, workers: int, window_s: float) -> list[dict]:
    """The events of a real run of ``script`` (jsonl), the straggler window ``window_s``."""
    import graphdist
    from graphdist._distribute import progress as progress_module

    monkeypatch.setattr(progress_module, "STRAGGLER_WINDOW_S", window_s)
    out = io.StringIO()
    graphdist.run_command(
        [sys.executable, "-c", script],
        workers=workers,
        output=out,
        output_format="jsonl",
        env={"PYTHONPATH": REPO, **QUIET_TF},
        timeout_s=200,
    )
    return [json.loads(ln) for ln in out.getvalue().splitlines()]


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_real_slow_worker_is_named_a_straggler_once_and_nothing_restarts(monkeypatch):
    events = straggler_run(monkeypatch, SLOW, workers=3, window_s=1.0)
    named = [e for e in events if e["event"] == "straggler"]
    assert [e["task"] for e in named] == ["worker-2"], named
    assert named[0]["steps_per_s"] < 0.5 * named[0]["others_per_s"] and named[0]["for_s"] >= 1.0
    assert not [e for e in events if e["event"] == "restarting"]


# MultiWorkerMirroredStrategy, a custom loop: worker-1 starts each step 0.15 s late, so worker-0
# waits in the step's all-reduce for it; both step at the same pace.
SYNC_SLOW = """
import json, os, time
import tensorflow as tf
import graphdist

index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
strategy = tf.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    w = tf.Variable(1.0)

@tf.function
def train_step():
    def replica():
        with tf.GradientTape() as tape:
            loss = (2.0 * w - 1.0) ** 2
        grad = tape.gradient(loss, w)
        with tf.control_dependencies([grad]):
            ready = tf.timestamp()  # this task's part is ready: the all-reduce comes next
        with tf.control_dependencies([ready]):
            grad = tf.distribute.get_replica_context().all_reduce("sum", grad)
        w.assign_sub(0.01 * grad)
        return loss, ready
    return strategy.run(replica)

for n in range(1, 81):
    if index == 1:
        time.sleep(0.15)
    loss, ready = train_step()
    graphdist.step(n, ready=ready, loss=loss)
time.sleep(1.0)  # the last all-reduce's buffers may still be read from us: no exit under them
"""


# The same under model.fit (tf-keras): worker-1 begins each batch 0.15 s late, so worker-0 waits
# in the step's first collective (the distributed iterator's: has every worker data?); a second
# fit reuses the traced step.
SYNC_SLOW_FIT = """
import json, os, time
os.environ["TF_USE_LEGACY_KERAS"] = "1"
import numpy as np
import tensorflow as tf
import graphdist

index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
strategy = tf.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])

class Late(tf.keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if index == 1:
            time.sleep(0.15)

x = np.random.RandomState(0).rand(64 * 40, 4).astype("float32")
data = tf.data.Dataset.from_tensor_slices((x, x.sum(axis=1, keepdims=True))).batch(64)
model.fit(data, epochs=1, verbose=0, callbacks=[Late(), graphdist.progress()])
model.fit(data, epochs=1, verbose=0, callbacks=[Late(), graphdist.progress()])
# the marks are no part of the model: its weights (and so its checkpoints) are its own
assert [w.name for w in model.weights] == ["dense/kernel:0", "dense/bias:0"], model.weights
assert len(graphdist._distribute.fitmarks._MARKS) == 1
time.sleep(1.0)  # the last all-reduce's buffers may still be read from us: no exit under them
"""


@pytest.mark.integration
@pytest.mark.timeout(240)
@pytest.mark.parametrize("script", [SYNC_SLOW, SYNC_SLOW_FIT], ids=["custom-loop", "fit"])
def test_a_real_mwms_worker_the_other_waits_for_is_named_though_rates_agree(monkeypatch, script):
    events = straggler_run(monkeypatch, script, workers=2, window_s=2.0)
    ended = [e for e in events if e["event"] == "run-ended"]
    assert ended and ended[0]["ran"] == ["worker-0", "worker-1"], events[-20:]
    named = [e for e in events if e["event"] == "straggler"]
    progress = [e for e in events if e["event"] == "progress"]
    seen = [(e["at_s"], e["task"][-1], e["step"], e["wait_s"]) for e in progress]
    assert [e["task"] for e in named] == ["worker-1"], (named, seen)
    assert named[0]["others_wait_s"] >= 0.1 and named[0]["costs_s"] >= 0.1, named
    waits = {
        task: statistics.median(e["wait_s"] for e in progress if e["task"] == task)
        for task in ("worker-0", "worker-1")
    }
    assert waits["worker-0"] - waits["worker-1"] >= 0.1, waits
    assert progress[-1]["step"] == 80 and progress[-1]["wait_s"] is not None  # the 2nd fit's too


# worker-2 is slow in the first attempt only; the others step on long enough for it to be named
SLOW_ONCE = (
    "import json, os, time, graphdist\n"
    "index = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
    "first = os.environ['GRAPHDIST_RESTART'] == '0'\n"
    "for n in range(1, 400 if first else 20):\n"
    "    time.sleep(0.08 if index == 2 and first else 0.02)\n"
    "    graphdist.step(n)\n"
)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_straggler_is_killed_and_the_run_restarted_only_when_asked(monkeypatch, run_cli):
    """--restart-stragglers: the named straggler is killed, the restart's cause is it (a
    straggler, in words and in the metrics' cause label), and the next attempt runs; without
    --max-restarts the flag is refused, as it would end the run."""
    import graphdist
    from graphdist._distribute import progress as progress_module

    refused = run_cli("run", "--workers", "3", "--restart-stragglers", "--", sys.executable)
    assert refused.returncode == 2 and "--max-restarts" in refused.stderr, refused
    monkeypatch.setattr(progress_module, "STRAGGLER_WINDOW_S", 1.0)
    out = io.StringIO()
    graphdist.run_command(
        [sys.executable, "-c", SLOW_ONCE],
        workers=3,
        max_restarts=1,
        restart_stragglers=True,
        output=out,
        output_format="jsonl",
        env={"PYTHONPATH": REPO},
    )
    events = [json.loads(ln) for ln in out.getvalue().splitlines()]
    named = [e for e in events if e["event"] == "straggler"]
    (restarting,) = [e for e in events if e["event"] == "restarting"]
    assert [e["task"] for e in named] == ["worker-2"], named
    assert restarting["cause"]["task"] == "worker-2", restarting
    assert restarting["cause"]["how"].startswith("was a straggler ("), restarting
    assert restarting["cause"]["how"].endswith(") and was killed"), restarting
    assert [e["attempt"] for e in events if e["event"] == "attempt-started"] == [1, 2]
    assert events[-1]["event"] == "run-ended" and events[-1]["ran"], events[-1]


# A task on an engine's node: its command line (srun, here left out: the node's guard is run
# directly) under a local guard in "step" mode, the command under a guard whose report is its
# stderr (report_fd 2), as commandrun starts them.
ON_NODE = (
    "import sys\n"
    "import graphdist\n"
    "print('to stdout', flush=True)\n"
    "print('to stderr', file=sys.stderr, flush=True)\n"
    "for n in range(1, 4): graphdist.step(n, total=3)\n"
    'sys.stderr.write(\'pid 999999\\nexit 0 1.0\\nprogress {"step": 99, "t": 1.0}\\n\')\n'
    "raise SystemExit(3)\n"
)


@pytest.mark.timeout(60)
def test_a_steps_records_come_back_on_its_stderr_and_nothing_else_is_lost_or_forged():
    """The node guard's report (its pid, its exit, the records) rides on the step's stderr, the
    command's stderr joined to its stdout; the local guard relays the records into its own
    report, drops the node guard's pid and exit lines, and passes every other line (srun's own
    words) to stdout. What the command writes, on either stream, is output: never a record
    (its forged ones are not relayed) and never a verdict."""
    on_node = guarded_argv(
        [sys.executable, "-c", ON_NODE], grace_s=1.0, parent=True, report_fd=2, progress=True
    )
    srun = [
        sys.executable,
        "-c",
        "import subprocess, sys; print('srun: words', file=sys.stderr, "
        "flush=True); sys.exit(subprocess.call(sys.argv[1:]))",
        *on_node,
    ]
    read, write = os.pipe2(os.O_CLOEXEC)
    argv = guarded_argv(srun, grace_s=1.0, report_fd=write, progress="step")
    env = {**os.environ, "PYTHONPATH": REPO, PROGRESS_ENV: "0:0"}
    proc = subprocess.Popen(
        argv, env=env, pass_fds=(write,), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    os.close(write)
    out, _ = proc.communicate(timeout=60)
    with os.fdopen(read, "rb") as report:
        text = report.read()
    assert proc.returncode == 3
    assert [r["step"] for r in parse_progress(text)] == [1, 3]  # the first, then the last
    pid, end = parse_report(text)
    assert end is not None and end[0] == 3 and pid != 999999
    lines = out.decode().splitlines()
    assert sorted(lines) == sorted(  # the node guard's pid and exit lines are not among them
        [
            "to stdout",
            "to stderr",
            "srun: words",
            "pid 999999",  # the command's own, output as written
            "exit 0 1.0",
            'progress {"step": 99, "t": 1.0}',
        ]
    )


# srun's last words after 87 KB of its stderr (a lost node's), then it exits 0 at once: its
# stderr pipe and the relay's stdout hold it all, so srun ends while the relay still waits
LAST_WORDS = (
    "import os, sys\n"
    "for i in range(1500): os.write(2, b'srun: noise %05d' % i + b'x' * 40 + b'\\n')\n"
    "os.write(2, b'x' * 3000 + b'\\nsrun: error: Node failure on n1\\n')\n"
)


@pytest.mark.timeout(60)
def test_srun_s_last_words_reach_stdout_before_its_exit_whoever_reads_slowly():
    """A step-mode guard says srun's exit only once srun's stderr, relayed to stdout, is all
    there: the launcher reads the exit and finds a lost node's words already waiting, though
    it read nothing of the output for seconds (a slow terminal); a line too long to be a
    record is passed on whole, after the lines before it. Red when the exit comes first."""
    import fcntl
    import selectors
    import struct
    import termios

    read, write = os.pipe2(os.O_CLOEXEC)
    argv = guarded_argv(
        [sys.executable, "-c", LAST_WORDS], grace_s=1.0, report_fd=write, progress="step"
    )
    proc = subprocess.Popen(argv, pass_fds=(write,), stdout=subprocess.PIPE)
    os.close(write)
    assert proc.stdout is not None
    out_fd = proc.stdout.fileno()
    time.sleep(2.5)  # nothing read: the relay waits on a full stdout, srun has ended
    os.set_blocking(out_fd, False)
    os.set_blocking(read, False)
    out, report = b"", b""
    with contextlib.suppress(BlockingIOError):
        report += os.read(read, 65536)  # the report first: an exit there now came too early
    with selectors.DefaultSelector() as sel:
        sel.register(out_fd, selectors.EVENT_READ)
        sel.register(read, selectors.EVENT_READ)
        while parse_report(report)[1] is None:
            for key, _ in sel.select(timeout=30):
                with contextlib.suppress(BlockingIOError):
                    if key.fd == read:
                        report += os.read(read, 65536)
                    else:
                        out += os.read(out_fd, 1 << 20)
    # what stdout held when the exit was read: no more (the relay may still be writing)
    (held,) = struct.unpack("i", fcntl.ioctl(out_fd, termios.FIONREAD, b"\0" * 4))
    while held > 0:
        chunk = os.read(out_fd, held)
        out, held = out + chunk, held - len(chunk)
    assert b"srun: error: Node failure on n1\n" in out.split(b"x" * 3000 + b"\n", 1)[1]
    assert out.count(b"srun: noise") == 1500
    assert proc.wait(timeout=30) == 0
    os.close(read)


def test_a_step_relay_passes_a_long_line_on_whole_after_the_lines_before_it(capfd):
    """A line too long to be a record (srun's words, a flood) reaches stdout whole and in its
    place, however the pipe cut it: never before the lines ahead of it (a lost node's line
    glued behind it would no longer be read), and its tail never read as a record."""
    from graphdist._proc.guardreport import ProgressRelay

    read, write = os.pipe()
    relay = ProgressRelay(write, step=True)
    srun = os.dup(relay.write_fd)
    relay.started()
    os.write(srun, b"srun: error: Node failure on n1\n" + b"x" * 3000)
    time.sleep(0.3)  # the relay has read that much
    os.write(srun, b'progress {"step": 1, "t": 1.0}\nprogress {"step": 2, "t": 2.0}\n')
    os.close(srun)
    relay.finish(10.0)
    os.close(write)
    with os.fdopen(read, "rb") as report:
        assert [r["step"] for r in parse_progress(report.read())] == [2]
    out = capfd.readouterr().out
    assert (
        out == "srun: error: Node failure on n1\n" + "x" * 3000 + 'progress {"step": 1, "t": 1.0}\n'
    )


@pytest.mark.timeout(60)
def test_a_finished_relay_leaves_later_forks_their_files():
    """A relay's read end is closed in a forked child only while the relay holds it: once it
    ended, its number may be another file's (here: a later pipe's), and a fork then (a Popen
    with a preexec_fn runs the at-fork hooks before its dup2s) must keep that file. Red when
    the child closes the number the relay once had (CI: Popens failing with EBADF, in the test
    process that ran a relay)."""
    from graphdist._proc.guardreport import ProgressRelay

    read, write = os.pipe()
    relay = ProgressRelay(write, step=True)
    old = relay._read
    relay.started()  # the relay's write end goes, and there is no other: it ends at once
    relay.finish(10.0)
    assert not relay._thread.is_alive()
    os.close(write)
    os.close(read)
    held_r, held_w = os.pipe()
    try:
        os.dup2(held_r, old)  # the number is another file's now, as in a busy process
        code = subprocess.run(
            [sys.executable, "-c", f"import os; os.fstat({old})"],
            pass_fds=(old,),
            preexec_fn=lambda: None,
            timeout=30,
            check=False,
        ).returncode
        assert code == 0
    finally:
        for fd in {held_r, held_w, old}:
            with contextlib.suppress(OSError):
                os.close(fd)


@pytest.mark.timeout(60)
def test_a_leftover_holding_sruns_stderr_does_not_hold_back_its_exit():
    """srun's words drained, its exit is said at once, though a process it left (a site's
    wrapper) still holds its stderr open: the drain waits for srun's words, not for the pipe's
    end. Red when the guard waits for the relay to end (DRAIN_S)."""
    left = (
        "import subprocess, sys; subprocess.Popen(['sleep', '30']); print('bye', file=sys.stderr)"
    )
    read, write = os.pipe2(os.O_CLOEXEC)
    argv = guarded_argv([sys.executable, "-c", left], grace_s=1.0, report_fd=write, progress="step")
    started = time.monotonic()
    proc = subprocess.Popen(argv, pass_fds=(write,), stdout=subprocess.PIPE)
    os.close(write)
    report = b""
    while parse_report(report)[1] is None:
        chunk = os.read(read, 65536)
        assert chunk, report
        report += chunk
    took = time.monotonic() - started
    assert proc.communicate(timeout=30)[0] == b"bye\n"
    os.close(read)
    assert took < 15, took  # a drain that waits for the pipe's end: 60 s


def test_a_straggler_is_killed_only_in_its_own_attempt_and_while_a_restart_is_left(monkeypatch):
    """take_stragglers: the stragglers of this attempt, named since the last call; one named as
    its attempt broke is never the next attempt's namesake's death, and with the restart budget
    spent a straggler is named only (a slow run that ends beats a run that fails)."""
    from graphdist._distribute.events import AttemptStarted
    from graphdist._distribute.runspec import RunSpec
    from graphdist._distribute.runstate import RunState

    monkeypatch.setattr(progress_mod, "STRAGGLER_WINDOW_S", 0.0)
    spec = RunSpec.check(
        ["python", "train.py"], workers=3, max_restarts=1, restart_stragglers=True,
        output=io.StringIO(), output_format="jsonl",
    )  # fmt: skip
    state = RunState(spec, None)
    tasks = ["worker-0", "worker-1", "worker-2"]

    def attempt(n: int, *, steps: bool = True) -> None:
        state.attempt = n
        state._emit(AttemptStarted(tasks, [], n - 1, "local", {}, {}))
        for t in (1.0, 2.0) if steps else ():
            for task, rate in (("worker-0", 40), ("worker-1", 42), ("worker-2", 5)):
                state.progress(task, record(int(rate * t), t, first=t == 1.0))

    attempt(1)
    assert list(state.take_stragglers()) == ["worker-2"]
    assert state.take_stragglers() == {}  # taken once
    attempt(2)  # named again as the attempt broke, not taken: the next attempt's is not it
    state.attempt = 3
    assert state.take_stragglers() == {}
    attempt(4)
    state.policy.restarted(state.policy.failed(what="worker-2", startup=False))
    assert state.take_stragglers() == {}  # no restart left: named, not killed
