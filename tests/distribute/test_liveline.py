"""The run's live line (graphdist._distribute.liveline): only on a terminal, never on a pipe,
in jsonl or on a dumb terminal; what it says from the run's events; and a real run under a
pseudo-terminal: every task line written as it is (tabs, carriage returns and backspaces
included) at the start of a line of its own, a burst of lines cleared once rather than redrawn
per line, and no live line left once the run ended."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import threading
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
    lock = threading.Lock()
    read, write = os.pipe()
    main, sub = pty.openpty()
    with os.fdopen(write, "w") as piped, os.fdopen(sub, "w") as tty:
        monkeypatch.setenv("TERM", "xterm")
        assert LiveLine.maybe(piped, lock, jsonl=False) is None
        assert LiveLine.maybe(None, lock, jsonl=False) is None
        assert LiveLine.maybe(tty, lock, jsonl=True) is None
        monkeypatch.setenv("TERM", "dumb")
        assert LiveLine.maybe(tty, lock, jsonl=False) is None
        monkeypatch.setenv("TERM", "xterm")
        live = LiveLine.maybe(tty, lock, jsonl=False)
        assert live is not None
        live.stop()
        live.stop()  # once only: nothing more to do
        assert not live.shown
    os.close(read)
    os.close(main)


def at(attempt: int, payload: object, task: str | None = None) -> Event:
    return Event.of(payload, 1.0, attempt, task)  # type: ignore[arg-type]


def test_it_says_the_attempt_restarts_rates_and_last_failure():
    live = LiveLine(io.StringIO(), threading.Lock())
    try:
        live.feed(at(1, Progress(10, 100, 20.0, {}), "worker-0"))
        live.feed(at(1, Progress(12, 100, 24.0, {}), "worker-1"))
        assert live._words() == "attempt 1 | worker-0 20.0 steps/s, worker-1 24.0 steps/s"
        assert (live.bar.total, live.bar.n) == (100, 10)  # the slowest task's steps
        cause = Cause("worker-1", 7, -9, "was killed by SIGKILL (exit status 137)", 2.0)
        live.feed(at(1, Restarting(cause, 0.0, "run", "restart 1 of 3")))
        live.feed(at(2, AttemptStarted([], [], 1, "local", {}, {})))
        live.feed(at(2, Progress(5, 100, None, {}), "worker-0"))
        assert live._words() == (
            "attempt 2 | 1 restart | last failure: worker-1 was killed by SIGKILL (exit status 137)"
        )
        assert (live.bar.total, live.bar.n) == (100, 5)  # back to the resumed attempt's steps
        for i in range(6):
            live.feed(at(2, Progress(9, 100, 10.0 + i, {}), f"worker-{i}"))
        assert "6 tasks 10.0-15.0 steps/s (median 12.5)" in live._words()
        live.feed(at(2, TaskExited(1, 0, "exited with code 0", 3.0), "worker-5"))
        assert "6 tasks 0.0-14.0 steps/s" in live._words()
    finally:
        live.stop()


class Refusing(io.StringIO):
    """A terminal whose writes fail as a full non-blocking one's do."""

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        raise BlockingIOError(11, "Resource temporarily unavailable")


def test_a_bar_that_cannot_be_written_ends_the_line_never_the_run(monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    live = LiveLine.maybe(Refusing(), threading.Lock(), jsonl=False)
    assert live is not None
    live.feed(at(1, AttemptStarted([], [], 0, "local", {}, {})))
    live.feed(at(1, Progress(10, 100, 20.0, {}), "worker-0"))  # draws: fails, said nowhere
    assert not live.shown
    live.stop()


def run_on_a_terminal(script: str, workers: int = 2) -> str:
    """``graphdist run`` with its output on a pseudo-terminal: all it wrote there."""
    main, sub = pty.openpty()
    fcntl.ioctl(sub, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))  # a window's size
    argv = [sys.executable, "-m", "graphdist", "run", "--workers", str(workers), "--"]
    env = {**os.environ, **QUIET_TF, "TERM": "xterm", "COLUMNS": "200", "PYTHONPATH": REPO}
    proc = subprocess.Popen(
        [*argv, sys.executable, "-c", script], stdin=sub, stdout=sub, stderr=sub, env=env
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
    return out.decode("utf-8", "replace")


def last_row(text: str) -> str:
    """What the terminal's last row shows once ``text`` was written (carriage returns and
    overwriting, the only controls the bar uses)."""
    row: list[str] = []
    column = 0
    for char in text.rsplit("\n", 1)[-1]:
        if char == "\r":
            column = 0
            continue
        row[column : column + 1] = [char]
        column += 1
    return "".join(row).strip()


STEPS = (
    "import time, graphdist\n"
    "for n in range(1, 31):\n"
    "    print(f'hello {n}', flush=True)\n"
    "    graphdist.step(n, total=30)\n"
    "    time.sleep(0.05)\n"
    "print('a\\tb\\rc\\x08d', flush=True)\n"
)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_run_on_a_terminal_keeps_whole_task_lines_and_removes_its_live_line():
    text = run_on_a_terminal(STEPS)
    assert "| attempt 1 | " in text and "steps/s" in text and "/30 |" in text, text[-2000:]
    for task in ("worker-0", "worker-1"):
        for n in range(1, 31):
            at_ = text.index(f"[{task}] hello {n}\r\n")
            assert text[:at_].endswith(("\n", "\r")), repr(text[at_ - 80 : at_])  # a row's start
        assert f"[{task}] a\tb\rc\x08d\r\n" in text  # as the task wrote it
    assert text.rstrip(" \r").endswith("exited 0 (worker-0, worker-1)\r\n") or not last_row(text)


BURST = "import sys\nsys.stdout.write(''.join(f'line {n}\\n' for n in range(3000)))\n"


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_burst_of_lines_clears_the_live_line_once_not_once_a_line():
    """3,000 lines at once: the bar is cleared before the first and drawn again only by its
    next refresh (every 0.5 s), not after each line. Red if each line redrew it."""
    text = run_on_a_terminal(BURST + "import time; time.sleep(1.5)\n", workers=1)
    assert text.count("[worker-0] line ") == 3000
    assert 1 <= text.count("attempt 1") < 30, text.count("attempt 1")  # draws, not one a line


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_piped_run_has_no_live_line():
    argv = [sys.executable, "-m", "graphdist", "run", "--workers", "1", "--"]
    done = subprocess.run(
        [*argv, sys.executable, "-c", STEPS],
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, **QUIET_TF, "TERM": "xterm", "PYTHONPATH": REPO},
    )
    assert done.returncode == 0, done.stderr
    assert "attempt 1" not in done.stdout + done.stderr and "\r" not in done.stdout.replace(
        "a\tb\rc\x08d", ""
    )
    assert done.stdout.count("[worker-0] hello") == 30
