"""A run's metrics file (``graphdist run --metrics-file``, graphdist._distribute.runmetrics): the
Prometheus text format, read back with the Prometheus client's own parser; the folder refused
where it is missing or others can write to it; the file replaced whole; a failed write said
once; and a real run's restart counted as node_exporter would read it."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from graphdist._distribute.events import (
    AttemptStarted,
    Cause,
    Event,
    OutputLost,
    Preempted,
    Restarting,
    RunEnded,
    TaskStarted,
    render,
)
from graphdist._distribute.runmetrics import (
    RunMetrics,
    check_metrics_file,
    restart_cause,
    run_outcome,
)
from graphdist._distribute.taskproc import how
from graphdist._exceptions import ArgumentError
from graphdist._proc.oom import OomKill
from graphdist._proc.slurm import out_of_memory
from tests.conftest import run_python

EXIT_USAGE = 2


def samples(path: os.PathLike[str] | str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the file, parsed as Prometheus parses it: (name, labels) -> value."""
    with open(path) as f:
        text = f.read()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def types(path: os.PathLike[str] | str) -> dict[str, str]:
    with open(path) as f:
        return {family.name: family.type for family in text_string_to_metric_families(f.read())}


def at(s_: float, attempt: int, payload: object, task: str | None = None) -> Event:
    return Event.of(payload, s_, attempt, task)  # type: ignore[arg-type]


def killed(task: str, ended_at_s: float) -> Cause:
    return Cause(task, 123, -9, "was killed by SIGKILL (exit status 137)", ended_at_s)


def test_a_runs_events_become_counters_and_gauges_in_the_prometheus_format(tmp_path):
    path = str(tmp_path / "mnist.prom")
    metrics = RunMetrics(path)
    events = [
        at(0.1, 1, AttemptStarted(["worker-0", "worker-1"], [], 0, "local", {}, {})),
        at(0.5, 1, TaskStarted(10, warm=True), "worker-0"),
        at(3.0, 1, Restarting(killed("worker-1", 2.5), 1.0, "run", "restart 1 of 1")),
        at(3.9, 2, AttemptStarted(["worker-0", "worker-1"], [], 1, "local", {}, {})),
        at(4.0, 2, TaskStarted(11, warm=True), "worker-0"),
        at(4.1, 2, TaskStarted(12, warm=True), "worker-1"),
        at(9.0, 2, Preempted(42, "at once")),
    ]
    for event in events:
        assert metrics.feed(event) is None
    got = samples(path)
    run = (("run", "mnist"),)
    assert types(path) == {
        "graphdist_run_up": "gauge",
        "graphdist_run_start_time_seconds": "gauge",
        "graphdist_run_attempt": "gauge",
        "graphdist_run_attempts": "counter",
        "graphdist_run_restarts": "counter",
        "graphdist_run_task_failures": "counter",
        "graphdist_run_preemptions": "counter",
        "graphdist_run_recovery_seconds": "counter",
        "graphdist_run_last_recovery_seconds": "gauge",
    }
    for cause in ("exit", "frozen", "straggler", "lost", "oom"):  # from 0: a rate sees the first
        assert (
            got[("graphdist_run_restarts_total", (("cause", cause), *run, ("scope", "run")))] == 0
        )
    assert got[("graphdist_run_up", run)] == 1
    assert got[("graphdist_run_attempt", run)] == 2
    assert got[("graphdist_run_attempts_total", run)] == 2
    assert got[("graphdist_run_restarts_total", (("cause", "signal"), *run, ("scope", "run")))] == 1
    assert got[("graphdist_run_task_failures_total", (("run", "mnist"), ("task", "worker-1")))] == 1
    assert got[("graphdist_run_preemptions_total", run)] == 1
    # from worker-1's end (2.5 s) to the next attempt's first task start (4.0 s)
    assert got[("graphdist_run_recovery_seconds_total", run)] == pytest.approx(1.5)
    assert got[("graphdist_run_last_recovery_seconds", run)] == pytest.approx(1.5)
    assert ("graphdist_run_outcome", (("outcome", "succeeded"), *run)) not in got

    metrics.feed(at(12.0, 2, RunEnded("every task exited 0", 2, ran=["worker-0", "worker-1"])))
    got = samples(path)
    assert got[("graphdist_run_up", run)] == 0
    assert got[("graphdist_run_outcome", (("outcome", "succeeded"), *run))] == 1
    assert oct(os.stat(path).st_mode & 0o777) == "0o644"  # node_exporter reads it as its user
    assert os.listdir(tmp_path) == ["mnist.prom"]  # no temporary file left


