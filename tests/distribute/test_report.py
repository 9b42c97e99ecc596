"""``graphdist report RUN_DIR`` (graphdist._distribute.report): each bar's state by a rule over
the events' facts, whatever order they came in; a folder that is not a run's and an output that
cannot be written refused in one line; a page that fetches nothing and runs no script; and a
real restarted run's page loaded in a real headless Chromium with no console error, its lanes
in the screenshot."""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from graphdist._distribute.events import (
    AttemptStarted,
    Cause,
    Event,
    GaveUp,
    Line,
    Preempted,
    Progress,
    Restarting,
    RunEnded,
    Stopping,
    Straggler,
    TaskExited,
    TaskStarted,
)
from graphdist._distribute.report import read_run, write_report
from graphdist._distribute.reportdraw import COLOURS, page
from graphdist._distribute.runtimeline import MAX_POINTS, timeline
from graphdist._exceptions import ArgumentError
from tests.conftest import REPO, run_python

WORKERS = ["worker-0", "worker-1"]


def started(attempt: int, at_s: float, servers: tuple[str, ...] = ()) -> Event:
    nodes = dict.fromkeys(WORKERS, "vm")
    return Event.of(
        AttemptStarted(WORKERS, list(servers), attempt - 1, "local", nodes, {}), at_s, attempt
    )


def task(attempt: int, at_s: float, name: str, pid: int) -> Event:
    return Event.of(TaskStarted(pid, True), at_s, attempt, name)


def exited(attempt: int, at_s: float, name: str, pid: int, code: int, ended: float) -> Event:
    how = "exited with code 0" if code == 0 else f"exited with code {code}"
    if code == -9:
        how = "was killed by SIGKILL (exit status 137)"
    return Event.of(TaskExited(pid, code, how, ended_at_s=ended), at_s, attempt, name)


def cause(name: str, pid: int, code: int, ended: float) -> Cause:
    return Cause(name, pid, code, f"exited with code {code}", ended)


def restarted_run() -> list[Event]:
    """worker-1 (pid 11) exits 3 at 2.0 s; the launcher stops worker-0 (pid 10, SIGKILL); the
    second attempt's tasks exit 0."""
    return [
        started(1, 1.0),
        task(1, 1.0, "worker-0", 10),
        task(1, 1.0, "worker-1", 11),
        Event.of(Progress(5, 10, None, {"loss": 0.5}), 1.5, 1, "worker-0"),
        exited(1, 2.2, "worker-0", 10, -9, 2.1),
        exited(1, 2.2, "worker-1", 11, 3, 2.0),
        Event.of(Restarting(cause("worker-1", 11, 3, 2.0), 0.0, "run", "restarting"), 2.2, 1),
        started(2, 2.3),
        task(2, 2.3, "worker-0", 20),
        task(2, 2.3, "worker-1", 21),
        Event.of(Progress(4, 10, None, {"loss": 0.4}, redone=1), 2.5, 2, "worker-0"),
        Event.of(Progress(10, 10, 20.0, {"loss": 0.1}), 3.0, 2, "worker-0"),
        Event.of(Straggler("vm", 2.0, 20.0, 0.45, 30.0), 2.8, 2, "worker-1"),
        exited(2, 3.5, "worker-0", 20, 0, 3.4),
        exited(2, 3.5, "worker-1", 21, 0, 3.3),
        Event.of(RunEnded("every task exited 0", 2, steps={"worker-0": 10}, redone=1), 3.6, 2),
    ]


def states(events: list[Event]) -> dict[tuple[str, int], str]:
    return {(s.task, s.attempt): s.state for s in timeline(events).spans}


def test_the_cause_failed_the_task_the_launcher_stopped_was_stopped_and_exit_0_is_done():
    assert states(restarted_run()) == {
        ("worker-0", 1): "stopped",
        ("worker-1", 1): "failed",
        ("worker-0", 2): "done",
        ("worker-1", 2): "done",
    }


def test_the_states_come_from_the_facts_not_from_which_exit_came_first():
    events = restarted_run()
    want = states(events)
    exits = [i for i, e in enumerate(events) if e.kind == "task-exited" and e.attempt == 1]
    for seed in range(5):  # the same attempt's exits, in any order
        shuffled = list(events)
        order = [events[i] for i in exits]
        random.Random(seed).shuffle(order)
        for i, e in zip(exits, order, strict=True):
            shuffled[i] = e
        assert states(shuffled) == want


