"""One server process of a LocalFleet (:class:`FleetTask`): its task, the process forked for it,
its log and restart count, and the kernel's word on whether it runs (a pidfd,
:mod:`graphdist._proc.pidwatch`), which decides ``alive`` before the fork server's exit message
comes (late by seconds on a loaded machine)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any

from graphdist._cluster import Task
from graphdist._fleet.task import LOG_TAIL_LINES, TaskView, read_log_tail
from graphdist._proc import oom
from graphdist._proc.pidwatch import PidWatch
from graphdist._proc.server import fleet_child
from graphdist._verdicts import ProcessFacts

__all__ = ["FleetTask", "pid_may_be"]


class FleetTask(TaskView):
    """One server process of a fleet: its task, process, log file and restart count."""

    def __init__(self, task: Task, log_path: str) -> None:
        self.task = task
        self.log_path = log_path
        self.restarts = 0
        self._process: Any = None
        self._pidwatch: PidWatch | None = None  # the kernel's word, once its pid is known
        self._started_s = 0.0  # time.monotonic() when its process was started

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def alive(self) -> bool:
        """Whether its process runs, as the kernel says (a pidfd), not as the fork server's
        exit message says, which a loaded machine delays by seconds."""
        if self._process is None:
            return False
        watch = self._kernel()
        if watch is not None:
            return not watch.ended()
        return bool(self._process.is_alive())

    @property
    def exitcode(self) -> int | None:
        """How its process ended, once the fork server's message said (None before)."""
        code: int | None = None if self._process is None else self._process.exitcode
        return code

    def _kernel(self) -> PidWatch | None:
        """The pidfd on its process, opened once its pid is known (never waiting for it)."""
        if self._pidwatch is None and self._process is not None and self.forked():
            with contextlib.suppress(Exception):  # its fork server died: no pid to watch
                pid = self._process.pid
                if pid is not None:
                    self._pidwatch = PidWatch(pid)
        return self._pidwatch

    def facts(self, wait_s: float = 0.0) -> ProcessFacts:
        """Its process's facts (the kill signal is the fleet's to add): ended as the kernel
        says; once ended, its exit code, waiting up to ``wait_s`` seconds for the fork server's
        message."""
        if self._process is None:
            return ProcessFacts(ended=None)
        ended = not self.alive
        if ended and self.exitcode is None and wait_s > 0:
            self._process.join(wait_s)
        code = self.exitcode if ended else None
        killed = oom.shared().killed(self.pid, self._started_s) if code == -signal.SIGKILL else None
        return ProcessFacts(
            ended=ended, exitcode=code, oom=None if killed is None else killed.words()
        )

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> list[str]:
        return read_log_tail(self.log_path, lines)

    def forked(self) -> bool:
        """Whether reading :attr:`pid` returns at once (the fork server's answer is in, or it
        died: reading it then raises ForkServerDiedError); True where nothing was started."""
        popen = None if self._process is None else self._process._popen
        return popen is None or bool(popen.pid_arrived())

    def _start(self, process_class: Any, spec: dict[str, Any]) -> None:
        self._forget_process()
        process = process_class(target=fleet_child, args=(spec,), name=f"graphdist-{self.name}")
        process.daemon = False
        oom.shared()  # the kernel's log is read from before the process starts
        self._started_s = time.monotonic()
        process.start()
        self._process = process

    def running(self) -> bool:
        """Whether its process runs (``process.Stoppable``; the same as :attr:`alive`)."""
        return self.alive

    def _forget_process(self) -> None:
        """Before a new process: the old one's pidfd is closed; ``_process`` is set once the new
        one started (a process that never started cannot be joined)."""
        watch, self._pidwatch, self._process = self._pidwatch, None, None
        if watch is not None:
            watch.close()

    def signal(self, sig: int) -> None:
        """Send ``sig`` to its process if it still runs (``process.Stoppable``), through its
        pidfd once it has one (no other process can get it)."""
        watch = self._kernel()
        if watch is not None:
            watch.send(sig)
        elif self._process is not None and self._process.is_alive():
            with contextlib.suppress(ProcessLookupError, OSError):
                os.kill(self._process.pid, sig)

    def _join(self, timeout_s: float) -> bool:
        """Whether its process ended within ``timeout_s`` seconds, as the kernel says; its exit
        code may still be on its way (:meth:`facts` waits for it)."""
        if self._process is None:
            return True
        watch = self._kernel()
        if watch is not None:
            return watch.wait(timeout_s)
        self._process.join(timeout_s)
        return self._process.exitcode is not None

    def __repr__(self) -> str:
        if self._process is None:
            state = "not started"
        elif self.alive:
            state = "running"
        else:
            state = f"exited {self.exitcode}"
        return f"<FleetTask {self.name} at {self.address} pid={self.pid} {state}>"


def pid_may_be(task: FleetTask, pid: int) -> bool:
    """Whether a notice from ``pid`` may be ``task``'s current process (one from a process it
    had before a restart is not; where its pid is not read yet, any may be)."""
    return not task.forked() or task.pid == pid