def test_the_file_is_replaced_whole_never_rewritten_in_place(tmp_path):
    path = str(tmp_path / "r.prom")
    metrics = RunMetrics(path)
    metrics.feed(at(0.1, 1, AttemptStarted(["worker-0"], [], 0, "local", {}, {})))
    with open(path) as reader:  # a scrape that opened the file before the next write
        first = reader.read()
        metrics.feed(at(3.0, 1, Restarting(killed("worker-0", 2.5), 1.0, "run", "restart")))
        reader.seek(0)
        assert reader.read() == first  # it still reads the whole old file: a rename, not a write
    key = ("graphdist_run_restarts_total", (("cause", "signal"), ("run", "r"), ("scope", "run")))
    assert samples(path)[key] == 1


def test_a_servers_restart_is_its_own_scope_and_no_recovery_is_timed_from_it(tmp_path):
    """A ps run's server restarted alone starts no command task: the next task start, after a
    preemption, is that preemption's, not this failure's recovery."""
    path = tmp_path / "ps.prom"
    metrics = RunMetrics(str(path))
    metrics.feed(at(0.1, 1, AttemptStarted(["chief-0"], ["ps-0"], 0, "local", {}, {})))
    metrics.feed(at(0.5, 1, TaskStarted(10, warm=False), "chief-0"))
    metrics.feed(at(5.0, 1, Restarting(killed("ps-0", 4.0), 1.0, "server", "restart 1 of 2")))
    metrics.feed(at(90.0, 1, Preempted(42, "at once")))
    metrics.feed(at(91.0, 2, AttemptStarted(["chief-0"], ["ps-0"], 0, "local", {}, {})))
    metrics.feed(at(91.5, 2, TaskStarted(11, warm=False), "chief-0"))
    got = samples(path)
    run = (("run", "ps"),)
    assert (
        got[("graphdist_run_restarts_total", (("cause", "signal"), *run, ("scope", "server")))] == 1
    )
    assert got[("graphdist_run_restarts_total", (("cause", "signal"), *run, ("scope", "run")))] == 0
    assert got[("graphdist_run_recovery_seconds_total", run)] == 0
    assert ("graphdist_run_last_recovery_seconds", run) not in got


def test_an_event_that_changes_nothing_writes_nothing(tmp_path):
    path = tmp_path / "r.prom"
    metrics = RunMetrics(str(path))
    assert metrics.feed(at(0.5, 1, TaskStarted(10, warm=True), "worker-0")) is None
    assert not path.exists()


def test_a_failed_write_removes_the_file_and_is_said_once(tmp_path, monkeypatch):
    path = tmp_path / "r.prom"
    metrics = RunMetrics(str(path))
    assert metrics.feed(at(0.1, 1, AttemptStarted(["worker-0"], [], 0, "local", {}, {}))) is None
    assert samples(path)[("graphdist_run_up", (("run", "r"),))] == 1

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("tempfile.mkstemp", full)  # the disk is full
    why = metrics.feed(at(3.9, 2, AttemptStarted(["worker-0"], [], 1, "local", {}, {})))
    assert why == "No space left on device"
    assert not path.exists()  # left, it would say "up" as long as it is scraped
    assert metrics.feed(at(9.0, 1, RunEnded("succeeded", 1))) is None  # said once, not again
    line = render(at(0.2, 1, OutputLost(metrics.path, why)), [])
    assert line == (
        f"graphdist: cannot write the run's metrics {metrics.path}: No space left on device; "
        "they are no longer written"
    )


@pytest.mark.parametrize(
    ("outcome", "word"),
    [
        (SimpleNamespace(exitcode=-9, oom=OomKill(7, "python", "/job", 1 << 30).words()), "oom"),
        (
            SimpleNamespace(
                exitcode=-9, oom=out_of_memory(b"srun: error: n1: task 0: Out Of Memory")
            ),
            "oom",
        ),
        (SimpleNamespace(exitcode=-9, frozen="stopped for 10 s"), "frozen"),
        (SimpleNamespace(exitcode=-9, straggler="2.0 steps/s against 9.0 for 30 s"), "straggler"),
        (SimpleNamespace(exitcode=-9, lost="node n2 is gone"), "lost"),
        (SimpleNamespace(exitcode=-9), "signal"),
        (SimpleNamespace(exitcode=1), "exit"),
    ],
)
def test_a_restarts_cause_label_is_read_from_the_launchers_own_words(outcome, word):
    """The label's few words come from how the launcher says a task ended (taskproc.how, with
    the kernel's and Slurm's out-of-memory words as they make them): red if those words change
    and this reading does not follow."""
    assert restart_cause({"how": how(outcome), "exitcode": outcome.exitcode}) == word


