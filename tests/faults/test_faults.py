"""Fault injection's arguments (graphdist/_faults/faults.py): every bad value is refused with
an ArgumentError naming the argument, before anything starts. The runs themselves are tested
through the pytest plugin (tests/test_plugin.py) and on real training
(tests/distribute/test_restarts.py)."""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import sys
import time

import psutil
import pytest

from graphdist._exceptions import ArgumentError
from graphdist._faults import injector as injector_module
from graphdist._faults.faults import DEFAULT_RUN_TIMEOUT_S, MAX_RESTARTS, freeze, kill
from graphdist._faults.injector import FaultInjector
from graphdist._faults.runstate import Run
from graphdist._validate import count, show
from tests.conftest import EVENTUALLY_S, wait_gone

TRAIN = [sys.executable, "train.py"]


def test_a_fault_says_what_it_is():
    assert repr(kill("worker-1", after=r"epoch 2/\d+")) == r"kill('worker-1', after='epoch 2/\\d+')"
    fault = freeze("chief-0", after_s=5, attempt=1, for_s=2, of=None)
    assert repr(fault) == "freeze('chief-0', after_s=5, attempt=1, for_s=2)"
    assert fault.after_s == 5.0 and fault.watched == "chief-0"
    assert kill("worker-1", after="x", of="worker-0").watched == "worker-0"
    assert kill("worker-0", after=re.compile("x")).after == re.compile("x")


@pytest.mark.parametrize(
    ("make", "name", "match"),
    [
        (lambda: kill("worker1", after="x"), "task", "task name such as 'worker-1'"),
        (lambda: kill("boss-0", after="x"), "task", "not 'boss-0'"),
        (lambda: kill(1, after="x"), "task", "not 1"),
        (lambda: kill("worker-1", after="x", of="w0"), "of", "of must be a task name"),
        (lambda: kill("worker-1"), "after", "exactly one of them"),
        (lambda: kill("worker-1", after="x", after_s=1), "after", "not both"),
        (lambda: kill("worker-1", after="("), "after", "is not: missing"),
        (lambda: kill("worker-1", after=3), "after", "a str or re.Pattern"),
        (lambda: kill("worker-1", after_s=-1), "after_s", ">= 0, not -1"),
        (lambda: kill("worker-1", after_s=math.nan), "after_s", ">= 0, not nan"),
        (lambda: kill("worker-1", after_s="5"), "after_s", "number of seconds, not '5'"),
        (lambda: kill("worker-1", after_s=True), "after_s", "number of seconds"),
        (lambda: kill("worker-1", after_s=1, attempt=-1), "attempt", "attempt"),
        (lambda: freeze("worker-1", after_s=1, for_s=0), "for_s", "for_s"),
    ],
)
def test_bad_faults_are_refused(make, name, match):
    with pytest.raises(ArgumentError, match=match) as err:
        make()
    assert err.value.name == name


@pytest.mark.parametrize(
    ("kwargs", "name", "match"),
    [
        ({"command": "python train.py"}, "command", "a list of arguments"),
        ({"command": []}, "command", "non-empty list"),
        ({"workers": 0}, "workers", "workers"),
        ({"timeout_s": 0}, "timeout_s", "> 0"),
        ({"wait_s": -1}, "wait_s", "> 0"),
        ({"max_restarts": -1}, "max_restarts", "max_restarts"),
        ({"restart_window_s": math.inf}, "restart_window_s", "finite"),
        ({"ps": 1}, "chief", "chief=True"),
        ({"launcher_args": "--expose"}, "launcher_args", "a list of arguments"),
        ({"cwd": "/no/such/folder"}, "cwd", "an existing folder, not '/no/such/folder'"),
        ({"faults": ["kill worker-1"]}, "faults", "made by kill"),
        ({"faults": kill("worker-2", after_s=1)}, "task", "no task 'worker-2' in a run of"),
        ({"faults": [kill("chief-0", after_s=1)]}, "task", "its tasks: worker-0, worker-1"),
        ({"faults": [kill("worker-1", after="x", of="worker-5")]}, "of", "no task 'worker-5'"),
        ({"faults": [kill("worker-1", after_s=1, attempt=1)]}, "attempt", "max_restarts=None"),
        (
            {"faults": [kill("worker-1", after_s=1, attempt=2)], "max_restarts": 1},
            "attempt",
            r"attempts are 0 to 1\); raise max_restarts",
        ),
        (
            {"faults": [kill("ps-0", after="x")], "ps": 1, "chief": True},
            "of",
            "ps-0 runs no command .* with of= \\(chief-0\\)",
        ),
    ],
)
def test_bad_runs_are_refused_before_anything_starts(kwargs, name, match):
    injector = FaultInjector()
    kwargs = {"command": TRAIN, **kwargs}
    with pytest.raises(ArgumentError, match=match) as err:
        injector.run(**kwargs)
    assert err.value.name == name
    assert injector.close() == []
    with pytest.raises(ArgumentError, match="closed"):
        injector.run(TRAIN)
    assert injector.close() == []  # twice is fine


