"""The run's live line (graphdist._distribute.liveline): only on a terminal, never on a pipe,
in jsonl or on a dumb terminal; what it says from the run's events; and a real run under a
pseudo-terminal, whose every task line stays whole on a line of its own and whose live line is
gone once the run ended."""

from __future__ import annotations

import io
import os
import pty
import select
import subprocess
import sys
import time

import pytest

from graphdist._distribute.events import (
    AttemptStarted,
    Cause,
    Event,
    Progress,
    Restarting,
    TaskExited,
)
from graphdist._distribute.liveline import LiveLine
from tests.conftest import QUIET_TF, REPO


def test_there_is_none_on_a_pipe_in_jsonl_or_on_a_dumb_terminal(monkeypatch):
    read, write = os.pipe()
    main, sub = pty.openpty()
    with os.fdopen(write, "w") as piped, os.fdopen(sub, "w") as tty:
        monkeypatch.setenv("TERM", "xterm")
        assert LiveLine.maybe(piped, jsonl=False) is None
        assert LiveLine.maybe(None, jsonl=False) is None
        assert LiveLine.maybe(tty, jsonl=True) is None
        monkeypatch.setenv("TERM", "dumb")
        assert LiveLine.maybe(tty, jsonl=False) is None
        monkeypatch.setenv("TERM", "xterm")
        live = LiveLine.maybe(tty, jsonl=False)
        assert live is not None
        live.stop()
        live.stop()  # once only
    os.close(read)
    os.close(main)


def at(attempt: int, payload: object, task: str | None = None) -> Event:
    return Event.of(payload, 1.0, attempt, task)  # type: ignore[arg-type]


def test_it_says_the_attempt_restarts_rates_and_last_failure():
    live = LiveLine(io.StringIO())
    try:
        live.feed(at(1, Progress(10, 100, 20.0, {}), "worker-0"))
        live.feed(at(1, Progress(12, 100, 24.0, {}), "worker-1"))
        assert live._words() == "attempt 1 · worker-0 20.0/s, worker-1 24.0/s"
        cause = Cause("worker-1", 7, -9, "was killed by SIGKILL (exit status 137)", 2.0)
        live.feed(at(1, Restarting(cause, 0.0, "run", "restart 1 of 3")))
        live.feed(at(2, AttemptStarted([], [], 1, "local", {}, {})))
        live.feed(at(2, Progress(5, 100, None, {}), "worker-0"))
        assert live._words() == (
            "attempt 2 · 1 restart · last failure: worker-1 was killed by SIGKILL (exit status 137)"
        )
        task = live.progress.tasks[0]
        assert (task.total, task.completed) == (100, 5)  # the slowest task's steps
        for i in range(6):
            live.feed(at(2, Progress(9, 100, 10.0 + i, {}), f"worker-{i}"))
        assert "6 tasks 10.0-15.0/s (median 12.5)" in live._words()
        live.feed(at(2, TaskExited(1, 0, "exited with code 0", 3.0), "worker-5"))
        assert "6 tasks 0.0-14.0/s" in live._words()
    finally:
        live.stop()


SCRIPT = (
    "import time, graphdist\n"
    "for n in range(1, 41):\n"
    "    print(f'hello {n}', flush=True)\n"
    "    graphdist.step(n, total=40)\n"
    "    time.sleep(0.05)\n"
)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_run_on_a_terminal_keeps_its_live_line_below_whole_task_lines_and_removes_it():
    main, sub = pty.openpty()
    argv = [sys.executable, "-m", "graphdist", "run", "--workers", "2", "--"]
    env = {**os.environ, **QUIET_TF, "TERM": "xterm", "COLUMNS": "200", "PYTHONPATH": REPO}
    proc = subprocess.Popen(
        [*argv, sys.executable, "-c", SCRIPT], stdin=sub, stdout=sub, stderr=sub, env=env
    )
    os.close(sub)
    out = b""
    deadline = time.monotonic() + 100
    while time.monotonic() < deadline:
        ready, _, _ = select.select([main], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the terminal's other end closed: the run is over
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    os.close(main)
    assert proc.wait(timeout=30) == 0, out[-2000:]
    text = out.decode("utf-8", "replace")
    assert "attempt 1" in text and "/s" in text, text[-2000:]  # the live line was drawn
    for task in ("worker-0", "worker-1"):
        for n in range(1, 41):
            line = f"[{task}] hello {n}\r\n"
            at_ = text.index(line)
            before = text[:at_]
            assert before.endswith(("\n", "\r\x1b[2K")), repr(before[-80:])  # a line's start
    # the run's last words are its last line; below it only the live line, which its end
    # erases (up a line from the cursor's new line, cleared) and the cursor shown again
    last = "exited 0 (worker-0, worker-1)\r\n"
    tail = text[text.rindex(last) + len(last) :]
    assert "[worker-" not in tail and tail.endswith("\x1b[?25h\r\x1b[1A\x1b[2K"), repr(tail)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_piped_run_has_no_live_line():
    argv = [sys.executable, "-m", "graphdist", "run", "--workers", "1", "--"]
    done = subprocess.run(
        [*argv, sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, **QUIET_TF, "TERM": "xterm", "PYTHONPATH": REPO},
    )
    assert done.returncode == 0, done.stderr
    assert "\x1b[" not in done.stdout + done.stderr
    assert done.stdout.count("[worker-0] hello") == 40
