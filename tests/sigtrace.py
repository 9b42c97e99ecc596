"""Who signals a process: the kernel's own record (tracefs, ``signal:signal_generate``), for the
tests that stop a process and must know, when it is continued behind their back, by whom.

Two tests retry when a process they SIGSTOPped was continued or ended by someone else meanwhile
(tests/fleet/test_faults.py ``while_stopped``, tests/fleet/test_pool.py): seen in CI under load,
never in a traced run here. Each such test watches its process with :func:`watching` (a tracefs
instance of its own, ``graphdist-sig-<pid>-<token>``, filtered on that target: nothing another
test made or reads) and a retry's warning names every signal it saw from a sender other than
the test's own process: the sender's command and pid, and ``code`` (0: ``kill()``; 128: the
kernel's own, e.g. an orphaned process group's SIGHUP and SIGCONT). As root it mounts tracefs
where the kernel has it unmounted (as a fresh machine boots); where tracefs cannot be written (not
root, no tracefs) it records nothing and says so.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["SignalLog", "watching"]

TRACEFS = "/sys/kernel/tracing"
_LINE = re.compile(
    r"^\s*(?P<comm>.+?)-(?P<tid>\d+)\s+(?:\(\s*(?P<tgid>[\d-]+)\)\s+)?\[\d+\].*?"
    r"signal_generate: sig=(?P<sig>\d+) errno=\d+ code=(?P<code>-?\d+) comm=.*? pid=(?P<pid>\d+)"
)


@dataclass
class SignalLog:
    """The signals sent to the watched pids while :func:`watching` ran (``None`` where tracefs
    could not be used: ``why`` says why)."""

    signals: list[dict[str, str]] | None = None
    why: str = ""
    own: set[int] = field(default_factory=set)

    def foreign(self) -> list[dict[str, str]]:
        """Those not sent by this test's own process (by any of its threads)."""
        return [s for s in self.signals or [] if _sender(s) not in self.own]

    def describe(self) -> str:
        if self.signals is None:
            return f"no signal record ({self.why})"
        seen = self.foreign()
        if not seen:
            return "no signal to it from another process in the kernel's record"
        return "; ".join(
            f"signal {s['sig']} from {s['comm'].strip()} (pid {_sender(s)}, code {s['code']})"
            for s in seen
        )


def _mount() -> None:
    """Mount tracefs where the kernel has it but nobody mounted it (a fresh machine boots so):
    as root only; elsewhere :func:`watching` records nothing and says why."""
    if os.path.isdir(os.path.join(TRACEFS, "instances")) or os.geteuid() != 0:
        return
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(
            ["mount", "-t", "tracefs", "nodev", TRACEFS], capture_output=True, timeout=10
        )


def _sweep() -> None:
    """Remove the instances of test processes that are gone (killed before their ``finally``)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(os.path.join(TRACEFS, "instances")):
            m = re.fullmatch(r"graphdist-sig-(\d+)-[0-9a-f]+", name)
            if m and not os.path.exists(f"/proc/{m.group(1)}"):
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(TRACEFS, "instances", name))


def _sender(record: dict[str, str]) -> int:
    """The sender's process (its thread's group), or its thread where tracefs did not say."""
    tgid = record.get("tgid") or ""
    return int(tgid) if tgid.isdigit() else int(record["tid"])


@contextlib.contextmanager
def watching(*pids: int) -> Iterator[SignalLog]:
    """Record every SIGHUP, SIGKILL, SIGTERM, SIGCONT and SIGSTOP sent to ``pids`` meanwhile."""
    log = SignalLog(own={os.getpid()})
    _mount()
    _sweep()
    name = os.path.join(TRACEFS, "instances", f"graphdist-sig-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.mkdir(name)
    except OSError as exc:
        log.why = f"tracefs: {exc.strerror or exc}"
        yield log
        return
    try:
        event = os.path.join(name, "events", "signal", "signal_generate")
        targets = " || ".join(f"pid == {p}" for p in pids)
        with open(os.path.join(event, "filter"), "w") as f:
            f.write(f"({targets}) && (sig == 1 || sig == 9 || sig == 15 || sig == 18 || sig == 19)")
        with open(os.path.join(event, "enable"), "w") as f:
            f.write("1")
        log.signals = []
        yield log
        with open(os.path.join(name, "trace")) as f:
            for line in f:
                m = _LINE.match(line)
                if m:
                    log.signals.append(m.groupdict())
    finally:
        with (
            contextlib.suppress(OSError),
            open(os.path.join(name, "events", "signal", "signal_generate", "enable"), "w") as f,
        ):
            f.write("0")
        with contextlib.suppress(OSError):
            os.rmdir(name)
