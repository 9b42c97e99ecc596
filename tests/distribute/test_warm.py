"""Warm task interpreters (``graphdist run --preload``, :mod:`graphdist._distribute.warm`): a
run's Python tasks forked from an interpreter that imported TensorFlow once. Each test runs the
same task warm and cold (``--preload none``) where the promise is "indistinguishable"."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from tests.conftest import QUIET_TF, SuiteAgent, wait_gone

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "examples")

VIEW = r"""
import atexit, json, os, signal, sys, threading
import numpy  # a preload: what makes a task warm (a task that imports none runs cold)
import helper  # a module beside the script: sys.path[0] is the script's folder

def fds():
    out = {}
    for fd in sorted(os.listdir("/proc/self/fd")):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return out

def status(key):
    with open("/proc/self/status") as f:
        return next(line.split()[1] for line in f if line.startswith(key + ":"))

view = {
    "argv": sys.argv,
    "name": __name__,
    "file": __file__,
    "path0": sys.path[0],
    "cwd": os.getcwd(),
    "helper": helper.VALUE,
    "task": json.loads(os.environ["TF_CONFIG"])["task"],
    "env": {k: os.environ.get(k) for k in ("FOO", "GRAPHDIST_TASK", "GRAPHDIST_RESTART")},
    "fds": sorted(k for k, v in fds().items() if not v.startswith("pipe:") or int(k) <= 2),
    "fd_kinds": [fds()[str(i)].split(":")[0] for i in range(3)],
    "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    "sigpipe": signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN,
    "blocked": status("SigBlk"),
    "ignored": status("SigIgn"),
    "threads": threading.active_count(),
    "stdout_line_buffered": sys.stdout.line_buffering,
    "stderr_line_buffered": sys.stderr.line_buffering,
    "main_module": sys.modules["__main__"].__dict__.get("__file__"),
    "ppid_is_guard": os.getppid(),
}
print("VIEW " + json.dumps(view), flush=True)
atexit.register(lambda: print("atexit ran", flush=True))
"""


def _run(
    args: list[str],
    *,
    cwd: str,
    env: dict[str, str] | None = None,
    timeout: float = 180,
    ignore: tuple[int, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """``graphdist run --output-format jsonl ARGS``; ``ignore``: signals the launcher starts
    with ignored (``nohup``: SIGHUP), as every process it starts inherits them."""

    def ignored() -> None:
        for sig in ignore:
            signal.signal(sig, signal.SIG_IGN)

    return subprocess.run(
        [sys.executable, "-m", "graphdist", "run", "--output-format", "jsonl", *args],
        env={**os.environ, **QUIET_TF, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        preexec_fn=ignored if ignore else None,
    )


def _events(result: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def _lines(events: list[dict[str, Any]], task: str = "worker-0") -> list[str]:
    return [e["text"] for e in events if e["event"] == "line" and e.get("task") == task]


def _started(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {e["task"]: e for e in events if e["event"] == "task-started"}


@pytest.mark.timeout(300)
def test_a_warm_task_sees_what_a_cold_one_sees(tmp_path: Any) -> None:
    """The same script, warm and cold: the same argv, ``__name__``, ``__file__``,
    ``sys.path[0]`` (relative imports from its folder), working folder, environment, open
    files (only stdin/stdout/stderr), signal handlers, mask and ignored set, threads and
    buffering; its parent is its guard (the ``task-started`` pid) both ways; ``atexit`` runs."""
    (tmp_path / "view.py").write_text(VIEW)
    (tmp_path / "helper.py").write_text("VALUE = 'beside'\n")
    views = {}
    for preload in ("none", "auto"):
        result = _run(
            ["--workers", "2", "--preload", preload, "--", sys.executable, "view.py", "a b", "-x"],
            cwd=str(tmp_path),
            env={"FOO": "bar"},
            ignore=(signal.SIGHUP,),  # started under nohup: a cold task inherits it ignored
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        events = _events(result)
        started = _started(events)
        assert {t: s["warm"] for t, s in started.items()} == {
            "worker-0": preload == "auto",
            "worker-1": preload == "auto",
        }, started
        lines = _lines(events)
        [view] = [json.loads(ln[5:]) for ln in lines if ln.startswith("VIEW ")]
        assert "atexit ran" in lines, lines
        assert view.pop("ppid_is_guard") == started["worker-0"]["pid"], (view, started)
        views[preload] = view
    cold, warm = views["none"], views["auto"]
    assert warm == cold, {k: (cold[k], warm.get(k)) for k in cold if cold[k] != warm.get(k)}
    assert cold["argv"] == ["view.py", "a b", "-x"] and cold["name"] == "__main__"
    assert cold["path0"] == str(tmp_path) and cold["helper"] == "beside"
    assert cold["fds"] == ["0", "1", "2"], cold["fds"]


EXITS = {
    "sys.exit(3)": 3,
    "sys.exit('a message')": 1,
    "raise ValueError('boom')": 1,
    "os.kill(os.getpid(), signal.SIGTERM); time.sleep(5)": -signal.SIGTERM,
    "raise KeyboardInterrupt": -signal.SIGINT,
    "threading.Thread(target=lambda: (time.sleep(1), print('thread joined'))).start()": 0,
}


@pytest.mark.timeout(300)
def test_exits_tracebacks_signals_and_threads_end_a_warm_task_as_a_cold_one(
    tmp_path: Any, warm_agent: SuiteAgent
) -> None:
    """``sys.exit`` with a code or a message, an uncaught exception (its traceback starts at
    the script's own frame: nothing of graphdist's in it), death by a signal, a
    KeyboardInterrupt and a non-daemon thread joined before the end: the same exit code, warm
    and cold, and the same last lines. The warm tasks are forked by the suite's warm agent
    (the same task set-up as a run's own warm interpreter's, ``zygote.serve``, without its
    TensorFlow import; that one's tree and spares are the other tests' subject)."""
    served = warm_agent.served()
    for i, statement in enumerate(EXITS):
        (tmp_path / f"exit{i}.py").write_text(
            "import os, signal, sys, threading, time\nimport numpy\n"
            f"print('started', flush=True)\n{statement}\n"
        )
    for i, (statement, code) in enumerate(EXITS.items()):
        seen = {}
        for preload in ("none", "auto"):
            result = _run(
                ["--workers", "1", "--preload", preload, "--", sys.executable, f"exit{i}.py"],
                cwd=str(tmp_path),
            )
            events = _events(result)
            [exited] = [e for e in events if e["event"] == "task-exited"]
            assert exited["exitcode"] == code, (statement, preload, exited, result.stderr[-2000:])
            assert _started(events)["worker-0"]["warm"] == (preload == "auto")
            lines = [ln for ln in _lines(events) if "graphdist" not in ln or "Traceback" in ln]
            seen[preload] = lines
        assert seen["auto"] == seen["none"], (statement, seen)
        if "raise ValueError" in statement:
            assert seen["auto"][:3] == [
                "started",
                "Traceback (most recent call last):",
                f'  File "{tmp_path}/exit{i}.py", line 4, in <module>',
            ], seen["auto"]
            assert "warm.py" not in "\n".join(seen["auto"])
        if "Thread" in statement:
            assert "thread joined" in seen["auto"]
    assert warm_agent.served() == served + len(EXITS)  # every warm run was the agent's


@pytest.mark.timeout(300)
def test_modules_code_and_what_runs_cold(tmp_path: Any) -> None:
    """``-m`` (relative imports in its package) and ``-c`` run warm; a command that is not
    graphdist's Python runs cold and says why."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "job.py").write_text(
        "import sys\nimport numpy\nfrom . import __name__ as parent\n"
        "print('module', __name__, parent, sys.argv[1:])\n"
    )
    result = _run(["--workers", "1", "--", sys.executable, "-m", "pkg.job", "x"], cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    events = _events(result)
    assert _started(events)["worker-0"]["warm"] is True
    assert _lines(events) == ["module __main__ pkg ['x']"]

    result = _run(
        ["--workers", "1", "--", sys.executable, "-c", "import numpy, sys; print(sys.argv)", "y"],
        cwd=str(tmp_path),
    )
    events = _events(result)
    assert _started(events)["worker-0"]["warm"] is True
    assert _lines(events) == ["['-c', 'y']"]

    # no preload imported: no wait for them (the warm interpreter is not even started)
    result = _run(["--workers", "1", "--", sys.executable, "-c", "print('plain')"], cwd="/")
    started = _started(_events(result))["worker-0"]
    assert started["warm"] is False and "imports none of" in started["cold_because"], started
    assert "tensorflow" in started["cold_because"] and "graphdist" in started["cold_because"]

    result = _run(["--workers", "1", "--", "sh", "-c", "echo shell"], cwd=str(tmp_path))
    started = _started(_events(result))["worker-0"]
    assert started["warm"] is False and "is not graphdist's Python" in started["cold_because"]


@pytest.mark.timeout(120)
def test_bad_preloads_and_a_missing_script_are_one_line(tmp_path: Any) -> None:
    """``--preload`` naming a module that is not there, or one that fails as it imports: one
    line naming it, exit 2, no task started. A script that is not there: the task's one line,
    and no restart spent on it."""
    result = _run(["--preload", "no_such_module_here", "--", sys.executable, "-c", "pass"], cwd="/")
    assert result.returncode == 2
    assert result.stderr.count("Error:") == 1 and "'no_such_module_here'" in result.stderr
    assert "Traceback" not in result.stderr

    def refused(preload: str, code: str) -> tuple[str, subprocess.CompletedProcess[str]]:
        """The one error line of a run with ``--preload PRELOAD`` (modules in tmp_path)."""
        result = _run(
            ["--preload", preload, "--", sys.executable, "-c", code],
            cwd="/",
            env={"PYTHONPATH": str(tmp_path)},
        )
        assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
        errors = [ln for ln in result.stderr.splitlines() if ln.startswith("Error:")]
        assert len(errors) == 1 and f"'{preload}'" in errors[0], result.stderr[-2000:]
        assert "task-started" not in result.stdout and "Traceback" not in result.stderr
        return errors[0], result

    (tmp_path / "breaks_on_import.py").write_text("raise RuntimeError('not today')\n")
    error, _ = refused("breaks_on_import", "import breaks_on_import")
    assert "not today" in error, error
    # a dotted name whose package prints and raises as it imports: checked without a traceback,
    # and what the package printed stays off the run's (JSON lines) stdout
    (tmp_path / "noisy").mkdir()
    (tmp_path / "noisy" / "__init__.py").write_text("print('NOISE')\nraise RuntimeError('no')\n")
    _, result = refused("noisy.sub", "pass")
    assert "NOISE" not in result.stdout, result.stdout

    result = _run(
        ["--max-restarts", "2", "--workers", "1", "--", sys.executable, "no_such_script.py"],
        cwd=str(tmp_path),
    )
    events = _events(result)
    started = _started(events)["worker-0"]
    assert result.returncode != 0 and "cannot be read" in started["cold_because"], started
    assert [e["event"] for e in events].count("attempt-started") == 1, result.stdout[-3000:]
    assert any("can't open file" in ln for ln in _lines(events)), _lines(events)


def _zygote_of(launcher: int) -> int | None:
    for child in psutil.Process(launcher).children():
        try:
            if any("zygote_main" in part for part in child.cmdline()):
                return child.pid
        except psutil.Error:
            continue
    return None


@contextlib.contextmanager
def _launcher(*args: str, cwd: Any) -> Iterator[subprocess.Popen[str]]:
    """``graphdist run --output-format jsonl ARGS`` in the background (its stdout: events),
    killed on the way out if it is still running."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "graphdist", "run", "--output-format", "jsonl", *args],
        env={**os.environ, **QUIET_TF},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=str(cwd),
    )
    try:
        yield launcher
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.communicate(timeout=30)


SLEEPER = "import numpy, os, time; print('up', os.getpid(), flush=True); time.sleep(120)"


@pytest.mark.timeout(300)
def test_a_killed_warm_interpreter_ends_its_tasks_and_the_run_restarts_with_a_new_one(
    tmp_path: Any,
) -> None:
    """The warm interpreter SIGKILLed under a running attempt: its guards end their tasks (their
    death signal), the run restarts with a new warm interpreter, and once it ends nothing of
    either is left."""
    code = (
        "import numpy, os, sys, time; print('up', os.getpid(), flush=True); "
        "sys.exit(0) if os.environ['GRAPHDIST_RESTART'] == '1' else time.sleep(120)"
    )
    args = ["--workers", "2", "--max-restarts", "1", "--min-uptime", "0"]
    with _launcher(*args, "--", sys.executable, "-c", code, cwd=tmp_path) as launcher:
        assert launcher.stdout is not None
        first: list[int] = []
        tasks: list[int] = []
        for line in launcher.stdout:
            event = json.loads(line)
            if event["event"] == "task-started":
                assert event["warm"] is True, event
            if event["event"] == "line" and event["text"].startswith("up "):
                tasks.append(int(event["text"].split()[1]))
            if len(tasks) == 2 and not first:
                zygote = _zygote_of(launcher.pid)
                assert zygote is not None
                first = [zygote, *tasks]
                os.kill(zygote, signal.SIGKILL)
            if event["event"] == "run-ended":
                break
        assert launcher.wait(120) == 0
        assert first and wait_gone(first, 30) == [], first
        assert len(tasks) == 4, tasks  # two attempts of two tasks
        assert wait_gone(tasks, 30) == []


@pytest.mark.timeout(300)
def test_a_sigkilled_launcher_leaves_no_warm_interpreter_guard_or_task(tmp_path: Any) -> None:
    """The launcher SIGKILLed while its warm tasks run: the warm interpreter dies with it (its
    death signal), the guards with that, and their tasks with them."""
    with _launcher("--workers", "2", "--", sys.executable, "-c", SLEEPER, cwd=tmp_path) as launcher:
        assert launcher.stdout is not None
        up = 0
        for line in launcher.stdout:
            event = json.loads(line)
            up += event["event"] == "line" and event["text"].startswith("up ")
            if up == 2:
                break
        everything = [p.pid for p in psutil.Process(launcher.pid).children(recursive=True)]
        assert len(everything) >= 5, everything  # the zygote, two guards, two tasks
        launcher.kill()
        launcher.wait(30)
        assert wait_gone(everything, 30) == [], everything


@pytest.mark.timeout(400)
def test_mwms_training_warm_ends_with_the_cold_runs_weights(tmp_path: Any) -> None:
    """The seeds' MultiWorkerMirroredStrategy script, two workers, warm and cold: the same
    weights, bit for bit."""
    script = os.path.join(EXAMPLES, "seed_mwms_training.py")
    weights = {}
    for preload in ("none", "auto"):
        out = tmp_path / preload
        result = _run(
            ["--workers", "2", "--preload", preload, "--", sys.executable, script, "--epochs",
             "2", "--out", str(out)],
            cwd=str(tmp_path),
            timeout=300,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert all(s["warm"] == (preload == "auto") for s in _started(_events(result)).values())
        import numpy as np

        with np.load(out / "weights-worker-0.npz") as data:
            weights[preload] = [data[k] for k in data.files]
    assert len(weights["auto"]) == 4
    assert all((a == b).all() for a, b in zip(weights["none"], weights["auto"], strict=True))


def test_the_documented_warm_fallbacks_are_the_ones_checked() -> None:
    """The import-time variables named in the docs are those the warm path compares."""
    from graphdist._distribute.warm import IMPORT_TIME_ENV, warm_target

    env = {"PATH": os.environ.get("PATH", ""), "TF_CPP_MIN_LOG_LEVEL": "2"}
    plain = warm_target([sys.executable, "-c", "pass"], env, env, ["numpy"])
    assert isinstance(plain, str) and "imports none of" in plain
    nested = warm_target(
        [sys.executable, "-c", "def f():\n import numpy.linalg"], env, env, ["numpy"]
    )
    assert not isinstance(nested, str)  # an import anywhere in the code counts
    for key in IMPORT_TIME_ENV:
        why = warm_target([sys.executable, "x.py"], {**env, key: "other"}, env)
        assert isinstance(why, str) and key in why, (key, why)
    target = warm_target(
        [sys.executable, "-u", "x.py", "1"], {**env, "CUDA_VISIBLE_DEVICES": "0"}, env
    )
    assert not isinstance(target, str) and target.unbuffered and target.argv == ("x.py", "1")
    assert isinstance(warm_target([sys.executable, "-O", "x.py"], env, env), str)
    assert isinstance(
        warm_target([sys.executable, "x.py"], {**env, "PYTHONHASHSEED": "1"}, env), str
    )


def test_a_script_is_parsed_once_while_unchanged_and_again_once_it_changes(
    tmp_path: Any, monkeypatch: Any
) -> None:
    """Every task of every attempt asks whether the run's script imports a preload: it is
    parsed once, and read again when it changed (a script edited between runs of one kernel
    is judged by what it says now)."""
    import ast

    from graphdist._distribute.warm import warm_target

    parsed: list[str] = []
    real_parse = ast.parse
    monkeypatch.setattr(
        ast, "parse", lambda source, *a, **k: parsed.append(source) or real_parse(source, *a, **k)
    )
    script = tmp_path / "train.py"
    script.write_text("import numpy\n")
    env = {"PATH": os.environ.get("PATH", "")}
    for _ in range(3):
        assert not isinstance(warm_target([sys.executable, str(script)], env, env, ["numpy"]), str)
    assert len(parsed) == 1, parsed
    script.write_text("print('no imports at all')\n")
    why = warm_target([sys.executable, str(script)], env, env, ["numpy"])
    assert isinstance(why, str) and "imports none of" in why, why
    assert len(parsed) == 2, parsed


FAIL_FIRST = """
task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
if os.environ["GRAPHDIST_RESTART"] == "0":
    if task == 1:
        sys.exit(3)  # attempt 1 fails: worker-1 exits 3 while worker-0 runs
    import time
    time.sleep(60)
"""


def _ours(mark: str) -> list[int]:
    """Processes whose environment holds ``mark`` (a forked process keeps its zygote's)."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get("GRAPHDIST_TEST_MARK") == mark:
                found.append(proc.pid)
    return found


@pytest.mark.timeout(300)
def test_a_restart_hands_its_tasks_to_guards_forked_while_the_failed_attempt_stopped(
    tmp_path: Any,
) -> None:
    """worker-1 fails in attempt 1: while attempt 1 is stopped, the warm interpreter forks a
    spare guard per task, and attempt 2's tasks start in them (``task-started``: ``spare``),
    attempt 1's did not. A task in a spare sees what a task forked on request sees (its parent
    its guard, the same open files: no socket of a spare's, the same signals); once the run
    ended no process of it is left."""
    (tmp_path / "view.py").write_text(VIEW + FAIL_FIRST)
    (tmp_path / "helper.py").write_text("VALUE = 'beside'\n")
    mark = f"spares-{os.getpid()}-{id(tmp_path)}"
    args = ["--workers", "2", "--max-restarts", "1", "--min-uptime", "0"]
    result = _run(
        [*args, "--", sys.executable, "view.py"], cwd=str(tmp_path),
        env={"GRAPHDIST_TEST_MARK": mark},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    events = _events(result)
    started = [e for e in events if e["event"] == "task-started"]
    assert [(e["warm"], e["spare"]) for e in started] == [(True, False)] * 2 + [(True, True)] * 2
    views = {}
    for e in events:
        if e["event"] == "line" and e["text"].startswith("VIEW "):
            view = json.loads(e["text"][5:])
            views.setdefault(view["env"]["GRAPHDIST_RESTART"], {})[e["task"]] = view
    guards = {(e["task"], i // 2): e["pid"] for i, e in enumerate(started)}
    for attempt, seen in views.items():
        for task, view in seen.items():
            assert view.pop("ppid_is_guard") == guards[task, int(attempt)], (attempt, task)
            view["env"].pop("GRAPHDIST_RESTART")
    assert views["1"]["worker-0"] == views["0"]["worker-0"], views
    assert views["1"]["worker-0"]["fds"] == ["0", "1", "2"], views["1"]
    assert wait_gone(_ours(mark), 30) == []


@pytest.mark.timeout(300)
def test_spares_that_no_restart_uses_end_with_the_run(tmp_path: Any) -> None:
    """worker-1 fails in both attempts and the run gives up after attempt 2 (one restart
    allowed): the spares forked while attempt 2 was stopped are ended with the warm
    interpreter; nothing of the run is left."""
    (tmp_path / "view.py").write_text(VIEW + FAIL_FIRST.replace('== "0"', '!= "9"'))
    (tmp_path / "helper.py").write_text("VALUE = 'beside'\n")
    mark = f"unused-{os.getpid()}-{id(tmp_path)}"
    result = _run(
        ["--workers", "2", "--max-restarts", "1", "--min-uptime", "0", "--", sys.executable,
         "view.py"], cwd=str(tmp_path), env={"GRAPHDIST_TEST_MARK": mark},
    )  # fmt: skip
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]
    assert wait_gone(_ours(mark), 30) == []