@pytest.mark.parametrize(
    ("outcome", "ran", "word"),
    [
        ("every task exited 0", ["worker-0"], "succeeded"),
        ("failed", [], "failed"),
        ("failed: LaunchError", [], "failed"),
        ("timed out after 30 s", [], "timed_out"),
        ("stopped by SIGTERM", [], "stopped"),
        ("preempted (stopped by SIGTERM)", [], "preempted"),
    ],
)
def test_a_runs_end_is_one_of_five_label_words(outcome, ran, word):
    assert run_outcome({"outcome": outcome, "ran": ran}) == word


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("x.txt", "must name a file ending in .prom"),
        (".prom", "must name a file ending in .prom"),
        (".x.prom", "not a hidden one"),
        ("no-such-folder/x.prom", "No such file or directory"),
        ("folder.prom", "folder.prom is a folder"),
        ("no-such-folder/\udcff.prom", "name must be UTF-8 text"),  # the name first
        ("x.prom/", "must name a file ending in .prom"),
    ],
)
def test_a_metrics_file_that_cannot_be_kept_is_refused(tmp_path, name, fragment):
    (tmp_path / "folder.prom").mkdir()
    with pytest.raises(ArgumentError, match=fragment) as info:
        check_metrics_file(f"{tmp_path}/{name}")  # a trailing / kept
    assert info.value.name == "metrics_file"


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o775])
def test_a_folder_others_can_write_to_is_refused_sticky_or_not(tmp_path, mode):
    """``/tmp`` included: another user could replace the file a scraper reads."""
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(mode)
    with pytest.raises(ArgumentError, match=rf"others can write to it \(mode {mode:04o}\)"):
        check_metrics_file(str(folder / "r.prom"))
    folder.chmod(0o700)
    assert check_metrics_file(str(folder / "r.prom")) == str(folder / "r.prom")


def test_the_cli_refuses_a_missing_folder_in_one_line(run_cli, tmp_path):
    where = tmp_path / "gone" / "r.prom"
    result = run_cli("run", "--metrics-file", str(where), "--", sys.executable, "-c", "pass")
    assert result.returncode == EXIT_USAGE, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: Cannot write metrics in "), lines
    assert str(where.parent) in lines[0] and "Traceback" not in result.stderr


def run_once_restarted(workers: int, path: os.PathLike[str], script: str, *args: str) -> str:
    """``graphdist run --max-restarts 1 --metrics-file PATH -- python -c SCRIPT ARGS``, which
    must succeed: what it printed."""
    argv = ["-m", "graphdist", "run", "--workers", str(workers), "--max-restarts", "1"]
    argv += ["--metrics-file", os.fspath(path), "--", sys.executable, "-c", script, *args]
    done = run_python(argv, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


# Worker-1 SIGKILLs itself in the first attempt; every task of the second exits 0.
FLAKY = (
    "import json, os, signal\n"
    "task = json.loads(os.environ['TF_CONFIG'])['task']\n"
    "if os.environ['GRAPHDIST_RESTART'] == '0' and task['index'] == 1:\n"
    "    os.kill(os.getpid(), signal.SIGKILL)\n"
)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_real_run_leaves_its_restart_in_the_metrics_file(tmp_path):
    path = tmp_path / "flaky.prom"
    run_once_restarted(2, path, FLAKY)
    got = samples(path)
    run = (("run", "flaky"),)
    assert got[("graphdist_run_attempts_total", run)] == 2
    assert got[("graphdist_run_restarts_total", (("cause", "signal"), *run, ("scope", "run")))] == 1
    assert got[("graphdist_run_task_failures_total", (*run, ("task", "worker-1")))] == 1
    assert 0 < got[("graphdist_run_recovery_seconds_total", run)] < 60
    assert got[("graphdist_run_up", run)] == 0
    assert got[("graphdist_run_outcome", (("outcome", "succeeded"), *run))] == 1
    assert os.listdir(tmp_path) == ["flaky.prom"]


# The only worker removes the metrics folder, then dies; its restart succeeds.
LOSES_ITS_FOLDER = (
    "import os, shutil, signal, sys\n"
    "if os.environ['GRAPHDIST_RESTART'] == '0':\n"
    "    shutil.rmtree(sys.argv[1])\n"
    "    os.kill(os.getpid(), signal.SIGKILL)\n"
)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_run_whose_metrics_cannot_be_written_says_so_once_and_goes_on(tmp_path):
    folder = tmp_path / "metrics"
    folder.mkdir()
    out = run_once_restarted(1, folder / "r.prom", LOSES_ITS_FOLDER, str(folder))
    said = [ln for ln in out.splitlines() if "run's metrics" in ln]
    assert said == [
        f"graphdist: cannot write the run's metrics {folder / 'r.prom'}: No such file or "
        "directory; they are no longer written"
    ], out
    assert "the run succeeded" in out