def test_a_task_named_by_the_cause_but_with_another_pid_was_stopped_not_failed():
    events = restarted_run()
    events[6] = Event.of(Restarting(cause("worker-1", 99, 3, 2.0), 0.0, "run", "r"), 2.2, 1)
    assert states(events)[("worker-1", 1)] == "stopped"


def test_a_preempted_attempt_a_stop_signal_a_gave_up_run_and_one_still_running():
    events = [
        started(1, 1.0),
        task(1, 1.0, "worker-0", 10),
        task(1, 1.0, "worker-1", 11),
        exited(1, 2.0, "worker-0", 10, 42, 1.9),
        exited(1, 2.0, "worker-1", 11, -9, 1.9),
        Event.of(Preempted(42, "restarting at once"), 2.0, 1),
        started(2, 2.1),
        task(2, 2.1, "worker-0", 20),
        task(2, 2.1, "worker-1", 21),
        Event.of(Stopping("SIGINT", WORKERS, 5.0), 2.5, 2),
        exited(2, 2.6, "worker-0", 20, -2, 2.6),
        exited(2, 2.6, "worker-1", 21, 0, 2.6),
        started(3, 3.0),
        task(3, 3.0, "worker-0", 30),
        task(3, 3.0, "worker-1", 31),
        exited(3, 4.0, "worker-1", 31, 1, 3.9),
        Event.of(GaveUp(cause("worker-1", 31, 1, 3.9), "budget", "no restart left"), 4.0, 3),
        started(4, 5.0),
        task(4, 5.0, "worker-0", 40),
    ]
    got = states(events)
    assert got[("worker-0", 1)] == "preempted"
    assert got[("worker-1", 1)] == "stopped"  # not the preemption's code
    assert (got[("worker-0", 2)], got[("worker-1", 2)]) == ("stopped", "done")
    assert (got[("worker-0", 3)], got[("worker-1", 3)]) == ("running", "failed")
    assert got[("worker-0", 4)] == "running"
    tl = timeline(events)
    assert tl.outcome is None and tl.ends[4] == "still running"
    assert tl.ends[3].startswith("worker-1 exited with code 1")


def test_an_exit_with_no_cause_failed_on_its_own():
    events = [started(1, 1.0), task(1, 1.0, "worker-0", 10), exited(1, 2.0, "worker-0", 10, 1, 2.0)]
    assert states(events) == {("worker-0", 1): "failed"}


def test_a_servers_restart_ends_its_bar_failed_and_a_new_one_goes_on():
    events = [
        started(1, 1.0, servers=("ps-0", "worker-1")),
        task(1, 1.0, "chief-0", 10),
        Event.of(Restarting(cause("worker-1", 7, -9, 2.0), 0.5, "server", "again"), 2.1, 1),
        exited(1, 4.0, "chief-0", 10, 0, 4.0),
        Event.of(TaskExited(7, -15, "stopped", server=True), 4.1, 1, "worker-1"),
        Event.of(TaskExited(8, -15, "stopped", server=True), 4.1, 1, "ps-0"),
    ]
    tl = timeline(events)
    bars = [(s.task, s.start_s, s.end_s, s.state) for s in tl.spans if s.task == "worker-1"]
    assert bars == [("worker-1", 1.0, 2.0, "failed"), ("worker-1", 2.6, 4.1, "stopped")]
    assert tl.tasks == ["chief-0", "worker-0", "worker-1", "ps-0"]  # chief, workers, ps


def test_progress_is_read_per_task_and_attempt_and_a_long_runs_is_thinned():
    tl = timeline(restarted_run())
    points = tl.progress["worker-0"]
    assert [(p.attempt, p.step, p.redone, p.loss) for p in points] == [
        (1, 5, 0, 0.5),
        (2, 4, 1, 0.4),
        (2, 10, 0, 0.1),
    ]
    many = [started(1, 0.0)] + [
        Event.of(Progress(i, None, 1.0, {}), i / 10, 1, "worker-0") for i in range(50 * MAX_POINTS)
    ]
    thinned = timeline(many).progress["worker-0"]
    assert MAX_POINTS <= len(thinned) <= 2 * MAX_POINTS + 1
    assert (thinned[0].step, thinned[-1].step) == (0, 50 * MAX_POINTS - 1)
    gaps = {b.step - a.step for a, b in itertools.pairwise(thinned[:-1])}
    assert len(gaps) == 1  # evenly spread