class _Started(Exception):
    """What a stubbed ``FaultInjector._start`` raises: every check passed."""


@pytest.fixture
def nothing_starts(monkeypatch):
    """``FaultInjector._start`` raises :class:`_Started` with the argv, env and cwd it was given
    (so a run that passes its checks starts nothing), and no child process of this one may
    appear."""

    def start(argv, env, cwd):
        raise _Started(argv, env, cwd)

    monkeypatch.setattr(FaultInjector, "_start", staticmethod(start))
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    new = {p.pid for p in me.children(recursive=True)} - before
    assert not new, f"processes {sorted(new)} were started for a refused run"


class _Path(os.PathLike):
    def __init__(self, path):
        self.path = path

    def __fspath__(self):
        return self.path


def _a_file(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("")
    return str(path)


BAD_RUNS = [
    # faults: a list of kill()/freeze() faults, or one
    ({"faults": None}, "faults"),
    ({"faults": 5}, "faults"),
    ({"faults": "kill worker-1"}, "faults"),
    ({"faults": {"worker-1": "kill"}}, "faults"),
    # env: a mapping of names to str
    ({"env": 5}, "env"),
    ({"env": ["A=1"]}, "env"),
    ({"env": "A=1"}, "env"),
    ({"env": {"A": 1}}, "env"),
    ({"env": {"A": None}}, "env"),
    ({"env": {1: "x"}}, "env"),
    ({"env": {"": "x"}}, "env"),
    ({"env": {"A=B": "x"}}, "env"),
    ({"env": {"A": "x\0y"}}, "env"),
    # cwd, log_dir: folders
    ({"cwd": 5}, "cwd"),
    ({"cwd": b"/tmp"}, "cwd"),
    ({"cwd": ["/tmp"]}, "cwd"),
    ({"cwd": "/tmp\0x"}, "cwd"),
    ({"log_dir": 5}, "log_dir"),
    ({"log_dir": b"/tmp/logs"}, "log_dir"),
    ({"log_dir": ""}, "log_dir"),
    ({"log_dir": "/tmp/a\0b"}, "log_dir"),
    ({"log_dir": _a_file}, "log_dir"),
    # launcher_args: a list of str
    ({"launcher_args": 5}, "launcher_args"),
    ({"launcher_args": b"--x"}, "launcher_args"),
    ({"launcher_args": ["--restart-window", 30]}, "launcher_args"),
    ({"launcher_args": ["--x\0"]}, "launcher_args"),
    # the command's arguments reach exec: no NUL
    ({"command": [sys.executable, "a\0b"]}, "command"),
    # counts with an upper bound the launcher also has (or that no test needs)
    ({"max_restarts": 2**70}, "max_restarts"),
    ({"max_restarts": MAX_RESTARTS + 1}, "max_restarts"),
    ({"max_restarts": 1.0}, "max_restarts"),
    ({"max_restarts": True}, "max_restarts"),
    ({"max_restarts": "1"}, "max_restarts"),
    ({"workers": 2**70}, "workers"),
    ({"ps": 2**70, "chief": True}, "ps"),
    ({"workers": 1024, "chief": True}, "workers"),
    # switches: True or False
    ({"chief": "no"}, "chief"),
    ({"chief": 1}, "chief"),
    ({"expose": "false"}, "expose"),
    ({"expose": None}, "expose"),
    # waits
    ({"wait_s": "60"}, "wait_s"),
    ({"wait_s": math.inf}, "wait_s"),
    ({"timeout_s": math.nan}, "timeout_s"),
]


@pytest.mark.timeout(60)
def _id(value: object) -> str:
    """A test id that is the same in every xdist worker: no function's address in it."""
    return getattr(value, "__name__", None) or repr(value)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    BAD_RUNS,
    ids=[",".join(f"{k}={_id(v)}" for k, v in kwargs.items()) for kwargs, _ in BAD_RUNS],
)
def test_every_bad_run_argument_is_an_argument_error_quoting_it(
    kwargs, name, tmp_path, nothing_starts
):
    kwargs = {k: v(tmp_path) if callable(v) else v for k, v in kwargs.items()}
    injector = FaultInjector()
    with pytest.raises(ArgumentError) as err:
        injector.run(**{"command": TRAIN, **kwargs})
    assert err.value.name == name, err.value
    value = kwargs[name]
    message = str(err.value)
    shown = [show(value), show(os.fsdecode(value)) if isinstance(value, bytes) else None]
    if isinstance(value, dict):
        shown += [show(k) for k in value] + [show(v) for v in value.values()]
    if isinstance(value, list):
        shown += [show(v) for v in value]
    assert name in message and any(s and s in message for s in shown), message
    assert "Traceback" not in message
    assert injector.close() == []