def test_a_long_runs_file_is_thinned_as_it_is_read(tmp_path):
    """Only the drawn records are kept in memory: a night's worth is read into at most twice
    MAX_POINTS per task and attempt, each attempt's first (its redone) and last kept."""
    lines = [started(1, 0.0), task(1, 0.0, "worker-0", 10)]
    lines += [Event.of(Progress(i, None, 9.0, {}), i, 1, "worker-0") for i in range(30_000)]
    lines += [started(2, 30_001.0), task(2, 30_001.0, "worker-0", 20)]
    lines += [Event.of(Progress(5, None, None, {}, redone=7), 30_002.0, 2, "worker-0")]
    read, skipped = read_run(run_dir(tmp_path, lines))
    steps = [(e.attempt, e.data["step"]) for e in read if e.kind == "progress"]
    assert skipped == 0 and len(steps) <= 2 * MAX_POINTS + 2
    assert steps[0] == (1, 0) and (1, 29_999) in steps and steps[-1] == (2, 5)
    assert [e.kind for e in read][:2] == ["attempt-started", "task-started"]  # in file order


def test_a_timeout_or_a_failed_start_shows_the_launchers_stops_not_failures():
    """No cause in the run's last attempt, and a run-ended: the launcher stopped the tasks (a
    timeout, a task that could not start); with no run-ended (the launcher died) an exit with
    no cause is the task's own failure."""
    events = [
        started(1, 1.0),
        task(1, 1.0, "worker-0", 10),
        task(1, 1.0, "worker-1", 11),
        exited(1, 5.0, "worker-0", 10, -15, 5.0),
        exited(1, 5.0, "worker-1", 11, -15, 5.0),
    ]
    assert set(states(events).values()) == {"failed"}
    ended = Event.of(RunEnded("timed out after 4 s", 1), 5.1, 1)
    assert set(states([*events, ended]).values()) == {"stopped"}


def test_odd_values_and_hostile_words_are_drawn_or_left_out_never_a_traceback(tmp_path):
    """A hand-edited or cut events.jsonl (Infinity, NaN, an attempt past any int), a task named
    with markup or mathtext, a path with no UTF-8: a page, escaped, and no script in it."""
    hostile = "<img src=x onerror=alert(1)>$\\frac{$"
    events = [
        started(1, 1.0),
        Event.of(TaskStarted(10, True), 1.0, 1, hostile),
        Event.of(Progress(1, None, None, {"loss": 0.5}), 1.5, 1, hostile),
        Event.of(Progress(2, None, 3.0, {"loss": 0.4}), 2.0, 1, hostile),
        Event.of(TaskExited(10, 3, "exited <b>3</b> $x$", ended_at_s=2.5), 2.6, 1, hostile),
        Event.of(
            GaveUp(Cause(hostile, 10, 3, "exited <b>3</b> $x$", 2.5), "failed", "end"), 2.7, 1
        ),
    ]
    extra = (
        '{"event": "progress", "at_s": 2.1, "attempt": 1, "task": "worker-0", "step": 3, '
        '"total": null, "steps_per_s": Infinity, "scalars": {"loss": NaN}, "redone": 0}\n'
        '{"event": "task-started", "at_s": Infinity, "attempt": 1, "task": "worker-0", '
        '"pid": 1, "warm": true, "cold_because": null, "spare": false}\n'
        '{"event": "task-started", "at_s": 1.0, "attempt": 1e999, "task": "worker-0", '
        '"pid": 1, "warm": true, "cold_because": null, "spare": false}\n' + "[" * 100_000 + "\n"
    )
    folder = tmp_path / "run-\udcff"
    folder.mkdir()
    (folder / "events.jsonl").write_text("".join(e.to_json() + "\n" for e in events) + extra)
    _, skipped = read_run(folder)
    assert skipped == 3
    path = write_report(str(folder))
    text = Path(path).read_bytes().decode("utf-8")
    assert "<img" not in text and "onerror=alert" not in text.replace("onerror=alert(1)&gt;", "")
    assert "&lt;img src=x onerror=alert(1)&gt;" in text and "<b>" not in text
    assert "run-\\udcff" in text  # the path, escaped
    write_report(str(folder), tmp_path / "odd.png")


def run_dir(tmp_path, events: list[Event], extra: str = "") -> str:
    folder = tmp_path / "run-1"
    folder.mkdir(mode=0o700)
    text = "".join(e.to_json() + "\n" for e in events)
    (folder / "events.jsonl").write_text(text + extra)
    return str(folder)


def test_task_lines_are_passed_over_and_a_cut_line_is_counted_not_fatal(tmp_path):
    events = restarted_run()
    events.insert(2, Event.of(Line("hello"), 1.1, 1, "worker-0"))
    folder = run_dir(tmp_path, events, extra='{"event": "progress", "at_s": 3.7, "att')
    read, skipped = read_run(folder)
    assert skipped == 1
    assert [e.kind for e in read] == [e.kind for e in events if e.kind != "line"]
    assert "1 line(s) of events.jsonl" in page(timeline(read, skipped), folder)


def test_the_page_is_one_file_that_fetches_nothing_and_runs_no_script(tmp_path):
    folder = run_dir(tmp_path, restarted_run())
    path = write_report(folder)
    assert path == os.path.join(folder, "report.html")
    text = Path(path).read_text()
    assert "<script" not in text.lower() and "@import" not in text
    assert text.count("url(") == text.count("url(#")  # the SVG's clip paths, in the page
    for attr in ("src=", "href="):  # only links inside the page (the SVG's own ids)
        for part in text.split(attr)[1:]:
            assert part[1] == "#", part[:80]
    # each bar carries its task, attempt and state: a wrong rule is a wrong id
    for bar in (
        "worker-1-attempt-1-failed",
        "worker-0-attempt-1-stopped",
        "worker-0-attempt-2-done",
    ):
        assert f'id="lane-{bar}"' in text
    assert "worker-1 exited with code 3" in text  # the attempts table, in words
    assert stat.S_IMODE(os.stat(path).st_mode) & 0o077 == 0


def coloured(png: str, state: str) -> int:
    """How many pixels of the image ``png`` have the colour of a bar in ``state``."""
    from matplotlib.image import imread

    pixels = imread(png)[..., :3]
    want = [int(COLOURS[state][i : i + 2], 16) / 255 for i in (1, 3, 5)]
    return int((abs(pixels - want) < 0.02).all(axis=-1).sum())


def test_the_png_is_the_same_figure(tmp_path):
    folder = run_dir(tmp_path, restarted_run())
    path = write_report(folder, tmp_path / "run.png")
    for state in ("failed", "stopped", "done"):  # the same bars, in the same colours
        assert coloured(path, state) > 400, state
    assert coloured(path, "preempted") < 400  # only its legend
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".report-")]  # no temp left


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda d: str(d / "nothere"), "no such folder"),
        (lambda d: (d / "f.txt").write_text("x") and str(d / "f.txt"), "it is not a folder"),
        (lambda d: str(d), "it holds runs (run-1): pass one"),
        (lambda d: str(d / "run-1" / "attempt-1"), "it is not a run's log folder"),
    ],
)
def test_a_folder_that_is_not_a_runs_is_refused_in_one_line_with_exit_2(
    tmp_path, run_cli, make, fragment
):
    run_dir(tmp_path, restarted_run())
    (tmp_path / "run-1" / "attempt-1").mkdir()
    target = make(tmp_path)
    result = run_cli("report", target)
    assert result.returncode == 2, result
    assert result.stdout == "" and result.stderr.count("\n") == 1, result
    assert fragment in result.stderr and "Traceback" not in result.stderr


def test_events_of_no_run_and_outputs_that_cannot_be_written_are_refused(tmp_path, run_cli):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "events.jsonl").write_text("not json\n")
    with pytest.raises(ArgumentError, match="no run's events"):
        read_run(empty)
    folder = run_dir(tmp_path, restarted_run())
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    for output, fragment in (
        ("r.txt", "--output must name a file ending in .html or .png"),
        (str(tmp_path / "missing" / "r.html"), "No such file or directory"),
        (str(shared / "r.html"), "others can write to it (mode 0777, no sticky bit)"),
        (folder, "--output must name a file ending"),
        (str(tmp_path / "r.html") + "/", "--output must name a file ending"),
    ):
        result = run_cli("report", folder, "--output", output)
        assert result.returncode == 2 and fragment in result.stderr, result
    assert not os.listdir(shared)
    shared.chmod(0o1777)  # sticky, as /tmp: written aside, then renamed into place
    result = run_cli("report", folder, "--output", str(shared / "r.html"))
    assert result.returncode == 0 and os.listdir(shared) == ["r.html"], result
    os.chmod(folder, 0)
    try:
        if not os.access(folder, os.R_OK):  # root reads it anyway
            assert "you cannot read it" in run_cli("report", folder).stderr
    finally:
        os.chmod(folder, 0o700)