@pytest.mark.timeout(60)
def test_good_run_arguments_pass_every_check(tmp_path, nothing_starts):
    """What the checks take, as the launcher's argv and environment (nothing starts)."""
    with pytest.raises(_Started) as started:
        FaultInjector().run(
            [_Path(sys.executable)],
            faults=(kill("worker-1", after_s=1, attempt=MAX_RESTARTS),),
            workers=2,
            ps=1,
            chief=True,
            max_restarts=MAX_RESTARTS,
            log_dir=_Path(str(tmp_path / "logs")),
            launcher_args=("--restart-window", "30"),
            env={"A": "1"},
            cwd=_Path(str(tmp_path)),
            expose=False,
        )
    argv, env, cwd = started.value.args
    assert argv[3:] == [
        "run", "--workers", "2", "--ps", "1", "--chief", "--max-restarts", str(MAX_RESTARTS),
        "--log-dir", str(tmp_path / "logs"), "--output-format", "jsonl", "--restart-window", "30",
        "--", sys.executable,
    ]  # fmt: skip
    assert env["A"] == "1" and env["PYTHONUNBUFFERED"] == "1" and cwd == str(tmp_path)
    with pytest.raises(_Started):  # a fault alone, env None, generator-free defaults
        FaultInjector().run(TRAIN, faults=kill("worker-0", after="x"), env=None, max_restarts=0)


def test_count_takes_an_upper_bound_and_keeps_its_old_message():
    assert count(5, "n", minimum=0, maximum=5) == 5
    with pytest.raises(ArgumentError, match=r"n must be a whole number from 0 to 5, not 6"):
        count(6, "n", minimum=0, maximum=5)
    with pytest.raises(ArgumentError, match=r"n must be a whole number >= 1, not 0"):
        count(0, "n")
    assert count(2**70, "n") == 2**70  # no bound unless one is asked for


def _fake_launcher(monkeypatch, code):
    """Runs ``python -c code`` in place of the launcher (a stand-in that never ends), so that the
    wait's bound is tested without TensorFlow."""
    monkeypatch.setattr(
        injector_module, "launcher_argv", lambda *args: [sys.executable, "-c", code]
    )


def test_the_default_wait_is_documented_and_bounded():
    assert 0 < DEFAULT_RUN_TIMEOUT_S <= 3600
    assert "DEFAULT_RUN_TIMEOUT_S" in (FaultInjector.run.__doc__ or "")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ignores_sigterm", [False, True])
def test_a_run_that_never_ends_is_stopped_after_the_default_wait(
    monkeypatch, graphdist_faults, ignores_sigterm
):
    """A frozen run (here: a launcher that prints and then sleeps, one that even ignores SIGTERM)
    ends after the default wait with an outcome that says so, and nothing of it is left."""
    monkeypatch.setattr(injector_module, "DEFAULT_RUN_TIMEOUT_S", 1.5)
    monkeypatch.setattr(injector_module, "STOP_WAIT_S", 1.0)
    ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN); " if ignores_sigterm else ""
    _fake_launcher(
        monkeypatch, f"import signal, time; {ignore}print('started', flush=True); time.sleep(600)"
    )
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    start = time.monotonic()
    outcome = graphdist_faults.run(TRAIN, faults=[kill("worker-1", after="never")])
    took = time.monotonic() - start
    assert outcome.timed_out and outcome.wait_s == 1.5
    assert took < 1.5 + 1.0 + 15, took  # the wait, the SIGKILL grace, reading the pipes
    assert outcome.returncode == (-signal.SIGKILL if ignores_sigterm else -signal.SIGTERM)
    assert outcome.lines == ["started"]
    assert "after wait_s=1.5 s and was stopped" in outcome.describe()
    assert [m.why for m in outcome.missed] == ["the run was stopped after wait_s=1.5 s"]
    new = {p.pid for p in me.children(recursive=True)} - before
    assert not wait_gone(new, EVENTUALLY_S)
    assert graphdist_faults.close() == []


@pytest.mark.timeout(60)
def test_a_reaped_launchers_pid_is_never_scanned_again():
    """Once the launcher is reaped its pid is free, and may be another process's: the
    injector's scans (which go on while the launcher's output is still open) must not take
    that process's tree for the run's, which the final sweep would SIGCONT and SIGKILL. Here
    the reaped launcher's pid is pointed at a live process with a child, as a reuse would.
    Red without the check in _scan: both strangers are taken for the run's."""
    import subprocess

    launcher = subprocess.Popen([sys.executable, "-c", "pass"])
    launcher.wait()
    code = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    stranger = subprocess.Popen([sys.executable, "-c", code])
    tree = [stranger.pid]
    try:
        deadline = time.monotonic() + EVENTUALLY_S
        while not psutil.Process(stranger.pid).children():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        tree += [c.pid for c in psutil.Process(stranger.pid).children()]
        launcher.pid = stranger.pid  # as if the kernel had given the pid to it
        run = Run(["python"], "mark", launcher, 0)
        assert FaultInjector()._scan(run) == [] and run.seen == {}
    finally:
        for pid in reversed(tree):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stranger.wait(10)
    assert wait_gone(tree, EVENTUALLY_S) == []