def test_a_user_matplotlibrc_changes_nothing(tmp_path, monkeypatch):
    """text.usetex in the user's matplotlibrc needs LaTeX, which this machine lacks: the report
    draws with matplotlib's defaults (line widths its own, not the user's 9), and draws."""
    folder = run_dir(tmp_path, restarted_run())
    import matplotlib

    monkeypatch.setitem(matplotlib.rcParams, "text.usetex", True)
    monkeypatch.setitem(matplotlib.rcParams, "lines.linewidth", 9.0)
    text = Path(write_report(folder, tmp_path / "b.html")).read_text()
    assert "stroke-width: 1.2" in text and "stroke-width: 9" not in text
    write_report(folder, tmp_path / "b.png")


def test_a_write_that_fails_leaves_no_temp_file_and_says_why(tmp_path, monkeypatch):
    folder = run_dir(tmp_path, restarted_run())

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("graphdist._distribute.reportdraw.page", full)
    from graphdist._exceptions import PictureError

    with pytest.raises(PictureError, match="No space left on device"):
        write_report(folder)
    assert sorted(os.listdir(folder)) == ["events.jsonl"]


# -- a real run, in a real browser ---------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"

# worker-1 exits 3 after 31 steps in the first attempt, while worker-0 waits there to be stopped
# (whatever the machine's load: it never ends on its own); the second resumes both from step 10
STEPS = (
    "import json, os, sys, time\n"
    "import graphdist\n"
    "again = os.environ['GRAPHDIST_RESTART'] != '0'\n"
    "index = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
    "for i in range(10 if again else 0, 40):\n"
    "    time.sleep(0.02)\n"
    "    graphdist.step(i + 1, total=40, loss=1.0 / (i + 1))\n"
    "    if i == 30 and not again:\n"
    "        sys.exit(3) if index == 1 else time.sleep(600)\n"
)


def headless(url: str, tmp_path, *flags: str) -> subprocess.CompletedProcess[str]:
    """Debian's Chromium, headless, on ``url``, with no profile of anyone's and no network
    wanted (the machine's is closed: background fetches would be refused)."""
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"
    argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic"]
    argv += ["--no-first-run", "--disable-background-networking", "--disable-component-update"]
    argv += ["--disable-sync", f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0"]
    return subprocess.run(
        [*argv, *flags, url], capture_output=True, text=True, timeout=90, start_new_session=True
    )


def console_errors(stderr: str) -> list[str]:
    """What the page wrote to its console or threw, as Chromium logs it (``CONSOLE`` lines)."""
    return [ln for ln in stderr.splitlines() if ":CONSOLE" in ln or "Uncaught" in ln]


@pytest.mark.integration
@pytest.mark.promise
@pytest.mark.timeout(240)
def test_a_real_restarted_runs_page_loads_in_chromium_with_no_console_error_and_shows_lanes(
    tmp_path,
):
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"Debian's chromium is not installed ({CHROMIUM}): make test installs it")
    logs = tmp_path / "logs"
    argv = ["-m", "graphdist", "run", "--workers", "2", "--max-restarts", "1"]
    argv += ["--log-dir", str(logs), "--", sys.executable, "-c", STEPS]
    done = run_python(argv, env={"PYTHONPATH": REPO}, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    (folder,) = list(logs.iterdir())
    shown = run_python(["-m", "graphdist", "report", str(folder)], env={"PYTHONPATH": REPO})
    assert shown.returncode == 0, shown.stderr
    path = shown.stdout.strip()
    text = Path(path).read_text()
    for bar in ("worker-1-attempt-1-failed", "worker-0-attempt-1-stopped"):
        assert f'id="lane-{bar}"' in text
    # the detector sees a console error where a page has one: a planted one is caught
    planted = tmp_path / "planted.html"
    planted.write_text("<html><body><script>console.error('planted')</script></body></html>")
    assert console_errors(headless(planted.as_uri(), tmp_path, "--dump-dom").stderr)
    dom = headless(f"file://{path}", tmp_path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert console_errors(dom.stderr) == []
    assert 'id="lane-worker-1-attempt-1-failed"' in dom.stdout  # parsed into the page's DOM
    shot = tmp_path / "shot.png"
    done = headless(f"file://{path}", tmp_path, f"--screenshot={shot}", "--window-size=1200,1000")
    assert shot.exists(), done.stderr[-2000:]
    for state in ("failed", "stopped", "done"):  # the lanes' bars, drawn on screen
        near = coloured(str(shot), state)
        assert near > 400, (state, near)  # a bar: tens of pixels each way
    with open(os.path.join(folder, "events.jsonl")) as f:
        assert any(json.loads(ln)["event"] == "progress" for ln in f)
